//! The worker's main loop: registers its GPUs, holds the session with the scheduler
//! (hello, heartbeats, reports, acknowledgements), starts and stops attempt processes
//! as the scheduler assigns and cancels, and reconnects with backoff when the scheduler
//! goes away. Attempts keep running while the worker is disconnected; their reports
//! wait in a queue and go out after the reconnect, so nothing is lost.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use carve_core::workload::{JobKind, Workload};
use carve_proto::ApiError;
use carve_proto::client::{BearerToken, ClientIdentity, connect, failover_endpoints};
use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use carve_proto::v1::worker_service_client::WorkerServiceClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::attempt_limits::{
    MaxDuration, RunLimits, effective_max_duration, run_attempt_limits,
    shortened_max_duration_warning,
};
use crate::attempt_process::AttemptControl;
use crate::error::WorkerError;
use crate::gang_member::{GangPorts, GangSettings, advertise_address};
use crate::gpus::{SimulatedGpu, SliceBook, WorkerGpu, discover_gpus};
use crate::guard_environment::{find_guard_library, find_simulated_guard_library};
use crate::leader_lease::{LeaderLease, stop_attempts_without_a_leader};
use crate::leftover_processes::record_directory;
use crate::sandbox::{Sandbox, SandboxSettings};
use crate::simulated_gpu_ledger::SimulatedGpuLedger;
use crate::watchdog::{SystemWatchSource, run_watchdog};

mod command_launch;
mod model_launch;
mod scheduler_choice;
mod session;
mod startup;
mod watched;

use scheduler_choice::SchedulerChoice;
pub use scheduler_choice::{ANSWERED_BACKOFF_MAX, AttemptEnd, EndpointReason, SessionAttempt};

use startup::{find_real_gpus, kill_leftovers_of_a_previous_life, serve_simulated_gpus};
use watched::{WorkerAttempts, WorkerLimitedAttempts};

/// Everything the worker needs to start.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// `http://host:port` of the scheduler, or several, comma-separated (replicas on
    /// PostgreSQL): the worker holds its session with the leader, going to the one a
    /// standby names, and to the next listed when one fails or names none (see
    /// `carve_proto::client::failover_endpoints` and `worker/scheduler_choice.rs`).
    pub scheduler_url: String,
    /// A WORKER bearer token.
    pub token: String,
    /// The node's name, as registration reports it; also part of simulated GPU uuids.
    pub hostname: String,
    /// GPUs to simulate, offered after the real ones NVML finds (or alone without NVML).
    pub simulated_gpus: Vec<SimulatedGpu>,
    /// Whether to look for real GPUs through NVML (on by default; tests that want only
    /// simulated GPUs, whatever the machine has, turn it off).
    pub discover_real_gpus: bool,
    /// What each attempt process takes outside its slice, on real and simulated GPUs.
    pub context_bytes: u64,
    /// Where attempts write checkpoints (`{job id}.attempt-{N}.ckpt`) and their spec
    /// files, and where the worker records the attempt processes it runs
    /// (`attempt-processes/{hostname}/`).
    pub checkpoint_directory: PathBuf,
    /// The program to run for an attempt (`PROGRAM attempt ...`): this binary, normally
    /// `std::env::current_exe()`.
    pub attempt_program: PathBuf,
    /// The first wait before reconnecting; it doubles up to `reconnect_backoff_max` while
    /// no replica answers, and only up to [`ANSWERED_BACKOFF_MAX`] while one does.
    pub reconnect_backoff_initial: Duration,
    pub reconnect_backoff_max: Duration,
    /// Told about every attempt at a session before it is made: where it goes, why, and
    /// how long the worker waited first (tests read which endpoints were tried).
    pub session_observer: Option<mpsc::UnboundedSender<SessionAttempt>>,
    /// Told about every attempt process the worker starts (tests use it to find pids).
    pub process_observer: Option<mpsc::UnboundedSender<StartedAttemptProcess>>,
    /// The certificate (PEM) to trust for an `https://` scheduler, for private CAs and
    /// self-signed certificates; without it the system's roots are trusted.
    pub scheduler_ca_certificate_pem: Option<Vec<u8>>,
    /// This worker's client certificate and key (`--tls-cert`, `--tls-key`), for a
    /// scheduler that requires client certificates (`--tls-client-ca`).
    pub client_identity: Option<ClientIdentity>,
    /// The guard (`libcarve_guard.so`) preloaded into command jobs' programs
    /// (`--guard-library`); `None`: next to `attempt_program`. Checked at start on a
    /// worker with real GPUs (see [`crate::guard_environment::find_guard_library`]); on
    /// simulated GPUs used when it passes the check, else their programs run without it
    /// ([`crate::guard_environment::find_simulated_guard_library`]).
    pub guard_library: Option<PathBuf>,
    /// How attempts are contained (`--oci-runtime`, `--insecure-no-sandbox`, the limits;
    /// see [`crate::sandbox`]).
    pub sandbox: SandboxSettings,
    /// What the worker itself holds every attempt to, contained or not: its wall-clock
    /// limit and the size of its directories (`--attempt-max-duration`,
    /// `--attempt-checkpoint-limit`; see [`crate::attempt_limits`]).
    pub run_limits: RunLimits,
    /// Whether simulated GPUs keep their memory in a ledger outside the programs
    /// (`simulated_gpu_ledger.rs`, reached by the fake driver) and get the watchdog over
    /// it, as real GPUs get it over NVML. On by default; a test turns it off to show what
    /// the watchdog stops.
    pub watch_simulated_gpus: bool,
    /// Gangs (issue 31): the address reported for rank-0 members and the master ports
    /// offered (`--advertise-address`, `--gang-ports`; see [`crate::gang_member`]).
    pub gang: GangSettings,
}

