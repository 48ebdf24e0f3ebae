//! What admins do (tenants, quotas, tokens, removing a gone worker), the job listing, and
//! the role checks the
//! handlers ask for before work of their own. Like every operation of the scheduler,
//! each is authorized here from the caller's role and tenant; the handlers only
//! authenticate the caller and convert messages.

use carve_proto::ApiError;

use crate::auth::{Caller, Role, generate_id, generate_secret, hash_secret};
use crate::error::SchedulerError;
use crate::store::{
    JobFilter, JobRecord, JobState, TenantDeletion, TenantRecord, TokenRecord, WorkerRecord,
};

use super::sessions::gpus_from_column;
use super::{GpuView, Scheduler, WorkerView};

/// A new token and its secret, shown this once.
#[derive(Debug, Clone)]
pub struct CreatedToken {
    pub token: TokenRecord,
    pub secret: String,
}

impl Scheduler {
    /// Whether the caller may estimate jobs: asked before the handler parses the spec.
    pub fn may_estimate(&self, caller: &Caller) -> Result<(), SchedulerError> {
        caller.require(&[Role::User, Role::Admin])
    }

    /// Whether the caller may register workers and hold their sessions: asked before
    /// the session handler waits for the worker's hello.
    pub fn may_hold_sessions(&self, caller: &Caller) -> Result<(), SchedulerError> {
        caller.require(&[Role::Worker, Role::Admin])
    }

    pub async fn create_tenant(
        &self,
        caller: &Caller,
        tenant: &TenantRecord,
    ) -> Result<(), SchedulerError> {
        caller.require(&[Role::Admin])?;
        self.store.create_tenant(tenant).await
    }

    pub async fn tenants(&self, caller: &Caller) -> Result<Vec<TenantRecord>, SchedulerError> {
        caller.require(&[Role::Admin])?;
        self.store.list_tenants().await
    }

    /// How many of `tenant`'s jobs are queued, counted by the database.
    pub async fn queued_jobs_of(&self, tenant: &str) -> Result<i64, SchedulerError> {
        self.store.count_jobs(tenant, JobState::Queued).await
    }

    /// Replaces a tenant's quota; this scheduler's next admission uses the new one.
    pub async fn set_quota(
        &self,
        caller: &Caller,
        tenant: &str,
        vram_quota_bytes: Option<i64>,
        max_running_jobs: Option<i64>,
        fair_share_weight: i64,
    ) -> Result<TenantRecord, SchedulerError> {
        caller.require(&[Role::Admin])?;
        let record = self
            .store
            .set_quota(
                tenant,
                vram_quota_bytes,
                max_running_jobs,
                fair_share_weight,
            )
            .await?;
        self.lookups.tenants.invalidate(&record.name);
        self.wake();
        Ok(record)
    }

    /// Deletes a tenant with its quota and finished jobs, and revokes its user and worker
    /// tokens, which this scheduler refuses from the next call on (their sessions and
    /// watches end). Refused while the tenant has jobs that have not finished.
    pub async fn delete_tenant(
        &self,
        caller: &Caller,
        name: &str,
        now_ms: i64,
    ) -> Result<TenantDeletion, SchedulerError> {
        caller.require(&[Role::Admin])?;
        let deletion = self.store.delete_tenant(name, now_ms).await?;
        self.lookups.tenants.invalidate(&name.to_string());
        for token in &deletion.revoked_tokens {
            self.forget_revoked_token(token);
        }
        Ok(deletion)
    }

    /// A new token, with a new secret. A user token acts for an existing tenant; admin
    /// and worker tokens need none (`tenant` empty), and one given must exist.
    pub async fn create_token(
        &self,
        caller: &Caller,
        tenant: String,
        role: Role,
        description: String,
        created_at_ms: i64,
        expires_at_ms: Option<i64>,
    ) -> Result<CreatedToken, SchedulerError> {
        caller.require(&[Role::Admin])?;
        if tenant.is_empty() {
            if role == Role::User {
                return Err(SchedulerError::invalid_argument(
                    "tenant",
                    "a user token acts for a tenant: name one",
                ));
            }
        } else {
            self.store.get_tenant(&tenant).await?;
        }
        let secret = generate_secret();
        let token = TokenRecord {
            id: generate_id("token"),
            tenant,
            role,
            secret_hash: hash_secret(&secret),
            description,
            created_at_ms,
            expires_at_ms,
            revoked: false,
            revoked_at_ms: None,
            last_used_at_ms: None,
        };
        self.store.create_token(&token).await?;
        Ok(CreatedToken { token, secret })
    }

    /// Tokens of `tenant` (every token when `None`), newest first: only those active at
    /// `now_ms` unless `include_inactive`, which adds the revoked and expired ones.
    pub async fn tokens(
        &self,
        caller: &Caller,
        tenant: Option<&str>,
        include_inactive: bool,
        now_ms: i64,
    ) -> Result<Vec<TokenRecord>, SchedulerError> {
        caller.require(&[Role::Admin])?;
        let mut tokens = self.store.list_tokens(tenant).await?;
        if !include_inactive {
            tokens.retain(|token| token.is_active(now_ms));
        }
        Ok(tokens)
    }

    /// Revokes a token; this scheduler refuses it from the next call on, and ends the
    /// worker sessions and job watches opened with it.
    pub async fn revoke_token(
        &self,
        caller: &Caller,
        token_id: &str,
        now_ms: i64,
    ) -> Result<TokenRecord, SchedulerError> {
        caller.require(&[Role::Admin])?;
        let token = self.store.revoke_token(token_id, now_ms).await?;
        self.forget_revoked_token(&token);
        Ok(token)
    }

