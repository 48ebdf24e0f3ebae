//! Setting up a running scheduler for a test through its admin API: a tenant and the
//! tokens its users and workers need. The scheduler tests, the worker's end-to-end and
//! chaos tests all start from this.

use carve_proto::client::authorized_request;
use carve_proto::v1;
use carve_proto::v1::admin_service_client::AdminServiceClient;
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
    let mut admin = AdminServiceClient::new(channel.clone());
    admin
        .create_tenant(
            authorized_request(
                v1::CreateTenantRequest {
                    name: tenant.into(),
                    quota: Some(quota),
                },
                admin_token,
            )
            .expect("a valid token"),
        )
        .await
        .expect("the tenant is created");
    let mut secrets = Vec::with_capacity(roles.len());
    for role in roles {
        let created = admin
            .create_token(
                authorized_request(
                    v1::CreateTokenRequest {
                        tenant: tenant.into(),
                        role: *role as i32,
                        description: "test".into(),
                        time_to_live: None,
                    },
                    admin_token,
                )
                .expect("a valid token"),
            )
            .await
            .expect("the token is created");
        secrets.push(created.into_inner().secret);
    }
    secrets
}
