//! A worker node's identity over its life: a drain's reason kept and shown; a gone
//! worker removed by an admin (never while it is connected or runs attempts); a restarted
//! worker process (same node, same token, no previous id) keeping its id, its previous
//! process's attempt interrupted to resume, instead of leaving a lost worker behind. The
//! real server over real gRPC, on SQLite and on PostgreSQL.

#[macro_use]
mod support;

use std::time::{Duration, Instant};

use carve_proto::v1;
use carve_proto::v1::cluster_service_client::ClusterServiceClient;
use carve_scheduler::error::SchedulerError;
use tonic::Code;
use tonic::transport::Channel;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::{TestWorker, authorized};

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{ADMIN, JOB, get, list_workers, submit, tenant_with_tokens};
use support::TestDb;

on_both_databases!(
    a_drain_keeps_its_reason_and_a_gone_worker_can_be_removed,
    a_restarted_worker_keeps_its_id_and_its_previous_attempt_is_interrupted,
);

async fn remove(channel: &Channel, reference: &str) -> Result<v1::Worker, tonic::Status> {
    ClusterServiceClient::new(channel.clone())
        .remove_worker(authorized(
            v1::RemoveWorkerRequest {
                worker_id: reference.into(),
            },
            ADMIN,
        ))
        .await
        .map(|response| response.into_inner().worker.unwrap())
}

/// Removes `reference` once the scheduler has seen its session end (a refusal that says
/// it is connected, until then); returns the last answer.
async fn remove_once_disconnected(
    channel: &Channel,
    reference: &str,
) -> Result<v1::Worker, tonic::Status> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answer = remove(channel, reference).await;
        match &answer {
            Err(status)
                if status.message().contains("is connected") && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            _ => return answer,
        }
    }
}

async fn a_drain_keeps_its_reason_and_a_gone_worker_can_be_removed(db: &TestDb) {
    let (_stop, channel) = cluster::start_on_database(db.url()).await;
    let (_user, worker_token) = tenant_with_tokens(&channel, "acme", v1::Quota::default()).await;
    let worker = TestWorker::connect(&channel, &worker_token, "gpu-b", 16 << 30).await;

    let drained = ClusterServiceClient::new(channel.clone())
        .drain_worker(authorized(
            v1::DrainWorkerRequest {
                worker_id: "host-gpu-b".into(),
                reason: "kernel upgrade".into(),
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner()
        .worker
        .unwrap();
    assert_eq!(drained.drain_reason, "kernel upgrade");
    let listed = list_workers(&channel, ADMIN).await;
    assert_eq!(listed[0].drain_reason, "kernel upgrade", "{listed:?}");
    let store = db.open().await;
    assert_eq!(
        store.get_worker(&worker.id).await.unwrap().drain_reason,
        "kernel upgrade"
    );

    // A connected worker is not removed.
    let refused = remove(&channel, &worker.id).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("is connected"), "{refused:?}");

    // Gone, it is removed by its node's name, from the list and from the store.
    let worker_id = worker.id.clone();
    worker.disconnect();
    let removed = remove_once_disconnected(&channel, "host-gpu-b")
        .await
        .unwrap();
    assert_eq!(removed.id, worker_id);
    assert!(list_workers(&channel, ADMIN).await.is_empty());
    assert!(matches!(
        store.get_worker(&worker_id).await,
        Err(SchedulerError::Api(carve_proto::ApiError::NotFound { .. }))
    ));
    let again = remove(&channel, &worker_id).await.unwrap_err();
    assert_eq!(again.code(), Code::NotFound, "{again:?}");
}

async fn a_restarted_worker_keeps_its_id_and_its_previous_attempt_is_interrupted(db: &TestDb) {
    let (_stop, channel) = cluster::start_on_database(db.url()).await;
    let (user, worker_token) = tenant_with_tokens(&channel, "acme", v1::Quota::default()).await;
    let mut worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    let first_id = worker.id.clone();
    let job = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    let assignment = worker.next_assignment().await;
    worker.started(&assignment).await;

    // The process dies: the worker holds no session but still counts an attempt, so it
    // cannot be removed.
    worker.disconnect();
    let refused = remove_once_disconnected(&channel, &first_id)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("runs 1 attempt"), "{refused:?}");

    // A new process on the same node with the same token, knowing no previous id.
    let restarted = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    assert_eq!(restarted.id, first_id);
    let workers = list_workers(&channel, ADMIN).await;
    assert_eq!(workers.len(), 1, "no lost worker left behind: {workers:?}");
    let attempts = get(&channel, &user, &job.id).await.unwrap().attempts;
    assert_eq!(
        attempts[0].outcome,
        v1::AttemptOutcome::Interrupted as i32,
        "{attempts:?}"
    );
    drop(restarted);
}
