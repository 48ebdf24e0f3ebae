//! A scheduler restart in the middle of a preemption (issue 29, point 3): the real
//! scheduler in-process on 127.0.0.1:0, stopped and started again on the same SQLite
//! file, with a test worker that speaks the worker protocol by hand. A low-priority job
//! runs (with a checkpoint at step 5) on a GPU that holds one and a half of it; an
//! urgent job makes the scheduler evict it; the scheduler is restarted
//!
//! - after the decision, before the cancel reached the worker (the worker never acts on
//!   the first life's cancel),
//! - after the cancel, before the victim's report (the worker stopped the victim; its
//!   report reaches the second life),
//! - after the report (the first life read it; the urgent job may not be placed yet).
//!
//! Each time the victim's stop is read as preempted (its job is requeued, never
//! CANCELLED), the urgent job is placed in the freed bytes, the victim resumes from its
//! checkpoint, and the second life evicts nobody (no second eviction for the same claim).
//! A user's real cancel of the victim during the preemption, after a restart, still
//! cancels it. On PostgreSQL, a standby that takes over from the leader finishes the
//! preemption the leader began, in the same way.

#[macro_use]
mod support;

use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::cluster_service_client::ClusterServiceClient;
use carve_scheduler::error::SchedulerError;
use carve_scheduler::server::run;
use carve_scheduler::store::Store;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::TestWorker;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{
    JOB, all_job_logs, cancel, connect_within, get, metric, scrape, sqlite_url, submit, test_config,
};

/// Every wait in these tests ends by this deadline.
const DEADLINE: Duration = Duration::from_secs(10);
/// Long enough that the worker never loses its attempt across a restart.
const LEASE: Duration = Duration::from_secs(30);
const GRACE: Duration = Duration::from_secs(7);
const CONTEXT_BYTES: u64 = 256 << 20;
const CHECKPOINT_STEP: u64 = 5;

/// One life of the scheduler: `run` on its own listener and metrics port, until `stop`.
struct Life {
    address: String,
    metrics_address: std::net::SocketAddr,
    shutdown: oneshot::Sender<()>,
    server: JoinHandle<Result<(), SchedulerError>>,
}

impl Life {
    async fn start(database_url: &str) -> Life {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        let metrics_address = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut config = test_config(database_url.to_string(), LEASE, Some(metrics_address));
        config.settings.preemption.min_run_time = Duration::ZERO;
        config.settings.preemption.grace_period = GRACE;
        // Replicas on PostgreSQL: a standby polls for the lease every quarter of it.
        config.settings.leader_lease = Duration::from_secs(2);
        let (shutdown, shutdown_signal) = oneshot::channel::<()>();
        let server = tokio::spawn(run(config, listener, async {
            let _ = shutdown_signal.await;
        }));
        Life {
            address,
            metrics_address,
            shutdown,
            server,
        }
    }

    async fn channel(&self) -> Channel {
        connect_within(&self.address, DEADLINE).await
    }

    /// How many attempts this life evicted.
    async fn evictions(&self) -> u64 {
        metric(
            &scrape(self.metrics_address).await,
            "carve_preemptions_total",
        )
    }

    /// Ends this life: `worker` disconnects, `channel` closes, and the scheduler stops.
    async fn end_with(self, channel: Channel, worker: TestWorker) {
        worker.disconnect();
        drop(channel);
        let _ = self.shutdown.send(());
        tokio::time::timeout(DEADLINE, self.server)
            .await
            .expect("run returns within the deadline after shutdown")
            .expect("the server task did not panic")
            .expect("run ends cleanly");
    }
}

fn with_priority(priority: i32, name: &str) -> String {
    JOB.replacen(
        "\"name\": \"small\",",
        &format!("\"name\": \"{name}\", \"priority\": {priority},"),
        1,
    )
}

/// The first life, with a channel to it and its worker.
struct FirstLife {
    life: Life,
    channel: Channel,
    worker: TestWorker,
}

/// What outlives the first life of a preemption: the database, the tenant's tokens, the
/// worker's id, the two jobs and the victim's attempt.
struct Evicting {
    _directory: tempfile::TempDir,
    database: String,
    user: String,
    worker_token: String,
    worker_id: String,
    low: v1::Job,
    low_attempt: v1::AttemptRef,
    high: v1::Job,
    gpu_bytes: u64,
}

