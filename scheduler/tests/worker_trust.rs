//! Regression tests for issue 13's defects in how the scheduler trusts workers and keeps
//! its own time, each against the real server on 127.0.0.1:0:
//! - a worker token could speak for any worker (its id was not bound to the token);
//! - a worker could hold several sessions, and revoking a token left its streams open;
//! - a killed attempt process failed its job for good; infrastructure failures are
//!   retried from the checkpoint, a bounded number of times, with backoff;
//! - two heavy EstimateJob calls froze health checks and got a heartbeating worker
//!   declared lost; worker tokens could call EstimateJob.

use std::time::{Duration, Instant};

use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_proto::v1::worker_service_client::WorkerServiceClient;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::Channel;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::{TestWorker, authorized};

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{
    ADMIN, JOB, get, list_workers, revoke_token, start_for_tenant, start_with_worker, submit,
    submit_and_place, tenant_with_tokens, token_with_id, wait_for_state, watch,
};

/// Waits up to `wait` for the session of `worker` to end, and checks it ended with `code`.
async fn session_ends_with(worker: &mut TestWorker, wait: Duration, code: Code) -> tonic::Status {
    let ended = worker.session_end(wait).await.expect("the session ends");
    assert_eq!(ended.code(), code, "{ended:?}");
    ended
}

/// Opens a session whose hello names `worker_id`, with `token`.
async fn hello_as(
    channel: &Channel,
    token: &str,
    worker_id: &str,
) -> Result<tonic::Streaming<v1::SchedulerMessage>, tonic::Status> {
    let (outgoing, receiver) = tokio::sync::mpsc::channel(4);
    outgoing
        .send(v1::WorkerMessage {
            sequence: 0,
            body: Some(v1::worker_message::Body::Hello(v1::worker_message::Hello {
                worker_id: worker_id.into(),
                running_attempts: vec![],
            })),
        })
        .await
        .unwrap();
    // The sender must outlive the call, or the stream ends before the hello is read.
    let session = WorkerServiceClient::new(channel.clone())
        .session(authorized(ReceiverStream::new(receiver), token))
        .await
        .map(|response| response.into_inner());
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(outgoing);
    });
    session
}

#[tokio::test]
async fn a_worker_token_cannot_speak_for_another_worker() {
    let (_cluster, channel, user, worker_token) =
        start_for_tenant(Duration::from_secs(30), "alice").await;
    let (_, impostor_token) = token_with_id(&channel, "alice", v1::Role::Worker).await;
    let mut real = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    let (job, assignment) = submit_and_place(&channel, &user, &mut real).await;
    real.started(&assignment).await;

    // Registering under the real worker's id with another token gives a new identity.
    let impostor = TestWorker::reconnect(
        &channel,
        &impostor_token,
        "gpu-b",
        16 << 30,
        &real.id,
        vec![assignment.attempt.clone().unwrap()],
    )
    .await;
    assert_ne!(impostor.id, real.id);

    // A session that says hello as the real worker with another token is refused.
    let refused = hello_as(&channel, &impostor_token, &real.id)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains(&real.id), "{refused:?}");

    // The real worker still holds its attempt and ends it.
    real.succeed(&assignment, 1 << 20).await;
    let finished = wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;
    assert_eq!(finished.attempts.len(), 1);
}

#[tokio::test]
async fn a_session_without_hello_is_closed_after_the_lease() {
    let lease = Duration::from_secs(1);
    let (_cluster, channel, _, worker_token) = start_for_tenant(lease, "alice").await;
    let (outgoing, receiver) = tokio::sync::mpsc::channel::<v1::WorkerMessage>(1);
    let opened_at = Instant::now();
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        WorkerServiceClient::new(channel.clone())
            .session(authorized(ReceiverStream::new(receiver), &worker_token)),
    )
    .await
    .expect("the scheduler answers")
    .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("hello"), "{refused:?}");
    assert!(opened_at.elapsed() >= lease);
    drop(outgoing);
}

#[tokio::test]
async fn worker_tokens_cannot_estimate_jobs() {
    let (_cluster, channel, user, worker_token) =
        start_for_tenant(Duration::from_secs(30), "alice").await;
    let estimate = |token: String| {
        let mut client = JobServiceClient::new(channel.clone());
        async move {
            client
                .estimate_job(authorized(
                    v1::EstimateJobRequest {
                        spec_json: JOB.into(),
                        ..Default::default()
                    },
                    &token,
                ))
                .await
        }
    };
    let refused = estimate(worker_token).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("worker token"), "{refused:?}");
    assert!(estimate(user).await.is_ok());
}

