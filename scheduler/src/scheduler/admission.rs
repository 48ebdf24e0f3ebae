//! Admission: what `submit` checks and computes before a job is stored (validation,
//! estimate, sizing to a slice and the cluster, shrinking ahead of time, quota), and the
//! short-lived lookups the submit path reads instead of the store (tokens, tenants,
//! measured-peak corrections, analysed specs), with the calls that invalidate them.

use std::sync::Arc;

use carve_core::admission::{AdmittedSlice, size_slice_at_admission};
use carve_core::estimator::MemoryEstimate;
use carve_core::job_state::JobState;
use carve_core::plan::RunConfig;
use carve_core::scheduling::{GpuState, TenantState, WaitReason, can_ever_fit};
use carve_core::shrink::ShrinkDecision;
use carve_core::usage::report::Submitter;
use carve_core::workload::Workload;
use carve_proto::ApiError;

use crate::auth::{Caller, Role, authenticate, generate_id};
use crate::cache::{
    BoundedCache, LOOKUP_CAPACITY, LOOKUP_TIME_TO_LIVE, ShortLivedCache, TOKEN_USE_RECORD_INTERVAL,
};
use crate::error::SchedulerError;
use crate::metrics::SubmitRejection;
use crate::store::{
    AttemptRecord, JobRecord, TenantRecord, TokenRecord, config_to_json, estimate_to_json,
    workload_to_json,
};

use super::{LeaderRole, Scheduler, StateChange, now_ms, spec_error};

/// How many distinct spec texts keep their analysis; specs are resubmitted verbatim
/// (sweeps, retries, scripts), and a miss only costs one validation and estimate.
const ANALYSED_SPECS_CAPACITY: usize = 256;

/// How many stored jobs' workloads the scheduler keeps (`Lookups::workloads`): about the
/// jobs queued and running on a large cluster; past it a job's stored workload is read
/// from the store again (`workload_json`; its spec is never parsed again).
const STORED_WORKLOADS_CAPACITY: usize = 4096;

/// Specs longer than this are analysed every time rather than held as cache keys, so
/// the spec cache stays under ANALYSED_SPECS_CAPACITY x this (16 MiB).
const ANALYSED_SPEC_MAX_BYTES: usize = 64 * 1024;

/// A spec as admission sees it before sizing: everything here depends on the spec's
/// text alone (validation, the configuration it asks for, the estimate and the peak
/// key are pure functions of it), so a spec submitted again reuses it.
///
/// A command job's memory is not a function of its text (it comes from the model a
/// profile stored for its command, or from its declared `vram`): its `estimate` is
/// `None` (`Workload::spec_estimate`), and admission looks the model up.
#[derive(Debug)]
struct AnalysedSpec {
    /// Shared with the job ids that admission stores with this spec
    /// (`Lookups::workloads`), so nothing reads the spec again while they live.
    job: Arc<Workload>,
    config: RunConfig,
    estimate: Option<Arc<MemoryEstimate>>,
    /// The key measured peaks of this job at `config` are kept under
    /// (`Workload::peak_key`).
    peak_key: String,
    /// `config` and `estimate` as a job row stores them, used as they are when admission
    /// keeps the spec's own configuration.
    config_json: String,
    estimate_json: String,
    /// `job` as its row stores it (`workload_json`), so what acts on the job later reads
    /// the validated form instead of the spec.
    workload_json: String,
}

#[derive(Debug)]
pub(super) struct Lookups {
    /// By secret hash: invalidated by `Scheduler::revoke_token`.
    pub(super) tokens: ShortLivedCache<Vec<u8>, TokenRecord>,
    /// Token ids whose last use this scheduler wrote less than
    /// [`TOKEN_USE_RECORD_INTERVAL`] ago: those are not written again yet.
    token_uses: ShortLivedCache<String, ()>,
    /// By name: invalidated by `Scheduler::set_quota`.
    pub(super) tenants: ShortLivedCache<String, TenantRecord>,
    /// By shape key (`None`: nothing measured yet): invalidated when this scheduler
    /// records a measured peak of that shape.
    pub(super) peak_corrections: ShortLivedCache<String, Option<f64>>,
    /// By the spec's exact text.
    specs: BoundedCache<String, Arc<AnalysedSpec>>,
    /// Stored jobs' workloads, by job id: put there by admission and by the first read of
    /// a job's stored validated form (`Scheduler::stored_workload`), so the form is
    /// decoded once in a scheduler's life, not at each placement or report.
    pub(super) workloads: BoundedCache<String, Arc<Workload>>,
}

