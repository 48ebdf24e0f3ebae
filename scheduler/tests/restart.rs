//! Restarting the scheduler while a job runs: the real scheduler in-process on
//! 127.0.0.1:0, stopped and started again (a second `run`) on the same SQLite file, with a
//! test worker that speaks the worker protocol by hand.
//!
//! - A worker that comes back within the lease keeps its id and its running attempt: the
//!   scheduler neither cancels nor re-places it, and the attempt's result is recorded.
//! - A worker that does not come back loses its attempt when the lease (restarted from the
//!   store) runs out: the job is placed again on another worker, from its checkpoint.
//! - A resumable watch broken by the restart resumes on the new life after the last event
//!   it saw, and gets every later event once: no duplicate, no gap.

use std::time::Duration;

use carve_proto::v1;
use carve_scheduler::error::SchedulerError;
use carve_scheduler::server::run;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::TestWorker;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{
    connect_within, get, job_logs, list_slices, sqlite_url, submit_and_place, test_config,
};

/// Every wait in these tests ends by this deadline.
const DEADLINE: Duration = Duration::from_secs(10);

/// One life of the scheduler: `run` on its own listener, until `stop`.
struct RunningScheduler {
    address: String,
    shutdown: oneshot::Sender<()>,
    server: JoinHandle<Result<(), SchedulerError>>,
}

impl RunningScheduler {
    async fn start(database_url: &str, lease: Duration) -> RunningScheduler {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        let (shutdown, shutdown_signal) = oneshot::channel::<()>();
        let config = test_config(database_url.to_string(), lease, None);
        let server = tokio::spawn(run(config, listener, async {
            let _ = shutdown_signal.await;
        }));
        RunningScheduler {
            address,
            shutdown,
            server,
        }
    }

    async fn channel(&self) -> Channel {
        connect_within(&self.address, DEADLINE).await
    }

    /// Ends this life as a test does: `worker` disconnects, `channel` closes, and the
    /// scheduler stops.
    async fn end_with(self, channel: Channel, worker: TestWorker) {
        worker.disconnect();
        drop(channel);
        self.stop().await;
    }

    /// Fires the shutdown and waits for `run` to return.
    async fn stop(self) {
        let _ = self.shutdown.send(());
        tokio::time::timeout(DEADLINE, self.server)
            .await
            .expect("run returns within the deadline after shutdown")
            .expect("the server task did not panic")
            .expect("run ends cleanly");
    }
}

/// A database for a test's lives of the scheduler: its URL, and the temp dir holding the
/// SQLite file (removed when dropped).
fn fresh_database() -> (tempfile::TempDir, String) {
    let directory = tempfile::tempdir().unwrap();
    let url = sqlite_url(directory.path());
    (directory, url)
}

/// The first life of a test: the scheduler with `lease` on `database`, a channel to it,
/// the tenant alice's user and worker tokens, and her worker on gpu-a (16 GiB).
async fn first_life(
    database: &str,
    lease: Duration,
) -> (RunningScheduler, Channel, String, String, TestWorker) {
    let scheduler = RunningScheduler::start(database, lease).await;
    let channel = scheduler.channel().await;
    let (user, worker_token) =
        cluster::tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    let worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    (scheduler, channel, user, worker_token, worker)
}

/// The first life's worker on gpu-a comes back to a later life under its old id, still
/// running `attempt`.
async fn come_back(
    channel: &Channel,
    worker_token: &str,
    worker_id: &str,
    attempt: &v1::AttemptRef,
) -> TestWorker {
    TestWorker::reconnect(
        channel,
        worker_token,
        "gpu-a",
        16 << 30,
        worker_id,
        vec![attempt.clone()],
    )
    .await
}

