//! What a command job's program reports, as the scheduler keeps and shows it, through the
//! real server and the hand-written worker on SQLite and on the PostgreSQL server this
//! binary starts: its metrics kept per attempt within the bounds whatever a worker
//! sends, its output lines marked with their stream, and a flood of progress reports
//! stored at most once a second with the last one kept.

#[macro_use]
mod support;

#[path = "support/worker.rs"]
mod test_worker;

#[path = "support/cluster.rs"]
mod cluster;

use std::time::{Duration, Instant};

use carve_core::command::metrics::{MOST_METRIC_NAME_BYTES, MOST_METRICS};
use carve_proto::v1;
use tokio::sync::oneshot;

use cluster::{JOB, get, job_logs, start_on_database, submit, tenant_with_tokens, wait_for_state};
use support::TestDb;
use test_worker::TestWorker;

on_both_databases!(
    metrics_are_kept_within_the_bounds_whatever_a_worker_sends,
    program_lines_are_stored_with_their_stream,
    a_flood_of_progress_is_stored_at_most_once_a_second_with_the_last_kept,
    a_held_progress_is_told_when_the_job_goes_quiet,
);

/// The scheduler on `database_url`, with the tenant `alice`'s user token and her worker
/// connected with one 16 GiB GPU. The sender stops the scheduler when dropped.
async fn start_on(
    database_url: &str,
) -> (
    oneshot::Sender<()>,
    tonic::transport::Channel,
    String,
    TestWorker,
) {
    let (shutdown, channel) = start_on_database(database_url).await;
    let (user, worker_token) = tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    let worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    (shutdown, channel, user, worker)
}

/// Every log line of the job's attempt 1.
async fn attempt_lines(
    channel: &tonic::transport::Channel,
    user: &str,
    job_id: &str,
) -> Vec<v1::JobLogLine> {
    job_logs(
        channel,
        user,
        v1::GetJobLogsRequest {
            job_id: job_id.into(),
            attempt_number: 1,
            ..Default::default()
        },
    )
    .await
    .unwrap()
    .lines
}

fn succeeded(
    attempt: &v1::AttemptRef,
    metrics: Vec<v1::Metric>,
) -> v1::worker_message::AttemptFinished {
    v1::worker_message::AttemptFinished {
        attempt: Some(attempt.clone()),
        outcome: v1::AttemptOutcome::Succeeded as i32,
        final_loss: Some(0.25),
        test_accuracy: Some(0.931),
        measured_peak_bytes: 2 << 20,
        message: String::new(),
        steps_done: Some(10),
        samples_per_second: None,
        profile_points: Vec::new(),
        metrics,
    }
}

/// A worker (a hostile or broken one: the worker's own reader bounds what a program
/// prints) reports thousands of metrics, a megabyte name and values that are not
/// numbers: the attempt keeps the first 16 good ones, stored and shown.
async fn metrics_are_kept_within_the_bounds_whatever_a_worker_sends(db: &TestDb) {
    let (_shutdown, channel, user, mut worker) = start_on(db.url()).await;
    let job = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    let assignment = worker.next_assignment().await;
    let attempt = assignment.attempt.clone().unwrap();
    worker.report_started(&assignment).await;
    let metric = |name: String, value: f64| v1::Metric { name, value };
    let mut metrics = vec![
        metric("val_loss".into(), 0.41),
        metric("x".repeat(1 << 20), 1.0),
        metric("nan".into(), f64::NAN),
        metric("\u{1b}[2Jclear".into(), 1.0),
    ];
    metrics.extend((0..5_000).map(|index| metric(format!("m{index}"), index as f64)));
    worker.report_finished(succeeded(&attempt, metrics)).await;
    let ended = wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;
    let shown = &ended.attempts[0];
    assert_eq!(shown.test_accuracy, Some(0.931));
    assert_eq!(shown.metrics.len(), MOST_METRICS, "{:?}", shown.metrics);
    assert_eq!(
        (shown.metrics[0].name.as_str(), shown.metrics[0].value),
        ("val_loss", 0.41)
    );
    assert_eq!(shown.metrics[1].name, "m0");
    assert!(shown.metrics.iter().all(|metric| metric.value.is_finite()
        && metric.name.len() <= MOST_METRIC_NAME_BYTES
        && metric.name.bytes().all(|byte| byte.is_ascii_graphic())));
    // Read back from the store, not only from memory: a fresh read of the job.
    let again = get(&channel, &user, &job.id).await.unwrap();
    assert_eq!(again.attempts[0].metrics, shown.metrics);
    // The attempt's last line says its results, metrics among them.
    let lines = attempt_lines(&channel, &user, &job.id).await;
    let ended_line = lines.last().expect("an ended line");
    assert!(
        ended_line.message.starts_with("ended: ") && ended_line.message.contains("val_loss 0.41"),
        "{ended_line:?}"
    );
    assert!(
        ended_line.message.len() < 2048,
        "{}",
        ended_line.message.len()
    );
}

