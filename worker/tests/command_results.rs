//! What a command job's own program reports, run through the worker's module (no
//! scheduler) with real programs: results (`accuracy`, `val_loss`, `metric_*`) and their
//! bounds against a hostile program, progress at most once a second with the last one
//! kept, the time left without the start-up, and stdout and stderr kept in order, each
//! line marked with its stream.

use std::path::Path;
use std::time::{Duration, Instant};

use carve_core::command::metrics::{MOST_METRIC_NAME_BYTES, MOST_METRICS};
use carve_core::command::validate::{ValidatedCommandJob, ValidatedSpec, parse_spec_json};
use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use carve_worker::command_attempt::{CommandAttemptLaunch, run_command_attempt};
use serde_json::json;
use tokio::sync::mpsc;

/// How long any one attempt may take before the test fails.
const WAIT: Duration = Duration::from_secs(120);

fn job(argv: &[&str], steps: u64) -> ValidatedCommandJob {
    let spec = json!({
        "name": "results-test",
        "command": { "argv": argv, "global_batch": 8, "micro_batch": 8, "steps": steps },
        "resources": { "vram": "1GiB" },
    });
    match parse_spec_json(&spec.to_string()).expect("a valid command job") {
        ValidatedSpec::Command(job) => job,
        ValidatedSpec::Model(_) => panic!("not a command job"),
    }
}