async fn wait_for_state(
    channel: &Channel,
    token: &str,
    job_id: &str,
    state: v1::JobState,
) -> v1::Job {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let job = get(channel, token, job_id).await.unwrap();
        if job.state == state as i32 {
            return job;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "job {job_id} never reached {state:?}; it is {:?}",
            v1::JobState::try_from(job.state)
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test]
async fn a_job_running_across_a_restart_finishes_and_its_result_is_recorded() {
    let (_directory, database) = fresh_database();
    let lease = Duration::from_secs(3);

    // The first life: a job is placed and starts.
    let (first, channel, user, worker_token, mut worker) = first_life(&database, lease).await;
    let (job, assignment) = submit_and_place(&channel, &user, &mut worker).await;
    let attempt = assignment.attempt.clone().unwrap();
    assert_eq!(attempt.job_id, job.id);
    assert_eq!(attempt.attempt_number, 1);
    worker.started(&assignment).await;
    wait_for_state(&channel, &user, &job.id, v1::JobState::Running).await;
    let worker_id = worker.id.clone();

    // The scheduler stops; the worker's session goes with it.
    first.end_with(channel, worker).await;

    // The second life, on the same database and a new socket.
    let second = RunningScheduler::start(&database, lease).await;
    let channel = second.channel().await;
    let recovered = get(&channel, &user, &job.id).await.unwrap();
    assert_eq!(recovered.state, v1::JobState::Running as i32);
    assert_eq!(recovered.attempts.len(), 1);
    assert_eq!(
        recovered.attempts[0].outcome,
        v1::AttemptOutcome::Running as i32
    );
    let held = list_slices(&channel).await;
    assert_eq!(
        held.len(),
        1,
        "the running attempt keeps its slice: {held:?}"
    );
    assert_eq!(held[0].job_id, job.id);
    assert_eq!(held[0].worker_id, worker_id);

    // The worker comes back under its old id, still running the attempt.
    let mut worker = come_back(&channel, &worker_token, &worker_id, &attempt).await;
    assert_eq!(
        worker.id, worker_id,
        "the worker keeps its id across a restart"
    );
    let progress = worker.report_halfway(&attempt).await;
    assert!(
        progress.is_empty(),
        "the attempt is still this worker's: nothing is cancelled or placed again: {progress:?}"
    );
    let after_progress = get(&channel, &user, &job.id).await.unwrap();
    assert_eq!(after_progress.state, v1::JobState::Running as i32);
    assert_eq!(after_progress.attempts.len(), 1);

    let finished = worker
        .finish(&attempt, v1::AttemptOutcome::Succeeded, 2 << 20)
        .await;
    assert!(finished.is_empty(), "unexpected messages: {finished:?}");
    let done = wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;
    assert_eq!(done.attempts.len(), 1, "{:?}", done.attempts);
    assert_eq!(
        done.attempts[0].outcome,
        v1::AttemptOutcome::Succeeded as i32
    );
    assert_eq!(done.attempts[0].number, 1);
    assert_eq!(done.attempts[0].worker_id, worker_id);
    assert_eq!(done.attempts[0].measured_peak_bytes, Some(2 << 20));
    assert!(list_slices(&channel).await.is_empty(), "the slice is freed");
    let late = worker.messages_within(Duration::from_millis(300)).await;
    assert!(late.is_empty(), "nothing is sent after success: {late:?}");

    second.end_with(channel, worker).await;
}

#[tokio::test]
async fn a_worker_that_does_not_come_back_after_a_restart_loses_its_attempt() {
    let (_directory, database) = fresh_database();
    let lease = Duration::from_secs(1);

    // The first life: a job starts and writes a checkpoint.
    let (first, channel, user, worker_token, mut worker) = first_life(&database, lease).await;
    let (job, assignment) = submit_and_place(&channel, &user, &mut worker).await;
    let attempt = assignment.attempt.clone().unwrap();
    worker.started(&assignment).await;
    let checkpoint = "/checkpoints/restart-a.ckpt";
    let others = worker
        .checkpoint_written(&attempt, 4, checkpoint.into())
        .await;
    assert!(others.is_empty(), "unexpected messages: {others:?}");
    wait_for_state(&channel, &user, &job.id, v1::JobState::Running).await;
    let lost_worker = worker.id.clone();
    first.end_with(channel, worker).await;

    // The second life: the worker never comes back.
    let restarted_at = tokio::time::Instant::now();
    let second = RunningScheduler::start(&database, lease).await;
    let channel = second.channel().await;
    let recovered = get(&channel, &user, &job.id).await.unwrap();
    if restarted_at.elapsed() < lease {
        // Within the lease the attempt is still the old worker's.
        assert_eq!(recovered.state, v1::JobState::Running as i32);
        assert_eq!(recovered.attempts.len(), 1);
    }
    let mut replacement = TestWorker::connect(&channel, &worker_token, "gpu-b", 16 << 30).await;
    assert_ne!(replacement.id, lost_worker);
    let second_assignment = replacement.next_assignment().await;
    assert!(
        restarted_at.elapsed() >= lease,
        "the job is placed again only after the lease runs out"
    );
    let second_attempt = second_assignment.attempt.clone().unwrap();
    assert_eq!(second_attempt.job_id, job.id);
    assert_eq!(second_attempt.attempt_number, 2);
    assert!(second_attempt.lease_epoch > attempt.lease_epoch);
    assert_eq!(
        second_assignment.resume_from.as_ref().unwrap().location,
        checkpoint
    );
    // The step of that checkpoint, as the worker reported it, not 0.
    assert_eq!(second_assignment.resume_from.as_ref().unwrap().step, 4);
    let requeued = get(&channel, &user, &job.id).await.unwrap();
    assert_eq!(requeued.attempts.len(), 2);
    assert_eq!(
        requeued.attempts[0].outcome,
        v1::AttemptOutcome::Lost as i32
    );
    assert_eq!(requeued.attempts[0].worker_id, lost_worker);
    assert_eq!(requeued.attempts[1].worker_id, replacement.id);
    assert_eq!(
        requeued.attempts[1].resumed_from.as_ref().unwrap().location,
        checkpoint
    );
    assert_eq!(requeued.attempts[1].resumed_from.as_ref().unwrap().step, 4);

    replacement.started(&second_assignment).await;
    let finished = replacement
        .finish(&second_attempt, v1::AttemptOutcome::Succeeded, 1 << 20)
        .await;
    assert!(finished.is_empty(), "unexpected messages: {finished:?}");
    let done = wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;
    assert_eq!(done.attempts.len(), 2);
    assert_eq!(
        done.attempts[1].outcome,
        v1::AttemptOutcome::Succeeded as i32
    );
    assert_eq!(done.attempts[1].measured_peak_bytes, Some(1 << 20));

    second.end_with(channel, replacement).await;
}

#[tokio::test]
async fn the_scheduler_stops_while_a_worker_is_still_connected() {
    let (_directory, database) = fresh_database();
    // The worker's session stays open from its side: the scheduler must end it to stop.
    let (scheduler, _channel, _, _, _worker) = first_life(&database, Duration::from_secs(30)).await;
    scheduler.stop().await;
}

/// Log lines received just before a graceful stop are written by the stop, and a job's
/// lines are read from the store after a restart.
#[tokio::test]
async fn job_logs_received_before_a_stop_are_read_after_the_restart() {
    let (_directory, database) = fresh_database();
    let lease = Duration::from_secs(3);
    let (first, channel, user, _, mut worker) = first_life(&database, lease).await;
    let (job, assignment) = submit_and_place(&channel, &user, &mut worker).await;
    let attempt = assignment.attempt.clone().unwrap();
    for step in 1..=3 {
        // Each send waits for its ack, so the scheduler has taken the line in.
        worker
            .send(v1::worker_message::Body::Log(v1::worker_message::LogLine {
                attempt: Some(attempt.clone()),
                level: "info".into(),
                message: format!("step {step}"),
                stream: String::new(),
            }))
            .await;
    }
    first.end_with(channel, worker).await;

    let second = RunningScheduler::start(&database, lease).await;
    let channel = second.channel().await;
    let logs = job_logs(
        &channel,
        &user,
        v1::GetJobLogsRequest {
            job_id: job.id.clone(),
            attempt_number: 1,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let messages: Vec<&str> = logs
        .lines
        .iter()
        .map(|line| line.message.as_str())
        .collect();
    assert_eq!(messages, vec!["step 1", "step 2", "step 3"]);
    let everything = job_logs(
        &channel,
        &user,
        v1::GetJobLogsRequest {
            job_id: job.id.clone(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(
        everything
            .lines
            .iter()
            .any(|line| line.attempt_number == 0 && line.message.starts_with("queued -> placed")),
        "{:#?}",
        everything.lines
    );
    drop(channel);
    second.stop().await;
}

/// A resumable watch of `job_id` with logs, after `after` (or from now without it).
async fn resumable_watch(
    channel: &Channel,
    token: &str,
    job_id: &str,
    after: Option<u64>,
) -> tonic::Streaming<v1::JobEvent> {
    carve_proto::v1::job_service_client::JobServiceClient::new(channel.clone())
        .watch_job(test_worker::authorized(
            v1::WatchJobRequest {
                job_id: job_id.into(),
                include_logs: true,
                resumable: true,
                after_log_sequence: after,
            },
            token,
        ))
        .await
        .unwrap()
        .into_inner()
}

/// The events `stream` sends until it ends, breaks, or is quiet for `quiet`.
async fn events_until_quiet(
    stream: &mut tonic::Streaming<v1::JobEvent>,
    quiet: Duration,
) -> Vec<v1::JobEvent> {
    let mut events = Vec::new();
    while let Ok(Ok(Some(event))) = tokio::time::timeout(quiet, stream.message()).await {
        events.push(event);
    }
    events
}

#[tokio::test]
async fn a_watch_broken_by_a_restart_resumes_after_its_last_event_without_duplicates_or_gaps() {
    let (_directory, database) = fresh_database();
    let lease = Duration::from_secs(3);
    let (first, channel, user, worker_token, mut worker) = first_life(&database, lease).await;
    let (job, assignment) = submit_and_place(&channel, &user, &mut worker).await;
    let attempt = assignment.attempt.clone().unwrap();

    // The first life: the watch starts with the current state, then sees the attempt
    // start, report progress and write a line.
    let mut watch = resumable_watch(&channel, &user, &job.id, None).await;
    let current = watch.message().await.unwrap().unwrap();
    let started_after = current.log_sequence;
    assert!(started_after > 0, "the job's story has begun: {current:?}");
    worker.started(&assignment).await;
    worker.report_halfway(&attempt).await;
    worker
        .report_log(&attempt, "info", "before the restart")
        .await;
    let seen = events_until_quiet(&mut watch, Duration::from_millis(800)).await;
    let seen_sequences: Vec<u64> = seen.iter().map(|event| event.log_sequence).collect();
    assert_eq!(
        seen_sequences,
        (started_after + 1..=started_after + seen.len() as u64).collect::<Vec<_>>(),
        "a resumable watch numbers every event, one after another: {seen:?}"
    );
    assert!(
        seen.iter().any(|event| matches!(
            &event.event,
            Some(v1::job_event::Event::Log(line)) if line.message == "before the restart"
        )),
        "{seen:?}"
    );
    let last_seen = *seen_sequences.last().unwrap();
    let worker_id = worker.id.clone();
    first.end_with(channel, worker).await;
    // The stream broke with the scheduler (an error or its end, never a terminal event).
    let rest = events_until_quiet(&mut watch, Duration::from_millis(300)).await;
    assert!(rest.is_empty(), "{rest:?}");

    // The second life: things happen before the watcher comes back.
    let second = RunningScheduler::start(&database, lease).await;
    let channel = second.channel().await;
    let mut worker = come_back(&channel, &worker_token, &worker_id, &attempt).await;
    worker
        .report_log(&attempt, "info", "after the restart")
        .await;
    worker
        .finish(&attempt, v1::AttemptOutcome::Succeeded, 2 << 20)
        .await;
    wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;

    // Resumed after the last event it saw: every later stored event once, in order, to
    // the end of the job, where the stream ends.
    let mut resumed = resumable_watch(&channel, &user, &job.id, Some(last_seen)).await;
    let replayed = events_until_quiet(&mut resumed, DEADLINE).await;
    let replayed_sequences: Vec<u64> = replayed.iter().map(|event| event.log_sequence).collect();
    assert_eq!(
        replayed_sequences,
        (last_seen + 1..=last_seen + replayed.len() as u64).collect::<Vec<_>>(),
        "{replayed:?}"
    );
    let last = replayed.last().unwrap();
    assert!(
        matches!(
            &last.event,
            Some(v1::job_event::Event::StateChanged(changed))
                if changed.state == v1::JobState::Succeeded as i32
        ),
        "the stream ends with the job: {last:?}"
    );
    let messages: Vec<String> = replayed
        .iter()
        .filter_map(|event| match &event.event {
            Some(v1::job_event::Event::Log(line)) => Some(line.message.clone()),
            _ => None,
        })
        .collect();
    assert!(
        messages.contains(&"after the restart".to_string()),
        "{messages:?}"
    );
    assert!(
        !messages.contains(&"before the restart".to_string()),
        "{messages:?}"
    );
    // What both streams sent is the job's whole stored story after the watch began.
    let logs = job_logs(
        &channel,
        &user,
        v1::GetJobLogsRequest {
            job_id: job.id.clone(),
            after_sequence: started_after,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let stored: Vec<u64> = logs.lines.iter().map(|line| line.sequence).collect();
    assert_eq!(stored, [seen_sequences, replayed_sequences].concat());

    second.end_with(channel, worker).await;
}
