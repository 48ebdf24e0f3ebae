//! The scheduler's state and its decisions: admission at submit, the scheduling pass
//! (core's pure `solve`), worker sessions, leases, OOM retries and cancellation.
//!
//! The store is the truth for jobs and attempts; memory holds what is live (worker
//! sessions, heartbeats, attempts running now), rebuilt from the store at start, and the
//! pass's copy of the queue (`queue`), read from the store by the first pass. Every
//! change of a job's state happens under one async lock (`job_changes`), so a cancel, a
//! worker report and a scheduling pass never interleave on the same job.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use carve_core::admission::{AdmittedSlice, size_slice_at_admission};
use carve_core::allocator::OutOfMemory;
use carve_core::estimator::{MemoryEstimate, estimate_job};
use carve_core::job_state::{JobEvent, JobState, next_state};
use carve_core::plan::RunConfig;
use carve_core::scheduling::{
    GpuState, SchedulingProblem, TenantState, WaitReason, can_ever_fit, solve,
};
use carve_core::shrink::{OomObservation, ShrinkDecision, plan_shrink};
use carve_core::validate::ValidatedJob;
use carve_proto::v1;
use sha2::{Digest, Sha256};
use tokio::sync::{Notify, broadcast, mpsc};
use tokio::time::Instant;
use tonic::Status;

use crate::auth::{Caller, Role, authenticate, generate_id};
use crate::cache::{BoundedCache, LOOKUP_CAPACITY, LOOKUP_TIME_TO_LIVE, ShortLivedCache};
use crate::compute_pool::{ComputeLimits, ComputePool};
use crate::convert::{
    attempt_to_proto, config_from_json, config_to_json, estimate_from_json, estimate_to_json,
    job_proto_from_parts, job_state_to_proto, job_to_proto, oom_to_json, timestamp,
};
use crate::error::SchedulerError;
use crate::metrics::{ClusterGauges, Metrics};
use crate::queue::QueueMirror;
use crate::store::{
    AttemptRecord, JobRecord, QueueFingerprint, Store, SubmitBatcher, TenantRecord, TokenRecord,
    WorkerRecord,
};
use crate::worker_session::{LiveSession, SessionHandle};

/// Timing of leases and passes.
#[derive(Debug, Clone)]
pub struct SchedulerSettings {
    /// A worker silent for longer loses its attempts.
    pub lease_duration: Duration,
    pub heartbeat_interval: Duration,
    /// A pass also runs at least this often, besides every submit and report.
    pub scheduling_interval: Duration,
    /// Where attempts write checkpoints: `{checkpoint_directory}/{job id}.ckpt` on the worker.
    pub checkpoint_directory: String,
    /// The wait before a job whose attempt died of an infrastructure failure (a lost
    /// worker, an interrupted process) is placed again; it doubles with each such failure
    /// of the job.
    pub infrastructure_retry_backoff: Duration,
}

impl Default for SchedulerSettings {
    fn default() -> Self {
        SchedulerSettings {
            lease_duration: Duration::from_secs(30),
            heartbeat_interval: Duration::from_secs(5),
            scheduling_interval: Duration::from_secs(2),
            checkpoint_directory: "checkpoints".to_string(),
            infrastructure_retry_backoff: Duration::from_secs(2),
        }
    }
}

pub type SessionSender = mpsc::Sender<Result<v1::SchedulerMessage, Status>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerLiveness {
    Ready,
    Draining,
    Lost,
}

impl WorkerLiveness {
    pub fn name(self) -> &'static str {
        match self {
            WorkerLiveness::Ready => "ready",
            WorkerLiveness::Draining => "draining",
            WorkerLiveness::Lost => "lost",
        }
    }
}

#[derive(Debug)]
struct LiveWorker {
    record: WorkerRecord,
    gpus: Vec<v1::Gpu>,
    state: WorkerLiveness,
    last_heartbeat: Instant,
    session: Option<LiveSession>,
}

/// An attempt that holds a slice now.
#[derive(Debug, Clone)]
struct RunningAttempt {
    attempt_number: u32,
    lease_epoch: u64,
    worker_id: String,
    gpu_id: String,
    slice_bytes: u64,
    tenant: String,
    estimate_bytes: u64,
    /// The peak the attempt last reported in its progress.
    measured_peak_bytes: u64,
}

#[derive(Debug, Default)]
struct Live {
    workers: HashMap<String, LiveWorker>,
    /// By job id: a job has at most one attempt running.
    running: HashMap<String, RunningAttempt>,
    /// Queued jobs backing off after an infrastructure failure, by job id: passes leave
    /// them out until then. Not stored: a restarted scheduler retries them at once.
    backing_off: HashMap<String, Instant>,
}

/// Infrastructure failures (lost worker, interrupted process) a job is retried after;
/// one more fails it.
pub const INFRASTRUCTURE_RETRIES: usize = 3;

/// The scheduler: shared by every service handler and the background loops.
#[derive(Debug)]
pub struct Scheduler {
    pub store: Store,
    batcher: SubmitBatcher,
    /// Job log lines (worker lines of current attempts, the scheduler's notes), written
    /// in groups; best effort, see `LogBatcher`.
    logs: crate::store::LogBatcher,
    pub settings: SchedulerSettings,
    live: Mutex<Live>,
    job_changes: tokio::sync::Mutex<()>,
    wake: Notify,
    events: broadcast::Sender<v1::JobEvent>,
    event_sequence: AtomicU64,
    pub metrics: Metrics,
    stopping: tokio::sync::watch::Sender<bool>,
    /// Counts wake-ups, so a pass knows whether anything asked for one since the last.
    wake_generation: AtomicU64,
    last_pass_inputs: Mutex<Option<PassInputs>>,
    /// The pass's copy of the queue (see `queue`): touched only under `job_changes`.
    queue: Mutex<QueueMirror>,
    /// Whole reads of the queue by passes (the first, and each time the copy disagreed
    /// with the store's fingerprint).
    queue_reloads: AtomicU64,
    /// What the submit path would otherwise read from the store or compute again on
    /// every call; see `cache` for how stale each may be.
    lookups: Lookups,
    /// Hands out worker session ids (see `worker_session`).
    session_ids: AtomicU64,
    /// Ids of tokens revoked through this scheduler, for the streams opened with them.
    revoked_tokens: broadcast::Sender<String>,
    /// Validation, estimation and shrink planning of requests, off the async runtime.
    compute: ComputePool,
    /// When `expire_leases` last ran.
    last_lease_check: Mutex<Option<Instant>>,
    /// When `recheck_session_tokens` last read the sessions' tokens.
    last_session_token_check: Mutex<Option<Instant>>,
}

/// How many distinct spec texts keep their analysis; specs are resubmitted verbatim
/// (sweeps, retries, scripts), and a miss only costs one validation and estimate.
const ANALYSED_SPECS_CAPACITY: usize = 256;

/// Specs longer than this are analysed every time rather than held as cache keys, so
/// the spec cache stays under ANALYSED_SPECS_CAPACITY x this (16 MiB).
const ANALYSED_SPEC_MAX_BYTES: usize = 64 * 1024;

/// A spec as admission sees it before sizing: everything here depends on the spec's
/// text alone (validation, the configuration it asks for, the estimate and the shape
/// key are pure functions of it), so a spec submitted again reuses it.
#[derive(Debug)]
struct AnalysedSpec {
    job: ValidatedJob,
    config: RunConfig,
    estimate: MemoryEstimate,
    shape_key: String,
    /// `config` and `estimate` as a job row stores them, used as they are when admission
    /// keeps the spec's own configuration.
    config_json: String,
    estimate_json: String,
}

#[derive(Debug)]
struct Lookups {
    /// By secret hash: invalidated by `Scheduler::revoke_token`.
    tokens: ShortLivedCache<Vec<u8>, TokenRecord>,
    /// By name: invalidated by `Scheduler::set_quota`.
    tenants: ShortLivedCache<String, TenantRecord>,
    /// By shape key (`None`: nothing measured yet): invalidated when this scheduler
    /// records a measured peak of that shape.
    peak_corrections: ShortLivedCache<String, Option<f64>>,
    /// By the spec's exact text.
    specs: BoundedCache<String, Arc<AnalysedSpec>>,
}

impl Lookups {
    fn new() -> Lookups {
        Lookups {
            tokens: ShortLivedCache::new(LOOKUP_TIME_TO_LIVE, LOOKUP_CAPACITY),
            tenants: ShortLivedCache::new(LOOKUP_TIME_TO_LIVE, LOOKUP_CAPACITY),
            peak_corrections: ShortLivedCache::new(LOOKUP_TIME_TO_LIVE, LOOKUP_CAPACITY),
            specs: BoundedCache::new(ANALYSED_SPECS_CAPACITY),
        }
    }
}

/// What a scheduling pass decides from, as far as it can tell cheaply: a pass with the
/// same inputs as the last one that finished is skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PassInputs {
    wake_generation: u64,
    queue: QueueFingerprint,
    /// Sorted by worker, then GPU.
    gpus: Vec<GpuState>,
    /// Sorted by tenant.
    tenants: Vec<TenantState>,
    /// Queued jobs left out because they are backing off: when one's backoff ends, the
    /// inputs change and the next pass runs.
    backing_off: Vec<String>,
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as i64)
}

