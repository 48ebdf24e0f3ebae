//! AdminService: tenants, quotas and tokens, with the field checks their requests need
//! before the scheduler (which authorizes) is called.

use carve_proto::v1;
use carve_proto::v1::admin_service_server::AdminService;
use tonic::{Request, Response, Status};

use super::{Services, invalid};
use crate::auth::Role;
use crate::convert::timestamp;
use crate::scheduler::now_ms;
use crate::store::{TenantRecord, TokenRecord};

impl Services {
    async fn tenant_proto(&self, tenant: &TenantRecord) -> v1::Tenant {
        let (vram_in_use_bytes, running_jobs) = self.scheduler.tenant_usage(&tenant.name);
        let queued_jobs = self
            .scheduler
            .queued_jobs_of(&tenant.name)
            .await
            .map(|count| u32::try_from(count).unwrap_or(u32::MAX))
            .unwrap_or(0);
        v1::Tenant {
            name: tenant.name.clone(),
            quota: Some(v1::Quota {
                vram_bytes: tenant.vram_quota_bytes.map(|bytes| bytes as u64),
                max_running_jobs: tenant.max_running_jobs.map(|count| count as u32),
                fair_share_weight: tenant.fair_share_weight as f64,
            }),
            created_at: Some(timestamp(tenant.created_at_ms)),
            vram_in_use_bytes,
            running_jobs,
            queued_jobs,
        }
    }
}

fn token_proto(token: &TokenRecord) -> v1::Token {
    v1::Token {
        id: token.id.clone(),
        tenant: token.tenant.clone(),
        role: match token.role {
            Role::User => v1::Role::User,
            Role::Admin => v1::Role::Admin,
            Role::Worker => v1::Role::Worker,
        } as i32,
        description: token.description.clone(),
        created_at: Some(timestamp(token.created_at_ms)),
        expires_at: token.expires_at_ms.map(timestamp),
        last_used_at: token.last_used_at_ms.map(timestamp),
        revoked_at: token.revoked_at_ms.map(timestamp),
    }
}
fn quota_fields(quota: Option<v1::Quota>) -> Result<(Option<i64>, Option<i64>, i64), Status> {
    let quota = quota.unwrap_or_default();
    if !(quota.fair_share_weight.is_finite() && quota.fair_share_weight >= 0.0) {
        return Err(invalid(
            "quota.fair_share_weight",
            format!("{} must be a finite number >= 0", quota.fair_share_weight),
        ));
    }
    let vram = quota
        .vram_bytes
        .map(|bytes| i64::try_from(bytes).map_err(|_| invalid("quota.vram_bytes", "is too large")))
        .transpose()?;
    let weight = if quota.fair_share_weight == 0.0 {
        1
    } else {
        quota.fair_share_weight.round().max(1.0) as i64
    };
    Ok((vram, quota.max_running_jobs.map(i64::from), weight))
}

/// A token's time to live in whole milliseconds (expiry times are milliseconds), rounded
/// up so that any positive duration, sub-second ones included, is accepted and never
/// expires at once. `InvalidArgument` for zero, negative or malformed durations.
fn time_to_live_ms(ttl: &prost_types::Duration) -> Result<i64, Status> {
    const NANOS_PER_SECOND: i32 = 1_000_000_000;
    let signs_agree = (ttl.seconds >= 0 && ttl.nanos >= 0) || (ttl.seconds <= 0 && ttl.nanos <= 0);
    if ttl.nanos.abs() >= NANOS_PER_SECOND || !signs_agree {
        return Err(invalid(
            "time_to_live.nanos",
            format!(
                "{} is not a valid nanosecond part for {} seconds (between -999999999 and \
                 999999999, with the sign of the seconds)",
                ttl.nanos, ttl.seconds
            ),
        ));
    }
    if ttl.seconds < 0 || (ttl.seconds == 0 && ttl.nanos <= 0) {
        return Err(invalid(
            "time_to_live",
            format!(
                "{}s {}ns must be positive (more than 0)",
                ttl.seconds, ttl.nanos
            ),
        ));
    }
    Ok(ttl
        .seconds
        .saturating_mul(1000)
        .saturating_add((i64::from(ttl.nanos) + 999_999) / 1_000_000))
}

