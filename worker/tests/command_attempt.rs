//! A command job's attempt run through the worker's own module (no scheduler): small
//! `sh -c` programs for output, progress, the ways a run ends, cancels and the profile;
//! and a Python program allocating through `libcuda.so.1` under the real guard in front
//! of the fake driver (`libcarve_guard.so` and `libcarve_fake_driver.so`, which cargo
//! writes to `target/<profile>/deps/` because this crate dev-depends on both).

use std::path::{Path, PathBuf};
use std::time::Duration;

use carve_core::command::validate::{ValidatedCommandJob, ValidatedSpec, parse_spec_json};
use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use carve_worker::attempt_process::AttemptControl;
use carve_worker::command_attempt::{CommandAttemptLaunch, run_command_attempt};
use carve_worker::sandbox::UNCONTAINED_WARNING;
use serde_json::json;
use tokio::sync::mpsc;

#[path = "support/guard_world.rs"]
mod guard_world;
use guard_world::guard_world;

const MIB: u64 = 1 << 20;
const SLICE_BYTES: u64 = 64 * MIB;
/// How long any one attempt may take before the test fails.
const WAIT: Duration = Duration::from_secs(60);

const PYTORCH_OOM: &str = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate \
                           64.00 MiB. GPU 0 has a total capacity of 1.00 GiB";

/// A command job running `argv`, global batch 8, starting at micro-batch 4, 4 steps,
/// profiled at micro-batches 8 and 4; `extra` is merged into its `[command]`.
fn job(argv: &[&str], extra: serde_json::Value) -> ValidatedCommandJob {
    let mut command = json!({
        "argv": argv,
        "global_batch": 8,
        "micro_batch": 4,
        "steps": 4,
        "profile": { "steps": 2, "micro_batches": [8, 4] },
    });
    for (key, value) in extra.as_object().expect("an object") {
        command[key] = value.clone();
    }
    let spec =
        json!({ "name": "command-test", "command": command, "resources": { "vram": "1GiB" } });
    match parse_spec_json(&spec.to_string()).expect("a valid command job") {
        ValidatedSpec::Command(job) => job,
        ValidatedSpec::Model(_) => panic!("not a command job"),
    }
}

fn sh(script: &str) -> ValidatedCommandJob {
    job(&["sh", "-c", script], json!({}))
}

fn attempt() -> v1::AttemptRef {
    v1::AttemptRef {
        job_id: "job-1".into(),
        attempt_number: 1,
        lease_epoch: 1,
        gang_rank: None,
    }
}

fn launch(
    directory: &Path,
    job: ValidatedCommandJob,
    profile: bool,
    guard_library: Option<PathBuf>,
) -> CommandAttemptLaunch {
    CommandAttemptLaunch {
        attempt: attempt(),
        config: job.initial_config(),
        job,
        slice_bytes: SLICE_BYTES,
        gpu_uuid: "GPU-sim-test".into(),
        guard_library,
        checkpoint_dir: directory.join("job-1"),
        attempt_directory: directory.join("job-1.attempt-1.run"),
        profile,
        resume_from: None,
        sandbox: None,
        tenant: "tenant-a".into(),
        image: Default::default(),
        devices: Default::default(),
        simulated_gpu_socket: None,
        container_name: "carve-job-1-1".into(),
        supervision: None,
    }
}

/// Runs the attempt to its end; every report it sent, in order.
async fn run(launch: CommandAttemptLaunch) -> Vec<Body> {
    let (reports, mut incoming) = mpsc::unbounded_channel();
    // Held to the end: a dropped control channel means the worker is going away.
    let (_control, control_receiver) = mpsc::unbounded_channel();
    tokio::time::timeout(
        WAIT,
        run_command_attempt(launch, reports, control_receiver, (), || {}),
    )
    .await
    .expect("the attempt ended in time");
    let mut all = Vec::new();
    while let Ok(body) = incoming.try_recv() {
        all.push(body);
    }
    all
}

fn finish(reports: &[Body]) -> &v1::worker_message::AttemptFinished {
    match reports.last() {
        Some(Body::AttemptFinished(finished)) => finished,
        other => panic!("the last report is not a finish: {other:?}\nall: {reports:#?}"),
    }
}

fn outcome(reports: &[Body]) -> v1::AttemptOutcome {
    v1::AttemptOutcome::try_from(finish(reports).outcome).unwrap()
}

