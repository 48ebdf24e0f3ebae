//! Accounting (issue 32): who used what over a period (ClusterService.GetUsage, `carve
//! usage`), and the same figures over all time as the usage counters on `/metrics`. The
//! attempts come from the store (`store/usage_report.rs`), the figures from core
//! (`carve_core::usage::report`).
//!
//! Scoping is here, before any read: a user token reads its own tenant alone (another
//! tenant's name is PERMISSION_DENIED on `tenant`); an admin reads every tenant's, or
//! one. Worker tokens read nothing.

use std::time::Instant;

use carve_core::usage::report::{Period, UsageReport, usage_report};
use carve_proto::ApiError;

use crate::auth::{Caller, Role};
use crate::error::SchedulerError;
use crate::metrics::TenantUsageTotals;
use crate::store::UsageQuery;

use super::{Scheduler, now_ms};

/// What a caller asked of GetUsage, as the scheduler's own type.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageRequest {
    pub from_ms: i64,
    /// `None`: now.
    pub to_ms: Option<i64>,
    /// Empty: the caller's own tenant (a user token) or every tenant (an admin).
    pub tenant: String,
    /// Empty: every submitter.
    pub user: String,
}

/// The figures of a period, with the period read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageAnswer {
    pub period: Period,
    pub report: UsageReport,
}

impl Scheduler {
    /// The usage figures `request` asks for, scoped to what `caller` may see.
    pub async fn usage(
        &self,
        caller: &Caller,
        request: &UsageRequest,
    ) -> Result<UsageAnswer, SchedulerError> {
        caller.require(&[Role::User, Role::Admin])?;
        let tenant = usage_tenant_scope(caller, &request.tenant)?;
        let now = now_ms();
        let to_ms = request.to_ms.unwrap_or(now);
        if to_ms < request.from_ms {
            return Err(SchedulerError::invalid_argument(
                "to",
                format!(
                    "is {to_ms} ms, before `from` ({} ms): a period ends after it starts",
                    request.from_ms
                ),
            ));
        }
        let period = Period {
            from_ms: request.from_ms,
            to_ms,
        };
        let attempts = self
            .store
            .accounted_attempts(&UsageQuery {
                from_ms: period.from_ms,
                to_ms: period.to_ms,
                tenant,
                submitter: (!request.user.is_empty()).then(|| request.user.clone()),
            })
            .await?;
        Ok(UsageAnswer {
            period,
            report: usage_report(&attempts, period, now),
        })
    }

    /// Brings the usage counters on `/metrics` up to date, at most every
    /// [`crate::metrics::TENANT_USAGE_READ_INTERVAL`]: every tenant's figures over all
    /// time, running attempts counted to now. A failed read keeps the last values.
    pub(super) async fn refresh_usage_counters(&self) {
        let now = Instant::now();
        if !self.metrics.tenant_usage_read_due(now) {
            return;
        }
        let now_ms = now_ms();
        let query = UsageQuery {
            from_ms: i64::MIN,
            to_ms: i64::MAX,
            tenant: None,
            submitter: None,
        };
        match self.store.accounted_attempts(&query).await {
            Ok(attempts) => {
                let period = Period {
                    from_ms: i64::MIN,
                    to_ms: now_ms.saturating_add(1),
                };
                let report = usage_report(&attempts, period, now_ms);
                let totals = report.tenants.iter().map(|figures| {
                    (
                        (figures.tenant.clone(), figures.gpu_type.clone()),
                        TenantUsageTotals::of(figures),
                    )
                });
                self.metrics.record_tenant_usage(totals, now);
            }
            Err(error) => tracing::warn!(%error, "cannot read usage for the metrics page"),
        }
    }
}

/// The tenant whose usage `caller` reads for a request naming `requested` (`None`:
/// every tenant, for an admin who named none).
fn usage_tenant_scope(caller: &Caller, requested: &str) -> Result<Option<String>, SchedulerError> {
    match caller.role {
        Role::Admin => Ok((!requested.is_empty()).then(|| requested.to_string())),
        _ if requested.is_empty() || requested == caller.tenant => Ok(Some(caller.tenant.clone())),
        _ => Err(SchedulerError::Api(ApiError::PermissionDenied(format!(
            "tenant: a token of tenant {:?} reads its own tenant's usage, not {requested:?}'s",
            caller.tenant
        )))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(role: Role, tenant: &str) -> Caller {
        Caller {
            tenant: tenant.to_string(),
            role,
            token_id: "tok".to_string(),
            token_description: "someone".to_string(),
        }
    }

    #[test]
    fn a_user_token_reads_its_own_tenant_alone_and_an_admin_any() {
        let user = caller(Role::User, "globex");
        assert_eq!(
            usage_tenant_scope(&user, "").unwrap(),
            Some("globex".to_string())
        );
        assert_eq!(
            usage_tenant_scope(&user, "globex").unwrap(),
            Some("globex".to_string())
        );
        let refused = usage_tenant_scope(&user, "acme").unwrap_err();
        assert!(
            matches!(&refused, SchedulerError::Api(ApiError::PermissionDenied(message)) if message.starts_with("tenant:")),
            "{refused:?}"
        );
        let admin = caller(Role::Admin, "");
        assert_eq!(usage_tenant_scope(&admin, "").unwrap(), None);
        assert_eq!(
            usage_tenant_scope(&admin, "acme").unwrap(),
            Some("acme".to_string())
        );
    }
}