impl Lookups {
    pub(super) fn new() -> Lookups {
        Lookups {
            tokens: ShortLivedCache::new(LOOKUP_TIME_TO_LIVE, LOOKUP_CAPACITY),
            token_uses: ShortLivedCache::new(TOKEN_USE_RECORD_INTERVAL, LOOKUP_CAPACITY),
            tenants: ShortLivedCache::new(LOOKUP_TIME_TO_LIVE, LOOKUP_CAPACITY),
            peak_corrections: ShortLivedCache::new(LOOKUP_TIME_TO_LIVE, LOOKUP_CAPACITY),
            specs: BoundedCache::new(ANALYSED_SPECS_CAPACITY),
            workloads: BoundedCache::new(STORED_WORKLOADS_CAPACITY),
        }
    }
}

/// The largest slice any GPU not lost could hold (after its CUDA context).
pub(super) fn largest_usable_gpu(gpus: &[GpuState]) -> Option<u64> {
    gpus.iter()
        .map(|gpu| gpu.total_bytes.saturating_sub(gpu.context_bytes))
        .max()
}

/// The waiting reason a new job is stored with, in its own submit group: when no GPU is
/// schedulable, every job of a known tenant waits for that reason (what `solve` says
/// first, whatever the queue), so the pass has nothing to write for it; otherwise the
/// reason depends on the queue, and the pass writes it. A standby knows no worker (only
/// the leader has sessions): its answer says the job waits for the leader's next pass,
/// whose reason replaces it.
fn waiting_reason_at_submit(gpus: &[GpuState], role: &LeaderRole) -> String {
    if let LeaderRole::Standby { leader_endpoint } = role {
        return match leader_endpoint {
            Some(endpoint) => format!(
                "queued for the leader's next pass: submitted to a standby replica; the \
                 leader, at {endpoint}, places it"
            ),
            None => "queued for the leader's next pass: submitted to a standby replica while \
                     no leader is known; the next leader places it"
                .to_string(),
        };
    }
    if gpus.iter().any(|gpu| gpu.schedulable) {
        String::new()
    } else {
        WaitReason::NoSchedulableGpu.to_string()
    }
}

/// Validation, the configuration the spec asks for, its estimate and peak key: what
/// admission needs of a spec's text alone.
fn analyse_spec_text(spec_json: &str) -> Result<AnalysedSpec, SchedulerError> {
    let job = carve_proto::convert::validated_spec_from_json(spec_json).map_err(spec_error)?;
    // A worker runs the job in a directory of its own, where a relative path means
    // nothing the person who wrote it had in mind.
    job.require_absolute_paths().map_err(spec_error_of_field)?;
    let config = job.initial_config();
    let estimate = job.spec_estimate(&config).map_err(spec_error_of_field)?;
    Ok(AnalysedSpec {
        peak_key: job.peak_key(&config),
        config_json: config_to_json(&config),
        estimate_json: estimate.as_ref().map(estimate_to_json).unwrap_or_default(),
        workload_json: workload_to_json(&job),
        estimate: estimate.map(Arc::new),
        job: Arc::new(job),
        config,
    })
}

/// What a submit did: the job, with its attempts when the idempotency key found an
/// earlier job (`created == false`), or with the configuration and estimate admission
/// just computed for a new one (so the answer needs no store read and no estimate).
#[derive(Debug, Clone)]
pub struct SubmittedJob {
    pub job: JobRecord,
    pub attempts: Vec<AttemptRecord>,
    pub created: bool,
    pub admitted: Option<AdmittedConfig>,
    /// What in the spec is allowed but looks like a mistake, each "field: message".
    pub warnings: Vec<String>,
}