/// The default context reservation, on real and simulated GPUs alike: what an attempt
/// process takes outside its slice — the CUDA context, cuDNN and cuBLAS handles, the
/// compiled kernels. Measured with NVML's per-process usage on an H200 (driver 580, CUDA
/// 13.0, cuDNN 9.19, cuBLAS 13): 594-596 MiB beyond the slice's allocation, for a
/// ResNet-style CNN and for an attempt that ran out of memory early; rounded up for
/// cuBLAS' own workspace. It varies with the driver and libraries, so operators can set
/// `--context-bytes` from their own reading (`nvidia-smi --query-compute-apps`).
pub const DEFAULT_CONTEXT_BYTES: u64 = 640 << 20;

impl WorkerConfig {
    /// A config with the defaults for everything but the scheduler and the GPUs.
    pub fn new(
        scheduler_url: impl Into<String>,
        token: impl Into<String>,
        simulated_gpus: Vec<SimulatedGpu>,
        attempt_program: PathBuf,
    ) -> WorkerConfig {
        WorkerConfig {
            scheduler_url: scheduler_url.into(),
            token: token.into(),
            hostname: "localhost".into(),
            simulated_gpus,
            discover_real_gpus: true,
            context_bytes: DEFAULT_CONTEXT_BYTES,
            checkpoint_directory: PathBuf::from("checkpoints"),
            attempt_program,
            reconnect_backoff_initial: Duration::from_millis(100),
            reconnect_backoff_max: Duration::from_secs(5),
            session_observer: None,
            process_observer: None,
            scheduler_ca_certificate_pem: None,
            client_identity: None,
            guard_library: None,
            sandbox: SandboxSettings::default(),
            run_limits: RunLimits::default(),
            watch_simulated_gpus: true,
            gang: GangSettings::default(),
        }
    }
}

/// An attempt process the worker started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartedAttemptProcess {
    pub job_id: String,
    pub attempt_number: u32,
    pub process_id: u32,
}

/// One attempt that runs now.
#[derive(Debug)]
struct RunningAttempt {
    attempt: v1::AttemptRef,
    control: mpsc::UnboundedSender<AttemptControl>,
    gpu_uuid: String,
    process_id: u32,
    slice_bytes: u64,
    /// The guard account of an attempt whose program runs under the guard; `None` for
    /// engine attempts (see [`crate::watchdog::WatchedAttempt::guard_account`]).
    guard_account: Option<PathBuf>,
    /// The `cgroup.procs` file of the container its program runs in; `None` when it is
    /// not contained (see [`crate::watchdog::WatchedAttempt::container_processes`]).
    container_processes: Option<PathBuf>,
    /// When the worker started it, what its wall clock counts from.
    started: Instant,
    /// Its wall-clock limit, the job's or the worker's ([`effective_max_duration`]).
    max_duration: Option<MaxDuration>,
    /// The directories its program may write: the job's ([`job_directory`]) and its own
    /// ([`attempt_directory`]), which `--attempt-checkpoint-limit` bounds together.
    directories: Vec<PathBuf>,
}

