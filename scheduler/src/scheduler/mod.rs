//! The scheduler's state and its decisions: admission at submit, the scheduling pass
//! (core's pure `solve`), worker sessions, leases, OOM retries and cancellation.
//!
//! The store is the truth for jobs and attempts; memory holds what is live (worker
//! sessions, heartbeats, attempts running now), rebuilt from the store at start, and the
//! pass's copy of the queue (`queue`), read from the store by the first pass. On PostgreSQL one replica of several
//! leads (`leadership`); the others serve reads and submits. Every
//! change of a job's state happens under one async lock (`job_changes`), so a cancel, a
//! worker report and a scheduling pass never interleave on the same job, and goes
//! through `move_job` (core's state machine, the store update and the event together;
//! placement alone stores the job with its new attempt and announces it itself).
//!
//! One file per concern, each adding to `impl Scheduler`: `admission` (submit and its
//! lookups), `sessions` (workers and their reports), `outcomes` (how attempts and jobs
//! end), `placement` (the scheduling pass), `views` (what reads show), `logs` (events and
//! job logs) and `recovery` (the live state rebuilt at start). This file holds the state
//! they share and the small helpers they all use.

mod admin;
mod admission;
mod command_jobs;
pub mod job_images;
mod leadership;
mod logs;
mod memory_models;
mod outcomes;
mod placement;
mod preemption;
mod recovery;
pub mod sealed_secrets;
mod session_handles;
mod sessions;
mod usage;
mod usage_report;
mod views;
pub mod worker_reports;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use carve_core::job_state::{JobEvent, JobState, next_state};
use carve_core::scheduling::GpuState;
use carve_core::workload::Workload;
use carve_proto::ApiError;
use tokio::sync::{Notify, broadcast};
use tokio::time::Instant;

use crate::compute_pool::{ComputeLimits, ComputePool};
use crate::error::SchedulerError;
use crate::metrics::Metrics;
use crate::queue::QueueMirror;
use crate::store::{
    AttemptEnd, JobRecord, Store, SubmitBatcher, WorkerRecord, WorkerState, workload_from_json,
    workload_to_json,
};
pub use logs::{EncodeJobEvent, JobUpdate, JobUpdateKind};
use worker_reports::{Gpu, WorkerCommand};

pub use admin::CreatedToken;
use admission::Lookups;
pub use admission::{AdmittedConfig, SPEC_MAX_BYTES, SubmittedJob, check_spec_size};
pub use leadership::{Candidate, LeaderRole};
pub use memory_models::KnownMemoryModel;
use placement::PassInputs;
pub use preemption::PreemptionSettings;
use session_handles::LiveSession;
pub use session_handles::{SessionHandle, SessionSender};
pub use usage_report::{UsageAnswer, UsageRequest};
pub use views::{GpuView, JobPage, JobView, SliceOwner, SliceView, WorkerView};

/// Timing of leases and passes.
#[derive(Debug, Clone)]
pub struct SchedulerSettings {
    /// A worker silent for longer loses its attempts.
    pub lease_duration: Duration,
    pub heartbeat_interval: Duration,
    /// A pass also runs at least this often, besides every submit and report.
    pub scheduling_interval: Duration,
    /// The wait before a job whose attempt died of an infrastructure failure (a lost
    /// worker, an interrupted process) is placed again; it doubles with each such failure
    /// of the job.
    pub infrastructure_retry_backoff: Duration,
    /// When and how urgent jobs may evict lower-priority attempts.
    pub preemption: PreemptionSettings,
    /// Replicas on PostgreSQL: how long the leader's lease lasts without renewal, so
    /// about the longest a failover takes.
    pub leader_lease: Duration,
    /// Replicas on PostgreSQL: where this replica's gRPC API is reached, told to clients
    /// of standbys (`None`: `http://` and the address it listens on).
    pub advertise_endpoint: Option<String>,
    /// No command job's slice is sized below this many bytes, whatever its memory model
    /// measured (`carve_core::command::memory_model::learning::floored_slice_bytes`).
    pub min_slice_bytes: u64,
    /// Past usage counts half as much in fair share after this long (issue 32).
    pub fair_share_half_life: Duration,
    /// The key tenants' secrets are sealed with in the store (`--secrets-key-file`; none
    /// stores them as they are) and the keys it replaced, which still open them
    /// (`--secrets-previous-key-file`) ([`sealed_secrets`]).
    pub sealing: sealed_secrets::Sealing,
}