/// The configuration admission gave a new job, and its estimate.
#[derive(Debug, Clone)]
pub struct AdmittedConfig {
    pub config: RunConfig,
    pub estimate: Arc<MemoryEstimate>,
}

/// The longest spec text the scheduler accepts: a spec at the layer limit with long
/// names stays well under it, and a larger one would only cost time to parse.
pub const SPEC_MAX_BYTES: usize = 1 << 20;

/// A spec's own error (an estimate it cannot have), named under `spec.`.
fn spec_error_of_field(error: carve_core::FieldError) -> SchedulerError {
    ApiError::InvalidArgument {
        field: format!("spec.{}", error.field),
        reason: error.reason,
    }
    .into()
}

/// Refuses a spec text over [`SPEC_MAX_BYTES`] before it is parsed.
pub fn check_spec_size(spec_json: &str) -> Result<(), SchedulerError> {
    if spec_json.len() > SPEC_MAX_BYTES {
        return Err(ApiError::InvalidArgument {
            field: "spec_json".into(),
            reason: format!(
                "is {} bytes; the limit is {SPEC_MAX_BYTES} bytes (1 MiB)",
                spec_json.len()
            ),
        }
        .into());
    }
    Ok(())
}

/// Whether a spec text sent again under an idempotency key is the spec stored with the
/// key: the same text, or the same JSON written with other spacing or key order (a
/// client that re-serialises its request on retry still retries).
fn same_spec(stored: &str, sent: &str) -> bool {
    stored == sent
        || matches!(
            (
                serde_json::from_str::<serde_json::Value>(stored),
                serde_json::from_str::<serde_json::Value>(sent),
            ),
            (Ok(stored), Ok(sent)) if stored == sent
        )
}

/// The refusal of an idempotency key reused with another spec. ALREADY_EXISTS, as gRPC
/// says for "the entity a client attempted to create already exists": the key names a
/// job that exists, and no state change would make this submit succeed, which is what
/// FAILED_PRECONDITION would promise.
fn reused_key_refusal(idempotency_key: &str, job_id: &str) -> SchedulerError {
    SchedulerError::already_exists(
        "idempotency_key",
        format!("{idempotency_key:?}, submitted before with another spec as job {job_id},"),
    )
}

/// A submit refused, and why, for the metrics page. Where the kind of error says it
/// (a bad spec, no token) the reason comes from the kind; admission names the reasons
/// the kind cannot tell apart (RESOURCE_EXHAUSTED is a quota, a job too large, or a
/// spent compute budget).
#[derive(Debug)]
pub struct SubmitRefused {
    pub reason: SubmitRejection,
    pub error: SchedulerError,
}

impl SubmitRefused {
    fn new(reason: SubmitRejection, error: impl Into<SchedulerError>) -> SubmitRefused {
        SubmitRefused {
            reason,
            error: error.into(),
        }
    }
}

impl From<SchedulerError> for SubmitRefused {
    fn from(error: SchedulerError) -> SubmitRefused {
        let reason = match &error {
            SchedulerError::Api(ApiError::InvalidArgument { .. }) => SubmitRejection::InvalidSpec,
            SchedulerError::Api(ApiError::Unauthenticated(_)) => SubmitRejection::Unauthenticated,
            SchedulerError::Api(ApiError::PermissionDenied(_)) => SubmitRejection::PermissionDenied,
            // Admission names quota and too-large refusals itself: what reaches here
            // exhausted is the compute pool's budget.
            SchedulerError::Api(ApiError::ResourceExhausted(_)) => SubmitRejection::ComputeBudget,
            SchedulerError::Api(ApiError::AlreadyExists { .. }) => {
                SubmitRejection::IdempotencyConflict
            }
            SchedulerError::Api(ApiError::Unavailable(_)) | SchedulerError::Database(_) => {
                SubmitRejection::Unavailable
            }
            _ => SubmitRejection::Other,
        };
        SubmitRefused { reason, error }
    }
}

