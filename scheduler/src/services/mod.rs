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
use carve_proto::v1::job_service_server::JobService;
use tokio_stream::Stream;
use tonic::{Code, Request, Response, Status};

use crate::auth::Caller;
use crate::convert::{
    attach_image, attach_progress, job_state_from_proto, job_to_proto, submitted_job_to_proto,
    timestamp,
};
use crate::metrics::{Metrics, SubmitRejection};
use crate::scheduler::{JobView, Scheduler, now_ms};
use crate::store::{JobFilter, JobRecord, LogLineRecord, LogQuery};

/// One handle on the scheduler for all four services.
#[derive(Debug, Clone)]
pub struct Services {
    pub scheduler: Arc<Scheduler>,
}

fn invalid(field: &str, reason: impl Into<String>) -> Status {
    ApiError::invalid_argument(field, reason).into()
}

mod admin;
mod cluster;
mod secrets;
mod watch;
mod worker_session;

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

    /// A job as the API shows it, with its attempts (the reads of a page of one).
    async fn job_message(&self, job: JobRecord) -> Result<v1::Job, Status> {
        view_message(&self.scheduler.job_view(job).await?)
    }
}

/// A job as the API shows it: its record, attempts, memory model and progress.
fn view_message(view: &JobView) -> Result<v1::Job, Status> {
    let mut message = job_to_proto(&view.job, &view.attempts)?;
    message.memory_model = view
        .memory_model
        .as_ref()
        .map(|known| v1::CommandMemoryModel {
            basis: known.basis.clone(),
            measured: known.learned.measured,
            ..known.model().into()
        });
    if let Some((attempt_number, progress)) = &view.progress {
        attach_progress(&mut message, *attempt_number, progress);
    }
    attach_image(
        &mut message,
        view.image_digest.as_deref(),
        view.image_pull.as_ref(),
    );
    Ok(message)
}

/// The most bytes of jobs one ListJobs response carries: a page stops before the job
/// that would pass it (a page's first job is always sent, and a job is at most a 1 MiB
/// spec and its attempts), so every page fits under the 4 MiB a gRPC client decodes by
/// default, with room for the page token and the frame.
pub const LIST_JOBS_RESPONSE_BUDGET_BYTES: usize = 3 << 20;

/// What `job` adds to an encoded ListJobsResponse: its field's tag, its length and itself.
fn encoded_len_in_list(job: &v1::Job) -> usize {
    let length = prost::Message::encoded_len(job);
    prost::encoding::key_len(1) + prost::encoding::encoded_len_varint(length as u64) + length
}

/// The first jobs of `views` as messages, as many as fit in `budget_bytes` (the first
/// always does).
fn messages_within(views: &[JobView], budget_bytes: usize) -> Result<Vec<v1::Job>, Status> {
    let mut messages = Vec::with_capacity(views.len());
    let mut bytes = 0;
    for view in views {
        let message = view_message(view)?;
        bytes += encoded_len_in_list(&message);
        if bytes > budget_bytes && !messages.is_empty() {
            break;
        }
        messages.push(message);
    }
    Ok(messages)
}

fn log_line_proto(line: LogLineRecord) -> v1::JobLogLine {
    v1::JobLogLine {
        sequence: line.sequence as u64,
        time: Some(timestamp(line.time_ms)),
        attempt_number: line.attempt_number as u32,
        level: line.level,
        message: line.message,
        stream: line.stream,
    }
}

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
        let job = self.job_message(job).await?;
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
        let mut page = self
            .scheduler
            .job_page(
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
                LIST_JOBS_RESPONSE_BUDGET_BYTES,
            )
            .await?;
        // Bounded in bytes as well as in jobs: a page that would not fit is cut short,
        // and its token continues right after the last job sent.
        let messages = messages_within(&page.jobs, LIST_JOBS_RESPONSE_BUDGET_BYTES)?;
        page.keep_first(messages.len());
        Ok(Response::new(v1::ListJobsResponse {
            jobs: messages,
            next_page_token: page.next_page_token.unwrap_or_default(),
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
        let job = self.job_message(job).await?;
        Ok(Response::new(v1::CancelJobResponse { job: Some(job) }))
    }

    type WatchJobStream = EventStream;

    async fn watch_job(
        &self,
        request: Request<v1::WatchJobRequest>,
    ) -> Result<Response<Self::WatchJobStream>, Status> {
        self.watch(request).await
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
        let mut spec = carve_proto::convert::estimable_job_spec_from_json(&request.spec_json)
            .map_err(Status::from)?;
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

    async fn reset_memory_models(
        &self,
        request: Request<v1::ResetMemoryModelsRequest>,
    ) -> Result<Response<v1::ResetMemoryModelsResponse>, Status> {
        let caller = self.caller(&request).await?;
        let request = request.into_inner();
        let deleted = self
            .scheduler
            .reset_memory_models(&caller, &request.job_id, request.all, &request.tenant)
            .await?;
        Ok(Response::new(v1::ResetMemoryModelsResponse { deleted }))
    }
}