    /// Stops honouring a token the store now holds revoked: its cached copy, the worker
    /// sessions and the job watches opened with it.
    fn forget_revoked_token(&self, token: &TokenRecord) {
        self.lookups.tokens.invalidate(&token.secret_hash);
        self.end_sessions_of_token(&token.id, "token rejected: revoked");
        let _ = self.revoked_tokens.send(token.id.clone());
    }

    /// One page of the jobs the caller may see. `filter.tenant` is the tenant asked for
    /// (`None`: the caller's own, or every tenant's for an admin); only admins list other
    /// tenants' jobs.
    pub async fn list_jobs(
        &self,
        caller: &Caller,
        filter: JobFilter,
    ) -> Result<(Vec<JobRecord>, Option<String>), SchedulerError> {
        let filter = scoped_to_caller(caller, filter)?;
        self.store.list_jobs(&filter).await
    }

    /// [`Scheduler::list_jobs`], the page also cut where the jobs' shown text passes
    /// `budget_bytes` (`Store::list_jobs_within`: rows past it are never read).
    pub async fn list_jobs_within(
        &self,
        caller: &Caller,
        filter: JobFilter,
        budget_bytes: u64,
    ) -> Result<(Vec<JobRecord>, Option<String>), SchedulerError> {
        let filter = scoped_to_caller(caller, filter)?;
        self.store.list_jobs_within(&filter, budget_bytes).await
    }

    /// Forgets the worker `reference` names: its id, or the name of a node with one
    /// worker (or one that holds no session: a lost one, typically). Admins only. Refused
    /// (FAILED_PRECONDITION) while it holds a session or runs attempts: those would be
    /// orphaned. Answers the worker as it was.
    pub async fn remove_worker(
        &self,
        caller: &Caller,
        reference: &str,
    ) -> Result<WorkerView, SchedulerError> {
        caller.require(&[Role::Admin])?;
        // No placement on it while it goes: passes run under this lock.
        let _guard = self.job_changes.lock().await;
        let stored = self.store.list_workers().await?;
        let record = self.worker_to_remove(&stored, reference)?;
        let view = {
            let live = self.live();
            if let Some(worker) = live.workers.get(&record.id)
                && worker.session.is_some()
            {
                return Err(ApiError::FailedPrecondition(format!(
                    "worker {} ({}) is connected: stop carve-worker there first (drain it to \
                     let its attempts finish)",
                    record.id, record.hostname
                ))
                .into());
            }
            let running = live
                .running
                .values()
                .filter(|running| running.worker_id == record.id)
                .count();
            if running > 0 {
                return Err(ApiError::FailedPrecondition(format!(
                    "worker {} ({}) runs {running} attempt(s): they must end first (its \
                     lease runs out if it is gone)",
                    record.id, record.hostname
                ))
                .into());
            }
            drop(live);
            self.workers()
                .into_iter()
                .find(|worker| worker.id == record.id)
                .unwrap_or_else(|| stored_worker_view(record))
        };
        self.store.delete_worker(&record.id).await?;
        self.live().workers.remove(&record.id);
        Ok(view)
    }

    /// The stored worker `reference` names for [`Scheduler::remove_worker`].
    fn worker_to_remove<'a>(
        &self,
        stored: &'a [WorkerRecord],
        reference: &str,
    ) -> Result<&'a WorkerRecord, SchedulerError> {
        if let Some(worker) = stored.iter().find(|worker| worker.id == reference) {
            return Ok(worker);
        }
        let mut named: Vec<&WorkerRecord> = stored
            .iter()
            .filter(|worker| worker.hostname == reference)
            .collect();
        if named.len() > 1 {
            // The node's connected worker is not the one to remove.
            let live = self.live();
            named.retain(|worker| {
                live.workers
                    .get(&worker.id)
                    .is_none_or(|live_worker| live_worker.session.is_none())
            });
        }
        match named.as_slice() {
            [worker] => Ok(worker),
            [] => Err(SchedulerError::not_found("worker", reference)),
            several => Err(SchedulerError::invalid_argument(
                "worker_id",
                format!(
                    "node {reference} has {} workers without a session ({}); name one by its id",
                    several.len(),
                    several
                        .iter()
                        .map(|worker| worker.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        }
    }
}

/// A worker only the store knows (lost before this scheduler started), as reads show it.
fn stored_worker_view(record: &WorkerRecord) -> WorkerView {
    WorkerView {
        id: record.id.clone(),
        hostname: record.hostname.clone(),
        state: record.state,
        // Removing a worker whose row cannot be read must still work: its view shows no
        // GPU, and the log says why.
        gpus: gpus_from_column(record)
            .unwrap_or_else(|error| {
                tracing::warn!(worker = %record.id, %error, "removing a worker whose GPUs cannot be read");
                Vec::new()
            })
            .into_iter()
            .map(|gpu| GpuView {
                gpu,
                slices: Vec::new(),
            })
            .collect(),
        last_heartbeat_ms: record.last_heartbeat_ms,
        registered_at_ms: record.registered_at_ms,
        version: record.version.clone(),
        drain_reason: record.drain_reason.clone(),
    }
}

/// `filter` as `caller` may list: `filter.tenant` is the tenant asked for (`None`: the
/// caller's own, or every tenant's for an admin); only admins list other tenants' jobs.
fn scoped_to_caller(caller: &Caller, mut filter: JobFilter) -> Result<JobFilter, SchedulerError> {
    caller.require(&[Role::User, Role::Admin])?;
    filter.tenant = match filter.tenant {
        None => (caller.role != Role::Admin).then(|| caller.tenant.clone()),
        Some(tenant) if caller.may_access_tenant(&tenant) => Some(tenant),
        Some(_) => {
            return Err(
                ApiError::PermissionDenied("only admins list other tenants' jobs".into()).into(),
            );
        }
    };
    Ok(filter)
}
