//! The limits' decisions by example, the measurement on real directories, and a round
//! stopping attempts through a scripted worker.

use std::sync::{Arc, Mutex};

use super::*;

const MIB: u64 = 1 << 20;

fn seconds(seconds: u64) -> Duration {
    Duration::from_secs(seconds)
}

fn attempt(job: &str) -> v1::AttemptRef {
    v1::AttemptRef {
        job_id: job.into(),
        attempt_number: 2,
        ..Default::default()
    }
}

fn usage(bytes: u64) -> DirectoryUsage {
    DirectoryUsage {
        bytes,
        entries: 3,
        cut_short: false,
    }
}

#[test]
fn the_shorter_limit_holds_and_says_who_set_it() {
    let job = |limit| MaxDuration {
        limit,
        set_by: LimitSource::Job,
    };
    let worker = |limit| MaxDuration {
        limit,
        set_by: LimitSource::Worker,
    };
    assert_eq!(
        effective_max_duration(Some(seconds(7_200)), Some(seconds(86_400))),
        Some(job(seconds(7_200)))
    );
    assert_eq!(
        effective_max_duration(Some(seconds(86_400)), Some(seconds(7_200))),
        Some(worker(seconds(7_200)))
    );
    assert_eq!(
        effective_max_duration(Some(seconds(60)), Some(seconds(60))),
        Some(job(seconds(60)))
    );
    assert_eq!(
        effective_max_duration(Some(seconds(60)), None),
        Some(job(seconds(60)))
    );
    assert_eq!(
        effective_max_duration(None, Some(seconds(60))),
        Some(worker(seconds(60)))
    );
    assert_eq!(effective_max_duration(None, None), None);
}

#[test]
fn an_attempt_past_its_max_duration_is_stopped_with_the_times() {
    let max_duration = effective_max_duration(Some(seconds(7_200)), Some(DEFAULT_MAX_DURATION));
    assert_eq!(
        judge_attempt(seconds(7_200), max_duration, None, None),
        None
    );
    let breach = judge_attempt(seconds(7_201), max_duration, Some(usage(0)), Some(MIB))
        .expect("past its limit");
    assert_eq!(
        breach,
        LimitBreach::RanTooLong {
            ran_for: seconds(7_201),
            max_duration: max_duration.unwrap(),
        }
    );
    assert_eq!(
        breach.message(&attempt("job-1")),
        "stopped by the worker: attempt job-1/2 ran for 2h1s, past its max_duration of 2h \
         (the job's resources.max_duration)"
    );
    assert_eq!(breach.grace_period(), DURATION_STOP_GRACE_PERIOD);
    let by_the_worker = judge_attempt(
        seconds(8 * 86_400),
        effective_max_duration(None, Some(DEFAULT_MAX_DURATION)),
        None,
        None,
    )
    .unwrap();
    assert!(
        by_the_worker.message(&attempt("job-1")).ends_with(
            "ran for 8d, past its max_duration of 7d (this worker's --attempt-max-duration)"
        ),
        "{}",
        by_the_worker.message(&attempt("job-1"))
    );
    // Under a minute, the tenths that put it past its limit.
    let just_past = judge_attempt(
        Duration::from_millis(2_001),
        effective_max_duration(Some(seconds(2)), None),
        None,
        None,
    )
    .unwrap();
    assert!(
        just_past
            .message(&attempt("job-1"))
            .contains("ran for 2.1s, past its max_duration of 2s"),
        "{}",
        just_past.message(&attempt("job-1"))
    );
    let an_hour_past = judge_attempt(
        Duration::from_millis(7_200_001),
        effective_max_duration(None, Some(seconds(7_200))),
        None,
        None,
    )
    .unwrap();
    assert!(
        an_hour_past
            .message(&attempt("job-1"))
            .contains("ran for 2h1s, past its max_duration of 2h"),
        "{}",
        an_hour_past.message(&attempt("job-1"))
    );
    // No limit at all: it runs as long as it runs.
    assert_eq!(judge_attempt(seconds(u64::MAX / 2), None, None, None), None);
}