impl Default for SchedulerSettings {
    fn default() -> Self {
        SchedulerSettings {
            lease_duration: Duration::from_secs(30),
            heartbeat_interval: Duration::from_secs(5),
            scheduling_interval: Duration::from_secs(2),
            infrastructure_retry_backoff: Duration::from_secs(2),
            preemption: PreemptionSettings::default(),
            leader_lease: Duration::from_secs(10),
            advertise_endpoint: None,
            min_slice_bytes: carve_core::command::memory_model::learning::DEFAULT_SLICE_FLOOR_BYTES,
            fair_share_half_life: Duration::from_millis(
                carve_core::usage::DEFAULT_HALF_LIFE_MS as u64,
            ),
            sealing: sealed_secrets::Sealing::default(),
        }
    }
}

#[derive(Debug)]
struct LiveWorker {
    record: WorkerRecord,
    gpus: Vec<Gpu>,
    state: WorkerState,
    last_heartbeat: Instant,
    session: Option<LiveSession>,
}

/// An attempt that holds a slice now.
#[derive(Debug, Clone)]
struct RunningAttempt {
    attempt_number: u32,
    /// Always the attempt's number (an attempt is never reassigned): sent as the wire's
    /// deprecated `AttemptRef.lease_epoch`, which older workers echo; never compared.
    lease_epoch: u64,
    worker_id: String,
    gpu_id: String,
    slice_bytes: u64,
    tenant: String,
    estimate_bytes: u64,
    /// The peak the attempt last reported in its progress.
    measured_peak_bytes: u64,
    /// Its latest progress report: job reads show it (it is not stored), and an attempt
    /// that ends without saying how far it got is stored with its step.
    latest_progress: Option<worker_reports::TrainingProgress>,
    /// The job's priority: preemption evicts lower ones first.
    priority: i32,
    /// When the attempt was placed: preemption spares attempts younger than its minimum
    /// run time.
    started_at_ms: i64,
}

impl RunningAttempt {
    /// What is known of the attempt's results without its word: how far its progress
    /// got. An attempt that runs out of memory or loses its worker is stored with it.
    fn results_so_far(&self) -> crate::store::AttemptResults {
        crate::store::AttemptResults {
            steps_done: self
                .latest_progress
                .map(|progress| i64::try_from(progress.step).unwrap_or(i64::MAX)),
            ..Default::default()
        }
    }
}

#[derive(Debug, Default)]
struct Live {
    workers: HashMap<String, LiveWorker>,
    /// By job id: a job has at most one attempt running.
    running: HashMap<String, RunningAttempt>,
    /// Queued jobs backing off after an infrastructure failure, by job id: passes leave
    /// them out until then. Not stored: a restarted scheduler retries them at once.
    backing_off: HashMap<String, Instant>,
    /// Preemptions under way and their history (see `preemption`).
    preemption: preemption::PreemptionLedger,
}

impl Live {
    /// The live worker with this id, or `NotFound`.
    fn worker_mut(&mut self, worker_id: &str) -> Result<&mut LiveWorker, SchedulerError> {
        self.workers
            .get_mut(worker_id)
            .ok_or_else(|| SchedulerError::not_found("worker", worker_id))
    }

