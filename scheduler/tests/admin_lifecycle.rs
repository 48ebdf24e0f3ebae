//! What an operator sees of tokens and tenants over their life: a token's last use and
//! revoke time, revoked and expired tokens listed only when asked for; a tenant deleted
//! with its tokens once its jobs have finished, never before. The real server
//! over real gRPC, on SQLite and on PostgreSQL (as `sqlite::NAME` and `postgres::NAME`,
//! like the store's contract suite).

#[macro_use]
mod support;

use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::admin_service_client::AdminServiceClient;
use tonic::Code;
use tonic::transport::Channel;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::authorized;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{
    ADMIN, JOB, cancel, create_tenant, create_token, list_jobs, revoke_token, submit, token_with_id,
};
use support::TestDb;

on_both_databases!(
    tokens_show_their_last_use_and_revoke_time_and_inactive_ones_on_request,
    a_tenant_is_deleted_with_its_tokens_once_its_jobs_have_finished,
);

/// Deletes the tenant `name` as `token`.
async fn delete_tenant(
    channel: &Channel,
    token: &str,
    name: &str,
) -> Result<v1::DeleteTenantResponse, tonic::Status> {
    AdminServiceClient::new(channel.clone())
        .delete_tenant(authorized(
            v1::DeleteTenantRequest { name: name.into() },
            token,
        ))
        .await
        .map(tonic::Response::into_inner)
}

/// The tokens of `tenant`, with the inactive ones when `include_inactive`.
async fn tokens_of(channel: &Channel, tenant: &str, include_inactive: bool) -> Vec<v1::Token> {
    AdminServiceClient::new(channel.clone())
        .list_tokens(authorized(
            v1::ListTokensRequest {
                tenant: tenant.into(),
                include_inactive,
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner()
        .tokens
}

fn ids(tokens: &[v1::Token]) -> Vec<&str> {
    tokens.iter().map(|token| token.id.as_str()).collect()
}

async fn tokens_show_their_last_use_and_revoke_time_and_inactive_ones_on_request(db: &TestDb) {
    let (_stop, channel) = cluster::start_on_database(db.url()).await;
    create_tenant(&channel, ADMIN, "acme").await.unwrap();
    let (used, used_secret) = token_with_id(&channel, "acme", v1::Role::User).await;
    let (revoked, _) = token_with_id(&channel, "acme", v1::Role::User).await;
    let short_lived = create_token(
        &channel,
        "acme",
        v1::Role::User,
        Some(prost_types::Duration {
            seconds: 0,
            nanos: 300_000_000,
        }),
    )
    .await
    .unwrap()
    .token
    .unwrap()
    .id;

    let listed = tokens_of(&channel, "acme", false).await;
    assert!(
        listed.iter().all(|token| token.last_used_at.is_none()),
        "never used yet: {listed:?}"
    );
    list_jobs(&channel, &used_secret, v1::ListJobsRequest::default())
        .await
        .unwrap();
    // A second call within the minute authenticates without writing again.
    list_jobs(&channel, &used_secret, v1::ListJobsRequest::default())
        .await
        .unwrap();

    let answered = AdminServiceClient::new(channel.clone())
        .revoke_token(authorized(
            v1::RevokeTokenRequest {
                token_id: revoked.clone(),
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner()
        .token
        .unwrap();
    assert!(answered.revoked_at.is_some(), "{answered:?}");
    // Revoking again keeps the first time.
    revoke_token(&channel, &revoked).await;
    tokio::time::sleep(Duration::from_millis(400)).await;

    let active = tokens_of(&channel, "acme", false).await;
    assert_eq!(
        ids(&active),
        vec![used.as_str()],
        "revoked and expired are hidden"
    );
    let last_used = active[0].last_used_at.expect("the use is recorded");
    let created = active[0].created_at.unwrap();
    assert!(last_used.seconds >= created.seconds, "{active:?}");
    assert!(active[0].revoked_at.is_none(), "{active:?}");

    let all = tokens_of(&channel, "acme", true).await;
    assert_eq!(
        ids(&all),
        vec![short_lived.as_str(), revoked.as_str(), used.as_str()],
        "newest first, inactive ones included"
    );
    assert_eq!(all[1].revoked_at, answered.revoked_at, "{all:?}");
    assert!(all[0].revoked_at.is_none(), "expired, not revoked: {all:?}");
    assert!(all[1].last_used_at.is_none(), "{all:?}");
}

async fn a_tenant_is_deleted_with_its_tokens_once_its_jobs_have_finished(db: &TestDb) {
    let (_stop, channel) = cluster::start_on_database(db.url()).await;
    for name in ["acme", "beta"] {
        create_tenant(&channel, ADMIN, name).await.unwrap();
    }
    let (user, user_secret) = token_with_id(&channel, "acme", v1::Role::User).await;
    let (worker, _) = token_with_id(&channel, "acme", v1::Role::Worker).await;
    let (admin, admin_secret) = token_with_id(&channel, "acme", v1::Role::Admin).await;
    let (_, beta_secret) = token_with_id(&channel, "beta", v1::Role::User).await;
    // No worker: both jobs stay queued.
    let mut jobs = Vec::new();
    for _ in 0..2 {
        jobs.push(
            submit(&channel, &user_secret, JOB, "")
                .await
                .unwrap()
                .job
                .unwrap()
                .id,
        );
    }

    let refused = delete_tenant(&channel, &beta_secret, "acme")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    let refused = delete_tenant(&channel, ADMIN, "acme").await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(
        refused.message().contains("2 jobs not finished"),
        "{refused:?}"
    );
    cancel(&channel, &user_secret, &jobs[0], "test")
        .await
        .unwrap();
    let refused = delete_tenant(&channel, ADMIN, "acme").await.unwrap_err();
    assert!(
        refused.message().contains("1 job not finished"),
        "{refused:?}"
    );
    assert_eq!(
        list_jobs(&channel, &user_secret, v1::ListJobsRequest::default())
            .await
            .unwrap()
            .jobs
            .len(),
        2,
        "a refused deletion changes nothing"
    );
    cancel(&channel, &user_secret, &jobs[1], "test")
        .await
        .unwrap();

    let deleted = delete_tenant(&channel, ADMIN, "acme").await.unwrap();
    let mut revoked = deleted.revoked_token_ids.clone();
    revoked.sort();
    let mut expected = vec![user.clone(), worker.clone()];
    expected.sort();
    assert_eq!(revoked, expected, "user and worker tokens, not the admin's");
    assert_eq!(deleted.deleted_jobs, 2);

    let rejected = list_jobs(&channel, &user_secret, v1::ListJobsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(rejected.code(), Code::Unauthenticated, "{rejected:?}");
    let all = tokens_of(&channel, "acme", true).await;
    assert!(
        all.iter()
            .all(|token| (token.id == admin) == token.revoked_at.is_none()),
        "{all:?}"
    );
    // The admin token named the tenant and still works; the other tenant is untouched.
    list_jobs(&channel, &admin_secret, v1::ListJobsRequest::default())
        .await
        .unwrap();
    list_jobs(&channel, &beta_secret, v1::ListJobsRequest::default())
        .await
        .unwrap();
    let missing = delete_tenant(&channel, ADMIN, "acme").await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound, "{missing:?}");

    // In the store: the tenant and its jobs are gone, the other tenant is not, and the
    // name can be taken again.
    let store = db.open().await;
    assert!(store.get_tenant("acme").await.is_err());
    assert!(store.get_tenant("beta").await.is_ok());
    assert!(store.get_job(&jobs[0]).await.is_err());
    create_tenant(&channel, ADMIN, "acme").await.unwrap();
}