/// The attempts the leaderless stopper may stop ([`crate::leader_lease`]).
fn stoppable_attempts(shared: &Shared) -> Vec<crate::leader_lease::StoppableAttempt> {
    lock(shared)
        .running
        .values()
        .map(|running| (running.attempt.clone(), running.control.clone()))
        .collect()
}

/// What the session loop and the attempt watchers share.
#[derive(Debug, Default)]
struct SharedState {
    slices: SliceBook,
    /// By [`attempt_key`]: after a reconnect an old attempt of a job may still be
    /// stopping while its new attempt starts here.
    running: HashMap<String, RunningAttempt>,
}

type Shared = Arc<Mutex<SharedState>>;

/// The checkpoint file of one attempt, in its job's directory ([`job_directory`]).
pub fn checkpoint_file_name(attempt: &v1::AttemptRef) -> String {
    format!("{}.attempt-{}.ckpt", attempt.job_id, attempt.attempt_number)
}

/// A job's own directory in the checkpoint directory: its checkpoints, the one
/// directory of the job its attempts may write (`{checkpoint_dir}` of command jobs).
pub fn job_directory(checkpoint_directory: &Path, attempt: &v1::AttemptRef) -> PathBuf {
    checkpoint_directory.join(&attempt.job_id)
}

/// The name of an attempt's container (a command job's runs add their number): unique
/// among the worker's containers, and in the runtime's alphabet.
fn container_name(attempt: &v1::AttemptRef) -> String {
    let job: String = attempt
        .job_id
        .chars()
        .map(|character| {
            if character.is_ascii_alphanumeric() || character == '-' {
                character
            } else {
                '_'
            }
        })
        .collect();
    match attempt.gang_rank {
        Some(rank) => format!("carve-{job}-{}-rank{rank}", attempt.attempt_number),
        None => format!("carve-{job}-{}", attempt.attempt_number),
    }
}

/// One attempt's own directory in the checkpoint directory: its spec file, or a command
/// job's guard account and OOM record and its working directory when the spec names none.
pub fn attempt_directory(checkpoint_directory: &Path, attempt: &v1::AttemptRef) -> PathBuf {
    // A gang's members on one worker each have their own (issue 31).
    let member = attempt
        .gang_rank
        .map(|rank| format!(".rank-{rank}"))
        .unwrap_or_default();
    checkpoint_directory.join(format!(
        "{}.attempt-{}{member}.run",
        attempt.job_id, attempt.attempt_number
    ))
}

/// `job/attempt` (`job/attempt/rank-R` for a gang's member): names one attempt in the
/// worker's tables.
fn attempt_key(attempt: &v1::AttemptRef) -> String {
    match attempt.gang_rank {
        Some(rank) => format!("{}/{}/rank-{rank}", attempt.job_id, attempt.attempt_number),
        None => format!("{}/{}", attempt.job_id, attempt.attempt_number),
    }
}

fn lock(shared: &Shared) -> MutexGuard<'_, SharedState> {
    // A panicking watcher must not take the whole worker down with a poisoned lock.
    shared
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A report the scheduler has not acknowledged yet.
#[derive(Debug)]
struct PendingReport {
    /// Its sequence number in the current session.
    sequence: u64,
    body: Body,
    /// How many sessions it was sent in.
    sessions: u32,
}

/// A report sent in this many sessions without an acknowledgement is dropped: the
/// scheduler rejects it (and ends the session) every time, and resending it forever
/// would keep the worker from ever holding a session.
const MOST_SESSIONS_PER_REPORT: u32 = 5;

