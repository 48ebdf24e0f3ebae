//! The watchdog's rules on scripted readings, and a stop carried through to a real
//! attempt process's final report, without NVML.

use std::path::Path;
use std::process::Stdio;

use super::*;
use crate::attempt_process::watch_attempt_process;
use crate::error::WorkerError;
use crate::nvml::NvmlHandle;

/// Attempts in containers: counted by their cgroup, matched by their pid inside.
mod containers;
/// Real processes: a stopped attempt process, and a real GPU where there is one.
mod live;

const MIB: u64 = 1 << 20;

fn attempt(job: &str) -> v1::AttemptRef {
    v1::AttemptRef {
        job_id: job.into(),
        attempt_number: 2,
        ..Default::default()
    }
}

fn watched(job: &str, gpu: &str, process_id: u32, slice_bytes: u64) -> WatchedAttempt {
    WatchedAttempt {
        attempt: attempt(job),
        gpu_uuid: gpu.into(),
        process_id,
        slice_bytes,
        context_bytes: 300 * MIB,
        guard_account: None,
        container_processes: None,
    }
}

fn guarded(job: &str, process_id: u32, slice_bytes: u64) -> WatchedAttempt {
    WatchedAttempt {
        guard_account: Some(PathBuf::from(format!("/attempts/{job}/gpu-memory.account"))),
        ..watched(job, "GPU-0", process_id, slice_bytes)
    }
}

fn usage(process_id: u32, used_bytes: u64) -> ProcessUsage {
    ProcessUsage {
        process_id,
        used_bytes,
    }
}

/// A reading of GPU-0 with these processes and parents.
fn reading(processes: Vec<ProcessUsage>, parents: &[(u32, u32)]) -> WatchReading {
    WatchReading {
        gpu_processes: HashMap::from([("GPU-0".to_string(), processes)]),
        parents: parents.iter().copied().collect(),
        ..Default::default()
    }
}

fn with_slots(mut reading: WatchReading, job: &str, slots: &[u32]) -> WatchReading {
    reading.guard_slots.insert(
        PathBuf::from(format!("/attempts/{job}/gpu-memory.account")),
        Ok(slots.iter().copied().collect()),
    );
    reading
}

fn stops(findings: &[WatchFinding]) -> Vec<&str> {
    findings
        .iter()
        .filter_map(|finding| match finding {
            WatchFinding::Stop { reason, .. } => Some(reason.as_str()),
            WatchFinding::Overrun(_) => None,
        })
        .collect()
}

fn overruns(findings: &[WatchFinding]) -> Vec<&SliceOverrun> {
    findings
        .iter()
        .filter_map(|finding| match finding {
            WatchFinding::Overrun(overrun) => Some(overrun),
            WatchFinding::Stop { .. } => None,
        })
        .collect()
}

/// A round with nothing remembered from before.
fn first_round(attempts: &[WatchedAttempt], reading: &WatchReading) -> Vec<WatchFinding> {
    judge_round(
        attempts,
        reading,
        &mut WatchMemory::default(),
        Instant::now(),
    )
}

fn seconds(start: Instant, seconds: f64) -> Instant {
    start + Duration::from_secs_f64(seconds)
}

#[test]
fn a_tree_is_the_process_and_all_its_descendants() {
    // 100 -> 101 -> 103, 100 -> 102; 200 is someone else's; 1 is init.
    let parents = HashMap::from([(100, 1), (101, 100), (102, 100), (103, 101), (200, 1)]);
    assert_eq!(
        process_tree(100, &parents),
        HashSet::from([100, 101, 102, 103])
    );
    assert_eq!(process_tree(101, &parents), HashSet::from([101, 103]));
    // The root alone when /proc did not show it (or could not be read).
    assert_eq!(process_tree(300, &HashMap::new()), HashSet::from([300]));
    // A torn reading with a cycle ends.
    let cycle = HashMap::from([(5, 6), (6, 5)]);
    assert_eq!(process_tree(5, &cycle), HashSet::from([5, 6]));
}

#[test]
fn the_parent_is_read_after_the_command_name_whatever_it_holds() {
    assert_eq!(parent_from_stat("42 (python3) S 7 42 42 0 -1"), Some(7));
    assert_eq!(parent_from_stat("42 (a) b (c) d) R 9 1 1"), Some(9));
    assert_eq!(parent_from_stat("42 (torn"), None);
    assert_eq!(parent_from_stat("42 (x) S notanumber"), None);
}