/// Moves a job to its next state through core's state machine, the one place that says
/// which transitions exist; returns the previous state's name.
fn transition(job: &mut JobRecord, event: JobEvent) -> Result<String, SchedulerError> {
    let current = JobState::from_name(&job.state).ok_or_else(|| {
        SchedulerError::Internal(format!(
            "job {} has an unknown state {:?}",
            job.id, job.state
        ))
    })?;
    let next = next_state(current, event)
        .map_err(|error| SchedulerError::FailedPrecondition(error.to_string()))?;
    Ok(std::mem::replace(&mut job.state, next.name().to_string()))
}

/// The spec of a stored job, validated again: it was valid at submit, so an error here
/// means the store holds something this build cannot read.
fn stored_spec_text(spec_json: &str) -> Result<ValidatedJob, SchedulerError> {
    carve_proto::convert::validated_job_from_json(spec_json).map_err(spec_error)
}

/// The largest slice any GPU not lost could hold (after its CUDA context).
fn largest_usable_gpu(gpus: &[GpuState]) -> Option<u64> {
    gpus.iter()
        .map(|gpu| gpu.total_bytes.saturating_sub(gpu.context_bytes))
        .max()
}

/// The waiting reason a new job is stored with, in its own submit group: when no GPU is
/// schedulable, every job of a known tenant waits for that reason (what `solve` says
/// first, whatever the queue), so the pass has nothing to write for it; otherwise the
/// reason depends on the queue, and the pass writes it.
fn waiting_reason_at_submit(gpus: &[GpuState]) -> String {
    if gpus.iter().any(|gpu| gpu.schedulable) {
        String::new()
    } else {
        WaitReason::NoSchedulableGpu.to_string()
    }
}

fn is_terminal(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "cancelled")
}