    /// The id of the worker `reference` names: a worker id, or the node name (hostname)
    /// of exactly one worker that is not lost, since operators know their nodes by name.
    fn resolve_worker(&self, reference: &str) -> Result<String, SchedulerError> {
        if self.workers.contains_key(reference) {
            return Ok(reference.to_string());
        }
        let mut named: Vec<&String> = self
            .workers
            .iter()
            .filter(|(_, worker)| {
                worker.record.hostname == reference && worker.state != WorkerState::Lost
            })
            .map(|(id, _)| id)
            .collect();
        named.sort();
        match named.as_slice() {
            [id] => Ok((*id).clone()),
            [] => Err(SchedulerError::not_found("worker", reference)),
            several => Err(SchedulerError::invalid_argument(
                "worker_id",
                format!(
                    "node {reference} has {} workers ({}); name one by its id",
                    several.len(),
                    several
                        .iter()
                        .map(|id| id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        }
    }
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
    /// Progress events held back to at most one a second per job (`logs.rs`).
    progress_pacing: logs::ProgressPacing,
    pub settings: SchedulerSettings,
    live: Mutex<Live>,
    job_changes: tokio::sync::Mutex<()>,
    wake: Notify,
    events: broadcast::Sender<JobUpdate>,
    /// How an event's log line stores it (see [`EncodeJobEvent`]).
    encode_event: EncodeJobEvent,
    event_sequence: AtomicU64,
    pub metrics: Metrics,
    stopping: tokio::sync::watch::Sender<bool>,
    /// Counts wake-ups, so a pass knows whether anything asked for one since the last.
    wake_generation: AtomicU64,
    last_pass_inputs: Mutex<Option<PassInputs>>,
    /// Ended attempts' decayed usage for fair share over time (see `usage`).
    usage_history: Mutex<Option<usage::UsageHistory>>,
    /// The pass's copy of the queue (see `queue`): touched only under `job_changes`.
    queue: Mutex<QueueMirror>,
    /// Workers' image caches and pulls under way (see `job_images`).
    images: Mutex<job_images::LiveImages>,
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
    /// Whether this replica leads (see `leadership`).
    role: Mutex<LeaderRole>,
    /// While it leads on PostgreSQL: the moment its own lease could first pass to another
    /// replica, less a margin; past it this replica acts as a standby though nobody told
    /// it so (see `leadership::Scheduler::leader_role`).
    lease_fenced_at: Mutex<Option<Instant>>,
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as i64)
}

/// A job's change of state, as its StateChanged event tells it.
#[derive(Debug, Clone, Copy)]
struct StateChange {
    previous: JobState,
    next: JobState,
}

/// Moves a job to its next state through core's state machine, the one place that says
/// which transitions exist. Only the record in memory changes: `Scheduler::move_job`
/// also stores it and announces it.
fn transition(job: &mut JobRecord, event: JobEvent) -> Result<StateChange, SchedulerError> {
    let previous = job.state;
    let next = next_state(previous, event)
        .map_err(|error| ApiError::FailedPrecondition(error.to_string()))?;
    job.state = next;
    Ok(StateChange { previous, next })
}

fn spec_error(error: ApiError) -> SchedulerError {
    match error {
        invalid @ ApiError::InvalidArgument { .. } => SchedulerError::Api(invalid),
        other => SchedulerError::invalid_argument("spec_json", other.to_string()),
    }
}

impl Scheduler {
    /// A scheduler over `store`; `encode_event` is how a job event's log line stores it
    /// (`convert::job_update_to_stored_event`: the wire's encoding, which the scheduler
    /// does not name).
    pub fn new(
        store: Store,
        settings: SchedulerSettings,
        encode_event: EncodeJobEvent,
    ) -> Scheduler {
        let batcher = SubmitBatcher::spawn(store.clone());
        let logs = crate::store::LogBatcher::spawn(store.clone());
        let (events, _) = broadcast::channel(4096);
        Scheduler {
            store,
            batcher,
            logs,
            progress_pacing: logs::ProgressPacing::default(),
            settings,
            live: Mutex::new(Live::default()),
            images: Mutex::new(job_images::LiveImages::default()),
            job_changes: tokio::sync::Mutex::new(()),
            wake: Notify::new(),
            events,
            encode_event,
            event_sequence: AtomicU64::new(1),
            metrics: Metrics::default(),
            stopping: tokio::sync::watch::Sender::new(false),
            wake_generation: AtomicU64::new(0),
            last_pass_inputs: Mutex::new(None),
            usage_history: Mutex::new(None),
            queue: Mutex::new(QueueMirror::default()),
            queue_reloads: AtomicU64::new(0),
            lookups: Lookups::new(),
            session_ids: AtomicU64::new(1),
            revoked_tokens: broadcast::channel(64).0,
            compute: ComputePool::new(ComputeLimits::default()),
            last_lease_check: Mutex::new(None),
            last_session_token_check: Mutex::new(None),
            role: Mutex::new(LeaderRole::Alone),
            lease_fenced_at: Mutex::new(None),
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

    /// A stored job's workload: from memory when admission or an earlier read left it
    /// there (`Lookups::workloads`), else the validated form admission stored with the
    /// job (`workload_json`), decoded as it was validated, nothing parsed or checked
    /// again; restarts included. Only a job stored without one (before the column, or in
    /// an older form) has its spec read, once, as the kind stored with it: the form is
    /// then stored for every later read (`carve_stored_spec_reads` counts these). An
    /// error here means the store holds something this build cannot read. Decoding a
    /// model job's graph, or inferring it, grows with the model: the compute pool runs
    /// it (the scheduler's own work, charged to no tenant's budget).
    async fn stored_workload(&self, job: &JobRecord) -> Result<Arc<Workload>, SchedulerError> {
        if let Some(workload) = self.lookups.workloads.get(&job.id) {
            return Ok(workload);
        }
        if let Some(text) = self.store.job_workload_json(&job.id).await? {
            let (kind, job_id) = (job.kind, job.id.clone());
            let decoded = self
                .compute
                .run_for_scheduler(move || workload_from_json(kind, &text))
                .await?
                .map_err(|error| error.of_job(&job_id))?;
            if let Some(workload) = decoded {
                let workload = Arc::new(workload);
                self.lookups
                    .workloads
                    .insert(job.id.clone(), Arc::clone(&workload));
                return Ok(workload);
            }
        }
        Metrics::count(&self.metrics.stored_spec_reads);
        let (kind, spec_json) = (job.kind, job.spec_json.clone());
        let job_id = job.id.clone();
        let workload = self
            .compute
            .run_for_scheduler(move || Workload::from_stored(kind, &spec_json))
            .await?
            .map_err(|error| {
                SchedulerError::from(ApiError::Internal(format!(
                    "job {job_id}: its stored spec cannot be read: spec.{}: {}",
                    error.field, error.reason
                )))
            })?;
        // Stored so that no later read, in this life or the next, reads the spec again.
        // A failed write costs only that: the next read parses the spec once more.
        if let Err(error) = self
            .store
            .backfill_job_workload(&job.id, &workload_to_json(&workload))
            .await
        {
            tracing::warn!(job = %job.id, %error, "could not store the job's validated workload");
        }
        let workload = Arc::new(workload);
        self.lookups
            .workloads
            .insert(job.id.clone(), Arc::clone(&workload));
        Ok(workload)
    }

    /// Makes a job's change of state: its transition through core's state machine on
    /// `event`, the store update (with whatever else the caller changed in `job`), and
    /// the StateChanged event with `reason`. Called under `job_changes`; nothing is stored
    /// or sent when the transition does not exist.
    async fn move_job(
        &self,
        job: &mut JobRecord,
        event: JobEvent,
        reason: &str,
    ) -> Result<StateChange, SchedulerError> {
        let change = transition(job, event)?;
        self.update_job(job).await?;
        self.emit_state(&job.id, change, reason);
        Ok(change)
    }

    /// Ends an attempt and stores its job in one transaction ([`Store::end_attempt`]):
    /// moved by `event` through core's state machine when one is given (nothing is stored
    /// when the transition does not exist), or as it is (with whatever the caller changed)
    /// when not. Either both are stored or neither is, so a failure between them cannot
    /// leave a job placed or running with its attempt ended. The caller announces the
    /// returned change (`emit_state`) once it has said what led to it. Called under
    /// `job_changes`.
    async fn end_attempt_with_job(
        &self,
        end: &AttemptEnd,
        job: &mut JobRecord,
        event: Option<JobEvent>,
    ) -> Result<Option<StateChange>, SchedulerError> {
        let change = event.map(|event| transition(job, event)).transpose()?;
        let result = self.store.end_attempt(end, Some(job)).await;
        match &result {
            Ok(()) => self.queue().note(job),
            Err(_) => self.queue().invalidate(),
        }
        result?;
        Ok(change)
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
                session.end(SchedulerError::Api(ApiError::Unavailable(
                    "the scheduler is stopping; reconnect to another".into(),
                )));
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

    pub fn subscribe(&self) -> broadcast::Receiver<JobUpdate> {
        self.events.subscribe()
    }

    /// Ids of tokens as they are revoked through this scheduler: a stream opened with
    /// one ends.
    pub fn subscribe_revocations(&self) -> broadcast::Receiver<String> {
        self.revoked_tokens.subscribe()
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

    /// GPUs of workers that are not lost, with the slices running on them.
    fn gpu_states(&self) -> Vec<GpuState> {
        let live = self.live();
        let mut gpus = Vec::new();
        for (worker_id, worker) in &live.workers {
            if worker.state == WorkerState::Lost {
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
                    schedulable: worker.state == WorkerState::Ready && worker.session.is_some(),
                });
            }
        }
        gpus
    }

    fn send_to_worker(&self, worker_id: &str, command: WorkerCommand) -> bool {
        let session = self.live().workers.get(worker_id).and_then(|worker| {
            worker
                .session
                .as_ref()
                .map(|session| session.sender.clone())
        });
        match session {
            Some(session) => session.try_send(Ok(command)).is_ok(),
            None => false,
        }
    }
}
