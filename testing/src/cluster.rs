//! Setting up a running scheduler for a test through its admin API: a tenant and the
//! tokens its users and workers need. The scheduler tests, the worker's end-to-end and
//! chaos tests all start from this; `carve dev` uses the same
//! `carve_proto::client::create_tenant_with_tokens` underneath.

use carve_proto::client::{BearerToken, create_tenant_with_tokens};
use carve_proto::v1;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// Creates `tenant` with `quota` as the admin `admin_token`, then one token for each of
/// `roles`, in order; returns their secrets. Panics on any refusal: a test cannot go on
/// without them.
pub async fn tenant_with_tokens(
    channel: &Channel,
    admin_token: &str,
    tenant: &str,
    quota: v1::Quota,
    roles: &[v1::Role],
) -> Vec<String> {
    let admin = InterceptedService::new(
        channel.clone(),
        BearerToken::new(admin_token).expect("a valid token"),
    );
    create_tenant_with_tokens(admin, tenant, quota, roles, "test")
        .await
        .expect("the tenant and its tokens are created")
}