/// The key under which measured peaks of "the same job shape" are remembered: the model
/// and the run config.
fn shape_key(model: &carve_core::spec::ModelSpec, config: &RunConfig) -> String {
    let model = serde_json::to_string(model).unwrap_or_default();
    let digest = Sha256::digest(format!("{model}|{}", config_to_json(config)).as_bytes());
    digest
        .iter()
        .take(16)
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// Validation, the configuration the spec asks for, its estimate and shape key: what
/// admission needs of a spec's text alone.
fn analyse_spec_text(spec_json: &str) -> Result<AnalysedSpec, SchedulerError> {
    let job = carve_proto::convert::validated_job_from_json(spec_json).map_err(spec_error)?;
    let config = RunConfig::from_spec(&job.spec);
    let estimate =
        estimate_job(&job, &config).map_err(|error| SchedulerError::InvalidArgument {
            field: format!("spec.{}", error.field),
            reason: error.reason,
        })?;
    let shape_key = shape_key(&job.spec.model, &config);
    let config_json = config_to_json(&config);
    let estimate_json = estimate_to_json(&estimate);
    Ok(AnalysedSpec {
        job,
        config,
        estimate,
        shape_key,
        config_json,
        estimate_json,
    })
}

/// The longest spec text the scheduler accepts: a spec at the layer limit with long
/// names stays well under it, and a larger one would only cost time to parse.
pub const SPEC_MAX_BYTES: usize = 1 << 20;

/// Refuses a spec text over [`SPEC_MAX_BYTES`] before it is parsed.
pub fn check_spec_size(spec_json: &str) -> Result<(), SchedulerError> {
    if spec_json.len() > SPEC_MAX_BYTES {
        return Err(SchedulerError::InvalidArgument {
            field: "spec_json".into(),
            reason: format!(
                "is {} bytes; the limit is {SPEC_MAX_BYTES} bytes (1 MiB)",
                spec_json.len()
            ),
        });
    }
    Ok(())
}

/// Why sizing at admission stopped before it was done.
enum AdmissionSizing {
    /// The job does not fit as written: the shrink planner must find a configuration
    /// within `limit` bytes.
    NeedsShrink { limit: u64 },
}

fn spec_error(error: carve_proto::ApiError) -> SchedulerError {
    match error {
        carve_proto::ApiError::InvalidArgument { field, reason } => {
            SchedulerError::InvalidArgument { field, reason }
        }
        other => SchedulerError::InvalidArgument {
            field: "spec_json".into(),
            reason: other.to_string(),
        },
    }
}

impl Scheduler {
    pub fn new(store: Store, settings: SchedulerSettings) -> Scheduler {
        let batcher = SubmitBatcher::spawn(store.clone());
        let logs = crate::store::LogBatcher::spawn(store.clone());
        let (events, _) = broadcast::channel(4096);
        Scheduler {
            store,
            batcher,
            logs,
            settings,
            live: Mutex::new(Live::default()),
            job_changes: tokio::sync::Mutex::new(()),
            wake: Notify::new(),
            events,
            event_sequence: AtomicU64::new(1),
            metrics: Metrics::default(),
            stopping: tokio::sync::watch::Sender::new(false),
            wake_generation: AtomicU64::new(0),
            last_pass_inputs: Mutex::new(None),
            queue: Mutex::new(QueueMirror::default()),
            queue_reloads: AtomicU64::new(0),
            lookups: Lookups::new(),
            session_ids: AtomicU64::new(1),
            revoked_tokens: broadcast::channel(64).0,
            compute: ComputePool::new(ComputeLimits::default()),
            last_lease_check: Mutex::new(None),
            last_session_token_check: Mutex::new(None),
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, QueueMirror> {
        self.queue
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// How many times passes read the whole queue (the first pass, and each time the
    /// copy disagreed with the store, e.g. after another replica moved jobs).
    pub fn queue_reloads(&self) -> u64 {
        self.queue_reloads.load(Ordering::Relaxed)
    }

    /// Stores a job's new state and tells the pass's copy of the queue (called under
    /// `job_changes`, like every change of a job's state).
    async fn update_job(&self, job: &JobRecord) -> Result<(), SchedulerError> {
        let result = self.store.update_job(job).await;
        match &result {
            Ok(()) => self.queue().note(job),
            // Whether the row changed is unknown: read the queue again next pass.
            Err(_) => self.queue().invalidate(),
        }
        result
    }

    fn live(&self) -> std::sync::MutexGuard<'_, Live> {
        // A panic while holding it would be a bug; the state is still usable.
        self.live
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Ends every worker session (the workers reconnect to the next scheduler) so that a
    /// graceful shutdown does not wait on streams that never end by themselves.
    pub fn begin_shutdown(&self) {
        self.stopping.send_replace(true);
        for worker in self.live().workers.values_mut() {
            if let Some(session) = worker.session.take() {
                session.end(SchedulerError::Unavailable(
                    "the scheduler is stopping; reconnect to another".into(),
                ));
            }
        }
    }

    pub fn shutting_down(&self) -> tokio::sync::watch::Receiver<bool> {
        self.stopping.subscribe()
    }

    pub fn wake(&self) {
        self.wake_generation.fetch_add(1, Ordering::AcqRel);
        self.wake.notify_one();
    }

    pub async fn wait_for_wake(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.wake.notified()).await;
    }

    pub fn subscribe(&self) -> broadcast::Receiver<v1::JobEvent> {
        self.events.subscribe()
    }

    /// Ids of tokens as they are revoked through this scheduler: a stream opened with
    /// one ends.
    pub fn subscribe_revocations(&self) -> broadcast::Receiver<String> {
        self.revoked_tokens.subscribe()
    }

    /// Sends an event to watchers, and stores the job log line it makes (worker lines,
    /// and the scheduler's notes on state changes, OOMs, shrinks and placements) — queued
    /// before the event is sent, so a watcher that saw the event and then reads the logs
    /// finds the line.
    fn emit(&self, job_id: &str, event: v1::job_event::Event) {
        let time_ms = now_ms();
        if let Some(line) = log_line_for_event(job_id, time_ms, &event) {
            self.logs.append(line);
        }
        let _ = self.events.send(v1::JobEvent {
            job_id: job_id.to_string(),
            sequence: self.event_sequence.fetch_add(1, Ordering::Relaxed),
            time: Some(timestamp(time_ms)),
            event: Some(event),
        });
    }

    /// Lines of a job the caller may see (NotFound for another tenant's job), after
    /// writing every line received so far, so a reader sees what the scheduler has.
    pub async fn job_logs(
        &self,
        caller: &Caller,
        query: &crate::store::LogQuery,
    ) -> Result<crate::store::LogPage, SchedulerError> {
        self.visible_job(caller, &query.job_id).await?;
        self.logs.flush().await;
        self.store.read_log_lines(query).await
    }

    /// Writes the log lines received so far (a graceful shutdown calls it last).
    pub async fn flush_logs(&self) {
        self.logs.flush().await;
    }

    fn emit_state(&self, job_id: &str, previous: &str, state: &str, reason: &str) {
        self.emit(
            job_id,
            v1::job_event::Event::StateChanged(v1::job_event::StateChanged {
                previous_state: job_state_to_proto(previous) as i32,
                state: job_state_to_proto(state) as i32,
                reason: reason.to_string(),
            }),
        );
    }

    /// Rebuilds the live state from the store after a start: attempts still running keep
    /// their slices, and their workers get one lease to come back.
    pub async fn recover(&self) -> Result<(), SchedulerError> {
        let workers = self.store.list_workers().await?;
        let active = self.store.jobs_in_states(&["placed", "running"]).await?;
        let mut running = HashMap::new();
        for job in active {
            let attempts = self.store.list_attempts(&job.id).await?;
            if let Some(attempt) = attempts
                .iter()
                .rev()
                .find(|attempt| attempt.outcome == "running")
            {
                running.insert(
                    job.id.clone(),
                    RunningAttempt {
                        attempt_number: attempt.attempt_number as u32,
                        lease_epoch: attempt.lease_epoch as u64,
                        worker_id: attempt.worker_id.clone(),
                        gpu_id: attempt.gpu_id.clone(),
                        slice_bytes: attempt.slice_bytes as u64,
                        tenant: job.tenant.clone(),
                        estimate_bytes: attempt.estimate_bytes as u64,
                        measured_peak_bytes: 0,
                    },
                );
            }
        }
        let mut live = self.live();
        for worker in workers {
            if worker.state == "lost" {
                continue;
            }
            let gpus: Vec<v1::Gpu> = serde_json::from_str::<Vec<GpuJson>>(&worker.gpus_json)
                .unwrap_or_default()
                .into_iter()
                .map(GpuJson::into_proto)
                .collect();
            let state = if worker.state == "draining" {
                WorkerLiveness::Draining
            } else {
                WorkerLiveness::Ready
            };
            live.workers.insert(
                worker.id.clone(),
                LiveWorker {
                    record: worker,
                    gpus,
                    state,
                    last_heartbeat: Instant::now(),
                    session: None,
                },
            );
        }
        live.running = running;
        Ok(())
    }

    // ---- jobs ----

    /// Admits a job: validates, estimates, fits it to its slice and the cluster (shrinking
    /// ahead of time when the job allows), checks the quota, and stores it durably.
    /// Returns the job as the answer shows it, and whether it was created (false: the
    /// idempotency key matched an earlier job).
    pub async fn submit(
        &self,
        caller: &Caller,
        spec_json: &str,
        idempotency_key: &str,
    ) -> Result<(v1::Job, bool), SchedulerError> {
        caller.require(&[Role::User, Role::Admin])?;
        if idempotency_key.len() > 256 {
            return Err(SchedulerError::InvalidArgument {
                field: "idempotency_key".into(),
                reason: format!(
                    "is {} characters long; the limit is 256",
                    idempotency_key.len()
                ),
            });
        }
        let analysed = self.analyse_spec(&caller.tenant, spec_json).await?;
        let job = &analysed.job;
        let tenant = self.tenant(&caller.tenant).await?;
        let correction = self
            .peak_correction(&analysed.shape_key)
            .await?
            .unwrap_or(1.0);
        let gpus = self.gpu_states();
        // Sizing asks for a shrink only when the job does not fit as written; the shrink
        // planner then runs on the compute pool, and sizing is done again with its answer.
        let size = |shrink: Option<&ShrinkDecision>| {
            size_slice_at_admission(
                job.spec.resources.vram,
                analysed.config,
                analysed.estimate.required_bytes,
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
            Ok(admitted) => admitted,
            Err(AdmissionSizing::NeedsShrink { limit }) => {
                let shrinking = Arc::clone(&analysed);
                let decision = self
                    .compute
                    .run(&caller.tenant, move || {
                        plan_shrink(&shrinking.job, &shrinking.config, None, limit)
                    })
                    .await?
                    .map_err(|error| {
                        SchedulerError::ResourceExhausted(format!(
                            "job {} cannot fit: {error}",
                            job.spec.name
                        ))
                    })?;
                let admitted = size(Some(&decision)).map_err(|_| {
                    SchedulerError::Internal("sizing asked for a second shrink".into())
                })?;
                shrunk_estimate = Some(decision.estimate);
                admitted
            }
        };
        let tenant_state = TenantState {
            tenant: tenant.name.clone(),
            weight: tenant.fair_share_weight.max(1) as u32,
            vram_quota_bytes: tenant.vram_quota_bytes.map(|bytes| bytes as u64),
            running_jobs_quota: tenant.max_running_jobs.map(|count| count as u32),
            vram_in_use_bytes: 0,
            running_jobs: 0,
        };
        if let Err(reason) = can_ever_fit(slice_bytes, &gpus, &tenant_state) {
            return Err(SchedulerError::ResourceExhausted(format!(
                "job {} can never run: {reason}",
                job.spec.name
            )));
        }
        let estimate = &analysed.estimate;
        let now = now_ms();
        let record = JobRecord {
            id: generate_id("job"),
            tenant: caller.tenant.clone(),
            name: job.spec.name.clone(),
            spec_json: spec_json.to_string(),
            state: "queued".into(),
            priority: i64::from(job.spec.priority),
            submit_sequence: 0,
            idempotency_key: (!idempotency_key.is_empty()).then(|| idempotency_key.to_string()),
            config_json: if config == analysed.config {
                analysed.config_json.clone()
            } else {
                config_to_json(&config)
            },
            // The estimate of the configuration stored: reads show it as it is.
            estimate_json: shrunk_estimate
                .as_ref()
                .map_or_else(|| analysed.estimate_json.clone(), estimate_to_json),
            required_bytes: slice_bytes as i64,
            waiting_reason: waiting_reason_at_submit(&gpus),
            message: String::new(),
            created_at_ms: now,
            finished_at_ms: None,
            checkpoint_location: None,
            checkpoint_step: 0,
            attempts_count: 0,
        };
        let outcome = self.batcher.submit(record).await?;
        if !outcome.created {
            // The idempotency key matched an earlier job, which may have attempts and
            // another configuration by now: answer with it as stored.
            return Ok((self.job_proto(&outcome.job).await?, false));
        }
        self.emit_state(&outcome.job.id, "queued", "queued", "submitted");
        self.wake();
        // A job created just now has no attempts, and its configuration and estimate
        // are the ones admission computed: no store read, no second estimate.
        let answer = job_proto_from_parts(
            &outcome.job,
            &[],
            Some(config),
            Some(shrunk_estimate.as_ref().unwrap_or(estimate)),
        );
        Ok((answer, true))
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

    /// Runs CPU-heavy work of a request for `tenant` off the async runtime (see
    /// `compute_pool`).
    pub async fn compute<T, Work>(&self, tenant: &str, work: Work) -> Result<T, SchedulerError>
    where
        T: Send + 'static,
        Work: FnOnce() -> T + Send + 'static,
    {
        self.compute.run(tenant, work).await
    }

    /// The caller a request's bearer token stands for (see `auth::authenticate` for how
    /// long a revoke through another replica may take to apply).
    pub async fn authenticate(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        now_ms: i64,
    ) -> Result<Caller, SchedulerError> {
        authenticate(&self.store, &self.lookups.tokens, metadata, now_ms).await
    }

    /// Revokes a token; this scheduler refuses it from the next call on, and ends the
    /// worker sessions and job watches opened with it.
    pub async fn revoke_token(&self, token_id: &str) -> Result<TokenRecord, SchedulerError> {
        let token = self.store.revoke_token(token_id).await?;
        self.lookups.tokens.invalidate(&token.secret_hash);
        self.end_sessions_of_token(&token.id, "token rejected: revoked");
        let _ = self.revoked_tokens.send(token.id.clone());
        Ok(token)
    }

    /// Replaces a tenant's quota; this scheduler's next admission uses the new one.
    pub async fn set_quota(
        &self,
        tenant: &str,
        vram_quota_bytes: Option<i64>,
        max_running_jobs: Option<i64>,
        fair_share_weight: i64,
    ) -> Result<TenantRecord, SchedulerError> {
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

    /// A job the caller may see, or NotFound (also for another tenant's job).
    pub async fn visible_job(
        &self,
        caller: &Caller,
        job_id: &str,
    ) -> Result<JobRecord, SchedulerError> {
        caller.require(&[Role::User, Role::Admin])?;
        if job_id.is_empty() {
            return Err(SchedulerError::InvalidArgument {
                field: "job_id".into(),
                reason: "must not be empty".into(),
            });
        }
        let job = self.store.get_job(job_id).await?;
        if !caller.may_access_tenant(&job.tenant) {
            return Err(SchedulerError::NotFound {
                what: "job",
                id: job_id.to_string(),
            });
        }
        Ok(job)
    }

    pub async fn job_proto(&self, job: &JobRecord) -> Result<v1::Job, SchedulerError> {
        let attempts = self.store.list_attempts(&job.id).await?;
        job_to_proto(job, &attempts)
    }

    pub async fn cancel(
        &self,
        caller: &Caller,
        job_id: &str,
        reason: &str,
    ) -> Result<JobRecord, SchedulerError> {
        let _guard = self.job_changes.lock().await;
        let mut job = self.visible_job(caller, job_id).await?;
        if is_terminal(&job.state) {
            return Err(SchedulerError::FailedPrecondition(format!(
                "job {job_id} already {}",
                job.state
            )));
        }
        let previous = transition(&mut job, JobEvent::CancelRequested)?;
        job.message = if reason.is_empty() {
            format!("cancelled by {}", caller.token_id)
        } else {
            format!("cancelled: {reason}")
        };
        job.finished_at_ms = Some(now_ms());
        job.waiting_reason.clear();
        self.update_job(&job).await?;
        // A running attempt keeps its slice until its worker confirms it stopped.
        let running = self.live().running.get(job_id).cloned();
        if let Some(running) = running {
            self.send_to_worker(
                &running.worker_id,
                v1::scheduler_message::Body::Cancel(v1::scheduler_message::Cancel {
                    attempt: Some(v1::AttemptRef {
                        job_id: job_id.to_string(),
                        attempt_number: running.attempt_number,
                        lease_epoch: running.lease_epoch,
                    }),
                    grace_period: Some(prost_types::Duration {
                        seconds: 10,
                        nanos: 0,
                    }),
                    reason: job.message.clone(),
                }),
            );
        }
        self.emit_state(job_id, &previous, "cancelled", &job.message);
        Metrics::count(&self.metrics.jobs_cancelled);
        Ok(job)
    }

    // ---- cluster ----

    /// GPUs of workers that are not lost, with the slices running on them.
    fn gpu_states(&self) -> Vec<GpuState> {
        let live = self.live();
        let mut gpus = Vec::new();
        for (worker_id, worker) in &live.workers {
            if worker.state == WorkerLiveness::Lost {
                continue;
            }
            for gpu in &worker.gpus {
                let allocated: u64 = live
                    .running
                    .values()
                    .filter(|running| running.worker_id == *worker_id && running.gpu_id == gpu.uuid)
                    .map(|running| running.slice_bytes)
                    .sum();
                gpus.push(GpuState {
                    gpu_id: gpu.uuid.clone(),
                    worker_id: worker_id.clone(),
                    total_bytes: gpu.total_bytes,
                    context_bytes: gpu.context_bytes,
                    allocated_bytes: allocated,
                    schedulable: worker.state == WorkerLiveness::Ready && worker.session.is_some(),
                });
            }
        }
        gpus
    }

    fn send_to_worker(&self, worker_id: &str, body: v1::scheduler_message::Body) -> bool {
        let session = self.live().workers.get(worker_id).and_then(|worker| {
            worker
                .session
                .as_ref()
                .map(|session| session.sender.clone())
        });
        match session {
            Some(session) => session
                .try_send(Ok(v1::SchedulerMessage { body: Some(body) }))
                .is_ok(),
            None => false,
        }
    }

    pub async fn register_worker(
        &self,
        caller: &Caller,
        request: v1::RegisterWorkerRequest,
    ) -> Result<v1::RegisterWorkerResponse, SchedulerError> {
        caller.require(&[Role::Worker, Role::Admin])?;
        if request.hostname.is_empty() {
            return Err(SchedulerError::InvalidArgument {
                field: "hostname".into(),
                reason: "must not be empty".into(),
            });
        }
        for (index, gpu) in request.gpus.iter().enumerate() {
            if gpu.uuid.is_empty() {
                return Err(SchedulerError::InvalidArgument {
                    field: format!("gpus[{index}].uuid"),
                    reason: "must not be empty".into(),
                });
            }
            if gpu.total_bytes == 0 || gpu.context_bytes >= gpu.total_bytes {
                return Err(SchedulerError::InvalidArgument {
                    field: format!("gpus[{index}].total_bytes"),
                    reason: format!(
                        "{} total with {} taken by the context leaves nothing for slices",
                        gpu.total_bytes, gpu.context_bytes
                    ),
                });
            }
        }
        // A token resumes only a worker it registered (or one registered before workers
        // were bound to tokens); any other id it names gets it a new identity, so a
        // worker token cannot take over another node's attempts.
        let known = !request.previous_worker_id.is_empty()
            && self
                .live()
                .workers
                .get(&request.previous_worker_id)
                .is_some_and(|worker| {
                    worker.record.token_id.is_empty() || worker.record.token_id == caller.token_id
                });
        let worker_id = if known {
            request.previous_worker_id.clone()
        } else {
            generate_id("worker")
        };
        let now = now_ms();
        let record = WorkerRecord {
            id: worker_id.clone(),
            hostname: request.hostname.clone(),
            gpus_json: serde_json::to_string(
                &request
                    .gpus
                    .iter()
                    .map(GpuJson::from_proto)
                    .collect::<Vec<_>>(),
            )
            .unwrap_or_else(|_| "[]".into()),
            state: "ready".into(),
            last_heartbeat_ms: now,
            registered_at_ms: now,
            version: request.version.clone(),
            token_id: caller.token_id.clone(),
        };
        self.store.upsert_worker(&record).await?;
        {
            let mut live = self.live();
            let session = live
                .workers
                .get_mut(&worker_id)
                .and_then(|worker| worker.session.take());
            live.workers.insert(
                worker_id.clone(),
                LiveWorker {
                    record,
                    gpus: request.gpus,
                    state: WorkerLiveness::Ready,
                    last_heartbeat: Instant::now(),
                    session,
                },
            );
        }
        let duration = |duration: Duration| prost_types::Duration {
            seconds: duration.as_secs() as i64,
            nanos: duration.subsec_nanos() as i32,
        };
        Ok(v1::RegisterWorkerResponse {
            worker_id,
            heartbeat_interval: Some(duration(self.settings.heartbeat_interval)),
            lease_duration: Some(duration(self.settings.lease_duration)),
        })
    }

    /// Binds a session stream to a registered worker and reconciles what it still runs.
    /// Only the token that registered the worker may open its session; a worker has one
    /// session at a time, so a newer one ends the one before.
    pub async fn open_session(
        &self,
        caller: &Caller,
        worker_id: &str,
        running_attempts: &[v1::AttemptRef],
        sender: SessionSender,
    ) -> Result<SessionHandle, SchedulerError> {
        caller.require(&[Role::Worker, Role::Admin])?;
        let handle = {
            let mut live = self.live();
            let worker =
                live.workers
                    .get_mut(worker_id)
                    .ok_or_else(|| SchedulerError::NotFound {
                        what: "worker",
                        id: worker_id.to_string(),
                    })?;
            if worker.record.token_id != caller.token_id {
                return Err(SchedulerError::PermissionDenied(format!(
                    "worker {worker_id} was registered with another token; a worker speaks \
                     only with the token it registered with"
                )));
            }
            if worker.state == WorkerLiveness::Lost {
                worker.state = WorkerLiveness::Ready;
            }
            let id = self.session_ids.fetch_add(1, Ordering::Relaxed);
            let (session, handle) = LiveSession::open(id, caller.token_id.clone(), sender);
            // The session before, if any, ends here (dropped: "replaced").
            worker.session = Some(session);
            worker.last_heartbeat = Instant::now();
            handle
        };
        // Attempts the worker runs that were reassigned meanwhile are stopped.
        for attempt in running_attempts {
            let current = self.live().running.get(&attempt.job_id).cloned();
            let still_ours = current.is_some_and(|current| {
                current.worker_id == worker_id && current.lease_epoch == attempt.lease_epoch
            });
            if !still_ours {
                self.send_to_worker(
                    worker_id,
                    v1::scheduler_message::Body::Cancel(v1::scheduler_message::Cancel {
                        attempt: Some(attempt.clone()),
                        grace_period: Some(prost_types::Duration {
                            seconds: 0,
                            nanos: 0,
                        }),
                        reason: "the attempt was reassigned while the worker was away".into(),
                    }),
                );
            }
        }
        self.wake();
        Ok(handle)
    }

    /// Whether `session_id` is the session `worker_id` holds now.
    fn is_current_session(&self, worker_id: &str, session_id: u64) -> bool {
        self.live()
            .workers
            .get(worker_id)
            .and_then(|worker| worker.session.as_ref())
            .is_some_and(|session| session.id == session_id)
    }

    /// Forgets a session that ended, unless the worker has opened a newer one since.
    pub fn close_session(&self, worker_id: &str, session_id: u64) {
        if let Some(worker) = self.live().workers.get_mut(worker_id)
            && worker
                .session
                .as_ref()
                .is_some_and(|current| current.id == session_id)
        {
            worker.session = None;
        }
    }

    /// Ends the sessions opened with a token (it was revoked): their workers are
    /// unschedulable until they come back with a valid token, and lose their attempts
    /// when their lease runs out.
    fn end_sessions_of_token(&self, token_id: &str, why: &str) {
        for worker in self.live().workers.values_mut() {
            if worker
                .session
                .as_ref()
                .is_some_and(|session| session.token_id == token_id)
                && let Some(session) = worker.session.take()
            {
                session.end(SchedulerError::Unauthenticated(why.to_string()));
            }
        }
    }

    /// Ends the sessions whose token was revoked through another replica, or expired,
    /// since they opened: the token is read again from the store at most every
    /// [`LOOKUP_TIME_TO_LIVE`], as a call's authentication would. A revoke through this
    /// scheduler ends them at once (`revoke_token`).
    pub async fn recheck_session_tokens(&self) -> Result<(), SchedulerError> {
        {
            let mut last = self
                .last_session_token_check
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if last.is_some_and(|last| last.elapsed() < LOOKUP_TIME_TO_LIVE) {
                return Ok(());
            }
            *last = Some(Instant::now());
        }
        let mut token_ids: Vec<String> = self
            .live()
            .workers
            .values()
            .filter_map(|worker| worker.session.as_ref())
            .map(|session| session.token_id.clone())
            .collect();
        token_ids.sort();
        token_ids.dedup();
        let now = now_ms();
        for token_id in token_ids {
            let token = self.store.get_token(&token_id).await?;
            let why = if token.revoked {
                "token rejected: revoked"
            } else if token.expires_at_ms.is_some_and(|expires| expires <= now) {
                "token rejected: expired"
            } else {
                continue;
            };
            self.end_sessions_of_token(&token_id, why);
        }
        Ok(())
    }

    /// A heartbeat on the worker's current session; one on a session that was replaced
    /// or ended says nothing about the worker.
    pub fn heartbeat(&self, worker_id: &str, session_id: u64, gpus: &[v1::GpuMemory]) {
        let mut live = self.live();
        if let Some(worker) = live.workers.get_mut(worker_id)
            && worker
                .session
                .as_ref()
                .is_some_and(|session| session.id == session_id)
        {
            worker.last_heartbeat = Instant::now();
            worker.record.last_heartbeat_ms = now_ms();
            for reported in gpus {
                if let Some(gpu) = worker
                    .gpus
                    .iter_mut()
                    .find(|gpu| gpu.uuid == reported.gpu_uuid)
                {
                    gpu.free_bytes = reported.free_bytes;
                }
            }
        }
    }

    /// Whether a report about `attempt` comes from the worker that holds it now.
    fn current_attempt(&self, worker_id: &str, attempt: &v1::AttemptRef) -> Option<RunningAttempt> {
        self.live()
            .running
            .get(&attempt.job_id)
            .filter(|running| {
                running.worker_id == worker_id
                    && running.attempt_number == attempt.attempt_number
                    && running.lease_epoch == attempt.lease_epoch
            })
            .cloned()
    }

    /// Handles one message of a worker's session.
    /// Handles one message of a worker's session; only the session the worker holds now
    /// may report.
    pub async fn handle_worker_message(
        &self,
        worker_id: &str,
        session_id: u64,
        message: v1::WorkerMessage,
    ) -> Result<(), SchedulerError> {
        use v1::worker_message::Body;
        if !self.is_current_session(worker_id, session_id) {
            return Err(SchedulerError::FailedPrecondition(format!(
                "this session of worker {worker_id} was replaced or ended; reports go on \
                 the worker's current session"
            )));
        }
        let Some(body) = message.body else {
            return Err(SchedulerError::InvalidArgument {
                field: "body".into(),
                reason: "a worker message needs a body".into(),
            });
        };
        match body {
            Body::Hello(_) => Err(SchedulerError::InvalidArgument {
                field: "body.hello".into(),
                reason: "hello is only the first message of a session".into(),
            }),
            Body::Heartbeat(heartbeat) => {
                self.heartbeat(worker_id, session_id, &heartbeat.gpus);
                Ok(())
            }
            Body::AttemptStarted(started) => {
                let attempt = started.attempt.unwrap_or_default();
                let _guard = self.job_changes.lock().await;
                if self.current_attempt(worker_id, &attempt).is_none() {
                    return Err(self.fenced(&attempt));
                }
                let mut job = self.store.get_job(&attempt.job_id).await?;
                if job.state == "placed" {
                    transition(&mut job, JobEvent::Started)?;
                    self.update_job(&job).await?;
                    self.emit_state(&job.id, "placed", "running", "the attempt started");
                }
                Ok(())
            }
            Body::Progress(progress) => {
                let attempt = progress.attempt.unwrap_or_default();
                if self.current_attempt(worker_id, &attempt).is_none() {
                    return Err(self.fenced(&attempt));
                }
                if let Some(peak) = progress
                    .progress
                    .as_ref()
                    .map(|progress| progress.memory_peak_bytes)
                    && let Some(running) = self.live().running.get_mut(&attempt.job_id)
                {
                    running.measured_peak_bytes = running.measured_peak_bytes.max(peak);
                }
                self.emit(
                    &attempt.job_id,
                    v1::job_event::Event::Progress(v1::job_event::Progress {
                        attempt_number: attempt.attempt_number,
                        progress: progress.progress,
                    }),
                );
                Ok(())
            }
            Body::Log(line) => {
                let attempt = line.attempt.unwrap_or_default();
                if self.current_attempt(worker_id, &attempt).is_some() {
                    self.emit(
                        &attempt.job_id,
                        v1::job_event::Event::Log(v1::job_event::LogLine {
                            attempt_number: attempt.attempt_number,
                            level: line.level,
                            message: line.message,
                        }),
                    );
                }
                Ok(())
            }
            Body::CheckpointWritten(written) => {
                let attempt = written.attempt.unwrap_or_default();
                let _guard = self.job_changes.lock().await;
                if self.current_attempt(worker_id, &attempt).is_none() {
                    return Err(self.fenced(&attempt));
                }
                if let Some(checkpoint) = written.checkpoint {
                    let mut job = self.store.get_job(&attempt.job_id).await?;
                    job.checkpoint_location = Some(checkpoint.location);
                    job.checkpoint_step = checkpoint.step as i64;
                    self.update_job(&job).await?;
                }
                Ok(())
            }
            Body::Oom(oom) => self.handle_oom(worker_id, oom).await,
            Body::AttemptFinished(finished) => self.handle_finished(worker_id, finished).await,
        }
    }

    fn fenced(&self, attempt: &v1::AttemptRef) -> SchedulerError {
        SchedulerError::Conflict(format!(
            "attempt {}/{} (lease epoch {}) is not this worker's any more",
            attempt.job_id, attempt.attempt_number, attempt.lease_epoch
        ))
    }

    async fn handle_oom(
        &self,
        worker_id: &str,
        oom: v1::worker_message::OomReport,
    ) -> Result<(), SchedulerError> {
        let attempt = oom.attempt.unwrap_or_default();
        let _guard = self.job_changes.lock().await;
        let running = self
            .current_attempt(worker_id, &attempt)
            .ok_or_else(|| self.fenced(&attempt))?;
        let report: OutOfMemory = oom.report.unwrap_or_default().into();
        let now = now_ms();
        self.store
            .finish_attempt(
                &attempt.job_id,
                i64::from(attempt.attempt_number),
                attempt.lease_epoch as i64,
                "out_of_memory",
                Some(report.peak as i64),
                Some(oom_to_json(&report).as_str()),
                &report.to_string(),
                now,
            )
            .await?;
        self.live().running.remove(&attempt.job_id);
        Metrics::count(&self.metrics.out_of_memory_reports);
        let mut job = self.store.get_job(&attempt.job_id).await?;
        if let Some(checkpoint) = oom
            .checkpoint
            .filter(|checkpoint| !checkpoint.location.is_empty())
        {
            job.checkpoint_location = Some(checkpoint.location);
            job.checkpoint_step = checkpoint.step as i64;
        }
        let old_config = config_from_json(&job.config_json)?;
        self.emit(
            &job.id,
            v1::job_event::Event::Oom(v1::job_event::OutOfMemory {
                attempt_number: attempt.attempt_number,
                config: Some(old_config.into()),
                report: Some(report.into()),
            }),
        );
        if is_terminal(&job.state) {
            // Cancelled meanwhile: the slice is free, nothing to retry.
            self.wake();
            return Ok(());
        }
        let attempts = self.store.list_attempts(&job.id).await?;
        let out_of_memory_attempts = attempts
            .iter()
            .filter(|attempt| attempt.outcome == "out_of_memory")
            .count();
        let previous = job.state.clone();
        let observation = OomObservation {
            report,
            estimated_required_bytes: running.estimate_bytes,
        };
        // Validation and the shrink planner grow with the model: the compute pool runs
        // them (the scheduler's own work, charged to no tenant's budget).
        let spec_json = job.spec_json.clone();
        let slice_bytes = running.slice_bytes;
        let (validated, planned) = self
            .compute
            .run_for_scheduler(move || {
                let validated = stored_spec_text(&spec_json)?;
                let planned = plan_shrink(&validated, &old_config, Some(&observation), slice_bytes);
                Ok::<_, SchedulerError>((validated, planned))
            })
            .await??;
        let retries_left = out_of_memory_attempts <= validated.spec.oom.max_retries as usize;
        match planned {
            Ok(decision) if retries_left && decision.config != old_config => {
                job.config_json = config_to_json(&decision.config);
                job.estimate_json = estimate_to_json(&decision.estimate);
                job.required_bytes =
                    running.slice_bytes.max(decision.estimate.required_bytes) as i64;
                transition(
                    &mut job,
                    JobEvent::AttemptOutOfMemory {
                        retry_allowed: true,
                    },
                )?;
                job.waiting_reason = String::new();
                self.update_job(&job).await?;
                self.emit(
                    &job.id,
                    v1::job_event::Event::Shrink(carve_proto::convert::shrink_decision_to_proto(
                        &old_config,
                        &decision,
                    )),
                );
                self.emit_state(
                    &job.id,
                    &previous,
                    "queued",
                    "out of memory: retrying with a smaller configuration",
                );
                Metrics::count(&self.metrics.retries);
            }
            outcome => {
                let why = match outcome {
                    Err(error) => error.to_string(),
                    Ok(_) if !retries_left => format!(
                        "the retry limit of {} is reached",
                        validated.spec.oom.max_retries
                    ),
                    Ok(_) => "the shrink planner found nothing smaller that fits".to_string(),
                };
                transition(
                    &mut job,
                    JobEvent::AttemptOutOfMemory {
                        retry_allowed: false,
                    },
                )?;
                job.message = format!("out of memory ({report}); {why}");
                job.finished_at_ms = Some(now);
                self.update_job(&job).await?;
                Metrics::count(&self.metrics.jobs_failed);
                self.emit_state(&job.id, &previous, "failed", &job.message);
            }
        }
        self.wake();
        Ok(())
    }

    async fn handle_finished(
        &self,
        worker_id: &str,
        finished: v1::worker_message::AttemptFinished,
    ) -> Result<(), SchedulerError> {
        let attempt = finished.attempt.unwrap_or_default();
        let _guard = self.job_changes.lock().await;
        let running = self
            .current_attempt(worker_id, &attempt)
            .ok_or_else(|| self.fenced(&attempt))?;
        let outcome = match v1::AttemptOutcome::try_from(finished.outcome) {
            Ok(v1::AttemptOutcome::Succeeded) => "succeeded",
            Ok(v1::AttemptOutcome::Cancelled) => "cancelled",
            Ok(v1::AttemptOutcome::Failed) => "failed",
            Ok(v1::AttemptOutcome::Interrupted) => "interrupted",
            _ => {
                return Err(SchedulerError::InvalidArgument {
                    field: "attempt_finished.outcome".into(),
                    reason: "must be succeeded, failed, cancelled or interrupted (out-of-memory goes in an oom report)".into(),
                });
            }
        };
        let now = now_ms();
        let measured =
            (finished.measured_peak_bytes > 0).then_some(finished.measured_peak_bytes as i64);
        self.store
            .finish_attempt(
                &attempt.job_id,
                i64::from(attempt.attempt_number),
                attempt.lease_epoch as i64,
                outcome,
                measured,
                None,
                &finished.message,
                now,
            )
            .await?;
        self.live().running.remove(&attempt.job_id);
        let mut job = self.store.get_job(&attempt.job_id).await?;
        if let (Some(measured), "succeeded") = (measured, outcome) {
            // The model as written is all the key needs: parsed, not validated again.
            let spec =
                carve_proto::convert::job_spec_from_json(&job.spec_json).map_err(spec_error)?;
            let config = config_from_json(&job.config_json)?;
            let shape_key = shape_key(&spec.model, &config);
            self.store
                .record_peak(&shape_key, running.estimate_bytes as i64, measured, now)
                .await?;
            self.lookups.peak_corrections.invalidate(&shape_key);
        }
        if outcome == "interrupted" {
            if !is_terminal(&job.state) {
                self.retry_after_infrastructure_failure(
                    &mut job,
                    attempt.attempt_number,
                    &format!(
                        "attempt {} was interrupted: {}",
                        attempt.attempt_number, finished.message
                    ),
                    now,
                )
                .await?;
            }
        } else if !is_terminal(&job.state) {
            let event = match outcome {
                "succeeded" => JobEvent::AttemptSucceeded,
                "cancelled" => JobEvent::CancelRequested,
                _ => JobEvent::AttemptFailed,
            };
            let previous = transition(&mut job, event)?;
            job.finished_at_ms = Some(now);
            if outcome == "failed" {
                job.message = format!(
                    "attempt {} failed: {}",
                    attempt.attempt_number, finished.message
                );
            }
            self.update_job(&job).await?;
            Metrics::count(match outcome {
                "succeeded" => &self.metrics.jobs_succeeded,
                "cancelled" => &self.metrics.jobs_cancelled,
                _ => &self.metrics.jobs_failed,
            });
            self.emit_state(&job.id, &previous, outcome, &finished.message);
        }
        self.wake();
        Ok(())
    }

    /// Workers silent for longer than the lease lose their attempts, which go back to
    /// the queue and resume from their last checkpoint.
    ///
    /// A scheduler that could not run this check for half a lease (its host stalled, or
    /// it was starved) cannot tell silent workers from heartbeats it did not get to
    /// read: it gives every worker a fresh lease instead of declaring any lost.
    pub async fn expire_leases(&self) -> Result<(), SchedulerError> {
        let lease = self.settings.lease_duration;
        let checked_at = Instant::now();
        let previous_check = self
            .last_lease_check
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .replace(checked_at);
        if previous_check.is_some_and(|previous| checked_at - previous > lease / 2) {
            tracing::warn!(
                since_last_check = ?previous_check.map(|previous| checked_at - previous),
                "the lease check was late: every worker gets a fresh lease"
            );
            for worker in self.live().workers.values_mut() {
                worker.last_heartbeat = worker.last_heartbeat.max(checked_at);
            }
            return Ok(());
        }
        let expired: Vec<String> = {
            let live = self.live();
            live.workers
                .iter()
                .filter(|(_, worker)| {
                    worker.state != WorkerLiveness::Lost && worker.last_heartbeat.elapsed() > lease
                })
                .map(|(id, _)| id.clone())
                .collect()
        };
        if expired.is_empty() {
            return Ok(());
        }
        let _guard = self.job_changes.lock().await;
        let now = now_ms();
        for worker_id in expired {
            let lost_attempts: Vec<(String, RunningAttempt)> = {
                let mut live = self.live();
                if let Some(worker) = live.workers.get_mut(&worker_id) {
                    worker.state = WorkerLiveness::Lost;
                    if let Some(session) = worker.session.take() {
                        session.end(SchedulerError::Unavailable(format!(
                            "no heartbeat for longer than the lease ({lease:?}): this \
                             worker's attempts were requeued; register again"
                        )));
                    }
                }
                let lost: Vec<String> = live
                    .running
                    .iter()
                    .filter(|(_, running)| running.worker_id == worker_id)
                    .map(|(job_id, _)| job_id.clone())
                    .collect();
                lost.into_iter()
                    .filter_map(|job_id| {
                        live.running
                            .remove(&job_id)
                            .map(|running| (job_id, running))
                    })
                    .collect()
            };
            self.store.set_worker_state(&worker_id, "lost").await?;
            for (job_id, running) in lost_attempts {
                Metrics::count(&self.metrics.attempts_lost);
                let fenced = self
                    .store
                    .finish_attempt(
                        &job_id,
                        i64::from(running.attempt_number),
                        running.lease_epoch as i64,
                        "lost",
                        None,
                        None,
                        &format!("worker {worker_id} stopped heartbeating"),
                        now,
                    )
                    .await;
                if let Err(error) = fenced
                    && !matches!(error, SchedulerError::Conflict(_))
                {
                    return Err(error);
                }
                let mut job = self.store.get_job(&job_id).await?;
                if !is_terminal(&job.state) {
                    self.retry_after_infrastructure_failure(
                        &mut job,
                        running.attempt_number,
                        &format!(
                            "lease lost: worker {worker_id} stopped heartbeating during \
                             attempt {}",
                            running.attempt_number
                        ),
                        now,
                    )
                    .await?;
                }
            }
        }
        self.wake();
        Ok(())
    }

    /// After an attempt died of an infrastructure failure (its outcome, `lost` or
    /// `interrupted`, already stored): the job goes back to the queue to resume from its
    /// checkpoint after a backoff that doubles with each such failure, or fails once it
    /// has had [`INFRASTRUCTURE_RETRIES`] retries. Called under `job_changes`.
    async fn retry_after_infrastructure_failure(
        &self,
        job: &mut JobRecord,
        attempt_number: u32,
        what_happened: &str,
        now: i64,
    ) -> Result<(), SchedulerError> {
        let failures = self
            .store
            .list_attempts(&job.id)
            .await?
            .iter()
            .filter(|attempt| matches!(attempt.outcome.as_str(), "lost" | "interrupted"))
            .count()
            .max(1);
        if failures > INFRASTRUCTURE_RETRIES {
            let previous = transition(job, JobEvent::AttemptFailed)?;
            job.message = format!(
                "{what_happened}; it was the job's {failures}th infrastructure failure, and \
                 it is retried only {INFRASTRUCTURE_RETRIES} times"
            );
            job.finished_at_ms = Some(now);
            self.update_job(job).await?;
            Metrics::count(&self.metrics.jobs_failed);
            self.emit_state(&job.id, &previous, "failed", &job.message);
            return Ok(());
        }
        let backoff = self
            .settings
            .infrastructure_retry_backoff
            .saturating_mul(1 << (failures - 1));
        let previous = transition(job, JobEvent::AttemptLost)?;
        job.waiting_reason = format!(
            "backing off for {backoff:?} after an infrastructure failure ({failures} of \
             {INFRASTRUCTURE_RETRIES} retries)"
        );
        self.live()
            .backing_off
            .insert(job.id.clone(), Instant::now() + backoff);
        self.update_job(job).await?;
        self.emit_state(
            &job.id,
            &previous,
            "queued",
            &format!(
                "{what_happened}; attempt {} resumes from the checkpoint after {backoff:?}",
                attempt_number + 1
            ),
        );
        Ok(())
    }

    /// One pass: place what fits, record why the rest waits.
    ///
    /// The pass solves over its copy of the queue (`queue::QueueMirror`), reading from the
    /// store only the jobs queued since the last pass (one range of the
    /// `(state, submit_sequence)` index) and the whole queue only when the copy
    /// disagrees with the store's fingerprint; it loads the whole record of the few jobs
    /// it places, and writes only waiting reasons that changed, grouped by reason. It is
    /// skipped when nothing it decides from changed since the last pass that finished (no
    /// wake-up, the same queue, GPUs and tenants): `solve` is a pure function, so it
    /// would decide the same again.
    pub async fn schedule_once(&self) -> Result<usize, SchedulerError> {
        let _guard = self.job_changes.lock().await;
        let result = self.schedule_once_locked().await;
        if result.is_err() {
            // Half a pass may have left the copy behind the store: read it whole again.
            self.queue().invalidate();
        }
        result
    }

    async fn schedule_once_locked(&self) -> Result<usize, SchedulerError> {
        // Read before anything else, so that a wake-up during the pass causes another.
        let wake_generation = self.wake_generation.load(Ordering::Acquire);
        let queue = self.store.queue_fingerprint().await?;
        if queue.queued_jobs == 0 {
            let mut mirror = self.queue();
            if mirror.len() != 0 {
                // Emptied by someone else (another replica): start again from the store.
                mirror.invalidate();
            }
            return Ok(0);
        }
        let tenants = self.store.list_tenants().await?;
        let mut gpus = self.gpu_states();
        gpus.sort_by(|left, right| {
            (&left.worker_id, &left.gpu_id).cmp(&(&right.worker_id, &right.gpu_id))
        });
        let (usage, running_counts) = {
            let live = self.live();
            let mut usage: HashMap<String, u64> = HashMap::new();
            let mut counts: HashMap<String, u32> = HashMap::new();
            for running in live.running.values() {
                *usage.entry(running.tenant.clone()).or_default() += running.slice_bytes;
                *counts.entry(running.tenant.clone()).or_default() += 1;
            }
            (usage, counts)
        };
        let mut tenant_states: Vec<TenantState> = tenants
            .iter()
            .map(|tenant| TenantState {
                tenant: tenant.name.clone(),
                weight: tenant.fair_share_weight.max(1) as u32,
                vram_quota_bytes: tenant.vram_quota_bytes.map(|bytes| bytes as u64),
                running_jobs_quota: tenant.max_running_jobs.map(|count| count as u32),
                vram_in_use_bytes: usage.get(&tenant.name).copied().unwrap_or(0),
                running_jobs: running_counts.get(&tenant.name).copied().unwrap_or(0),
            })
            .collect();
        tenant_states.sort_by(|left, right| left.tenant.cmp(&right.tenant));
        let backing_off: Vec<String> = {
            let mut live = self.live();
            let now = Instant::now();
            live.backing_off.retain(|_, until| *until > now);
            let mut jobs: Vec<String> = live.backing_off.keys().cloned().collect();
            jobs.sort();
            jobs
        };
        let inputs = PassInputs {
            wake_generation,
            queue,
            gpus: gpus.clone(),
            tenants: tenant_states.clone(),
            backing_off: backing_off.clone(),
        };
        if self.last_pass_inputs().as_ref() == Some(&inputs) {
            return Ok(0);
        }
        self.refresh_queue(&queue).await?;
        let problem = SchedulingProblem {
            gpus,
            tenants: tenant_states,
            pending: self
                .queue()
                .pending_jobs()
                .into_iter()
                .filter(|job| backing_off.binary_search(&job.job_id).is_err())
                .collect(),
        };
        let decision = solve(&problem);
        drop(problem);
        let now = now_ms();
        let mut placed = 0;
        for placement in &decision.placements {
            if !self.queue().contains(&placement.job_id) {
                continue;
            }
            // Only placed jobs need their whole record (spec, config, checkpoint).
            let mut job = self.store.get_job(&placement.job_id).await?;
            if job.state != "queued" {
                self.queue().remove(&job.id);
                continue;
            }
            let attempt_number = job.attempts_count + 1;
            let config = config_from_json(&job.config_json)?;
            // The estimate of the job's configuration is stored with it (admission and
            // OOM shrinks keep it current): nothing is validated or estimated here.
            let estimate_bytes = estimate_from_json(&job.estimate_json, None)?.required_bytes;
            transition(&mut job, JobEvent::Placed)?;
            job.attempts_count = attempt_number;
            job.waiting_reason.clear();
            let attempt = AttemptRecord {
                job_id: job.id.clone(),
                attempt_number,
                config_json: job.config_json.clone(),
                estimate_bytes: estimate_bytes as i64,
                slice_bytes: placement.slice_bytes as i64,
                worker_id: placement.worker_id.clone(),
                gpu_id: placement.gpu_id.clone(),
                lease_epoch: attempt_number,
                outcome: "running".into(),
                measured_peak_bytes: None,
                oom_json: None,
                message: String::new(),
                resumed_from: job.checkpoint_location.clone(),
                resumed_from_step: job.checkpoint_step,
                started_at_ms: now,
                finished_at_ms: None,
            };
            self.store.record_job_and_attempt(&job, &attempt).await?;
            self.queue().remove(&job.id);
            self.live().running.insert(
                job.id.clone(),
                RunningAttempt {
                    attempt_number: attempt_number as u32,
                    lease_epoch: attempt_number as u64,
                    worker_id: placement.worker_id.clone(),
                    gpu_id: placement.gpu_id.clone(),
                    slice_bytes: placement.slice_bytes,
                    tenant: job.tenant.clone(),
                    estimate_bytes,
                    measured_peak_bytes: 0,
                },
            );
            let checkpoint_location =
                format!("{}/{}.ckpt", self.settings.checkpoint_directory, job.id);
            self.send_to_worker(
                &placement.worker_id,
                v1::scheduler_message::Body::Assignment(v1::scheduler_message::Assignment {
                    attempt: Some(v1::AttemptRef {
                        job_id: job.id.clone(),
                        attempt_number: attempt_number as u32,
                        lease_epoch: attempt_number as u64,
                    }),
                    spec_json: job.spec_json.clone(),
                    config: Some(config.into()),
                    gpu_uuid: placement.gpu_id.clone(),
                    slice_bytes: placement.slice_bytes,
                    resume_from: Some(v1::Checkpoint {
                        step: job.checkpoint_step.max(0) as u64,
                        location: job
                            .checkpoint_location
                            .clone()
                            .unwrap_or(checkpoint_location),
                    }),
                }),
            );
            self.emit_state(
                &job.id,
                "queued",
                "placed",
                &format!("placed on {} ({})", placement.gpu_id, placement.worker_id),
            );
            self.emit(
                &job.id,
                v1::job_event::Event::AttemptStarted(attempt_to_proto(&attempt)),
            );
            placed += 1;
            Metrics::count(&self.metrics.placements);
        }
        // Reasons are compared as values first: most are what the last pass said, and
        // are not formatted again.
        let changed_reasons: Vec<(String, String)> = {
            let mut mirror = self.queue();
            let mut changed = Vec::new();
            for (job_id, reason) in decision.waiting {
                let Some(job) = mirror.get_mut(&job_id) else {
                    continue;
                };
                if job.decided.as_ref() == Some(&reason) {
                    continue;
                }
                let text = reason.to_string();
                if job.stored_reason != text {
                    job.stored_reason.clone_from(&text);
                    changed.push((job_id, text));
                }
                job.decided = Some(reason);
            }
            changed
        };
        self.store.set_waiting_reasons(&changed_reasons).await?;
        *self
            .last_pass_inputs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(inputs);
        Ok(placed)
    }

    /// Brings the pass's copy of the queue up to the store's, as `fingerprint` (read
    /// just before, under `job_changes`) describes it: the jobs queued since the last
    /// read, or the whole queue when the copy still disagrees.
    async fn refresh_queue(&self, fingerprint: &QueueFingerprint) -> Result<(), SchedulerError> {
        let through = fingerprint.highest_submit_sequence;
        let (loaded, after) = {
            let mirror = self.queue();
            (mirror.is_loaded(), mirror.read_through())
        };
        if loaded && after < through {
            let rows = self
                .store
                .queued_jobs_in_sequence_range(after, through)
                .await?;
            self.queue().add(rows, through);
        }
        if !self.queue().matches(fingerprint) {
            let rows = self
                .store
                .queued_jobs_in_sequence_range(i64::MIN, through)
                .await?;
            self.queue().replace_all(rows, through);
            self.queue_reloads.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// What the last pass that finished decided from.
    fn last_pass_inputs(&self) -> Option<PassInputs> {
        self.last_pass_inputs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    // ---- what the cluster service shows ----

    pub fn workers_proto(&self) -> Vec<v1::Worker> {
        let live = self.live();
        let mut workers: Vec<v1::Worker> = live
            .workers
            .iter()
            .map(|(worker_id, worker)| v1::Worker {
                id: worker_id.clone(),
                hostname: worker.record.hostname.clone(),
                state: match worker.state {
                    WorkerLiveness::Ready => v1::WorkerState::Ready,
                    WorkerLiveness::Draining => v1::WorkerState::Draining,
                    WorkerLiveness::Lost => v1::WorkerState::Lost,
                } as i32,
                gpus: worker
                    .gpus
                    .iter()
                    .map(|gpu| v1::Gpu {
                        slices: live
                            .running
                            .iter()
                            .filter(|(_, running)| {
                                running.worker_id == *worker_id && running.gpu_id == gpu.uuid
                            })
                            .map(|(job_id, running)| slice_proto(job_id, running))
                            .collect(),
                        ..gpu.clone()
                    })
                    .collect(),
                last_heartbeat_at: Some(timestamp(worker.record.last_heartbeat_ms)),
                registered_at: Some(timestamp(worker.record.registered_at_ms)),
                version: worker.record.version.clone(),
            })
            .collect();
        workers.sort_by(|left, right| left.id.cmp(&right.id));
        workers
    }

    pub async fn set_draining(
        &self,
        worker_id: &str,
        draining: bool,
    ) -> Result<(), SchedulerError> {
        let state = {
            let mut live = self.live();
            let worker =
                live.workers
                    .get_mut(worker_id)
                    .ok_or_else(|| SchedulerError::NotFound {
                        what: "worker",
                        id: worker_id.to_string(),
                    })?;
            worker.state = if draining {
                WorkerLiveness::Draining
            } else {
                WorkerLiveness::Ready
            };
            worker.state
        };
        self.store.set_worker_state(worker_id, state.name()).await?;
        if draining {
            self.send_to_worker(
                worker_id,
                v1::scheduler_message::Body::Drain(v1::scheduler_message::Drain {}),
            );
        }
        self.wake();
        Ok(())
    }

    pub fn slices_proto(&self) -> Vec<v1::Slice> {
        let live = self.live();
        let mut slices: Vec<v1::Slice> = live
            .running
            .iter()
            .map(|(job_id, running)| slice_proto(job_id, running))
            .collect();
        slices.sort_by(|left, right| left.id.cmp(&right.id));
        slices
    }

    /// The metrics page: counters plus gauges read now.
    pub async fn render_metrics(&self) -> String {
        let mut gauges = ClusterGauges {
            submit_groups_committed: self.batcher.groups_committed(),
            submit_jobs_committed: self.batcher.jobs_committed(),
            queue_full_reads: self.queue_reloads(),
            log_lines_stored: self.logs.lines_stored(),
            log_lines_dropped: self.logs.lines_dropped(),
            ..ClusterGauges::default()
        };
        // Counted by the database: a scrape must not load a million queued jobs.
        if let Ok(queued) = self.store.queued_jobs_by_tenant().await {
            for (tenant, count) in queued {
                gauges.queued_jobs.insert(tenant, count.max(0) as u64);
            }
        }
        {
            let live = self.live();
            for running in live.running.values() {
                *gauges
                    .running_jobs
                    .entry(running.tenant.clone())
                    .or_default() += 1;
                *gauges
                    .vram_allocated_bytes
                    .entry(running.tenant.clone())
                    .or_default() += running.slice_bytes;
                *gauges
                    .vram_estimated_bytes
                    .entry(running.tenant.clone())
                    .or_default() += running.estimate_bytes;
                *gauges
                    .vram_measured_bytes
                    .entry(running.tenant.clone())
                    .or_default() += running.measured_peak_bytes;
            }
            for worker in live.workers.values() {
                match worker.state {
                    WorkerLiveness::Lost => gauges.workers_lost += 1,
                    _ => gauges.workers_ready += 1,
                }
            }
        }
        self.metrics.render(&gauges)
    }

    /// VRAM in use and running jobs of a tenant now.
    pub fn tenant_usage(&self, tenant: &str) -> (u64, u32) {
        let live = self.live();
        live.running
            .values()
            .filter(|running| running.tenant == tenant)
            .fold((0, 0), |(bytes, count), running| {
                (bytes + running.slice_bytes, count + 1)
            })
    }
}

/// The job log line an event makes, if any: a worker's line under its attempt number, or
/// one of the scheduler's notes (attempt 0) telling the job's story — state changes with
/// their reasons, out-of-memory reports, shrink decisions and where attempts run.
/// Progress is left out: it is frequent and `carve get` shows the latest.
fn log_line_for_event(
    job_id: &str,
    time_ms: i64,
    event: &v1::job_event::Event,
) -> Option<crate::store::NewLogLine> {
    use carve_core::bytes::HumanBytes;
    use v1::job_event::Event;
    let (attempt_number, level, message) = match event {
        Event::Log(line) => (
            line.attempt_number,
            line.level.as_str(),
            line.message.clone(),
        ),
        Event::StateChanged(changed) => {
            let name = |state: i32| {
                v1::JobState::try_from(state)
                    .ok()
                    .and_then(crate::convert::job_state_from_proto)
                    .unwrap_or("unknown")
            };
            let (previous, state) = (name(changed.previous_state), name(changed.state));
            let level = match (previous, state) {
                (_, "failed") => "error",
                (_, "cancelled") => "warn",
                // Back in the queue from a slice: an OOM retry or a lost lease.
                ("placed" | "running", "queued") => "warn",
                _ => "info",
            };
            let message = match (previous == state, changed.reason.is_empty()) {
                (true, _) => format!("job {}", changed.reason),
                (false, true) => format!("{previous} -> {state}"),
                (false, false) => format!("{previous} -> {state}: {}", changed.reason),
            };
            (0, level, message)
        }
        Event::Oom(oom) => {
            let report: OutOfMemory = oom.report.unwrap_or_default().into();
            (
                0,
                "warn",
                format!("attempt {} ran {report}", oom.attempt_number),
            )
        }
        Event::Shrink(decision) => {
            let steps: Vec<&str> = decision
                .steps
                .iter()
                .map(|step| step.description.as_str())
                .collect();
            let estimate = decision
                .estimate
                .as_ref()
                .map_or(0, |estimate| estimate.required_bytes);
            (
                0,
                "info",
                format!(
                    "shrink decision: {} (needs {} of a {} budget)",
                    if steps.is_empty() {
                        "no change".to_string()
                    } else {
                        steps.join("; ")
                    },
                    HumanBytes(estimate),
                    HumanBytes(decision.budget_bytes)
                ),
            )
        }
        Event::AttemptStarted(attempt) => {
            let resume = attempt
                .resumed_from
                .as_ref()
                .filter(|checkpoint| !checkpoint.location.is_empty())
                .map(|checkpoint| format!(", from checkpoint {}", checkpoint.location))
                .unwrap_or_default();
            (
                0,
                "info",
                format!(
                    "attempt {} assigned: a {} slice of {} on {} (estimated need {}){resume}",
                    attempt.number,
                    HumanBytes(attempt.slice_bytes),
                    attempt.gpu_uuid,
                    attempt.worker_id,
                    HumanBytes(attempt.estimate_bytes)
                ),
            )
        }
        Event::AttemptFinished(attempt) => {
            let outcome = v1::AttemptOutcome::try_from(attempt.outcome)
                .map_or("unknown", |outcome| outcome.as_str_name());
            (
                0,
                "info",
                format!("attempt {} ended: {outcome}", attempt.number),
            )
        }
        Event::Progress(_) => return None,
    };
    Some(crate::store::NewLogLine::normalized(
        job_id,
        time_ms,
        i64::from(attempt_number),
        level,
        &message,
    ))
}

fn slice_proto(job_id: &str, running: &RunningAttempt) -> v1::Slice {
    v1::Slice {
        id: format!("{job_id}/{}", running.attempt_number),
        gpu_uuid: running.gpu_id.clone(),
        bytes: running.slice_bytes,
        job_id: job_id.to_string(),
        attempt_number: running.attempt_number,
        worker_id: running.worker_id.clone(),
        tenant: running.tenant.clone(),
    }
}

/// How a worker's GPUs are kept in the store (JSON, not the wire format).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct GpuJson {
    uuid: String,
    index: u32,
    model_name: String,
    total_bytes: u64,
    context_bytes: u64,
    simulated: bool,
    compute_capability: String,
}

impl GpuJson {
    fn from_proto(gpu: &v1::Gpu) -> GpuJson {
        GpuJson {
            uuid: gpu.uuid.clone(),
            index: gpu.index,
            model_name: gpu.model_name.clone(),
            total_bytes: gpu.total_bytes,
            context_bytes: gpu.context_bytes,
            simulated: gpu.simulated,
            compute_capability: gpu.compute_capability.clone(),
        }
    }

    fn into_proto(self) -> v1::Gpu {
        v1::Gpu {
            uuid: self.uuid,
            index: self.index,
            model_name: self.model_name,
            total_bytes: self.total_bytes,
            context_bytes: self.context_bytes,
            free_bytes: self.total_bytes.saturating_sub(self.context_bytes),
            simulated: self.simulated,
            slices: Vec::new(),
            compute_capability: self.compute_capability,
        }
    }
}