fn launch(directory: &Path, job: ValidatedCommandJob) -> CommandAttemptLaunch {
    CommandAttemptLaunch {
        attempt: v1::AttemptRef {
            job_id: "job-1".into(),
            attempt_number: 1,
            lease_epoch: 1,
            gang_rank: None,
        },
        config: job.initial_config(),
        job,
        slice_bytes: 64 << 20,
        gpu_uuid: "GPU-sim-test".into(),
        guard_library: None,
        checkpoint_dir: directory.join("job-1"),
        attempt_directory: directory.join("job-1.attempt-1.run"),
        profile: false,
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

/// Runs `argv` as an attempt to its end: every report, in order, and how long it took.
async fn run(argv: &[&str], steps: u64) -> (Vec<Body>, Duration) {
    let directory = tempfile::tempdir().unwrap();
    let (reports, mut incoming) = mpsc::unbounded_channel();
    let (_control, control_receiver) = mpsc::unbounded_channel();
    let began = Instant::now();
    tokio::time::timeout(
        WAIT,
        run_command_attempt(
            launch(directory.path(), job(argv, steps)),
            reports,
            control_receiver,
            (),
            || {},
        ),
    )
    .await
    .expect("the attempt ended in time");
    let took = began.elapsed();
    let mut all = Vec::new();
    while let Ok(body) = incoming.try_recv() {
        all.push(body);
    }
    (all, took)
}

fn finish(reports: &[Body]) -> &v1::worker_message::AttemptFinished {
    match reports.last() {
        Some(Body::AttemptFinished(finished)) => finished,
        other => panic!("the last report is not a finish: {other:?}"),
    }
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

/// The program's lines as (stream, text), leaving out the worker's own.
fn program_lines(reports: &[Body]) -> Vec<(String, String)> {
    reports
        .iter()
        .filter_map(|body| match body {
            Body::Log(line) if !line.stream.is_empty() => {
                Some((line.stream.clone(), line.message.clone()))
            }
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn accuracy_and_metrics_are_the_attempts_results() {
    let script = r#"
        echo "CARVE_PROGRESS step=1 total_steps=2 loss=0.9 val_loss=0.8"
        echo "CARVE_PROGRESS step=2 total_steps=2 loss=0.5 val_loss=0.45 metric_top5=0.97"
        echo "test accuracy 93.1%"
        echo "CARVE_PROGRESS accuracy=0.931 metric_f1=0.9"
    "#;
    let (reports, _) = run(&["sh", "-c", script], 2).await;
    let finished = finish(&reports);
    assert_eq!(
        finished.outcome,
        v1::AttemptOutcome::Succeeded as i32,
        "{finished:?}"
    );
    assert_eq!(finished.test_accuracy, Some(0.931));
    assert_eq!(finished.final_loss, Some(0.5));
    let metrics: Vec<(&str, f64)> = finished
        .metrics
        .iter()
        .map(|metric| (metric.name.as_str(), metric.value))
        .collect();
    assert_eq!(
        metrics,
        vec![("val_loss", 0.45), ("top5", 0.97), ("f1", 0.9)]
    );
    // A line with results only is not a progress report of its own.
    assert_eq!(progress(&reports).last().map(|last| last.step), Some(2));
}

/// A program printing thousands of distinct metric keys, a megabyte name and values that
/// are not numbers: what the attempt reports stays within the bounds.
#[tokio::test]
async fn a_hostile_program_cannot_report_unbounded_metrics() {
    let program = r#"
import sys
huge = "n" * (1 << 20)
print("CARVE_PROGRESS metric_" + huge + "=1")
print("CARVE_PROGRESS metric_nan=nan metric_inf=inf val_loss=-inf accuracy=nan")
for line in range(300):
    keys = " ".join("metric_k%d_%d=%d" % (line, key, key) for key in range(40))
    print("CARVE_PROGRESS step=%d %s" % (line, keys))
print("CARVE_PROGRESS metric_k0_0=42")
"#;
    let (reports, _) = run(&["python3", "-c", program], 300).await;
    let finished = finish(&reports);
    assert_eq!(
        finished.outcome,
        v1::AttemptOutcome::Succeeded as i32,
        "{finished:?}"
    );
    assert_eq!(
        finished.metrics.len(),
        MOST_METRICS,
        "{:?}",
        finished.metrics
    );
    assert!(
        finished
            .metrics
            .iter()
            .all(|metric| metric.value.is_finite()
                && !metric.name.is_empty()
                && metric.name.len() <= MOST_METRIC_NAME_BYTES)
    );
    // The first names reported are the ones kept, and they still update.
    assert_eq!(finished.metrics[0].name, "k0_0");
    assert_eq!(finished.metrics[0].value, 42.0);
    assert_eq!(finished.test_accuracy, None);
}

/// 3,000 progress lines as fast as the program can print them: a report a second at
/// most, and the last step always reported.
#[tokio::test]
async fn progress_is_reported_at_most_once_a_second_and_the_last_always() {
    let program = r#"
import time
for step in range(1, 3001):
    print("CARVE_PROGRESS step=%d total_steps=3000 loss=%f" % (step, 1.0 / step))
    if step % 1000 == 0:
        time.sleep(0.5)
"#;
    let (reports, took) = run(&["python3", "-c", program], 3000).await;
    let progress = progress(&reports);
    let most = took.as_secs() as usize + 2;
    assert!(
        !progress.is_empty() && progress.len() <= most,
        "{} reports in {took:?}",
        progress.len()
    );
    assert_eq!(progress.last().map(|last| last.step), Some(3000));
    assert_eq!(finish(&reports).steps_done, Some(3000));
}

/// Start-up before the first step is not counted in the time left: the first step's
/// report has no time left (one step says nothing of the pace), a later one has.
#[tokio::test]
async fn the_time_left_starts_from_the_first_reported_step() {
    let program = r#"
import time
time.sleep(1.5)
print("CARVE_PROGRESS step=1 total_steps=40")
time.sleep(1.2)
print("CARVE_PROGRESS step=20 total_steps=40")
time.sleep(1.2)
print("CARVE_PROGRESS step=40 total_steps=40")
"#;
    let (reports, _) = run(&["python3", "-c", program], 40).await;
    let progress = progress(&reports);
    let by_step: Vec<(u64, Option<f64>)> = progress
        .iter()
        .map(|progress| (progress.step, progress.seconds_left))
        .collect();
    assert_eq!(by_step.len(), 3, "{by_step:?}");
    assert_eq!(by_step[0], (1, None));
    assert_eq!(by_step[1].0, 20);
    // The pace of the 19 steps after the first (the arithmetic is core's, tested there).
    let left = by_step[1].1.expect("a time left at step 20");
    assert!(left > 0.0, "{left}");
    assert_eq!(by_step[2], (40, None));
}

/// A Python program alternating stdout and stderr, as a traceback follows the output
/// before it: each line comes in the order it was printed, marked with its stream.
/// Before each line it waits until the worker read the last one from its pipe (FIONREAD
/// on the pipe is 0), so the order of arrival is the order of printing. Without
/// `PYTHONUNBUFFERED` its stdout would sit in Python's buffer until it exits, after the
/// traceback.
#[tokio::test]
async fn stdout_and_stderr_lines_come_in_order_marked_with_their_stream() {
    let program = r#"
import fcntl, struct, sys, termios, time
def drained(stream):
    while True:
        waiting = struct.unpack("i", fcntl.ioctl(stream.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        if waiting == 0:
            return
        time.sleep(0.005)
for index in range(5):
    print("out %d" % index)
    drained(sys.stdout)
    print("err %d" % index, file=sys.stderr)
    drained(sys.stderr)
raise RuntimeError("CUDA error: something else")
"#;
    let (reports, _) = run(&["python3", "-c", program], 1).await;
    let lines = program_lines(&reports);
    let mut expected = Vec::new();
    for index in 0..5 {
        expected.push(("stdout".to_string(), format!("out {index}")));
        expected.push(("stderr".to_string(), format!("err {index}")));
    }
    assert_eq!(lines[..10], expected[..], "{lines:#?}");
    // The traceback follows, on stderr, its last line last.
    assert!(lines[10..].iter().all(|(stream, _)| stream == "stderr"));
    assert_eq!(
        lines.last().map(|(_, text)| text.as_str()),
        Some("RuntimeError: CUDA error: something else")
    );
    assert_eq!(finish(&reports).outcome, v1::AttemptOutcome::Failed as i32);
}
