//! An attempt's end and its job's move are one write: a failure between them cannot
//! leave a job placed or running with its attempt ended, and a job a store already holds
//! that way (written by code from before, which made them two writes) is moved on when
//! the scheduler recovers.
//!
//! - The store: `end_attempt` with a job writes both or neither, on both databases.
//! - The scheduler over real gRPC on a SQLite file: a trigger makes every job update
//!   fail while a worker reports its attempt succeeded; the report is refused and
//!   nothing is stored, and the report sent again once the database works ends the job.
//!   (Written as two writes, the attempt ended and the job stayed running forever: the
//!   resent report was "already ended".)
//! - Recovery: jobs left running with their attempts ended (succeeded, lost) are ended
//!   or queued again when the scheduler starts.

#[macro_use]
mod support;
#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/worker.rs"]
mod test_worker;

use std::time::Duration;

use carve_proto::v1;
use carve_scheduler::error::SchedulerError;
use carve_scheduler::store::{AttemptEnd, AttemptOutcome, AttemptResults, JobState};
use sqlx::Connection;
use support::{T0, TestDb, attempt, job, open_with_acme};
use test_worker::TestWorker;

on_both_databases!(ending_an_attempt_writes_its_job_in_the_same_transaction);

/// The end of attempt `number` of `job_id`, with `outcome`.
fn end(job_id: &str, number: i64, outcome: AttemptOutcome) -> AttemptEnd {
    AttemptEnd {
        job_id: job_id.into(),
        attempt_number: number,
        outcome,
        measured_peak_bytes: Some(3 << 20),
        oom: None,
        message: "done".into(),
        finished_at_ms: T0 + 100,
        results: AttemptResults::default(),
        details: Default::default(),
    }
}

async fn ending_an_attempt_writes_its_job_in_the_same_transaction(db: &TestDb) {
    let store = open_with_acme(db).await;
    store
        .submit_jobs(vec![job("j", "acme", "x")])
        .await
        .unwrap();
    let mut placed = store.get_job("j").await.unwrap();
    placed.state = JobState::Running;
    placed.attempts_count = 1;
    store
        .record_job_and_attempt(&placed, &attempt("j", 1, 2))
        .await
        .unwrap();

    // A report of an attempt the job never had is refused, and the job's move with it.
    let mut succeeded = placed.clone();
    succeeded.state = JobState::Succeeded;
    succeeded.finished_at_ms = Some(T0 + 100);
    let stale = store
        .end_attempt(&end("j", 2, AttemptOutcome::Succeeded), Some(&succeeded))
        .await;
    assert_eq!(stale, Err(SchedulerError::not_found("attempt", "j/2")));
    assert_eq!(store.get_job("j").await.unwrap(), placed);
    assert_eq!(
        store.list_attempts("j").await.unwrap()[0].outcome,
        AttemptOutcome::Running
    );

    // A job that is not the attempt's is refused before anything is written.
    let mut other = succeeded.clone();
    other.id = "k".into();
    let refused = store
        .end_attempt(&end("j", 1, AttemptOutcome::Succeeded), Some(&other))
        .await;
    assert!(refused.is_err());
    assert_eq!(
        store.list_attempts("j").await.unwrap()[0].outcome,
        AttemptOutcome::Running
    );

    store
        .end_attempt(&end("j", 1, AttemptOutcome::Succeeded), Some(&succeeded))
        .await
        .unwrap();
    assert_eq!(store.get_job("j").await.unwrap(), succeeded);
    let ended = &store.list_attempts("j").await.unwrap()[0];
    assert_eq!(ended.outcome, AttemptOutcome::Succeeded);
    assert_eq!(ended.finished_at_ms, Some(T0 + 100));
}

/// Opens its own connection to the scheduler's SQLite file and runs `sql` on it.
async fn run_sql(database_url: &str, sql: &str) {
    let mut connection = sqlx::SqliteConnection::connect(database_url).await.unwrap();
    sqlx::query(sql).execute(&mut connection).await.unwrap();
}

/// The attempt of `assignment`.
fn attempt_of(assignment: &v1::scheduler_message::Assignment) -> v1::AttemptRef {
    assignment
        .attempt
        .clone()
        .expect("an assignment names its attempt")
}

