//! Tenants and their quotas.

use super::{Store, TenantRecord, insert_error};
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
}
