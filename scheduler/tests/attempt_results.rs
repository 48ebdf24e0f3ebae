//! What researchers expect to find of their attempts (issue 19), through the real server
//! and the hand-written worker: the results the worker reports at the end are kept and
//! shown, a running attempt's latest progress is shown, the step an attempt really
//! resumed from is stored, and the attempt's output, progress and results are lines of
//! its own in the job's logs. On SQLite and on the PostgreSQL server this binary starts.

#[macro_use]
mod support;

#[path = "support/worker.rs"]
mod test_worker;

#[path = "support/cluster.rs"]
mod cluster;

use carve_proto::v1;
use tokio::sync::oneshot;

use cluster::{JOB, get, job_logs, start_on_database, submit, tenant_with_tokens, wait_for_state};
use support::TestDb;
use test_worker::TestWorker;

on_both_databases!(
    results_progress_and_the_resume_step_are_kept_and_shown,
    an_attempt_ended_early_is_stored_with_the_step_it_reached,
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

/// The messages of the job's log lines of `attempt_number` (0: every line).
async fn log_messages(
    channel: &tonic::transport::Channel,
    user: &str,
    job_id: &str,
    attempt_number: u32,
) -> Vec<String> {
    let page = job_logs(
        channel,
        user,
        v1::GetJobLogsRequest {
            job_id: job_id.into(),
            attempt_number,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    page.lines
        .into_iter()
        .inspect(|line| {
            assert!(attempt_number == 0 || line.attempt_number == attempt_number);
        })
        .map(|line| line.message)
        .collect()
}

async fn results_progress_and_the_resume_step_are_kept_and_shown(db: &TestDb) {
    let (_shutdown, channel, user, mut worker) = start_on(db.url()).await;
    let job = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    let assignment = worker.next_assignment().await;
    let attempt = assignment.attempt.clone().unwrap();
    // The attempt process found a checkpoint the scheduler had not heard of (its report
    // was lost with a killed worker): it says which step it loaded.
    let loaded = v1::Checkpoint {
        step: 300,
        location: "/checkpoints/elsewhere.ckpt".into(),
    };
    worker.report_resumed(&assignment, Some(loaded)).await;
    worker
        .report_log(&attempt, "warn", "UserWarning: the learning rate is high")
        .await;
    worker
        .report_progress(
            &attempt,
            v1::TrainingProgress {
                step: 305,
                total_steps: 500,
                loss: 0.5,
                samples_per_second: 100.0,
                memory_in_use_bytes: 1 << 20,
                memory_peak_bytes: 2 << 20,
                seconds_left: None,
            },
        )
        .await;

    let running = get(&channel, &user, &job.id).await.unwrap();
    let shown = &running.attempts[0];
    let resumed = shown.resumed_from.as_ref().expect("the attempt resumed");
    assert_eq!(
        (resumed.step, resumed.location.as_str()),
        (300, "/checkpoints/elsewhere.ckpt")
    );
    let progress = shown
        .progress
        .as_ref()
        .expect("the latest progress is shown");
    assert_eq!((progress.step, progress.total_steps), (305, 500));
    assert!(shown.started_at.is_some());
    assert_eq!(shown.final_loss, None, "no results before the end");

    worker
        .report_finished(v1::worker_message::AttemptFinished {
            attempt: Some(attempt.clone()),
            outcome: v1::AttemptOutcome::Succeeded as i32,
            final_loss: Some(0.25),
            test_accuracy: Some(0.75),
            measured_peak_bytes: 2 << 20,
            message: String::new(),
            steps_done: Some(500),
            samples_per_second: Some(321.5),
            profile_points: Vec::new(),
            metrics: Vec::new(),
        })
        .await;
    let ended = wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;
    let shown = &ended.attempts[0];
    assert_eq!(shown.final_loss, Some(0.25));
    assert_eq!(shown.test_accuracy, Some(0.75));
    assert_eq!(shown.steps_done, Some(500));
    assert_eq!(shown.samples_per_second, Some(321.5));
    assert!(shown.finished_at.is_some());
    assert_eq!(
        shown.progress, None,
        "an ended attempt shows its results instead"
    );
    assert_eq!(shown.resumed_from.as_ref().unwrap().step, 300);

    // The attempt's own lines, in order, under its number; the scheduler's notes are not
    // among them.
    let lines = log_messages(&channel, &user, &job.id, 1).await;
    assert_eq!(
        lines,
        vec![
            "resumed from step 300 (checkpoint /checkpoints/elsewhere.ckpt)".to_string(),
            "UserWarning: the learning rate is high".to_string(),
            "step 305/500: loss 0.5000, 100 samples/s, 1 MiB in use (peak 2 MiB)".to_string(),
            "ended: 500 steps, final loss 0.2500, test accuracy 75.00%, 322 samples/s".to_string(),
        ]
    );
    let everything = log_messages(&channel, &user, &job.id, 0).await;
    assert!(everything.len() > lines.len(), "{everything:#?}");
}

async fn an_attempt_ended_early_is_stored_with_the_step_it_reached(db: &TestDb) {
    let (_shutdown, channel, user, mut worker) = start_on(db.url()).await;
    let job = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    let assignment = worker.next_assignment().await;
    let attempt = assignment.attempt.clone().unwrap();
    worker.report_started(&assignment).await;
    worker
        .report_progress(&attempt, test_worker::halfway_progress())
        .await;
    // A worker that does not say how far the attempt got (an older one, or a failure
    // before its final line): the scheduler keeps the step of the last progress.
    worker
        .report_finished(v1::worker_message::AttemptFinished {
            attempt: Some(attempt),
            outcome: v1::AttemptOutcome::Failed as i32,
            final_loss: None,
            test_accuracy: None,
            measured_peak_bytes: 0,
            message: "the program crashed".into(),
            steps_done: None,
            samples_per_second: None,
            profile_points: Vec::new(),
            metrics: Vec::new(),
        })
        .await;
    let ended = wait_for_state(&channel, &user, &job.id, v1::JobState::Failed).await;
    let shown = &ended.attempts[0];
    assert_eq!(shown.steps_done, Some(5));
    assert_eq!((shown.final_loss, shown.samples_per_second), (None, None));
    assert_eq!(
        shown.resumed_from, None,
        "a first attempt starts from scratch"
    );
    let lines = log_messages(&channel, &user, &job.id, 1).await;
    assert_eq!(lines.last().map(String::as_str), Some("ended: 5 steps"));
}