#[test]
fn a_directory_past_the_limit_is_stopped_with_the_numbers() {
    let limit = Some(64 * MIB);
    assert_eq!(
        judge_attempt(seconds(1), None, Some(usage(64 * MIB)), limit),
        None
    );
    // Not measured yet, or not measured at all.
    assert_eq!(judge_attempt(seconds(1), None, None, limit), None);
    assert_eq!(
        judge_attempt(seconds(1), None, Some(usage(u64::MAX)), None),
        None
    );
    let breach = judge_attempt(seconds(1), None, Some(usage(70 * MIB)), limit).unwrap();
    assert_eq!(
        breach,
        LimitBreach::DirectoryTooLarge {
            usage: usage(70 * MIB),
            limit_bytes: 64 * MIB,
        }
    );
    let message = breach.message(&attempt("job-1"));
    assert_eq!(
        message,
        "stopped by the worker: attempt job-1/2's checkpoint directory (with the attempt's \
         own) holds 70 MiB (73400320 bytes in 3 entries), past this worker's limit of 64 MiB \
         (--attempt-checkpoint-limit)"
    );
    assert_eq!(breach.grace_period(), CHECKPOINT_STOP_GRACE_PERIOD);
    // Too many entries to measure is a stop too, whatever the bytes so far.
    let cut_short = DirectoryUsage {
        bytes: MIB,
        entries: MOST_MEASURED_ENTRIES,
        cut_short: true,
    };
    let breach = judge_attempt(seconds(1), None, Some(cut_short), limit).unwrap();
    assert_eq!(breach, LimitBreach::TooManyEntries { usage: cut_short });
    assert!(
        breach
            .message(&attempt("job-1"))
            .contains("holds more than 1000000 files and directories"),
        "{}",
        breach.message(&attempt("job-1"))
    );
    // Both broken: the time first, whose stop lets the program checkpoint.
    let both = judge_attempt(
        seconds(3),
        effective_max_duration(Some(seconds(2)), None),
        Some(usage(70 * MIB)),
        limit,
    );
    assert!(
        matches!(both, Some(LimitBreach::RanTooLong { .. })),
        "{both:?}"
    );
}

/// Writes `bytes` of real (not sparse) data to `path`.
fn write_file(path: &std::path::Path, bytes: usize) {
    std::fs::write(path, vec![7u8; bytes]).unwrap();
}

#[test]
fn a_measurement_counts_blocks_links_once_and_follows_no_link() {
    let directory = tempfile::tempdir().unwrap();
    let job = directory.path().join("job");
    let attempt = directory.path().join("job.attempt-1.run");
    std::fs::create_dir_all(job.join("nested/deeper")).unwrap();
    std::fs::create_dir_all(&attempt).unwrap();
    write_file(&job.join("weights.ckpt"), 4 * MIB as usize);
    write_file(&job.join("nested/deeper/optimizer.ckpt"), 2 * MIB as usize);
    write_file(&attempt.join("scratch"), MIB as usize);
    let measured = measure_directories(&[job.clone(), attempt.clone()], MOST_MEASURED_ENTRIES);
    assert!(!measured.cut_short);
    // Three files and four directories.
    assert_eq!(measured.entries, 7, "{measured:?}");
    assert!((7 * MIB..8 * MIB).contains(&measured.bytes), "{measured:?}");

    // A hard link is the same file; a symbolic link to a large directory elsewhere is
    // a link, not what it points at; a sparse file counts what it holds.
    let elsewhere = directory.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    write_file(&elsewhere.join("big"), 16 * MIB as usize);
    std::fs::hard_link(job.join("weights.ckpt"), job.join("weights-again.ckpt")).unwrap();
    std::os::unix::fs::symlink(&elsewhere, job.join("link-to-elsewhere")).unwrap();
    std::os::unix::fs::symlink(elsewhere.join("big"), job.join("link-to-big")).unwrap();
    let sparse = std::fs::File::create(job.join("sparse")).unwrap();
    sparse.set_len(1 << 40).unwrap();
    let again = measure_directories(&[job.clone(), attempt.clone()], MOST_MEASURED_ENTRIES);
    assert_eq!(again.entries, 11, "{again:?}");
    assert!((7 * MIB..8 * MIB).contains(&again.bytes), "{again:?}");

    // A directory that is not there holds nothing.
    let missing = measure_directories(&[directory.path().join("none")], MOST_MEASURED_ENTRIES);
    assert_eq!(missing, DirectoryUsage::default());

    // The walk stops at its bound and says so.
    let bounded = measure_directories(&[job], 3);
    assert!(bounded.cut_short, "{bounded:?}");
    assert_eq!(bounded.entries, 3);
}

