//! Tokens that act for no tenant: `carve admin tokens create --role worker` (as the deploy
//! docs have operators run it) sends an empty tenant, and the scheduler must issue the
//! token, and the worker must be able to open its session with it; a user token still
//! needs a tenant.

use std::time::Duration;

use carve_proto::v1;
use tonic::Code;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::TestWorker;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{channel, create_token, start};

#[tokio::test]
async fn a_worker_token_needs_no_tenant_and_opens_a_session() {
    let cluster = start(Duration::from_secs(30)).await;
    let channel = channel(&cluster).await;
    let created = create_token(&channel, "", v1::Role::Worker, None)
        .await
        .expect("a worker token without a tenant");
    let token = created.token.expect("the token's details");
    assert_eq!(token.tenant, "");
    assert_eq!(token.role, v1::Role::Worker as i32);
    let _worker = TestWorker::connect(&channel, &created.secret, "gpu-a", 16 << 30).await;
}

#[tokio::test]
async fn a_user_token_without_a_tenant_is_an_invalid_argument() {
    let cluster = start(Duration::from_secs(30)).await;
    let channel = channel(&cluster).await;
    let status = create_token(&channel, "", v1::Role::User, None)
        .await
        .expect_err("a user token acts for a tenant");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("tenant"), "{status:?}");
}

#[tokio::test]
async fn a_worker_token_for_a_tenant_that_does_not_exist_is_refused() {
    let cluster = start(Duration::from_secs(30)).await;
    let channel = channel(&cluster).await;
    let status = create_token(&channel, "nobody", v1::Role::Worker, None)
        .await
        .expect_err("the tenant does not exist");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
}