fn logs(reports: &[Body]) -> Vec<(String, String)> {
    reports
        .iter()
        .filter_map(|body| match body {
            Body::Log(line) => Some((line.level.clone(), line.message.clone())),
            _ => None,
        })
        .collect()
}

fn progress(reports: &[Body]) -> Vec<v1::TrainingProgress> {
    reports
        .iter()
        .filter_map(|body| match body {
            Body::Progress(progress) => progress.progress,
            _ => None,
        })
        .collect()
}

fn started(reports: &[Body]) -> Vec<&v1::worker_message::AttemptStarted> {
    reports
        .iter()
        .filter_map(|body| match body {
            Body::AttemptStarted(started) => Some(started),
            _ => None,
        })
        .collect()
}

fn oom_reports(reports: &[Body]) -> Vec<&v1::worker_message::OomReport> {
    reports
        .iter()
        .filter_map(|body| match body {
            Body::Oom(oom) => Some(oom),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn output_becomes_log_lines_and_progress_and_exit_0_succeeds() {
    let directory = tempfile::tempdir().unwrap();
    let script = r#"
        echo "hello micro=$1 accumulation=$CARVE_ACCUMULATION_STEPS slice=$CARVE_SLICE_BYTES"
        echo "a warning" >&2
        test -d "$CARVE_CHECKPOINT_DIR" && echo "checkpoint dir at $CARVE_CHECKPOINT_DIR"
        echo "working in $(pwd)"
        echo "CARVE_PROGRESS step=2 total_steps=4 loss=0.5 samples_per_s=100"
        echo "CARVE_PROGRESS step=4 total_steps=4 loss=0.25 samples_per_s=300"
    "#;
    let job = job(
        &["sh", "-c", script, "carve-test", "{micro_batch}"],
        json!({}),
    );
    let reports = run(launch(directory.path(), job, false, None)).await;

    let started = started(&reports);
    assert_eq!(started.len(), 1);
    assert!(
        matches!(reports[0], Body::AttemptStarted(_)),
        "{reports:#?}"
    );
    assert_eq!(started[0].reserved_bytes, SLICE_BYTES);
    assert_eq!(started[0].command_argv[4], "4", "the rendered argv");
    // No sandbox here: the start says the attempt ran with the worker's rights, and its
    // log says so loudly.
    assert!(started[0].uncontained, "{:?}", started[0]);
    let logs = logs(&reports);
    assert!(
        logs.contains(&("warn".to_string(), UNCONTAINED_WARNING.to_string())),
        "{logs:#?}"
    );
    let checkpoint_dir = directory.path().join("job-1");
    let attempt_directory = directory.path().join("job-1.attempt-1.run");
    for expected in [
        (
            "info",
            format!("hello micro=4 accumulation=2 slice={SLICE_BYTES}"),
        ),
        ("warn", "a warning".to_string()),
        (
            "info",
            format!("checkpoint dir at {}", checkpoint_dir.display()),
        ),
        (
            "info",
            format!(
                "working in {}",
                attempt_directory.canonicalize().unwrap().display()
            ),
        ),
    ] {
        let expected = (expected.0.to_string(), expected.1);
        assert!(logs.contains(&expected), "{expected:?} not in {logs:#?}");
    }
    // Progress lines are progress, not log lines.
    assert!(!logs.iter().any(|(_, line)| line.contains("CARVE_PROGRESS")));
    let progress = progress(&reports);
    assert_eq!(
        progress
            .iter()
            .map(|progress| (progress.step, progress.total_steps, progress.loss))
            .collect::<Vec<_>>(),
        vec![(2, 4, 0.5), (4, 4, 0.25)]
    );
    assert_eq!(outcome(&reports), v1::AttemptOutcome::Succeeded);
    let finished = finish(&reports);
    assert_eq!(finished.steps_done, Some(4));
    assert_eq!(finished.final_loss, Some(0.25));
    // No guard: nothing measured the device memory.
    assert_eq!(finished.measured_peak_bytes, 0);
}

#[tokio::test]
async fn a_program_that_exits_0_after_printing_an_oom_succeeded() {
    let directory = tempfile::tempdir().unwrap();
    let script = format!("echo '{PYTORCH_OOM}' >&2; echo 'caught it, going on'; exit 0");
    let reports = run(launch(directory.path(), sh(&script), false, None)).await;
    assert_eq!(outcome(&reports), v1::AttemptOutcome::Succeeded);
    assert!(oom_reports(&reports).is_empty());
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet: it holds nothing).
fn process_is_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the parenthesized command name.
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

#[tokio::test]
async fn what_the_program_left_running_ends_with_the_attempt() {
    let directory = tempfile::tempdir().unwrap();
    let pid_file = directory.path().join("background.pid");
    // The background process keeps the output pipes open too: the attempt must not wait
    // for it beyond the drain, and must not leave it running.
    let script = format!(
        "sleep 300 & echo $! > {}; echo 'started a background process'; exit 0",
        pid_file.display()
    );
    let reports = run(launch(directory.path(), sh(&script), false, None)).await;
    assert_eq!(outcome(&reports), v1::AttemptOutcome::Succeeded);
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !process_is_gone(pid) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        process_is_gone(pid),
        "the background process {pid} still runs"
    );
}

#[tokio::test]
async fn exit_1_with_a_pytorch_oom_is_an_oom_detected_by_pytorch() {
    let directory = tempfile::tempdir().unwrap();
    let script =
        format!("echo 'Traceback (most recent call last):' >&2; echo '{PYTORCH_OOM}' >&2; exit 1");
    let reports = run(launch(directory.path(), sh(&script), false, None)).await;
    assert_eq!(outcome(&reports), v1::AttemptOutcome::OutOfMemory);
    let ooms = oom_reports(&reports);
    assert_eq!(ooms.len(), 1, "{reports:#?}");
    assert_eq!(ooms[0].detected_by, "pytorch");
    assert!(
        ooms[0].evidence.contains("CUDA out of memory"),
        "{:?}",
        ooms[0].evidence
    );
    assert_eq!(ooms[0].report.unwrap().requested_bytes, 64 * MIB);
    assert_eq!(ooms[0].checkpoint, None);
    // The report comes right before the finish.
    assert!(matches!(reports[reports.len() - 2], Body::Oom(_)));
}

#[tokio::test]
async fn exit_3_is_a_failure_that_quotes_the_end_of_stderr() {
    let directory = tempfile::tempdir().unwrap();
    let script = "echo 'loading data' >&2; echo 'ValueError: no such dataset' >&2; exit 3";
    let reports = run(launch(directory.path(), sh(script), false, None)).await;
    assert_eq!(outcome(&reports), v1::AttemptOutcome::Failed);
    let message = &finish(&reports).message;
    assert!(message.contains('3'), "{message}");
    assert!(message.contains("ValueError: no such dataset"), "{message}");
    assert!(oom_reports(&reports).is_empty());
}

#[tokio::test]
async fn a_program_that_cannot_start_fails_without_starting() {
    let directory = tempfile::tempdir().unwrap();
    let job = job(&["python4", "train.py"], json!({}));
    let reports = run(launch(directory.path(), job, false, None)).await;
    assert_eq!(reports.len(), 1, "{reports:#?}");
    assert_eq!(outcome(&reports), v1::AttemptOutcome::Failed);
    assert_eq!(
        finish(&reports).message,
        "could not start python4: No such file or directory"
    );
}

/// Starts `script`, waits for its log line "ready", cancels it with `grace_period`;
/// returns the reports and how long the attempt took to end after the cancel.
async fn cancelled(script: &str, grace_period: Duration) -> (Vec<Body>, Duration) {
    let directory = tempfile::tempdir().unwrap();
    let (reports, mut incoming) = mpsc::unbounded_channel();
    let (control, control_receiver) = mpsc::unbounded_channel();
    let task = tokio::spawn(run_command_attempt(
        launch(directory.path(), sh(script), false, None),
        reports,
        control_receiver,
        (),
        || {},
    ));
    let mut all = Vec::new();
    loop {
        let body = tokio::time::timeout(WAIT, incoming.recv())
            .await
            .expect("the program said it is ready")
            .expect("reports");
        let ready = matches!(&body, Body::Log(line) if line.message == "ready");
        all.push(body);
        if ready {
            break;
        }
    }
    let cancelled_at = std::time::Instant::now();
    control
        .send(AttemptControl::Cancel {
            grace_period,
            reason: "cancelled by a test".into(),
        })
        .unwrap();
    tokio::time::timeout(WAIT, task)
        .await
        .expect("the attempt ended in time")
        .unwrap();
    let took = cancelled_at.elapsed();
    while let Ok(body) = incoming.try_recv() {
        all.push(body);
    }
    (all, took)
}

#[tokio::test]
async fn a_cancel_stops_the_program_and_a_sigterm_it_ignores_is_followed_by_sigkill() {
    let (reports, took) = cancelled("echo ready; exec sleep 60", Duration::from_secs(30)).await;
    assert_eq!(outcome(&reports), v1::AttemptOutcome::Cancelled);
    assert_eq!(finish(&reports).message, "cancelled by a test");
    assert!(took < Duration::from_secs(10), "SIGTERM took {took:?}");

    let (reports, took) = cancelled(
        "trap '' TERM; echo ready; sleep 60; sleep 60",
        Duration::from_millis(500),
    )
    .await;
    assert_eq!(outcome(&reports), v1::AttemptOutcome::Cancelled);
    assert!(
        took >= Duration::from_millis(500),
        "killed before its grace: {took:?}"
    );
    assert!(took < Duration::from_secs(10), "SIGKILL took {took:?}");
}

#[tokio::test]
async fn the_profile_runs_each_micro_batch_and_reports_its_points() {
    let directory = tempfile::tempdir().unwrap();
    // Without the guard the program's own memory figure is the peak.
    let script = r#"
        echo "micro $CARVE_MICRO_BATCH for $CARVE_MAX_STEPS steps into $CARVE_CHECKPOINT_DIR"
        touch "$CARVE_CHECKPOINT_DIR/scratch"
        echo "CARVE_PROGRESS step=$CARVE_MAX_STEPS memory_peak_bytes=$((1000 + CARVE_MICRO_BATCH * 100))"
    "#;
    let reports = run(launch(directory.path(), sh(script), true, None)).await;
    assert_eq!(
        outcome(&reports),
        v1::AttemptOutcome::Succeeded,
        "{reports:#?}"
    );
    assert_eq!(
        started(&reports).len(),
        1,
        "started once for the whole profile"
    );
    let points: Vec<(u64, u64, bool)> = finish(&reports)
        .profile_points
        .iter()
        .map(|point| (point.micro_batch, point.peak_bytes, point.ran_out))
        .collect();
    assert_eq!(points, vec![(8, 1800, false), (4, 1400, false)]);
    assert_eq!(finish(&reports).measured_peak_bytes, 0);
    let logs = logs(&reports);
    for micro_batch in [8, 4] {
        let scratch = directory.path().join(format!(
            "job-1.attempt-1.run/profile-checkpoints-micro-batch-{micro_batch}"
        ));
        let expected = format!(
            "profile micro-batch {micro_batch}: micro {micro_batch} for 2 steps into {}",
            scratch.display()
        );
        assert!(
            logs.iter().any(|(_, line)| *line == expected),
            "{expected:?} not in {logs:#?}"
        );
        assert!(!scratch.exists(), "the scratch checkpoints are removed");
    }
    // The profile trains nothing: no progress for the job.
    assert!(progress(&reports).is_empty());
    // The job's own checkpoint directory is untouched by the profile.
    assert!(!directory.path().join("job-1/scratch").exists());
}

#[tokio::test]
async fn a_profile_run_that_runs_out_gives_a_lower_bound_and_one_that_fails_fails_the_profile() {
    let directory = tempfile::tempdir().unwrap();
    let script = format!(
        "if [ \"$CARVE_MICRO_BATCH\" = 8 ]; then echo '{PYTORCH_OOM}' >&2; exit 1; fi; \
         echo 'CARVE_PROGRESS step=2 memory_peak_bytes=1000'"
    );
    let reports = run(launch(directory.path(), sh(&script), true, None)).await;
    assert_eq!(
        outcome(&reports),
        v1::AttemptOutcome::Succeeded,
        "{reports:#?}"
    );
    let points = &finish(&reports).profile_points;
    assert_eq!(points.len(), 2);
    assert_eq!((points[0].micro_batch, points[0].ran_out), (8, true));
    assert!(points[0].peak_bytes >= 64 * MIB, "{points:?}");
    assert_eq!(
        (
            points[1].micro_batch,
            points[1].peak_bytes,
            points[1].ran_out
        ),
        (4, 1000, false)
    );
    assert!(
        oom_reports(&reports).is_empty(),
        "a profile's OOM is a point, not a report"
    );

    let script = "if [ \"$CARVE_MICRO_BATCH\" = 4 ]; then echo 'KeyError: labels' >&2; exit 2; fi";
    let reports = run(launch(directory.path(), sh(script), true, None)).await;
    assert_eq!(outcome(&reports), v1::AttemptOutcome::Failed);
    let message = &finish(&reports).message;
    assert!(
        message.contains("profile run at micro-batch 4"),
        "{message}"
    );
    assert!(message.contains("KeyError: labels"), "{message}");
    assert!(finish(&reports).profile_points.is_empty());
}

/// Allocates `sys.argv[2]` x `sys.argv[3]` MiB a step (samples x MiB per sample)
/// through the driver API for `sys.argv[1]` steps, holding all of it; a refused
/// allocation is reported as the driver's error and exit 1. (No braces: they would be
/// placeholders.)
const ALLOCATING_PROGRAM: &str = r#"
import ctypes, sys
cuda = ctypes.CDLL('libcuda.so.1')
def check(name, result):
    if result != 0:
        sys.stderr.write('%s failed: CUDA error %d\n' % (name, result))
        sys.exit(1)
check('cuInit', cuda.cuInit(0))
device = ctypes.c_int()
check('cuDeviceGet', cuda.cuDeviceGet(ctypes.byref(device), 0))
context = ctypes.c_void_p()
check('cuCtxCreate_v2', cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device))
held = []
step_bytes = int(sys.argv[2]) * int(sys.argv[3]) << 20
for step in range(1, int(sys.argv[1]) + 1):
    pointer = ctypes.c_uint64()
    check('cuMemAlloc_v2', cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(step_bytes)))
    held.append(pointer)
    print('CARVE_PROGRESS step=%d total_steps=%s' % (step, sys.argv[1]), flush=True)