fn succeeded(attempt: &v1::AttemptRef) -> v1::worker_message::Body {
    v1::worker_message::Body::AttemptFinished(v1::worker_message::AttemptFinished {
        attempt: Some(attempt.clone()),
        outcome: v1::AttemptOutcome::Succeeded as i32,
        final_loss: Some(0.1),
        test_accuracy: None,
        measured_peak_bytes: 1 << 20,
        message: String::new(),
        steps_done: Some(10),
        samples_per_second: None,
        profile_points: Vec::new(),
        metrics: Vec::new(),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_at_an_attempts_end_stores_nothing_and_the_resent_report_ends_the_job() {
    let (cluster, channel, user, worker_token, mut worker) =
        cluster::start_with_worker(Duration::from_secs(30), "alice").await;
    let (job, assignment) = cluster::submit_and_place(&channel, &user, &mut worker).await;
    worker.started(&assignment).await;
    cluster::wait_for_state(&channel, &user, &job.id, v1::JobState::Running).await;
    let database = cluster::sqlite_url(cluster._directory.path());
    run_sql(
        &database,
        "CREATE TRIGGER refuse_job_updates BEFORE UPDATE ON jobs \
         BEGIN SELECT RAISE(ABORT, 'injected: the job cannot be written'); END",
    )
    .await;

    let attempt = attempt_of(&assignment);
    let refused = worker.send_refused(succeeded(&attempt)).await;
    assert!(
        refused.message().contains("injected"),
        "the report is refused for the failed write: {refused:?}"
    );
    let shown = cluster::get(&channel, &user, &job.id).await.unwrap();
    assert_eq!(shown.state, v1::JobState::Running as i32);
    assert_eq!(
        shown.attempts[0].outcome,
        v1::AttemptOutcome::Running as i32,
        "the attempt's end was not stored without its job's"
    );

    run_sql(&database, "DROP TRIGGER refuse_job_updates").await;
    let mut worker = TestWorker::reconnect(
        &channel,
        &worker_token,
        "gpu-a",
        16 << 30,
        &worker.id,
        vec![attempt.clone()],
    )
    .await;
    worker.send(succeeded(&attempt)).await;
    let ended = cluster::wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;
    assert_eq!(
        ended.attempts[0].outcome,
        v1::AttemptOutcome::Succeeded as i32
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_left_running_with_their_attempts_ended_are_moved_on_at_recovery() {
    let directory = tempfile::tempdir().unwrap();
    let database = cluster::sqlite_url(directory.path());
    let (stop, channel) = cluster::start_on_database(&database).await;
    let (user, worker_token) =
        cluster::tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    let mut worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    let (finished, first) = cluster::submit_and_place(&channel, &user, &mut worker).await;
    let (lost, second) = cluster::submit_and_place(&channel, &user, &mut worker).await;
    worker.started(&first).await;
    worker.started(&second).await;
    cluster::wait_for_state(&channel, &user, &lost.id, v1::JobState::Running).await;
    worker.disconnect();
    drop(channel);
    drop(stop);
    tokio::time::sleep(Duration::from_millis(300)).await;

    // What two writes left when the second failed: the attempts ended, the jobs running.
    let store = carve_scheduler::store::Store::open(&database)
        .await
        .unwrap();
    for (assignment, outcome) in [
        (&first, AttemptOutcome::Succeeded),
        (&second, AttemptOutcome::Lost),
    ] {
        let attempt = attempt_of(assignment);
        store
            .end_attempt(
                &end(&attempt.job_id, i64::from(attempt.attempt_number), outcome),
                None,
            )
            .await
            .unwrap();
    }
    drop(store);

    let (_stop, channel) = cluster::start_on_database(&database).await;
    let shown =
        cluster::wait_for_state(&channel, &user, &finished.id, v1::JobState::Succeeded).await;
    assert!(shown.message.contains("recovered"), "{}", shown.message);
    // Queued again (the pass soon writes why it waits: no worker is left).
    cluster::wait_for_state(&channel, &user, &lost.id, v1::JobState::Queued).await;
    let logs = cluster::all_job_logs(&channel, &user, &lost.id).await;
    assert!(
        logs.lines.iter().any(
            |line| line.message.contains("recovered: the job was left running")
                && line.message.contains("runs again from its checkpoint")
        ),
        "{:#?}",
        logs.lines
    );
}