#[test]
fn parents_are_read_from_a_proc_directory() {
    let proc_root = tempfile::tempdir().unwrap();
    for (process_id, stat) in [(10, "10 (sh) S 1 10"), (11, "11 (my prog) R 10 10")] {
        let directory = proc_root.path().join(process_id.to_string());
        std::fs::create_dir(&directory).unwrap();
        std::fs::write(directory.join("stat"), stat).unwrap();
    }
    // Not processes: a file and a process gone without its stat.
    std::fs::create_dir(proc_root.path().join("self")).unwrap();
    std::fs::create_dir(proc_root.path().join("12")).unwrap();
    assert_eq!(
        read_process_parents(proc_root.path()),
        HashMap::from([(10, 1), (11, 10)])
    );
    assert!(read_process_parents(&proc_root.path().join("missing")).is_empty());
    // The real /proc knows this test and its parent.
    let real = read_process_parents(Path::new("/proc"));
    assert_eq!(
        real.get(&std::process::id()).copied(),
        rustix::process::getppid().map(|parent| parent.as_raw_nonzero().get() as u32)
    );
}

#[test]
fn an_attempt_over_its_slice_and_context_is_warned_about_with_a_clear_message() {
    let attempts = [
        watched("job-a", "GPU-0", 100, 1024 * MIB),
        watched("job-b", "GPU-0", 200, 1024 * MIB),
    ];
    let readings = reading(
        vec![
            // Within slice + context: fine.
            usage(100, 1324 * MIB),
            // One byte over.
            usage(200, 1324 * MIB + 1),
            // Not an attempt of this worker.
            usage(999, 70_000 * MIB),
        ],
        &[],
    );
    let findings = first_round(&attempts, &readings);
    assert!(stops(&findings).is_empty(), "{findings:?}");
    let warned = overruns(&findings);
    assert_eq!(warned.len(), 1, "{findings:?}");
    assert_eq!(warned[0].attempt.job_id, "job-b");
    let line = warned[0].to_log_line();
    assert_eq!(line.level, "warn");
    assert!(
        line.message.starts_with(
            "attempt job-b/2 (pid 200) uses 1.29 GiB of device memory, its slice is 1 GiB"
        ),
        "{}",
        line.message
    );
}

#[test]
fn the_whole_tree_is_counted_and_processes_outside_it_are_not() {
    let attempts = [watched("job-a", "GPU-0", 100, 1024 * MIB)];
    // 100 -> 101 -> 102 (a data loader's child, say); 200 is a neighbour.
    let parents = [(100, 1), (101, 100), (102, 101), (200, 1)];
    let readings = reading(
        vec![
            usage(100, 700 * MIB),
            usage(102, 700 * MIB),
            usage(200, 10_000 * MIB),
        ],
        &parents,
    );
    let findings = first_round(&attempts, &readings);
    assert_eq!(overruns(&findings)[0].used_bytes, 1400 * MIB);
    // A process listed twice (once per MIG compute instance) is added up too.
    let twice = reading(vec![usage(100, 700 * MIB), usage(100, 700 * MIB)], &[]);
    let findings = first_round(&attempts, &twice);
    assert_eq!(overruns(&findings)[0].used_bytes, 1400 * MIB);
}

#[test]
fn a_steady_overrun_is_warned_about_once_and_a_new_peak_again() {
    let attempts = [watched("job-a", "GPU-0", 100, 1024 * MIB)];
    let at = |used| reading(vec![usage(100, used)], &[]);
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    let mut round =
        |used, time| judge_round(&attempts, &at(used), &mut memory, seconds(start, time));
    // Readings 6 to 7 s apart: never three breaches within the window, so never stopped.
    assert_eq!(overruns(&round(2048 * MIB, 0.0)).len(), 1);
    assert!(round(2048 * MIB, 6.0).is_empty());
    assert!(round(1500 * MIB, 13.0).is_empty());
    let again = round(3072 * MIB, 20.0);
    assert_eq!(overruns(&again).len(), 1);
    assert_eq!(overruns(&again)[0].used_bytes, 3072 * MIB);
}

#[test]
fn an_overrun_seen_in_three_readings_stops_the_attempt_once() {
    let attempts = [watched("job-a", "GPU-0", 100, 1024 * MIB)];
    let over = reading(vec![usage(100, 2048 * MIB)], &[]);
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    assert!(stops(&judge_round(&attempts, &over, &mut memory, start)).is_empty());
    // Two readings are not enough.
    assert!(
        stops(&judge_round(
            &attempts,
            &over,
            &mut memory,
            seconds(start, 1.0)
        ))
        .is_empty()
    );
    let findings = judge_round(&attempts, &over, &mut memory, seconds(start, 2.0));
    assert_eq!(
        stops(&findings),
        [
            "stopped by the worker: attempt job-a/2 held 2 GiB of device memory on its gpu, \
          more than its slice of 1 GiB plus the context allowance of 300 MiB; it was over its \
          slice in 3 of its last 10 s of readings"
        ]
    );
    // Asked once: the attempt's watcher does the rest.
    assert!(judge_round(&attempts, &over, &mut memory, seconds(start, 5.0)).is_empty());
}