#[tokio::test]
async fn a_newer_session_of_a_worker_ends_the_older_one() {
    let (_cluster, channel, user, worker_token, mut first) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    let mut second = TestWorker::reconnect(
        &channel,
        &worker_token,
        "gpu-a",
        16 << 30,
        &first.id,
        vec![],
    )
    .await;
    assert_eq!(second.id, first.id, "the same token resumes its worker");
    let ended = session_ends_with(&mut first, Duration::from_secs(5), Code::Aborted).await;
    assert!(ended.message().contains("replaced"), "{ended:?}");

    // Work goes to the session that is live now.
    submit(&channel, &user, JOB, "").await.unwrap();
    let assignment = second.next_assignment().await;
    second.started(&assignment).await;
}

#[tokio::test]
async fn revoking_a_token_ends_the_worker_sessions_and_watches_opened_with_it() {
    let (_cluster, channel, _, _) = start_for_tenant(Duration::from_secs(30), "alice").await;
    let (worker_token_id, worker_token) = token_with_id(&channel, "alice", v1::Role::Worker).await;
    let (user_token_id, user) = token_with_id(&channel, "alice", v1::Role::User).await;
    let mut worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;

    let revoked_at = Instant::now();
    revoke_token(&channel, &worker_token_id).await;
    session_ends_with(&mut worker, Duration::from_secs(5), Code::Unauthenticated).await;
    assert!(revoked_at.elapsed() < Duration::from_secs(2));
    // Its worker takes nothing new: a job submitted now stays queued.
    let job = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let queued = get(&channel, &user, &job.id).await.unwrap();
    assert_eq!(queued.state, v1::JobState::Queued as i32);

    let mut watch = watch(&channel, &user, &job.id).await;
    // The first event is the job's current state.
    watch.next().await.unwrap().unwrap();
    revoke_token(&channel, &user_token_id).await;
    let watch_end = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match watch.next().await {
                Some(Ok(_)) => {}
                Some(Err(status)) => return status,
                None => panic!("the watch ended without a status"),
            }
        }
    })
    .await
    .expect("the watch ends");
    assert_eq!(watch_end.code(), Code::Unauthenticated, "{watch_end:?}");
}

#[tokio::test]
async fn a_token_revoked_through_another_replica_ends_its_sessions_within_seconds() {
    let (cluster, channel, _, _) = start_for_tenant(Duration::from_secs(30), "alice").await;
    let (worker_token_id, worker_token) = token_with_id(&channel, "alice", v1::Role::Worker).await;
    let mut worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    let other_replica = cluster.other_replica().await;
    let revoked_at = Instant::now();
    other_replica
        .revoke_token(&worker_token_id, 0)
        .await
        .unwrap();
    let ended =
        session_ends_with(&mut worker, Duration::from_secs(10), Code::Unauthenticated).await;
    assert!(ended.message().contains("revoked"), "{ended:?}");
    // Tokens are read again at most every 2 s (the lookups' time to live).
    assert!(
        revoked_at.elapsed() < Duration::from_secs(5),
        "{:?}",
        revoked_at.elapsed()
    );
}