impl From<ApiError> for SubmitRefused {
    fn from(error: ApiError) -> SubmitRefused {
        SubmitRefused::from(SchedulerError::Api(error))
    }
}

/// Why sizing at admission stopped before it was done.
enum AdmissionSizing {
    /// The job does not fit as written: the shrink planner must find a configuration
    /// within `limit` bytes.
    NeedsShrink { limit: u64 },
}

impl Scheduler {
    /// Admits a job: validates, estimates, fits it to its slice and the cluster (shrinking
    /// ahead of time when the job allows), checks the quota, and stores it durably.
    /// Returns the job as the answer shows it, and whether it was created (false: the
    /// idempotency key matched an earlier job).
    pub async fn submit(
        &self,
        caller: &Caller,
        spec_json: &str,
        idempotency_key: &str,
    ) -> Result<SubmittedJob, SubmitRefused> {
        caller.require(&[Role::User, Role::Admin])?;
        if idempotency_key.len() > 256 {
            return Err(ApiError::InvalidArgument {
                field: "idempotency_key".into(),
                reason: format!(
                    "is {} characters long; the limit is 256",
                    idempotency_key.len()
                ),
            }
            .into());
        }
        let analysed = self.analyse_spec(&caller.tenant, spec_json).await?;
        let job = &analysed.job;
        // A pull secret must be one of the job's own tenant's.
        self.check_image_pull_secret(&caller.tenant, job).await?;
        // Core places gangs (`gang::solve_gangs`) and workers launch their members, but
        // this scheduler's passes do not yet place a gang as a whole: refused here, a
        // `gpus = 4` job would otherwise run as one slice of one member's size.
        if job.gang_shape(0).members > 1 {
            return Err(ApiError::InvalidArgument {
                field: "spec.resources.gpus".into(),
                reason: "multi-GPU gangs are not scheduled by this release yet; \
                         ask for one GPU (gpus = 1)"
                    .into(),
            }
            .into());
        }
        let tenant = self.tenant(&caller.tenant).await?;
        // Corrections are kept by job shape for every tenant: only a kind whose estimate
        // they refine takes them (not a command job, whose peaks, a program's own figures,
        // are in its tenant's memory model).
        let correction = if job.takes_peak_corrections() {
            self.peak_correction(&analysed.peak_key)
                .await?
                .unwrap_or(1.0)
        } else {
            1.0
        };
        let gpus = self.gpu_states();
        // A job declaring more than any GPU has is refused as written, before any memory
        // model could shrink it into one.
        job.check_fits_largest_gpu(largest_usable_gpu(&gpus))
            .map_err(spec_error_of_field)?;
        // What the job needs as written: the estimator's answer for a model job (from
        // the analysis); for a command job, its tenant's model of its command (a profile
        // measured it), else its declared vram, else the profile it runs first in a
        // roomy slice.
        let measured = self.measured_memory_model(&caller.tenant, job).await?;
        let spec_estimate = match &analysed.estimate {
            Some(estimate) => Arc::clone(estimate),
            None => Arc::new(
                job.estimate(
                    &analysed.config,
                    measured.as_ref(),
                    largest_usable_gpu(&gpus),
                )
                .map_err(spec_error_of_field)?,
            ),
        };
        let profile = job.needs_profile(measured.as_ref());
        // Sizing asks for a shrink only when the job does not fit as written; the shrink
        // planner then runs on the compute pool, and sizing is done again with its answer.
        let size = |shrink: Option<&ShrinkDecision>| {
            size_slice_at_admission(
                job.resources().vram,
                analysed.config,
                spec_estimate.required_bytes,
                correction,
                largest_usable_gpu(&gpus),
                |_, limit| match shrink {
                    Some(decision) => Ok((decision.config, decision.estimate.required_bytes)),
                    None => Err(AdmissionSizing::NeedsShrink { limit }),
                },
            )
        };
        // The estimate of the configuration admitted, for the answer: the spec's own
        // unless admission shrank it, then the shrink planner's for the new one (the
        // same `estimate_job` of that configuration).
        let mut shrunk_estimate = None;
        let AdmittedSlice {
            config,
            slice_bytes,
            ..
        } = match size(None) {
            // A profile runs the job as written in its roomy slice.
            _ if profile => AdmittedSlice {
                config: analysed.config,
                slice_bytes: spec_estimate.required_bytes,
                shrunk: false,
            },
            Ok(admitted) => admitted,
            Err(AdmissionSizing::NeedsShrink { limit }) => {
                let shrinking = Arc::clone(&analysed);
                let decision = self
                    .compute
                    .run(&caller.tenant, move || {
                        shrinking
                            .job
                            .plan_shrink(&shrinking.config, None, limit, measured.as_ref())
                            .map_err(|error| error.to_string())
                    })
                    .await?
                    .map_err(|error| {
                        SubmitRefused::new(
                            SubmitRejection::TooLarge,
                            ApiError::ResourceExhausted(format!(
                                "job {} cannot fit: {error}",
                                job.name()
                            )),
                        )
                    })?;
                let admitted = size(Some(&decision))
                    .map_err(|_| ApiError::Internal("sizing asked for a second shrink".into()))?;
                shrunk_estimate = Some(Arc::new(decision.estimate));
                admitted
            }
        };
        // No command job's slice below the operator's floor, whatever its model says
        // (a model job's slice is the estimator's exact answer for a plan Carve runs).
        let slice_bytes = job.slice_with_floor(
            slice_bytes,
            self.settings.min_slice_bytes,
            largest_usable_gpu(&gpus),
        );
        let tenant_state = TenantState {
            tenant: tenant.name.clone(),
            weight: tenant.fair_share_weight.max(1) as u32,
            vram_quota_bytes: tenant.vram_quota_bytes.map(|bytes| bytes as u64),
            running_jobs_quota: tenant.max_running_jobs.map(|count| count as u32),
            vram_in_use_bytes: 0,
            running_jobs: 0,
            decayed_usage_byte_seconds: 0,
        };
        if let Err(reason) = can_ever_fit(slice_bytes, &gpus, &tenant_state) {
            let rejection = match reason {
                WaitReason::TenantVramQuota { .. } | WaitReason::TenantRunningJobsQuota { .. } => {
                    SubmitRejection::Quota
                }
                _ => SubmitRejection::TooLarge,
            };
            return Err(SubmitRefused::new(
                rejection,
                ApiError::ResourceExhausted(format!("job {} can never run: {reason}", job.name())),
            ));
        }
        let now = now_ms();
        let record = JobRecord {
            id: generate_id("job"),
            tenant: caller.tenant.clone(),
            name: job.name().to_string(),
            kind: job.kind(),
            spec_json: spec_json.to_string(),
            state: JobState::Queued,
            priority: i64::from(job.priority()),
            submit_sequence: 0,
            idempotency_key: (!idempotency_key.is_empty()).then(|| idempotency_key.to_string()),
            config_json: if config == analysed.config {
                analysed.config_json.clone()
            } else {
                config_to_json(&config)
            },
            // The estimate of the configuration stored: reads show it as it is.
            estimate_json: match shrunk_estimate.as_deref() {
                Some(estimate) => estimate_to_json(estimate),
                None if analysed.estimate_json.is_empty() => estimate_to_json(&spec_estimate),
                None => analysed.estimate_json.clone(),
            },
            required_bytes: slice_bytes as i64,
            waiting_reason: waiting_reason_at_submit(&gpus, &self.leader_role()),
            message: String::new(),
            created_at_ms: now,
            finished_at_ms: None,
            checkpoint_location: None,
            checkpoint_step: 0,
            attempts_count: 0,
        };
        let warnings = job.warnings().iter().map(ToString::to_string).collect();
        let outcome = self
            .batcher
            .submit_by(
                record,
                Some(analysed.workload_json.clone()),
                Submitter {
                    token_id: caller.token_id.clone(),
                    description: caller.token_description.clone(),
                },
            )
            .await?;
        if !outcome.created {
            // The idempotency key matched an earlier job. A retry of that submit sends
            // the same spec; another spec under the same key is a different job, and
            // answering with the first one would hide that it was never created.
            if !same_spec(&outcome.job.spec_json, spec_json) {
                return Err(reused_key_refusal(idempotency_key, &outcome.job.id).into());
            }
            // The job may have attempts and another configuration by now: answer with
            // it as stored.
            let attempts = self.attempts(&outcome.job.id).await?;
            return Ok(SubmittedJob {
                job: outcome.job,
                attempts,
                created: false,
                admitted: None,
                warnings,
            });
        }
        // A new job has no state before: its event goes from queued to queued.
        let submitted = StateChange {
            previous: JobState::Queued,
            next: JobState::Queued,
        };
        self.lookups
            .workloads
            .insert(outcome.job.id.clone(), Arc::clone(&analysed.job));
        self.emit_state(&outcome.job.id, submitted, "submitted");
        self.wake();
        // A job created just now has no attempts, and its configuration and estimate
        // are the ones admission computed: no store read, no second estimate.
        Ok(SubmittedJob {
            job: outcome.job,
            attempts: Vec::new(),
            created: true,
            admitted: Some(AdmittedConfig {
                config,
                estimate: shrunk_estimate.unwrap_or(spec_estimate),
            }),
            warnings,
        })
    }