/// The worker across sessions.
struct Worker {
    config: WorkerConfig,
    gpus: Vec<WorkerGpu>,
    shared: Shared,
    reports: mpsc::UnboundedSender<Body>,
    /// How long since a leader last heard this worker ([`crate::leader_lease`]).
    leader_lease: Arc<LeaderLease>,
    /// Reports sent in the current session and not yet acknowledged; after a reconnect
    /// they are sent again (renumbered) ahead of anything new.
    unacknowledged: VecDeque<PendingReport>,
    worker_id: String,
    /// Which scheduler replica the next session tries, and after what wait.
    scheduler_choice: SchedulerChoice,
    /// How the current attempt at a session ended, when it got as far as an answer or
    /// an open session (`None`: nothing answered).
    attempt_end: Option<AttemptEnd>,
    /// Where this worker records the attempt processes it runs.
    process_records: PathBuf,
    /// Set by a drain: the scheduler places nothing new here.
    draining: bool,
    /// The checked guard library, on a worker with real GPUs where it was found.
    guard_library: Option<PathBuf>,
    /// The guard for command jobs on simulated GPUs, when one was named or is in its
    /// default place (the fake driver's tests); without it they run without the guard.
    simulated_guard_library: Option<PathBuf>,
    /// Where attempts are contained; `None`: they run with the worker's rights.
    sandbox: Option<Arc<Sandbox>>,
    /// The simulated GPUs' ledgers by uuid (none with `watch_simulated_gpus` off).
    simulated_gpu_ledgers: HashMap<String, Arc<SimulatedGpuLedger>>,
    /// The master ports of the one-node gangs whose members run here.
    gang_ports: Arc<GangPorts>,
}

/// Runs the worker until `shutdown` completes; then stops its attempts.
pub async fn run_worker(
    config: WorkerConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), WorkerError> {
    if config.scheduler_url.is_empty() {
        return Err(WorkerError::invalid_setting(
            "--scheduler",
            "must not be empty",
        ));
    }
    if config.token.is_empty() {
        return Err(WorkerError::invalid_setting("--token", "must not be empty"));
    }
    let (nvml, real_gpus) = find_real_gpus(&config).await?;
    let gpus = discover_gpus(
        &config.hostname,
        &real_gpus,
        &config.simulated_gpus,
        config.context_bytes,
    )?;
    tokio::fs::create_dir_all(&config.checkpoint_directory)
        .await
        .map_err(|error| {
            WorkerError::io(
                format!("cannot create {}", config.checkpoint_directory.display()),
                error,
            )
        })?;
    let guard_library = find_guard_library(
        config.guard_library.as_deref(),
        &config.attempt_program,
        &gpus,
    )?;
    let simulated_guard_library =
        find_simulated_guard_library(config.guard_library.as_deref(), &config.attempt_program);
    let process_records = record_directory(&config.checkpoint_directory, &config.hostname);
    kill_leftovers_of_a_previous_life(&process_records);
    let sandbox = Sandbox::open(
        &config.sandbox,
        &config.checkpoint_directory,
        &config.hostname,
    )?
    .map(Arc::new);
    if let Some(sandbox) = &sandbox {
        for name in sandbox.remove_leftover_containers() {
            tracing::warn!(container = %name, "removed a container left over from this worker's previous run");
        }
    }
    let simulated_gpu_ledgers = if config.watch_simulated_gpus {
        serve_simulated_gpus(&gpus, &config.checkpoint_directory)
    } else {
        HashMap::new()
    };
    let (reports, mut incoming_reports) = mpsc::unbounded_channel();
    let shared = Shared::default();
    // A worker no leader hears stops its attempts before the scheduler could give them
    // to another worker.
    let leader_lease = LeaderLease::new();
    let leaderless_stops = tokio::spawn(stop_attempts_without_a_leader(leader_lease.clone(), {
        let shared = shared.clone();
        move || stoppable_attempts(&shared)
    }));
    // The watchdog watches real GPUs, and simulated ones whose memory is in a ledger: a
    // simulated GPU without one has no device memory to take.
    let context_bytes: HashMap<String, u64> = gpus
        .iter()
        .filter(|gpu| !gpu.simulated || simulated_gpu_ledgers.contains_key(&gpu.uuid))
        .map(|gpu| (gpu.uuid.clone(), gpu.context_bytes))
        .collect();
    // The worker's own limits hold on every attempt, real GPU or simulated.
    let limits = tokio::spawn(run_attempt_limits(
        config.run_limits.clone(),
        WorkerLimitedAttempts {
            shared: shared.clone(),
        },
    ));
    let watchdog = (!context_bytes.is_empty()).then(|| {
        tokio::spawn(run_watchdog(
            SystemWatchSource::new(nvml, simulated_gpu_ledgers.clone()),
            WorkerAttempts {
                shared: shared.clone(),
                context_bytes,
            },
            reports.clone(),
        ))
    });
    let scheduler_choice = SchedulerChoice::new(
        config.reconnect_backoff_initial,
        config.reconnect_backoff_max,
    );
    let mut worker = Worker {
        process_records,
        config,
        gpus,
        shared,
        reports,
        leader_lease,
        unacknowledged: VecDeque::new(),
        worker_id: String::new(),
        scheduler_choice,
        attempt_end: None,
        draining: false,
        guard_library,
        simulated_guard_library,
        sandbox,
        simulated_gpu_ledgers,
        gang_ports: Arc::default(),
    };
    tokio::pin!(shutdown);
    let mut stopped_by: Option<WorkerError> = None;
    loop {
        let ended = tokio::select! {
            _ = &mut shutdown => break,
            ended = worker.run_session(&mut incoming_reports) => ended,
        };
        let reason = match ended {
            Ok(()) => "the scheduler ended the session".to_string(),
            Err(error) if error.is_permanent() => {
                stopped_by = Some(error);
                break;
            }
            Err(error) => error.to_string(),
        };
        let wait = worker.next_session_wait();
        tracing::warn!(%reason, retry_in = ?wait, "no session with the scheduler");
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(wait) => {}
        }
    }
    if let Some(watchdog) = watchdog {
        watchdog.abort();
    }
    limits.abort();
    leaderless_stops.abort();
    // Shutting down: the attempts die with the worker (their processes would outlive it
    // otherwise); the scheduler requeues them when the lease runs out.
    for running in lock(&worker.shared).running.values() {
        let _ = running.control.send(AttemptControl::Cancel {
            grace_period: Duration::ZERO,
            reason: "the worker is shutting down".into(),
        });
    }
    tracing::info!("worker stopped");
    stopped_by.map_or(Ok(()), Err)
}

