//! Tenants and their quotas.

use carve_proto::ApiError;

use super::tokens::TOKEN_COLUMNS;
use super::{
    JobState, Role, Store, TenantRecord, TokenRecord, insert_error, is_foreign_key_violation,
};
use crate::error::SchedulerError;

const TENANT_COLUMNS: &str =
    "name, vram_quota_bytes, max_running_jobs, fair_share_weight, created_at_ms";

/// The longest tenant name: a DNS label's limit, so a name can go wherever one can
/// (Kubernetes namespaces and labels, host names, metric labels).
pub const MAX_TENANT_NAME_LENGTH: usize = 63;

/// The one rule for tenant names, the API's documented one: 1 to 63 lowercase ASCII
/// letters, digits and '-'. `InvalidArgument` naming `field` otherwise. Every tenant is
/// created through [`Store::create_tenant`], which applies it.
pub fn check_tenant_name(field: &str, name: &str) -> Result<(), SchedulerError> {
    let allowed = |character: char| {
        character.is_ascii_lowercase() || character.is_ascii_digit() || character == '-'
    };
    let reason = if name.is_empty() {
        "must not be empty".to_string()
    } else if name.len() > MAX_TENANT_NAME_LENGTH {
        format!(
            "is {} characters long; the limit is {MAX_TENANT_NAME_LENGTH}",
            name.chars().count()
        )
    } else if let Some(bad) = name.chars().find(|character| !allowed(*character)) {
        format!("{name:?} contains {bad:?}; use lowercase letters, digits and '-'")
    } else {
        return Ok(());
    };
    Err(SchedulerError::invalid_argument(field, reason))
}

/// What deleting a tenant took with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantDeletion {
    /// Its user and worker tokens that were still valid, now revoked (admin tokens act
    /// across tenants and stay valid, so deleting the tenant an admin token names cannot
    /// lock the operators out).
    pub revoked_tokens: Vec<TokenRecord>,
    /// Its finished jobs, removed with their attempts and log lines: a job must name an
    /// existing tenant.
    pub deleted_jobs: u64,
}