/// The first life up to the eviction: the low job runs (checkpoint at step 5), the high
/// job is submitted, and the worker has received the low attempt's cancel.
async fn evicting() -> (FirstLife, Evicting) {
    let directory = tempfile::tempdir().unwrap();
    let database = sqlite_url(directory.path());
    evicting_on(directory, database).await
}

/// [`evicting`] on `database` (`directory`: what to keep while the test runs).
async fn evicting_on(directory: tempfile::TempDir, database: String) -> (FirstLife, Evicting) {
    let life = Life::start(&database).await;
    let channel = life.channel().await;
    let (user, worker_token) =
        cluster::tenant_with_tokens(&channel, "acme", v1::Quota::default()).await;
    // Submitted before any GPU exists, so its size is known first.
    let low = submit(&channel, &user, &with_priority(0, "low"), "")
        .await
        .unwrap()
        .job
        .unwrap();
    let required = low.estimate.as_ref().unwrap().required_bytes;
    let gpu_bytes = CONTEXT_BYTES + required * 3 / 2;
    let mut worker = TestWorker::connect(&channel, &worker_token, "gpu-a", gpu_bytes).await;
    let assignment = worker.next_assignment().await;
    worker.started(&assignment).await;
    let low_attempt = assignment.attempt.clone().unwrap();
    worker
        .checkpoint_written(
            &low_attempt,
            CHECKPOINT_STEP,
            "/checkpoints/low.ckpt".into(),
        )
        .await;
    let high = submit(&channel, &user, &with_priority(10, "high"), "")
        .await
        .unwrap()
        .job
        .unwrap();
    let cancel = expect_cancel(&mut worker, &low_attempt).await;
    assert!(cancel.reason.contains(&high.id), "{}", cancel.reason);
    let worker_id = worker.id.clone();
    (
        FirstLife {
            life,
            channel,
            worker,
        },
        Evicting {
            _directory: directory,
            database,
            user,
            worker_token,
            worker_id,
            low,
            low_attempt,
            high,
            gpu_bytes,
        },
    )
}

/// The next message, which must be the cancel of `attempt` with the whole grace period.
async fn expect_cancel(
    worker: &mut TestWorker,
    attempt: &v1::AttemptRef,
) -> v1::scheduler_message::Cancel {
    match worker.next().await {
        v1::scheduler_message::Body::Cancel(cancel) => {
            assert_eq!(cancel.attempt.as_ref(), Some(attempt));
            assert_eq!(
                cancel.grace_period.as_ref().map(|grace| grace.seconds),
                Some(GRACE.as_secs() as i64)
            );
            cancel
        }
        other => panic!("expected the cancel of {attempt:?}, got {other:?}"),
    }
}

/// The first assignment among `already` and the worker's next messages, skipping the
/// cancels of `victim` (a restarted scheduler sends its stop again).
async fn next_assignment_after(
    worker: &mut TestWorker,
    already: Vec<v1::scheduler_message::Body>,
    victim: &v1::AttemptRef,
) -> v1::scheduler_message::Assignment {
    let mut messages = already.into_iter();
    loop {
        let message = match messages.next() {
            Some(message) => message,
            None => worker.next().await,
        };
        match message {
            v1::scheduler_message::Body::Assignment(assignment) => return assignment,
            v1::scheduler_message::Body::Cancel(cancel)
                if cancel.attempt.as_ref() == Some(victim) => {}
            other => panic!("expected an assignment, got {other:?}"),
        }
    }
}