"#;

#[tokio::test]
async fn under_the_guard_its_peak_is_measured_and_its_refusal_is_the_oom() {
    let directory = tempfile::tempdir().unwrap();
    let (guard, libraries) = guard_world(directory.path());
    let program = |steps: u64| {
        job(
            &[
                "python3",
                "-c",
                ALLOCATING_PROGRAM,
                "{max_steps}",
                "1",
                "16",
            ],
            json!({
                "steps": steps,
                "env": { "LD_LIBRARY_PATH": libraries.to_str().unwrap() },
            }),
        )
    };

    // Two steps: 32 MiB of the 64 MiB slice.
    let fits = run(launch(
        directory.path(),
        program(2),
        false,
        Some(guard.clone()),
    ))
    .await;
    assert_eq!(outcome(&fits), v1::AttemptOutcome::Succeeded, "{fits:#?}");
    assert_eq!(finish(&fits).measured_peak_bytes, 32 * MIB);
    // The account is read when the line arrives: the program may have gone on (or
    // exited, giving its memory back) by then, but the peak only grows.
    let progress = progress(&fits);
    assert_eq!(progress.len(), 2);
    for (step, progress) in (1..).zip(&progress) {
        assert_eq!(progress.step, step);
        assert!(
            (step * 16 * MIB..=32 * MIB).contains(&progress.memory_peak_bytes),
            "{progress:?}"
        );
        assert!(progress.memory_in_use_bytes <= progress.memory_peak_bytes);
    }

    // Ten steps: the fifth allocation is refused.
    let runs_out = run(launch(directory.path(), program(10), false, Some(guard))).await;
    assert_eq!(
        outcome(&runs_out),
        v1::AttemptOutcome::OutOfMemory,
        "{runs_out:#?}"
    );
    let ooms = oom_reports(&runs_out);
    assert_eq!(ooms.len(), 1);
    assert_eq!(ooms[0].detected_by, "guard");
    let report = ooms[0].report.unwrap();
    assert_eq!(
        (
            report.requested_bytes,
            report.in_use_bytes,
            report.limit_bytes,
            report.peak_bytes
        ),
        (16 * MIB, 64 * MIB, SLICE_BYTES, 64 * MIB)
    );
    assert_eq!(finish(&runs_out).measured_peak_bytes, 64 * MIB);
    assert_eq!(finish(&runs_out).steps_done, Some(4));
}