#[test]
fn breaches_count_only_within_the_window() {
    let attempts = [watched("job-a", "GPU-0", 100, 1024 * MIB)];
    let over = reading(vec![usage(100, 2048 * MIB)], &[]);
    let within = reading(vec![usage(100, 1024 * MIB)], &[]);
    let unread = WatchReading::default();
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    let mut round = |reading: &WatchReading, time| {
        stops(&judge_round(
            &attempts,
            reading,
            &mut memory,
            seconds(start, time),
        ))
        .len()
    };
    assert_eq!(round(&over, 0.0), 0);
    assert_eq!(round(&within, 2.0), 0);
    assert_eq!(round(&over, 5.0), 0);
    // The breach at 0.0 is 10 s old: out of the window, so two within it, not three.
    assert_eq!(round(&over, 10.0), 0);
    // A round whose GPU could not be read is neither a breach nor its end: the
    // breaches at 5.0 and 10.0 still count with the next.
    assert_eq!(round(&unread, 11.0), 0);
    assert_eq!(round(&within, 12.0), 0);
    assert_eq!(round(&over, 14.5), 1);
}

#[test]
fn readings_of_other_gpus_or_missing_gpus_decide_nothing() {
    let attempts = [watched("job-a", "GPU-0", 100, 1024 * MIB)];
    let other = WatchReading {
        gpu_processes: HashMap::from([("GPU-1".to_string(), vec![usage(100, 70_000 * MIB)])]),
        ..Default::default()
    };
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    for time in [0.0, 5.0, 10.0] {
        assert!(judge_round(&attempts, &other, &mut memory, seconds(start, time)).is_empty());
        assert!(
            judge_round(
                &attempts,
                &WatchReading::default(),
                &mut memory,
                seconds(start, time)
            )
            .is_empty()
        );
    }
}

#[test]
fn a_guarded_process_on_the_gpu_without_a_slot_is_stopped_at_its_third_reading() {
    let attempts = [guarded("job-a", 100, 4096 * MIB)];
    // 101 registered with the guard; 102 reached the GPU without it. Both small.
    let parents = [(100, 1), (101, 100), (102, 100)];
    let seen = with_slots(
        reading(vec![usage(101, 500 * MIB), usage(102, 400 * MIB)], &parents),
        "job-a",
        &[100, 101],
    );
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    assert!(judge_round(&attempts, &seen, &mut memory, start).is_empty());
    assert!(judge_round(&attempts, &seen, &mut memory, seconds(start, 2.0)).is_empty());
    let findings = judge_round(&attempts, &seen, &mut memory, seconds(start, 3.5));
    assert_eq!(
        stops(&findings),
        [
            "stopped by the worker: process 102 of attempt job-a/2 used the gpu without the \
          guard (was LD_PRELOAD removed?): it held 400 MiB of device memory with no slot in \
          the attempt's guard account; the attempt had such a process in 3 of its last 10 s \
          of readings"
        ]
    );
}

#[test]
fn a_process_the_guard_registers_after_a_reading_is_fine() {
    let attempts = [guarded("job-a", 100, 4096 * MIB)];
    let on_gpu = reading(vec![usage(100, 500 * MIB)], &[]);
    let before = with_slots(on_gpu.clone(), "job-a", &[]);
    let after = with_slots(on_gpu, "job-a", &[100]);
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    assert!(judge_round(&attempts, &before, &mut memory, start).is_empty());
    for time in [1.0, 4.0, 10.0] {
        assert!(judge_round(&attempts, &after, &mut memory, seconds(start, time)).is_empty());
    }
    // Losing the slot later counts anew: the reading at 0.0 is out of the window, so
    // the third reading without the slot stops the attempt, not the second.
    assert!(judge_round(&attempts, &before, &mut memory, seconds(start, 11.0)).is_empty());
    assert!(judge_round(&attempts, &before, &mut memory, seconds(start, 12.0)).is_empty());
    assert_eq!(
        stops(&judge_round(
            &attempts,
            &before,
            &mut memory,
            seconds(start, 13.0)
        ))
        .len(),
        1
    );
}