impl Store {
    /// Creates a tenant. `InvalidArgument` when its name breaks [`check_tenant_name`];
    /// `AlreadyExists` when the name is taken.
    pub async fn create_tenant(&self, tenant: &TenantRecord) -> Result<(), SchedulerError> {
        check_tenant_name("name", &tenant.name)?;
        let result = with_pool!(self, pool => {
            sqlx::query(
                "INSERT INTO tenants \
                 (name, vram_quota_bytes, max_running_jobs, fair_share_weight, created_at_ms) \
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(&tenant.name)
            .bind(tenant.vram_quota_bytes)
            .bind(tenant.max_running_jobs)
            .bind(tenant.fair_share_weight)
            .bind(tenant.created_at_ms)
            .execute(pool)
            .await
            .map(drop)
        });
        result.map_err(|error| insert_error(error, "tenant", &tenant.name, None))
    }

    /// The tenant named `name`; `NotFound` when there is none.
    pub async fn get_tenant(&self, name: &str) -> Result<TenantRecord, SchedulerError> {
        let sql = format!("SELECT {TENANT_COLUMNS} FROM tenants WHERE name = $1");
        let tenant: Option<TenantRecord> = with_pool!(self, pool => {
            sqlx::query_as(&sql).bind(name).fetch_optional(pool).await?
        });
        tenant.ok_or_else(|| SchedulerError::not_found("tenant", name))
    }

    /// Every tenant, by name.
    pub async fn list_tenants(&self) -> Result<Vec<TenantRecord>, SchedulerError> {
        let sql = format!("SELECT {TENANT_COLUMNS} FROM tenants ORDER BY name");
        Ok(with_pool!(self, pool => sqlx::query_as(&sql).fetch_all(pool).await?))
    }

    /// Replaces a tenant's quota (limits and weight) and returns the tenant as it is now.
    /// `NotFound` when there is no such tenant.
    pub async fn set_quota(
        &self,
        name: &str,
        vram_quota_bytes: Option<i64>,
        max_running_jobs: Option<i64>,
        fair_share_weight: i64,
    ) -> Result<TenantRecord, SchedulerError> {
        let sql = format!(
            "UPDATE tenants SET vram_quota_bytes = $2, max_running_jobs = $3, \
             fair_share_weight = $4 WHERE name = $1 RETURNING {TENANT_COLUMNS}"
        );
        let tenant: Option<TenantRecord> = with_pool!(self, pool => {
            sqlx::query_as(&sql)
                .bind(name)
                .bind(vram_quota_bytes)
                .bind(max_running_jobs)
                .bind(fair_share_weight)
                .fetch_optional(pool)
                .await?
        });
        tenant.ok_or_else(|| SchedulerError::not_found("tenant", name))
    }

    /// Deletes the tenant `name` in one transaction: its quota, its finished jobs, and
    /// it; its user and worker tokens are revoked at `now_ms` (see [`TenantDeletion`]).
    /// `NotFound` when there is no such tenant; `FailedPrecondition`, counting them,
    /// while it has jobs that have not finished.
    pub async fn delete_tenant(
        &self,
        name: &str,
        now_ms: i64,
    ) -> Result<TenantDeletion, SchedulerError> {
        let unfinished: Vec<&str> = JobState::ALL
            .into_iter()
            .filter(|state| !state.is_terminal())
            .map(JobState::name)
            .collect();
        let unfinished_list = unfinished
            .iter()
            .map(|state| format!("'{state}'"))
            .collect::<Vec<_>>()
            .join(", ");
        let count_sql =
            format!("SELECT count(*) FROM jobs WHERE tenant = $1 AND state IN ({unfinished_list})");
        let revoke_sql = format!(
            "UPDATE tokens SET revoked = $2, revoked_at_ms = $3 \
             WHERE tenant = $1 AND role <> $4 AND revoked = $5 RETURNING {TOKEN_COLUMNS}"
        );
        let deletion = with_write_tx!(self, tx => {
            let exists: Option<(String,)> =
                sqlx::query_as("SELECT name FROM tenants WHERE name = $1")
                    .bind(name)
                    .fetch_optional(&mut *tx)
                    .await?;
            if exists.is_none() {
                return Err(SchedulerError::not_found("tenant", name));
            }
            let (count,): (i64,) = sqlx::query_as(&count_sql)
                .bind(name)
                .fetch_one(&mut *tx)
                .await?;
            if count > 0 {
                return Err(unfinished_jobs_error(name, count));
            }
            let deleted_jobs = sqlx::query("DELETE FROM jobs WHERE tenant = $1")
                .bind(name)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            let revoked_tokens: Vec<TokenRecord> = sqlx::query_as(&revoke_sql)
                .bind(name)
                .bind(true)
                .bind(now_ms)
                .bind(Role::Admin.name())
                .bind(false)
                .fetch_all(&mut *tx)
                .await?;
            let deleted = sqlx::query("DELETE FROM tenants WHERE name = $1")
                .bind(name)
                .execute(&mut *tx)
                .await;
            match deleted {
                // A PostgreSQL replica committed a job for it since the count.
                Err(error) if is_foreign_key_violation(&error) => {
                    return Err(unfinished_jobs_error(name, 1));
                }
                other => other?,
            };
            TenantDeletion {
                revoked_tokens,
                deleted_jobs,
            }
        });
        Ok(deletion)
    }
}

/// Why a tenant with `count` unfinished jobs is not deleted.
fn unfinished_jobs_error(name: &str, count: i64) -> SchedulerError {
    let jobs = if count == 1 { "job" } else { "jobs" };
    SchedulerError::Api(ApiError::FailedPrecondition(format!(
        "tenant {name} has {count} {jobs} not finished (queued, placed or running); \
         cancel them or wait for them to end, then delete it"
    )))
}