#[tokio::test]
async fn each_profile_run_is_measured_by_the_guard_in_a_fresh_account() {
    let directory = tempfile::tempdir().unwrap();
    let (guard, libraries) = guard_world(directory.path());
    // 5 MiB per sample, 2 profile steps, in the 64 MiB slice: micro-batch 8 needs 80 MiB
    // and runs out at its second step (40 MiB held, 40 asked); micro-batch 4 peaks at 40.
    let job = job(
        &[
            "python3",
            "-c",
            ALLOCATING_PROGRAM,
            "{max_steps}",
            "{micro_batch}",
            "5",
        ],
        json!({ "env": { "LD_LIBRARY_PATH": libraries.to_str().unwrap() } }),
    );
    let reports = run(launch(directory.path(), job, true, Some(guard))).await;
    assert_eq!(
        outcome(&reports),
        v1::AttemptOutcome::Succeeded,
        "{reports:#?}"
    );
    let points: Vec<(u64, u64, bool)> = finish(&reports)
        .profile_points
        .iter()
        .map(|point| (point.micro_batch, point.peak_bytes, point.ran_out))
        .collect();
    // A fresh account per run: the second run's peak is its own, not 40 MiB more.
    assert_eq!(points, vec![(8, 80 * MIB, true), (4, 40 * MIB, false)]);
    assert!(oom_reports(&reports).is_empty());
}