#[test]
fn an_unreadable_account_counts_as_no_slots_and_says_why() {
    let attempts = [guarded("job-a", 100, 4096 * MIB)];
    let mut unreadable = reading(vec![usage(100, 500 * MIB)], &[]);
    unreadable.guard_slots.insert(
        PathBuf::from("/attempts/job-a/gpu-memory.account"),
        Err("it is not a Carve memory account".into()),
    );
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    judge_round(&attempts, &unreadable, &mut memory, start);
    judge_round(&attempts, &unreadable, &mut memory, seconds(start, 1.0));
    let findings = judge_round(&attempts, &unreadable, &mut memory, seconds(start, 2.0));
    let reasons = stops(&findings);
    assert_eq!(reasons.len(), 1);
    assert!(
        reasons[0]
            .ends_with("(its guard account cannot be read: it is not a Carve memory account)"),
        "{}",
        reasons[0]
    );
}

#[test]
fn engine_attempts_are_never_flagged_as_unguarded() {
    // The same process on the GPU with no account at all: an engine attempt runs
    // without the guard by design, and only the overrun rule applies to it.
    let attempts = [watched("job-a", "GPU-0", 100, 4096 * MIB)];
    let on_gpu = reading(vec![usage(100, 500 * MIB)], &[]);
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    for time in [0.0, 1.0, 2.0, 3.0, 4.0, 60.0] {
        assert!(judge_round(&attempts, &on_gpu, &mut memory, seconds(start, time)).is_empty());
    }
}

#[test]
fn a_guarded_attempt_over_its_slice_is_stopped_by_the_overrun_rule_too() {
    let attempts = [guarded("job-a", 100, 1024 * MIB)];
    let over = with_slots(reading(vec![usage(100, 2048 * MIB)], &[]), "job-a", &[100]);
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    assert_eq!(
        overruns(&judge_round(&attempts, &over, &mut memory, start)).len(),
        1
    );
    judge_round(&attempts, &over, &mut memory, seconds(start, 1.0));
    let findings = judge_round(&attempts, &over, &mut memory, seconds(start, 2.0));
    assert!(stops(&findings)[0].contains("more than its slice of 1 GiB"));
}

#[test]
fn ended_attempts_are_forgotten() {
    let over = reading(vec![usage(100, 2048 * MIB)], &[]);
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    judge_round(
        &[watched("job-a", "GPU-0", 100, 1024 * MIB)],
        &over,
        &mut memory,
        start,
    );
    assert_eq!(memory.attempts.len(), 1);
    judge_round(&[], &over, &mut memory, seconds(start, 1.0));
    assert!(memory.attempts.is_empty());
}

#[test]
fn an_attempt_that_dips_under_its_limit_between_overruns_is_stopped() {
    // Over, under, over, under, over, a reading a second. The rule this replaced
    // stopped only a breach that lasted 3 s reading after reading: each dip restarted
    // its clock, so this pattern, repeated for ever, was never stopped while the
    // program held memory not its own in three readings of five.
    let attempts = [watched("job-a", "GPU-0", 100, 1024 * MIB)];
    let over = reading(vec![usage(100, 2048 * MIB)], &[]);
    let under = reading(vec![usage(100, 1000 * MIB)], &[]);
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    let mut stopped_at = Vec::new();
    for (second, reading) in [&over, &under, &over, &under, &over]
        .into_iter()
        .enumerate()
    {
        let findings = judge_round(
            &attempts,
            reading,
            &mut memory,
            seconds(start, second as f64),
        );
        for reason in stops(&findings) {
            assert!(reason.ends_with("over its slice in 3 of its last 10 s of readings"));
            stopped_at.push(second);
        }
    }
    assert_eq!(stopped_at, [4]);
}

#[test]
fn unguarded_processes_are_counted_for_the_attempt_not_one_by_one() {
    // A new process without the guard every other reading, each gone before the next:
    // no one process is seen twice, but the attempt used the gpu without the guard in
    // three readings of five.
    let attempts = [guarded("job-a", 100, 4096 * MIB)];
    let unguarded = |process_id| {
        with_slots(
            reading(
                vec![usage(100, 500 * MIB), usage(process_id, 400 * MIB)],
                &[(100, 1), (process_id, 100)],
            ),
            "job-a",
            &[100],
        )
    };
    let guarded_only = with_slots(reading(vec![usage(100, 500 * MIB)], &[]), "job-a", &[100]);
    let pattern = [
        unguarded(101),
        guarded_only.clone(),
        unguarded(102),
        guarded_only,
        unguarded(103),
    ];
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    let mut stopped = Vec::new();
    for (second, reading) in pattern.iter().enumerate() {
        let findings = judge_round(
            &attempts,
            reading,
            &mut memory,
            seconds(start, second as f64),
        );
        for reason in stops(&findings) {
            stopped.push((second, reason.to_string()));
        }
    }
    assert_eq!(stopped.len(), 1, "{stopped:?}");
    assert_eq!(stopped[0].0, 4);
    assert!(
        stopped[0].1.starts_with(
            "stopped by the worker: process 103 of attempt job-a/2 used the gpu without the guard"
        ),
        "{}",
        stopped[0].1
    );
}