fn proto_duration(duration: Option<prost_types::Duration>) -> Option<Duration> {
    let duration = duration?;
    let seconds = u64::try_from(duration.seconds).ok()?;
    let nanos = u32::try_from(duration.nanos).ok()?;
    Some(Duration::new(seconds, nanos))
}

/// How long registering may take: a replica that accepted the connection but does not
/// answer (frozen) is left for the next one after this.
const REGISTER_DEADLINE: Duration = Duration::from_secs(5);

impl Worker {
    /// The endpoint choice's side of the session loop: where the next attempt goes.
    async fn choose_session_endpoint(&mut self) -> String {
        let listed = failover_endpoints(&self.config.scheduler_url).await;
        self.attempt_end = None;
        let attempt = self.scheduler_choice.next_attempt(&listed);
        tracing::debug!(endpoint = %attempt.endpoint, reason = ?attempt.reason, waited = ?attempt.waited, "session attempt");
        if let Some(observer) = &self.config.session_observer {
            let _ = observer.send(attempt.clone());
        }
        attempt.endpoint
    }

    /// Records that the replica answered `status` (a refusal, or the end of an open
    /// session), with the leader it named.
    fn scheduler_answered(&mut self, status: &tonic::Status, session_was_open: bool) {
        self.attempt_end = Some(AttemptEnd::of_status(status, session_was_open));
    }

    /// After an attempt at a session ended: reads how, and returns how long to wait
    /// before the next.
    fn next_session_wait(&mut self) -> Duration {
        let end = self.attempt_end.take().unwrap_or(AttemptEnd::NoAnswer);
        self.scheduler_choice.attempt_ended(end);
        self.scheduler_choice.wait()
    }

    fn gpus_proto(&self) -> Vec<v1::Gpu> {
        let shared = lock(&self.shared);
        self.gpus
            .iter()
            .map(|gpu| gpu.to_proto(shared.slices.free_bytes(gpu)))
            .collect()
    }