fn checkpoints_written(reports: &[Body]) -> Vec<v1::Checkpoint> {
    reports
        .iter()
        .filter_map(|body| match body {
            Body::CheckpointWritten(written) => written.checkpoint.clone(),
            _ => None,
        })
        .collect()
}

/// A program reports its checkpoint and then rewrites it in place (as `torch.save`
/// does): the worker reported a copy that still holds the reported step, before the
/// attempt's end; a line naming a path outside the job's directory is refused in the
/// log. The job's next attempt gets that copy as `CARVE_RESUME_FROM`.
#[tokio::test]
async fn a_reported_checkpoint_is_recorded_as_a_copy_that_the_next_attempt_resumes_from() {
    let directory = tempfile::tempdir().unwrap();
    let script = r#"
        mkdir -p "$CARVE_CHECKPOINT_DIR/weights"
        echo "step 5" > "$CARVE_CHECKPOINT_DIR/weights/model.pt"
        echo "CARVE_CHECKPOINT step=5 path=weights/model.pt"
        # Once the copy is in place, the next checkpoint goes over the same file.
        while [ ! -d "$CARVE_CHECKPOINT_DIR.recorded/attempt-1.step-5" ]; do sleep 0.02; done
        echo "step 9" > "$CARVE_CHECKPOINT_DIR/weights/model.pt"
        echo "CARVE_CHECKPOINT step=9 path=../job-2/model.pt"
    "#;
    let reports = run(launch(directory.path(), sh(script), false, None)).await;
    assert_eq!(
        outcome(&reports),
        v1::AttemptOutcome::Succeeded,
        "{reports:#?}"
    );
    let written = checkpoints_written(&reports);
    let copy = directory
        .path()
        .join("job-1.recorded/attempt-1.step-5/weights/model.pt");
    assert_eq!(
        written,
        [v1::Checkpoint {
            step: 5,
            location: copy.to_string_lossy().into_owned(),
        }]
    );
    assert_eq!(std::fs::read_to_string(&copy).unwrap(), "step 5\n");
    assert_eq!(
        std::fs::read_to_string(directory.path().join("job-1/weights/model.pt")).unwrap(),
        "step 9\n"
    );
    let first_logs = logs(&reports);
    assert!(
        first_logs.iter().any(|(level, line)| level == "warn"
            && line.contains("a checkpoint line is not taken")
            && line.contains("\"..\"")),
        "{first_logs:#?}"
    );
    assert!(
        !first_logs
            .iter()
            .any(|(_, line)| line.contains("CARVE_CHECKPOINT"))
    );

    // The next attempt, given what the scheduler recorded.
    let resume = r#"echo "resuming from step $CARVE_RESUME_STEP: $(cat "$CARVE_RESUME_FROM")""#;
    let mut next = launch(directory.path(), sh(resume), false, None);
    next.attempt.attempt_number = 2;
    next.resume_from = Some(written[0].clone());
    let reports = run(next).await;
    assert_eq!(
        outcome(&reports),
        v1::AttemptOutcome::Succeeded,
        "{reports:#?}"
    );
    assert_eq!(started(&reports)[0].resumed_from, Some(written[0].clone()));
    assert!(
        logs(&reports).contains(&(
            "info".to_string(),
            "resuming from step 5: step 5".to_string()
        )),
        "{:#?}",
        logs(&reports)
    );

    // A location that is not a recorded copy on this node is not offered.
    let unset = r#"echo "resume from [${{CARVE_RESUME_FROM-unset}}]""#;
    let mut elsewhere = launch(directory.path(), sh(unset), false, None);
    elsewhere.resume_from = Some(v1::Checkpoint {
        step: 5,
        location: directory
            .path()
            .join("job-1/weights/model.pt")
            .to_string_lossy()
            .into_owned(),
    });
    let reports = run(elsewhere).await;
    assert!(started(&reports)[0].resumed_from.is_none());
    assert!(
        logs(&reports).contains(&("info".to_string(), "resume from [unset]".to_string())),
        "{:#?}",
        logs(&reports)
    );
}