    /// Validates a spec and estimates it with the configuration it asks for (on the
    /// compute pool, charged to `tenant`), or reuses that analysis from an earlier submit
    /// of the same text.
    async fn analyse_spec(
        &self,
        tenant: &str,
        spec_json: &str,
    ) -> Result<Arc<AnalysedSpec>, SchedulerError> {
        if let Some(analysed) = self.lookups.specs.get(spec_json) {
            return Ok(analysed);
        }
        check_spec_size(spec_json)?;
        let text = spec_json.to_string();
        let analysed = Arc::new(
            self.compute
                .run(tenant, move || analyse_spec_text(&text))
                .await??,
        );
        if spec_json.len() <= ANALYSED_SPEC_MAX_BYTES {
            self.lookups
                .specs
                .insert(spec_json.to_string(), Arc::clone(&analysed));
        }
        Ok(analysed)
    }

    /// The caller a request's bearer token stands for (see `auth::authenticate` for how
    /// long a revoke through another replica may take to apply).
    pub async fn authenticate(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        now_ms: i64,
    ) -> Result<Caller, SchedulerError> {
        authenticate(
            &self.store,
            &self.lookups.tokens,
            &self.lookups.token_uses,
            metadata,
            now_ms,
        )
        .await
    }

    /// A tenant as admission checks it: read from the store at most
    /// `LOOKUP_TIME_TO_LIVE` ago (a quota changed through this scheduler applies at once).
    async fn tenant(&self, name: &str) -> Result<TenantRecord, SchedulerError> {
        let key = name.to_string();
        if let Some(tenant) = self.lookups.tenants.get(&key, std::time::Instant::now()) {
            return Ok(tenant);
        }
        let ticket = self.lookups.tenants.begin_fill();
        let read_at = std::time::Instant::now();
        let tenant = self.store.get_tenant(name).await?;
        self.lookups
            .tenants
            .insert(ticket, key, tenant.clone(), read_at);
        Ok(tenant)
    }

    /// The measured-peak correction of a job shape, read from the store at most
    /// `LOOKUP_TIME_TO_LIVE` ago (a peak recorded by this scheduler applies at once).
    async fn peak_correction(&self, shape_key: &str) -> Result<Option<f64>, SchedulerError> {
        let key = shape_key.to_string();
        let cache = &self.lookups.peak_corrections;
        if let Some(correction) = cache.get(&key, std::time::Instant::now()) {
            return Ok(correction);
        }
        let ticket = cache.begin_fill();
        let read_at = std::time::Instant::now();
        let correction = self.store.peak_correction(shape_key).await?;
        cache.insert(ticket, key, correction, read_at);
        Ok(correction)
    }
}
