//! The gRPC handlers: authenticate, check the request's fields, call the scheduler (which
//! decides what the caller may do), turn its answers into messages through `convert.rs`.
//! Generated types stop here, and the store is reached only through the scheduler;
//! errors become statuses through `carve_proto::ApiError`, the project's one mapping.

use std::pin::Pin;
use std::sync::Arc;

use carve_core::estimator::estimate_job;
use carve_core::plan::RunConfig;
use carve_core::shrink::plan_shrink;
use carve_proto::ApiError;
use carve_proto::v1;
use carve_proto::v1::admin_service_server::AdminService;
use carve_proto::v1::cluster_service_server::ClusterService;
use carve_proto::v1::job_service_server::JobService;
use carve_proto::v1::worker_service_server::WorkerService;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Code, Request, Response, Status, Streaming};

use crate::auth::{Caller, Role};
use crate::convert::{
    attach_progress, attempt_ref_from_proto, job_state_from_proto, job_to_proto,
    job_update_to_proto, registered_to_proto, registration_from_proto, slice_to_proto,
    submitted_job_to_proto, timestamp, worker_command_to_proto, worker_to_proto,
};
use crate::metrics::{Metrics, SubmitRejection};
use crate::scheduler::worker_reports::AttemptRef;
use crate::scheduler::{JobUpdate, JobUpdateKind, Scheduler, now_ms};
use crate::store::{JobFilter, JobRecord, LogLineRecord, LogQuery, TenantRecord, TokenRecord};

/// One handle on the scheduler for all four services.
#[derive(Debug, Clone)]
pub struct Services {
    pub scheduler: Arc<Scheduler>,
}

fn invalid(field: &str, reason: impl Into<String>) -> Status {
    ApiError::invalid_argument(field, reason).into()
}

type EventStream = Pin<Box<dyn Stream<Item = Result<v1::JobEvent, Status>> + Send>>;
type SchedulerMessageStream =
    Pin<Box<dyn Stream<Item = Result<v1::SchedulerMessage, Status>> + Send>>;

impl Services {
    async fn caller<T>(&self, request: &Request<T>) -> Result<Caller, Status> {
        self.scheduler
            .authenticate(request.metadata(), now_ms())
            .await
            .map_err(Status::from)
    }

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

    /// A job as the API shows it, with its attempts.
    async fn job_message(&self, job: &JobRecord) -> Result<v1::Job, Status> {
        let attempts = self.scheduler.attempts(&job.id).await?;
        let mut message = job_to_proto(job, &attempts)?;
        message.memory_model = self.scheduler.job_memory_model(job).await?.map(Into::into);
        if let Some((attempt_number, progress)) = self.scheduler.latest_progress(&job.id) {
            attach_progress(&mut message, attempt_number, &progress);
        }
        Ok(message)
    }
}