/// Lines marked stdout and stderr keep their marks in the store and in GetJobLogs; a mark
/// that is neither is dropped, and the worker's own lines have none.
async fn program_lines_are_stored_with_their_stream(db: &TestDb) {
    let (_shutdown, channel, user, mut worker) = start_on(db.url()).await;
    let job = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    let assignment = worker.next_assignment().await;
    let attempt = assignment.attempt.clone().unwrap();
    worker.report_started(&assignment).await;
    let line = |level: &str, message: &str, stream: &str| {
        v1::worker_message::Body::Log(v1::worker_message::LogLine {
            attempt: Some(attempt.clone()),
            level: level.into(),
            message: message.into(),
            stream: stream.into(),
        })
    };
    for body in [
        line("info", "epoch 1", "stdout"),
        line("warn", "Traceback (most recent call last):", "stderr"),
        line("info", "epoch 2", "stdout"),
        line("warn", "a worker's note", ""),
        line("info", "odd", "/dev/tty"),
    ] {
        worker.send(body).await;
    }
    worker
        .report_finished(succeeded(&attempt, Vec::new()))
        .await;
    wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;
    let lines: Vec<(String, String)> = attempt_lines(&channel, &user, &job.id)
        .await
        .into_iter()
        .filter(|line| !line.message.starts_with("ended: "))
        .map(|line| (line.stream, line.message))
        .collect();
    let expected: Vec<(String, String)> = [
        ("stdout", "epoch 1"),
        ("stderr", "Traceback (most recent call last):"),
        ("stdout", "epoch 2"),
        ("", "a worker's note"),
        ("", "odd"),
    ]
    .into_iter()
    .map(|(stream, message)| (stream.to_string(), message.to_string()))
    .collect();
    assert_eq!(lines, expected);
}

/// 1,000 progress reports as fast as the worker can send them (an older worker, or one
/// that reports every step): the job's log keeps a progress line a second at most, and
/// the last report's line is kept, before the attempt's end.
async fn a_flood_of_progress_is_stored_at_most_once_a_second_with_the_last_kept(db: &TestDb) {
    let (_shutdown, channel, user, mut worker) = start_on(db.url()).await;
    let job = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    let assignment = worker.next_assignment().await;
    let attempt = assignment.attempt.clone().unwrap();
    worker.report_started(&assignment).await;
    let began = Instant::now();
    const STEPS: u64 = 1_000;
    for step in 1..=STEPS {
        worker
            .report_progress(
                &attempt,
                v1::TrainingProgress {
                    step,
                    total_steps: STEPS,
                    loss: 1.0,
                    ..test_worker::halfway_progress()
                },
            )
            .await;
    }
    let took = began.elapsed();
    // The latest progress is what `carve get` shows, whatever was held back.
    let running = get(&channel, &user, &job.id).await.unwrap();
    assert_eq!(
        running.attempts[0]
            .progress
            .as_ref()
            .map(|progress| progress.step),
        Some(STEPS)
    );
    worker
        .report_finished(succeeded(&attempt, Vec::new()))
        .await;
    wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;
    let lines = attempt_lines(&channel, &user, &job.id).await;
    let progress: Vec<&str> = lines
        .iter()
        .map(|line| line.message.as_str())
        .filter(|message| message.starts_with("step "))
        .collect();
    let most = took.as_secs() as usize + 2;
    assert!(
        !progress.is_empty() && progress.len() <= most,
        "{} progress lines in {took:?}",
        progress.len()
    );
    assert!(
        progress
            .last()
            .unwrap()
            .starts_with(&format!("step {STEPS}/{STEPS}:")),
        "{progress:?}"
    );
    // The last progress comes before the attempt's end.
    let last_progress = lines
        .iter()
        .rposition(|line| line.message.starts_with("step "))
        .unwrap();
    let ended = lines
        .iter()
        .position(|line| line.message.starts_with("ended: "))
        .unwrap();
    assert!(last_progress < ended, "{lines:#?}");
}

/// A report held back because it came within a second of the last one is stored once
/// its second has passed, even when the attempt then goes quiet (a long evaluation).
async fn a_held_progress_is_told_when_the_job_goes_quiet(db: &TestDb) {
    let (_shutdown, channel, user, mut worker) = start_on(db.url()).await;
    let job = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    let assignment = worker.next_assignment().await;
    let attempt = assignment.attempt.clone().unwrap();
    worker.report_started(&assignment).await;
    for step in [1, 2] {
        worker
            .report_progress(
                &attempt,
                v1::TrainingProgress {
                    step,
                    ..test_worker::halfway_progress()
                },
            )
            .await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let lines = attempt_lines(&channel, &user, &job.id).await;
        if lines.iter().any(|line| line.message.starts_with("step 2/")) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the held step 2 was never stored: {lines:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
