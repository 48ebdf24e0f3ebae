//! A worker started again with a new token (`carve dev` makes one at every start;
//! operators rotate them) replaces its lost predecessor on the same node and GPUs instead
//! of leaving it listed as lost for good; a token of another tenant never takes a worker
//! over. The real server over real gRPC, with a short lease so a silent worker is lost.

use std::time::{Duration, Instant};

use carve_proto::v1;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::TestWorker;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{ADMIN, list_workers, tenant_with_tokens, token_with_id};

/// The workers the admin sees, once `worker_id` is listed as lost (within 10 s).
async fn once_lost(channel: &tonic::transport::Channel, worker_id: &str) -> Vec<v1::Worker> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let workers = list_workers(channel, ADMIN).await;
        let lost = workers
            .iter()
            .any(|worker| worker.id == worker_id && worker.state == v1::WorkerState::Lost as i32);
        if lost {
            return workers;
        }
        assert!(
            Instant::now() < deadline,
            "worker {worker_id} was not lost: {workers:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_with_a_new_token_replaces_its_lost_predecessor() {
    let cluster = cluster::start(Duration::from_millis(500)).await;
    let channel = cluster::channel(&cluster).await;
    let (_user, first_token) = tenant_with_tokens(&channel, "acme", v1::Quota::default()).await;
    let first = TestWorker::connect(&channel, &first_token, "gpu-a", 16 << 30).await;
    let first_id = first.id.clone();
    first.disconnect();
    assert_eq!(once_lost(&channel, &first_id).await.len(), 1);

    // The node's worker again, with a new token of the same tenant: it is the lost one.
    let (_, second_token) = token_with_id(&channel, "acme", v1::Role::Worker).await;
    let second = TestWorker::connect(&channel, &second_token, "gpu-a", 16 << 30).await;
    assert_eq!(second.id, first_id);
    let workers = list_workers(&channel, ADMIN).await;
    assert_eq!(workers.len(), 1, "no lost worker left behind: {workers:?}");
    assert_eq!(
        workers[0].state,
        v1::WorkerState::Ready as i32,
        "{workers:?}"
    );

    // A worker of the same node offering other GPUs is another worker.
    let (_, third_token) = token_with_id(&channel, "acme", v1::Role::Worker).await;
    second.disconnect();
    once_lost(&channel, &first_id).await;
    let sibling =
        TestWorker::reconnect(&channel, &third_token, "gpu-b", 16 << 30, "", vec![]).await;
    assert_ne!(sibling.id, first_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_token_cannot_take_a_lost_worker_over() {
    let cluster = cluster::start(Duration::from_millis(500)).await;
    let channel = cluster::channel(&cluster).await;
    let (_user, acme_token) = tenant_with_tokens(&channel, "acme", v1::Quota::default()).await;
    let (_user, other_token) = tenant_with_tokens(&channel, "other", v1::Quota::default()).await;
    let acme = TestWorker::connect(&channel, &acme_token, "gpu-a", 16 << 30).await;
    let acme_id = acme.id.clone();
    acme.disconnect();
    once_lost(&channel, &acme_id).await;

    // Same node, same GPU, another tenant's token: a worker of its own, and acme's stays
    // as it was (lost, its record untouched), not erased or taken.
    let intruder = TestWorker::connect(&channel, &other_token, "gpu-a", 16 << 30).await;
    assert_ne!(intruder.id, acme_id);
    let workers = list_workers(&channel, ADMIN).await;
    let kept = workers
        .iter()
        .find(|worker| worker.id == acme_id)
        .unwrap_or_else(|| panic!("acme's worker is still listed: {workers:?}"));
    assert_eq!(kept.state, v1::WorkerState::Lost as i32, "{workers:?}");
    assert_eq!(workers.len(), 2, "{workers:?}");
}