/// Waits until `job_id` is in `state`; fails the test if it ends CANCELLED on the way
/// (when `state` is not CANCELLED) or does not get there within [`DEADLINE`].
async fn wait_for(channel: &Channel, user: &str, job_id: &str, state: v1::JobState) -> v1::Job {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let job = get(channel, user, job_id).await.unwrap();
        if job.state == state as i32 {
            return job;
        }
        assert_ne!(
            job.state,
            v1::JobState::Cancelled as i32,
            "job {job_id} was cancelled though no one cancelled it: {}",
            job.message
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "job {job_id} never reached {state:?}; it is {:?}",
            v1::JobState::try_from(job.state)
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The second life with the worker back under its old id, `running` what it still runs.
async fn second_life(
    evicting: &Evicting,
    running: Vec<v1::AttemptRef>,
) -> (Life, Channel, TestWorker) {
    let life = Life::start(&evicting.database).await;
    let channel = life.channel().await;
    let worker = TestWorker::reconnect(
        &channel,
        &evicting.worker_token,
        "gpu-a",
        evicting.gpu_bytes,
        &evicting.worker_id,
        running,
    )
    .await;
    (life, channel, worker)
}

/// From the victim's "cancelled" report (`after_report`: what the scheduler sent with
/// its ack) on: the urgent job is placed and succeeds, the victim was preempted and
/// resumes from its checkpoint and succeeds; no job ends CANCELLED; `life` evicted
/// nobody, and the victim's log names one eviction.
async fn preemption_completes(
    life: &Life,
    channel: &Channel,
    worker: &mut TestWorker,
    evicting: &Evicting,
    after_report: Vec<v1::scheduler_message::Body>,
) {
    let (user, low, high) = (&evicting.user, &evicting.low, &evicting.high);
    let required = low.estimate.as_ref().unwrap().required_bytes;
    let high_assignment = next_assignment_after(worker, after_report, &evicting.low_attempt).await;
    assert_eq!(high_assignment.attempt.as_ref().unwrap().job_id, high.id);
    let queued = wait_for(channel, user, &low.id, v1::JobState::Queued).await;
    assert_eq!(
        queued.attempts[0].outcome,
        v1::AttemptOutcome::Preempted as i32,
        "{:?}",
        queued.attempts[0]
    );
    assert!(
        queued.attempts[0].failure_message.contains(&high.id),
        "{}",
        queued.attempts[0].failure_message
    );
    let others = worker.report_started(&high_assignment).await;
    let others = [others, worker.succeed(&high_assignment, required / 2).await].concat();
    wait_for(channel, user, &high.id, v1::JobState::Succeeded).await;
    let resumed = next_assignment_after(worker, others, &evicting.low_attempt).await;
    let resumed_attempt = resumed.attempt.clone().unwrap();
    assert_eq!(resumed_attempt.job_id, low.id);
    assert_eq!(resumed_attempt.attempt_number, 2);
    assert_eq!(
        resumed
            .resume_from
            .as_ref()
            .map(|checkpoint| checkpoint.step),
        Some(CHECKPOINT_STEP),
        "the victim resumes from its checkpoint"
    );
    worker.report_started(&resumed).await;
    worker.succeed(&resumed, required / 2).await;
    let done = wait_for(channel, user, &low.id, v1::JobState::Succeeded).await;
    assert_eq!(done.attempts.len(), 2, "{:?}", done.attempts);

    assert_eq!(
        life.evictions().await,
        0,
        "the restarted scheduler evicted an attempt again"
    );
    let logs = all_job_logs(channel, user, &low.id).await;
    let evictions = logs
        .lines
        .iter()
        .filter(|line| line.message.starts_with("preempted by job"))
        .count();
    assert_eq!(evictions, 1, "{:?}", logs.lines);
}

#[tokio::test]
async fn a_restart_after_the_decision_before_the_cancel_reached_the_worker() {
    let (first, evicting) = evicting().await;
    // The worker never acts on the first life's cancel: as far as it knows, the victim
    // runs on.
    first.life.end_with(first.channel, first.worker).await;

    let (life, channel, mut worker) =
        second_life(&evicting, vec![evicting.low_attempt.clone()]).await;
    // The second life tells it to stop: the preemption the first one began.
    expect_cancel(&mut worker, &evicting.low_attempt).await;
    let report = worker
        .finish(
            &evicting.low_attempt,
            v1::AttemptOutcome::Cancelled,
            1 << 20,
        )
        .await;
    preemption_completes(&life, &channel, &mut worker, &evicting, report).await;
    life.end_with(channel, worker).await;
}

#[tokio::test]
async fn a_restart_after_the_cancel_before_the_victims_report() {
    let (first, evicting) = evicting().await;
    // The worker stops the victim; the scheduler goes before its report reaches it.
    first.life.end_with(first.channel, first.worker).await;

    // The worker comes back and sends the report it could not send: the victim was
    // cancelled (as the worker saw it: it was told to stop).
    let (life, channel, mut worker) =
        second_life(&evicting, vec![evicting.low_attempt.clone()]).await;
    let report = worker
        .finish(
            &evicting.low_attempt,
            v1::AttemptOutcome::Cancelled,
            1 << 20,
        )
        .await;
    preemption_completes(&life, &channel, &mut worker, &evicting, report).await;
    life.end_with(channel, worker).await;
}

#[tokio::test]
async fn a_restart_after_the_victims_report() {
    let (mut first, evicting) = evicting().await;
    // The first life reads the report; the scheduler goes right after its ack, whether
    // or not it placed the urgent job.
    let after_report = first
        .worker
        .finish(
            &evicting.low_attempt,
            v1::AttemptOutcome::Cancelled,
            1 << 20,
        )
        .await;
    let placed_before_the_restart = after_report
        .iter()
        .any(|message| matches!(message, v1::scheduler_message::Body::Assignment(_)));
    first.life.end_with(first.channel, first.worker).await;

    let (life, channel, mut worker) = second_life(&evicting, vec![]).await;
    // An urgent job placed before the restart, which the worker never started, is lost
    // with the old session and placed again.
    let _ = placed_before_the_restart;
    preemption_completes(&life, &channel, &mut worker, &evicting, Vec::new()).await;
    life.end_with(channel, worker).await;
}

#[tokio::test]
async fn a_users_cancel_of_the_victim_during_its_preemption_across_a_restart_cancels_it() {
    let (first, evicting) = evicting().await;
    first.life.end_with(first.channel, first.worker).await;

    let (life, channel, mut worker) =
        second_life(&evicting, vec![evicting.low_attempt.clone()]).await;
    expect_cancel(&mut worker, &evicting.low_attempt).await;
    cancel(
        &channel,
        &evicting.user,
        &evicting.low.id,
        "not needed any more",
    )
    .await
    .unwrap();
    let report = worker
        .finish(
            &evicting.low_attempt,
            v1::AttemptOutcome::Cancelled,
            1 << 20,
        )
        .await;
    let low = get(&channel, &evicting.user, &evicting.low.id)
        .await
        .unwrap();
    assert_eq!(low.state, v1::JobState::Cancelled as i32, "{}", low.message);
    assert!(
        low.message.contains("not needed any more"),
        "{}",
        low.message
    );
    // The urgent job still gets the freed bytes.
    let high_assignment = next_assignment_after(&mut worker, report, &evicting.low_attempt).await;
    assert_eq!(
        high_assignment.attempt.as_ref().unwrap().job_id,
        evicting.high.id
    );
    life.end_with(channel, worker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_finishes_the_preemption_the_old_leader_began() {
    let database = support::shared_postgres()
        .create_database("preemption")
        .await
        .unwrap_or_else(|error| panic!("{error}"));
    // The first replica leads (it found the lease free); the worker never acts on its
    // cancel before it goes.
    let (first, evicting) = evicting_on(tempfile::tempdir().unwrap(), database.clone()).await;
    let standby = Life::start(&database).await;
    let store = Store::open(&database).await.unwrap();
    let epoch_before = store.leadership().await.unwrap().epoch;
    first.life.end_with(first.channel, first.worker).await;

    // The standby takes over (the stopping leader released its lease): it leads once it
    // has recovered and serves what needs live state (a standby refuses slice views).
    let channel = standby.channel().await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let slices = ClusterServiceClient::new(channel.clone())
            .list_slices(test_worker::authorized(
                v1::ListSlicesRequest::default(),
                cluster::ADMIN,
            ))
            .await;
        let leadership = store.leadership().await.unwrap();
        if slices.is_ok() && leadership.epoch > epoch_before {
            assert_eq!(leadership.endpoint, standby.address);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the standby never took over: {leadership:?}, {slices:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let mut worker = TestWorker::reconnect(
        &channel,
        &evicting.worker_token,
        "gpu-a",
        evicting.gpu_bytes,
        &evicting.worker_id,
        vec![evicting.low_attempt.clone()],
    )
    .await;
    expect_cancel(&mut worker, &evicting.low_attempt).await;
    let report = worker
        .finish(
            &evicting.low_attempt,
            v1::AttemptOutcome::Cancelled,
            1 << 20,
        )
        .await;
    preemption_completes(&standby, &channel, &mut worker, &evicting, report).await;
    standby.end_with(channel, worker).await;
}