/// Checked here too, though the store checks every tenant it creates, so a bad name is
/// refused before the quota's fields are looked at.
fn tenant_name_check(name: &str) -> Result<(), Status> {
    crate::store::check_tenant_name("name", name).map_err(Status::from)
}
#[tonic::async_trait]
impl AdminService for Services {
    async fn create_tenant(
        &self,
        request: Request<v1::CreateTenantRequest>,
    ) -> Result<Response<v1::CreateTenantResponse>, Status> {
        let caller = self.caller(&request).await?;
        let request = request.into_inner();
        tenant_name_check(&request.name)?;
        let (vram_quota_bytes, max_running_jobs, fair_share_weight) = quota_fields(request.quota)?;
        let tenant = TenantRecord {
            name: request.name,
            vram_quota_bytes,
            max_running_jobs,
            fair_share_weight,
            created_at_ms: now_ms(),
        };
        self.scheduler.create_tenant(&caller, &tenant).await?;
        Ok(Response::new(v1::CreateTenantResponse {
            tenant: Some(self.tenant_proto(&tenant).await),
        }))
    }

    async fn list_tenants(
        &self,
        request: Request<v1::ListTenantsRequest>,
    ) -> Result<Response<v1::ListTenantsResponse>, Status> {
        let caller = self.caller(&request).await?;
        let tenants = self.scheduler.tenants(&caller).await?;
        let mut messages = Vec::new();
        for tenant in &tenants {
            messages.push(self.tenant_proto(tenant).await);
        }
        Ok(Response::new(v1::ListTenantsResponse { tenants: messages }))
    }

    async fn set_quota(
        &self,
        request: Request<v1::SetQuotaRequest>,
    ) -> Result<Response<v1::SetQuotaResponse>, Status> {
        let caller = self.caller(&request).await?;
        let request = request.into_inner();
        let (vram, running, weight) = quota_fields(request.quota)?;
        let tenant = self
            .scheduler
            .set_quota(&caller, &request.tenant, vram, running, weight)
            .await?;
        Ok(Response::new(v1::SetQuotaResponse {
            tenant: Some(self.tenant_proto(&tenant).await),
        }))
    }

    async fn delete_tenant(
        &self,
        request: Request<v1::DeleteTenantRequest>,
    ) -> Result<Response<v1::DeleteTenantResponse>, Status> {
        let caller = self.caller(&request).await?;
        let name = request.into_inner().name;
        let deletion = self
            .scheduler
            .delete_tenant(&caller, &name, now_ms())
            .await?;
        Ok(Response::new(v1::DeleteTenantResponse {
            revoked_token_ids: deletion
                .revoked_tokens
                .into_iter()
                .map(|token| token.id)
                .collect(),
            deleted_jobs: deletion.deleted_jobs,
        }))
    }

    async fn create_token(
        &self,
        request: Request<v1::CreateTokenRequest>,
    ) -> Result<Response<v1::CreateTokenResponse>, Status> {
        let caller = self.caller(&request).await?;
        let request = request.into_inner();
        let role = match v1::Role::try_from(request.role) {
            Ok(v1::Role::User) => Role::User,
            Ok(v1::Role::Admin) => Role::Admin,
            Ok(v1::Role::Worker) => Role::Worker,
            _ => {
                return Err(invalid(
                    "role",
                    format!("{} is not a role (user, admin, worker)", request.role),
                ));
            }
        };
        let now = now_ms();
        let expires_at_ms = match request.time_to_live {
            Some(ttl) => Some(now.saturating_add(time_to_live_ms(&ttl)?)),
            None => None,
        };
        let created = self
            .scheduler
            .create_token(
                &caller,
                request.tenant,
                role,
                request.description,
                now,
                expires_at_ms,
            )
            .await?;
        Ok(Response::new(v1::CreateTokenResponse {
            token: Some(token_proto(&created.token)),
            secret: created.secret,
        }))
    }

    async fn list_tokens(
        &self,
        request: Request<v1::ListTokensRequest>,
    ) -> Result<Response<v1::ListTokensResponse>, Status> {
        let caller = self.caller(&request).await?;
        let request = request.into_inner();
        let tokens = self
            .scheduler
            .tokens(
                &caller,
                (!request.tenant.is_empty()).then_some(request.tenant.as_str()),
                request.include_inactive,
                now_ms(),
            )
            .await?;
        Ok(Response::new(v1::ListTokensResponse {
            tokens: tokens.iter().map(token_proto).collect(),
        }))
    }

    async fn revoke_token(
        &self,
        request: Request<v1::RevokeTokenRequest>,
    ) -> Result<Response<v1::RevokeTokenResponse>, Status> {
        let caller = self.caller(&request).await?;
        let token_id = request.into_inner().token_id;
        let token = self
            .scheduler
            .revoke_token(&caller, &token_id, now_ms())
            .await?;
        Ok(Response::new(v1::RevokeTokenResponse {
            token: Some(token_proto(&token)),
        }))
    }
}