#[test]
fn a_single_spike_in_the_window_is_only_warned_about() {
    let attempts = [watched("job-a", "GPU-0", 100, 1024 * MIB)];
    let spike = reading(vec![usage(100, 2048 * MIB)], &[]);
    let under = reading(vec![usage(100, 1000 * MIB)], &[]);
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    let findings = judge_round(&attempts, &spike, &mut memory, start);
    assert!(stops(&findings).is_empty(), "{findings:?}");
    assert_eq!(overruns(&findings).len(), 1);
    for second in 1..=20 {
        let findings = judge_round(
            &attempts,
            &under,
            &mut memory,
            seconds(start, second as f64),
        );
        assert!(findings.is_empty(), "{findings:?}");
    }
}

/// The same reading every round.
#[derive(Debug, Clone)]
struct FixedSource(WatchReading);

impl WatchSource for FixedSource {
    fn read(&self, _targets: &WatchTargets) -> WatchReading {
        self.0.clone()
    }
}

/// Attempts held by the test; a stop goes to the attempt's control channel, as the
/// worker's does.
struct TestAttempts {
    attempts: Vec<WatchedAttempt>,
    controls: HashMap<String, mpsc::UnboundedSender<AttemptControl>>,
}

impl WatchedAttempts for TestAttempts {
    fn running(&self) -> Vec<WatchedAttempt> {
        self.attempts.clone()
    }

    fn stop(&self, attempt: &v1::AttemptRef, control: AttemptControl) {
        if let Some(sender) = self.controls.get(&attempt_key(attempt)) {
            let _ = sender.send(control);
        }
    }
}

/// The wiring of [`watch_once`] around one attempt (job-a/2) read through `source`;
/// stops go to `control`, reports to `reports`.
struct Rounds<S: WatchSource> {
    source: S,
    attempts: TestAttempts,
    memory: WatchMemory,
    reports: mpsc::UnboundedSender<Body>,
    start: Instant,
}

impl<S: WatchSource> Rounds<S> {
    fn new(
        source: S,
        watched: WatchedAttempt,
        control: mpsc::UnboundedSender<AttemptControl>,
        reports: mpsc::UnboundedSender<Body>,
    ) -> Rounds<S> {
        Rounds {
            source,
            attempts: TestAttempts {
                attempts: vec![watched],
                controls: HashMap::from([("job-a/2".to_string(), control)]),
            },
            memory: WatchMemory::default(),
            reports,
            start: Instant::now(),
        }
    }

    /// One round, `time` seconds after the first.
    async fn at(&mut self, time: f64) {
        let now = seconds(self.start, time);
        watch_once(
            &self.source,
            &self.attempts,
            &mut self.memory,
            &self.reports,
            now,
        )
        .await;
    }
}

#[tokio::test]
async fn a_round_warns_through_the_reports_and_stops_through_the_control_channel() {
    let (control, mut controls) = mpsc::unbounded_channel();
    let (reports, mut sent) = mpsc::unbounded_channel();
    let over = FixedSource(reading(vec![usage(100, 2048 * MIB)], &[]));
    let mut rounds = Rounds::new(
        over,
        watched("job-a", "GPU-0", 100, 1024 * MIB),
        control,
        reports,
    );
    rounds.at(0.0).await;
    let Ok(Body::Log(line)) = sent.try_recv() else {
        panic!("no warning");
    };
    assert_eq!(line.level, "warn");
    assert!(controls.try_recv().is_err(), "stopped at the first reading");
    rounds.at(1.0).await;
    assert!(
        controls.try_recv().is_err(),
        "stopped at the second reading"
    );
    rounds.at(2.0).await;
    let Ok(AttemptControl::StopAsFailed {
        grace_period,
        reason,
    }) = controls.try_recv()
    else {
        panic!("not stopped");
    };
    assert_eq!(grace_period, STOP_GRACE_PERIOD);
    assert!(reason.contains("held 2 GiB of device memory"), "{reason}");
}