impl Services {
    /// Drain and undrain: admins only; answers with the worker as it is now.
    async fn set_draining(
        &self,
        caller: &Caller,
        reference: &str,
        draining: bool,
        reason: &str,
    ) -> Result<Option<v1::Worker>, Status> {
        let worker_id = self
            .scheduler
            .set_draining(caller, reference, draining, reason)
            .await?;
        Ok(self
            .scheduler
            .workers()
            .iter()
            .map(worker_to_proto)
            .find(|worker| worker.id == worker_id))
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

fn log_line_proto(line: LogLineRecord) -> v1::JobLogLine {
    v1::JobLogLine {
        sequence: line.sequence as u64,
        time: Some(timestamp(line.time_ms)),
        attempt_number: line.attempt_number as u32,
        level: line.level,
        message: line.message,
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
/// EstimateJob's answer for a spec (with the request's overrides applied): validation,
/// the estimate, and the shrink plan when a slice is given and the job does not fit it.
fn estimate_answer(
    spec: carve_core::spec::JobSpec,
    slice_bytes: Option<u64>,
) -> Result<v1::EstimateJobResponse, Status> {
    let job = carve_core::validate::validate_job_spec(spec)
        .map_err(|error| invalid(&format!("spec.{}", error.field), error.reason))?;
    let config = RunConfig::from_spec(&job.spec);
    let estimate = estimate_job(&job, &config)
        .map_err(|error| invalid(&format!("spec.{}", error.field), error.reason))?;
    let (fits, shrink_plan) = match slice_bytes {
        Some(slice) if estimate.required_bytes > slice => {
            let decision = plan_shrink(&job, &config, None, slice).map_err(ApiError::from)?;
            (
                false,
                Some(carve_proto::convert::shrink_decision_to_proto(
                    &config, &decision,
                )),
            )
        }
        _ => (true, None),
    };
    Ok(v1::EstimateJobResponse {
        estimate: Some(estimate.into()),
        fits,
        shrink_plan,
    })
}

fn tenant_name_check(name: &str) -> Result<(), Status> {
    crate::store::check_tenant_name("name", name).map_err(Status::from)
}

#[tonic::async_trait]
impl JobService for Services {
    async fn submit_job(
        &self,
        request: Request<v1::SubmitJobRequest>,
    ) -> Result<Response<v1::SubmitJobResponse>, Status> {
        let metrics = &self.scheduler.metrics;
        let caller = match self.caller(&request).await {
            Ok(caller) => caller,
            Err(status) => {
                let reason = match status.code() {
                    Code::Unauthenticated => SubmitRejection::Unauthenticated,
                    Code::PermissionDenied => SubmitRejection::PermissionDenied,
                    Code::Unavailable => SubmitRejection::Unavailable,
                    _ => SubmitRejection::Other,
                };
                metrics.count_rejected_submit(reason);
                return Err(status);
            }
        };
        let request = request.into_inner();
        if request.spec_json.trim().is_empty() {
            metrics.count_rejected_submit(SubmitRejection::InvalidSpec);
            return Err(invalid("spec_json", "must not be empty"));
        }
        let started = std::time::Instant::now();
        let submitted = self
            .scheduler
            .submit(&caller, &request.spec_json, &request.idempotency_key)
            .await;
        let submitted = match submitted.and_then(|submitted| {
            let job = submitted_job_to_proto(&submitted)?;
            Ok((job, submitted.created, submitted.warnings))
        }) {
            Ok(submitted) => {
                metrics.observe_submit_latency(started.elapsed());
                if submitted.1 {
                    Metrics::count(&metrics.submits_accepted);
                }
                submitted
            }
            Err(refused) => {
                metrics.count_rejected_submit(refused.reason);
                return Err(refused.error.into());
            }
        };
        let (job, created, warnings) = submitted;
        Ok(Response::new(v1::SubmitJobResponse {
            job: Some(job),
            created,
            warnings,
        }))
    }

    async fn get_job(
        &self,
        request: Request<v1::GetJobRequest>,
    ) -> Result<Response<v1::GetJobResponse>, Status> {
        let caller = self.caller(&request).await?;
        let job = self
            .scheduler
            .visible_job(&caller, &request.get_ref().job_id)
            .await?;
        let job = self.job_message(&job).await?;
        Ok(Response::new(v1::GetJobResponse { job: Some(job) }))
    }

    async fn list_jobs(
        &self,
        request: Request<v1::ListJobsRequest>,
    ) -> Result<Response<v1::ListJobsResponse>, Status> {
        let caller = self.caller(&request).await?;
        let request = request.into_inner();
        let mut states = Vec::new();
        for (index, state) in request.states.iter().enumerate() {
            let state = v1::JobState::try_from(*state)
                .ok()
                .and_then(job_state_from_proto)
                .ok_or_else(|| {
                    invalid(
                        &format!("states[{index}]"),
                        format!("{state} is not a job state"),
                    )
                })?;
            states.push(state);
        }
        if request.page_size > 1000 {
            return Err(invalid(
                "page_size",
                format!("{} is more than the limit of 1000", request.page_size),
            ));
        }
        let (jobs, next_page_token) = self
            .scheduler
            .list_jobs(
                &caller,
                JobFilter {
                    tenant: (!request.tenant.is_empty()).then_some(request.tenant),
                    states,
                    name_prefix: (!request.name_prefix.is_empty()).then_some(request.name_prefix),
                    page_size: if request.page_size == 0 {
                        100
                    } else {
                        request.page_size
                    },
                    page_token: (!request.page_token.is_empty()).then_some(request.page_token),
                },
            )
            .await?;
        let mut messages = Vec::with_capacity(jobs.len());
        for job in &jobs {
            messages.push(self.job_message(job).await?);
        }
        Ok(Response::new(v1::ListJobsResponse {
            jobs: messages,
            next_page_token: next_page_token.unwrap_or_default(),
        }))
    }

    async fn cancel_job(
        &self,
        request: Request<v1::CancelJobRequest>,
    ) -> Result<Response<v1::CancelJobResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let request = request.into_inner();
        let job = self
            .scheduler
            .cancel(&caller, &request.job_id, &request.reason)
            .await?;
        let job = self.job_message(&job).await?;
        Ok(Response::new(v1::CancelJobResponse { job: Some(job) }))
    }

    type WatchJobStream = EventStream;

    async fn watch_job(
        &self,
        request: Request<v1::WatchJobRequest>,
    ) -> Result<Response<Self::WatchJobStream>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let request = request.into_inner();
        // Subscribe before reading the state, so nothing falls between the two.
        let mut events = self.scheduler.subscribe();
        let mut revocations = self.scheduler.subscribe_revocations();
        let token_id = caller.token_id.clone();
        let job = self.scheduler.visible_job(&caller, &request.job_id).await?;
        let (sender, receiver) = mpsc::channel(256);
        let job_id = job.id.clone();
        let include_logs = request.include_logs;
        let first = JobUpdate {
            job_id: job.id.clone(),
            sequence: 0,
            time_ms: now_ms(),
            kind: JobUpdateKind::StateChanged {
                previous: job.state,
                state: job.state,
                reason: "current state".into(),
            },
        };
        let already_over = first.ends_the_job();
        tokio::spawn(async move {
            if sender.send(Ok(job_update_to_proto(&first))).await.is_err() || already_over {
                return;
            }
            loop {
                let received = tokio::select! {
                    received = events.recv() => received,
                    revoked = revocations.recv() => match revoked {
                        Ok(revoked) if revoked == token_id => {
                            let _ = sender
                                .send(Err(Status::from(ApiError::Unauthenticated(
                                    "token rejected: revoked".into(),
                                ))))
                                .await;
                            return;
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                        _ => continue,
                    },
                };
                match received {
                    Ok(event) if event.job_id == job_id => {
                        if !include_logs && matches!(event.kind, JobUpdateKind::Log { .. }) {
                            continue;
                        }
                        let over = event.ends_the_job();
                        if sender.send(Ok(job_update_to_proto(&event))).await.is_err() || over {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => {
                        let _ = sender
                            .send(Err(Status::from(ApiError::DataLoss(format!(
                                "the watcher fell {missed} events behind; watch again"
                            )))))
                            .await;
                        return;
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }

    async fn estimate_job(
        &self,
        request: Request<v1::EstimateJobRequest>,
    ) -> Result<Response<v1::EstimateJobResponse>, Status> {
        let caller = self.caller(&request).await?;
        self.scheduler.may_estimate(&caller)?;
        let request = request.into_inner();
        crate::scheduler::check_spec_size(&request.spec_json)?;
        if request.slice_bytes == Some(0) {
            return Err(invalid("slice_bytes", "must be larger than 0"));
        }
        if carve_proto::convert::is_command_spec_json(&request.spec_json) {
            return Err(invalid(
                "spec",
                carve_proto::convert::COMMAND_JOB_HAS_NO_ESTIMATE,
            ));
        }
        let mut spec =
            carve_proto::convert::job_spec_from_json(&request.spec_json).map_err(Status::from)?;
        if let Some(batch_size) = request.batch_size {
            spec.training.batch_size = batch_size;
        }
        if let Some(precision) = request.precision {
            spec.training.precision =
                carve_proto::convert::precision_from_proto(precision, "precision")
                    .map_err(Status::from)?;
        }
        // Validation, the estimate and the shrink plan grow with the model: they run on
        // the compute pool, charged to the caller's tenant.
        let answer = self
            .scheduler
            .compute(&caller.tenant, move || {
                estimate_answer(spec, request.slice_bytes)
            })
            .await??;
        Ok(Response::new(answer))
    }

    async fn get_job_logs(
        &self,
        request: Request<v1::GetJobLogsRequest>,
    ) -> Result<Response<v1::GetJobLogsResponse>, Status> {
        let caller = self.caller(&request).await?;
        let request = request.into_inner();
        // Sequences are stored as signed 64-bit integers, so a larger one cannot exist.
        let after_sequence = i64::try_from(request.after_sequence).map_err(|_| {
            invalid(
                "after_sequence",
                format!(
                    "{} is larger than any sequence ({})",
                    request.after_sequence,
                    i64::MAX
                ),
            )
        })?;
        // Page sizes and tails over the cap are capped by the store, not refused (the
        // proto's contract).
        let page = self
            .scheduler
            .job_logs(
                &caller,
                &LogQuery {
                    job_id: request.job_id,
                    attempt_number: (request.attempt_number != 0)
                        .then_some(i64::from(request.attempt_number)),
                    after_sequence,
                    page_size: request.page_size,
                    tail: (request.tail != 0).then_some(request.tail),
                },
            )
            .await?;
        let last_sequence = page
            .lines
            .last()
            .map_or(request.after_sequence, |line| line.sequence as u64);
        Ok(Response::new(v1::GetJobLogsResponse {
            lines: page.lines.into_iter().map(log_line_proto).collect(),
            last_sequence,
            more: page.more,
        }))
    }
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

#[tonic::async_trait]
impl ClusterService for Services {
    async fn list_workers(
        &self,
        request: Request<v1::ListWorkersRequest>,
    ) -> Result<Response<v1::ListWorkersResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let states = request.into_inner().states;
        let workers = self
            .scheduler
            .workers_seen_by(&caller)
            .iter()
            .map(worker_to_proto)
            .filter(|worker| states.is_empty() || states.contains(&worker.state))
            .collect();
        Ok(Response::new(v1::ListWorkersResponse { workers }))
    }

    async fn get_worker(
        &self,
        request: Request<v1::GetWorkerRequest>,
    ) -> Result<Response<v1::GetWorkerResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let worker_id = request.into_inner().worker_id;
        let worker = self
            .scheduler
            .workers_seen_by(&caller)
            .iter()
            .map(worker_to_proto)
            .find(|worker| worker.id == worker_id)
            .ok_or_else(|| {
                Status::from(ApiError::NotFound {
                    what: "worker",
                    id: worker_id,
                })
            })?;
        Ok(Response::new(v1::GetWorkerResponse {
            worker: Some(worker),
        }))
    }

    async fn drain_worker(
        &self,
        request: Request<v1::DrainWorkerRequest>,
    ) -> Result<Response<v1::DrainWorkerResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let request = request.into_inner();
        let worker = self
            .set_draining(&caller, &request.worker_id, true, &request.reason)
            .await?;
        Ok(Response::new(v1::DrainWorkerResponse { worker }))
    }

    async fn undrain_worker(
        &self,
        request: Request<v1::UndrainWorkerRequest>,
    ) -> Result<Response<v1::UndrainWorkerResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let worker = self
            .set_draining(&caller, &request.into_inner().worker_id, false, "")
            .await?;
        Ok(Response::new(v1::UndrainWorkerResponse { worker }))
    }

    async fn remove_worker(
        &self,
        request: Request<v1::RemoveWorkerRequest>,
    ) -> Result<Response<v1::RemoveWorkerResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let removed = self
            .scheduler
            .remove_worker(&caller, &request.into_inner().worker_id)
            .await?;
        Ok(Response::new(v1::RemoveWorkerResponse {
            worker: Some(worker_to_proto(&removed)),
        }))
    }

    async fn list_slices(
        &self,
        request: Request<v1::ListSlicesRequest>,
    ) -> Result<Response<v1::ListSlicesResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let request = request.into_inner();
        let slices = self
            .scheduler
            // The same rule as the worker views: only admins see other tenants' jobs (a
            // worker token included: a worker process never needs this list).
            .slices_seen_by(&caller)
            .iter()
            .map(slice_to_proto)
            .filter(|slice| request.worker_id.is_empty() || slice.worker_id == request.worker_id)
            .filter(|slice| request.gpu_uuid.is_empty() || slice.gpu_uuid == request.gpu_uuid)
            .filter(|slice| request.job_id.is_empty() || slice.job_id == request.job_id)
            .collect();
        Ok(Response::new(v1::ListSlicesResponse { slices }))
    }
}

#[tonic::async_trait]
impl WorkerService for Services {
    async fn register(
        &self,
        request: Request<v1::RegisterWorkerRequest>,
    ) -> Result<Response<v1::RegisterWorkerResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let registered = self
            .scheduler
            .register_worker(&caller, registration_from_proto(request.into_inner()))
            .await?;
        Ok(Response::new(registered_to_proto(registered)))
    }

    type SessionStream = SchedulerMessageStream;

    async fn session(
        &self,
        request: Request<Streaming<v1::WorkerMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        self.scheduler.may_hold_sessions(&caller)?;
        let mut incoming = request.into_inner();
        // A worker says hello as soon as the stream is open; one that does not within
        // the lease would hold a stream, and a handler, open for ever.
        let lease = self.scheduler.settings.lease_duration;
        let first = tokio::time::timeout(lease, incoming.next())
            .await
            .map_err(|_| {
                invalid(
                    "body.hello",
                    format!("a session starts with hello, and none came within {lease:?}"),
                )
            })?
            .ok_or_else(|| invalid("body.hello", "a session starts with hello"))??;
        let hello = match first.body {
            Some(v1::worker_message::Body::Hello(hello)) => hello,
            _ => return Err(invalid("body.hello", "a session starts with hello")),
        };
        let running_attempts: Vec<AttemptRef> = hello
            .running_attempts
            .into_iter()
            .map(|attempt| attempt_ref_from_proto(Some(attempt)))
            .collect();
        let (sender, receiver) = mpsc::channel(1024);
        let session = self
            .scheduler
            .open_session(&caller, &hello.worker_id, &running_attempts, sender.clone())
            .await?;
        let commands =
            ReceiverStream::new(receiver).map(|command| command.map(worker_command_to_proto));
        crate::worker_session::serve_session(
            self.scheduler.clone(),
            hello.worker_id,
            session,
            incoming,
            sender,
        );
        Ok(Response::new(Box::pin(commands)))
    }
}