/// A worker with scripted attempts that records the stops it is told.
#[derive(Clone, Default)]
struct Scripted {
    running: Arc<Mutex<Vec<LimitedAttempt>>>,
    stops: Arc<Mutex<Vec<(v1::AttemptRef, AttemptControl)>>>,
}

impl LimitedAttempts for Scripted {
    fn running(&self) -> Vec<LimitedAttempt> {
        self.running.lock().unwrap().clone()
    }

    fn stop(&self, attempt: &v1::AttemptRef, control: AttemptControl) {
        self.stops.lock().unwrap().push((attempt.clone(), control));
    }
}

#[tokio::test]
async fn a_round_stops_each_attempt_once_for_its_time_or_its_directory() {
    let directory = tempfile::tempdir().unwrap();
    let full = directory.path().join("full");
    std::fs::create_dir_all(&full).unwrap();
    write_file(&full.join("checkpoint"), 2 * MIB as usize);
    let start = Instant::now();
    let scripted = Scripted::default();
    *scripted.running.lock().unwrap() = vec![
        LimitedAttempt {
            attempt: attempt("slow"),
            started: start,
            max_duration: effective_max_duration(Some(seconds(2)), None),
            directories: vec![directory.path().join("slow")],
        },
        LimitedAttempt {
            attempt: attempt("full"),
            started: start,
            max_duration: None,
            directories: vec![full],
        },
        LimitedAttempt {
            attempt: attempt("fine"),
            started: start,
            max_duration: effective_max_duration(None, Some(seconds(60))),
            directories: vec![directory.path().join("fine")],
        },
    ];
    let mut watch = LimitsWatch::new(RunLimits {
        max_duration: Some(seconds(60)),
        checkpoint_bytes: Some(MIB),
        measure_interval: seconds(5),
    });
    // At its start: nothing broken, a measurement under way.
    assert!(watch.round(&scripted, start).await.is_empty());
    // Three seconds in: `slow` ran past its 2 s; `full` once its measurement is in.
    let mut stopped = Vec::new();
    let deadline = std::time::Instant::now() + seconds(10);
    while stopped.len() < 2 && std::time::Instant::now() < deadline {
        stopped.extend(watch.round(&scripted, start + seconds(3)).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let jobs: Vec<&str> = stopped.iter().map(|(a, _)| a.job_id.as_str()).collect();
    assert_eq!(jobs, ["slow", "full"], "{stopped:?}");
    let stops = scripted.stops.lock().unwrap().clone();
    assert_eq!(stops.len(), 2, "each stopped once: {stops:?}");
    let AttemptControl::StopAsFailed {
        grace_period,
        reason,
    } = &stops[0].1
    else {
        panic!("a stop as failed: {stops:?}");
    };
    assert_eq!(*grace_period, DURATION_STOP_GRACE_PERIOD);
    assert!(
        reason.contains("ran for 3s, past its max_duration of 2s"),
        "{reason}"
    );
    let AttemptControl::StopAsFailed { reason, .. } = &stops[1].1 else {
        panic!("a stop as failed: {stops:?}");
    };
    assert!(
        reason.contains("past this worker's limit of 1 MiB"),
        "{reason}"
    );
    // Later rounds do not stop them again while they end.
    assert!(watch.round(&scripted, start + seconds(9)).await.is_empty());
    assert_eq!(scripted.stops.lock().unwrap().len(), 2);
}

#[test]
fn a_job_asking_for_longer_than_its_worker_allows_is_told_so() {
    let hours = |count: u64| Duration::from_secs(count * 3600);
    let warning = shortened_max_duration_warning(Some(hours(240)), Some(hours(168)))
        .expect("10d asked of a 7d worker");
    assert_eq!(
        warning,
        "this worker stops an attempt after 7d (its --attempt-max-duration), shorter than \
         the job's resources.max_duration of 10d: this attempt has 7d at most"
    );
    // Asked for less, the same, nothing, or of a worker without a limit: nothing to tell.
    for (job, worker) in [
        (Some(hours(2)), Some(hours(168))),
        (Some(hours(168)), Some(hours(168))),
        (None, Some(hours(168))),
        (Some(hours(240)), None),
    ] {
        assert_eq!(shortened_max_duration_warning(job, worker), None);
    }
}