    async fn start_attempt(&mut self, assignment: v1::scheduler_message::Assignment) {
        let Some(mut attempt) = assignment.attempt.clone() else {
            tracing::warn!("an assignment without an attempt: ignored");
            return;
        };
        // A gang's member is named by its rank in every report and table (issue 31).
        if let Some(gang) = &assignment.gang {
            attempt.gang_rank = Some(gang.rank);
        }
        if self.draining {
            // The scheduler places nothing on a draining worker, so an assignment after
            // a drain means an operator took the drain back (the protocol has no undrain
            // message).
            tracing::info!("an assignment after a drain: the drain was taken back");
            self.draining = false;
        }
        let key = attempt_key(&attempt);
        if lock(&self.shared).running.contains_key(&key) {
            tracing::info!(job = %attempt.job_id, "the same assignment again: already running");
            return;
        }
        let Some(gpu) = self
            .gpus
            .iter()
            .find(|gpu| gpu.uuid == assignment.gpu_uuid)
            .cloned()
        else {
            let reason = format!("this worker has no gpu {}", assignment.gpu_uuid);
            return self.refuse(attempt, reason);
        };
        let Some(config) = assignment.config.as_ref() else {
            return self.refuse(attempt, "the assignment has no run config".into());
        };
        if let Err(reason) = lock(&self.shared)
            .slices
            .admit(&gpu, &key, assignment.slice_bytes)
        {
            return self.refuse(attempt, reason);
        }
        match self.launch(&assignment, &attempt, config, &gpu).await {
            Ok(()) => {}
            Err(error) => {
                lock(&self.shared).slices.release(&gpu.uuid, &key);
                self.refuse(attempt, error.to_string());
            }
        }
    }

    /// Starts the attempt: a model job's attempt process, or a command job's program
    /// ([`crate::command_attempt`]).
    async fn launch(
        &self,
        assignment: &v1::scheduler_message::Assignment,
        attempt: &v1::AttemptRef,
        config: &v1::RunConfig,
        gpu: &WorkerGpu,
    ) -> Result<(), WorkerError> {
        // The kind is the one the scheduler stored at admission: the spec is read strictly
        // as that kind, never sniffed from its text.
        let kind = JobKind::from_name(&assignment.kind)
            .map_err(|error| WorkerError::Attempt(format!("the assignment's kind: {error}")))?;
        let spec = Workload::from_stored(kind, &assignment.spec_json)
            .map_err(|error| WorkerError::Attempt(format!("the job spec: {error}")))?;
        // The job may ask for less time than the worker allows, never more.
        let job_max_duration = spec
            .resources()
            .max_duration_limit()
            .map_err(|error| WorkerError::Attempt(format!("the job spec: {error}")))?;
        let max_duration =
            effective_max_duration(job_max_duration, self.config.run_limits.max_duration);
        // Told as the attempt starts (its log, `carve logs`), not first when it is stopped.
        if let Some(warning) =
            shortened_max_duration_warning(job_max_duration, self.config.run_limits.max_duration)
        {
            let _ = self.reports.send(Body::Log(v1::worker_message::LogLine {
                attempt: Some(attempt.clone()),
                level: "warn".into(),
                message: warning,
                stream: String::new(),
            }));
        }
        // One conversion for both kinds, checked as the job's kind reads a config (the
        // model job's attempt process checks it again against its model, in its own
        // process, before training).
        let run_config = carve_proto::convert::run_config_for_workload(config, &spec, "config")
            .map_err(|error| WorkerError::Attempt(format!("the run config: {error}")))?;
        // Each kind has its own launcher: the engine's attempt process or the program
        // under the guard.
        match spec {
            // A model job is one engine process in one slice (issue 31: only command
            // jobs are gangs); the scheduler never sends one, and it is refused here.
            Workload::Model(_) if assignment.gang.is_some() => Err(WorkerError::Attempt(
                "a model job runs in one slice: the assignment's gang is for command jobs"
                    .to_string(),
            )),
            Workload::Model(job) => {
                self.launch_model(assignment, attempt, config, gpu, &job, max_duration)
                    .await
            }
            Workload::Command(job) => {
                self.launch_command(assignment, attempt, run_config, gpu, job, max_duration)
            }
        }
    }
}