#[tokio::test]
async fn an_interrupted_attempt_resumes_from_its_checkpoint_with_backoff_a_bounded_number_of_times()
{
    let (_cluster, channel, user, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    let job = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    // The tests' backoff is 100 ms, doubling with each failure.
    let backoffs = [100, 200, 400];
    let mut assignment = worker.next_assignment().await;
    for (failure, backoff_ms) in backoffs.iter().enumerate() {
        let attempt = assignment.attempt.clone().unwrap();
        assert_eq!(attempt.attempt_number as usize, failure + 1);
        worker.started(&assignment).await;
        let location = format!("/checkpoints/{}.attempt-{}.ckpt", job.id, failure + 1);
        worker.checkpoint_written(&attempt, 4, location).await;
        let interrupted_at = Instant::now();
        worker
            .finish(&attempt, v1::AttemptOutcome::Interrupted, 0)
            .await;
        assignment = worker.next_assignment().await;
        assert!(
            interrupted_at.elapsed() >= Duration::from_millis(*backoff_ms),
            "placed again after {:?}, before the backoff of {backoff_ms} ms",
            interrupted_at.elapsed()
        );
        let resume = assignment.resume_from.clone().unwrap();
        assert!(
            resume
                .location
                .ends_with(&format!("attempt-{}.ckpt", failure + 1)),
            "{resume:?}"
        );
    }
    // The fourth infrastructure failure fails the job.
    worker.started(&assignment).await;
    worker
        .finish(
            assignment.attempt.as_ref().unwrap(),
            v1::AttemptOutcome::Interrupted,
            0,
        )
        .await;
    let failed = wait_for_state(&channel, &user, &job.id, v1::JobState::Failed).await;
    assert_eq!(failed.attempts.len(), 4);
    assert!(
        failed
            .attempts
            .iter()
            .all(|attempt| attempt.outcome == v1::AttemptOutcome::Interrupted as i32)
    );
    assert!(
        failed.message.contains("retried only 3 times"),
        "{}",
        failed.message
    );
}

/// A spec of `layers` dense layers: validation, the estimate and the shrink plan all grow
/// with it.
fn deep_dense_spec(layers: usize) -> String {
    let layer = r#"{ "dense": { "units": 64 } }, { "relu": {} }"#;
    let body = vec![layer; layers / 2].join(",\n");
    format!(
        r#"{{
  "name": "deep",
  "model": {{ "input_shape": [64], "loss": "mse", "layers": [{body}, {{ "dense": {{ "units": 1 }} }}] }},
  "training": {{ "batch_size": 256, "steps": 10, "optimizer": {{ "sgd": {{ "learning_rate": 0.01 }} }} }},
  "data": {{ "format": "synthetic", "samples": 1024 }}
}}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_estimates_leave_health_checks_and_heartbeats_answered() {
    // A short lease: a worker whose heartbeats went unread for a second would be lost.
    let lease = Duration::from_secs(1);
    let (_cluster, channel, user, worker_token) = start_for_tenant(lease, "alice").await;
    let (bob, _) = tenant_with_tokens(&channel, "bob", v1::Quota::default()).await;
    let mut worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    let (job, assignment) = submit_and_place(&channel, &user, &mut worker).await;
    worker.started(&assignment).await;

    // Several heavy estimates from one user at once, each asked to shrink into 1 MiB.
    let spec = deep_dense_spec(4000);
    let heavy: Vec<_> = (0..6)
        .map(|_| {
            let mut client = JobServiceClient::new(channel.clone());
            let request = authorized(
                v1::EstimateJobRequest {
                    spec_json: spec.clone(),
                    slice_bytes: Some(1 << 20),
                    ..Default::default()
                },
                &bob,
            );
            tokio::spawn(async move {
                let started = Instant::now();
                let answer = client.estimate_job(request).await;
                (
                    started.elapsed(),
                    answer.map(|_| ()).map_err(|status| status.code()),
                )
            })
        })
        .collect();

    // While they run, health checks answer within a second.
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let mut slowest = Duration::ZERO;
    let mut checks = 0;
    while heavy.iter().any(|call| !call.is_finished()) || checks < 5 {
        let started = Instant::now();
        health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap();
        slowest = slowest.max(started.elapsed());
        checks += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut outcomes = Vec::new();
    for call in heavy {
        outcomes.push(call.await.unwrap());
    }
    eprintln!("heavy estimates: {outcomes:?}; {checks} health checks, slowest {slowest:?}");
    assert!(
        slowest < Duration::from_secs(1),
        "a health check took {slowest:?} while heavy estimates ran"
    );
    // Each heavy call ended with an answer: a result, the planner's refusal, or the
    // tenant's budget, never a timeout or an internal error.
    for (_, outcome) in &outcomes {
        assert!(
            matches!(
                outcome,
                Ok(())
                    | Err(Code::ResourceExhausted
                        | Code::InvalidArgument
                        | Code::FailedPrecondition)
            ),
            "{outcomes:?}"
        );
    }

    // The worker kept its lease and its attempt all along.
    let workers = list_workers(&channel, ADMIN).await;
    assert_eq!(
        workers[0].state,
        v1::WorkerState::Ready as i32,
        "{workers:?}"
    );
    let running = get(&channel, &user, &job.id).await.unwrap();
    assert_eq!(running.state, v1::JobState::Running as i32);
    assert_eq!(running.attempts.len(), 1);
}
