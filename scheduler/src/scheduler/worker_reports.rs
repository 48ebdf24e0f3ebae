//! What workers tell the scheduler and what it tells them, as the scheduler's own types:
//! a registration with its GPUs, the reports of a session, and the commands sent down it.
//! `convert.rs` turns them from and into the generated messages; nothing in the
//! scheduler reads or writes a generated type of a worker's.

use carve_core::command::oom::OomSource;
use std::time::Duration;

use carve_core::allocator::OutOfMemory;
use carve_core::command::memory_model::ProfilePoint;
use carve_core::job_state::AttemptOutcome;
use carve_core::plan::RunConfig;
use carve_core::workload::JobKind;

use crate::store::AttemptResults;

/// A GPU a worker offers: its memory as the worker measured it at registration, and its
/// free memory as its heartbeats last said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub uuid: String,
    pub index: u32,
    pub model_name: String,
    pub total_bytes: u64,
    /// What the CUDA context takes, never available to slices.
    pub context_bytes: u64,
    pub free_bytes: u64,
    pub simulated: bool,
    pub compute_capability: String,
}

/// A worker registering (again, when `previous_worker_id` is not empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRegistration {
    pub hostname: String,
    pub version: String,
    pub previous_worker_id: String,
    pub gpus: Vec<Gpu>,
}

/// What a registered worker is told: its id and its timings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    pub worker_id: String,
    pub heartbeat_interval: Duration,
    pub lease_duration: Duration,
}

/// One assignment of an attempt, as the worker names it in its reports: the lease epoch
/// fences reports from a worker the attempt was taken from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttemptRef {
    pub job_id: String,
    pub attempt_number: u32,
    pub lease_epoch: u64,
}

/// A checkpoint an attempt wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub location: String,
    pub step: u64,
}

/// A GPU's free memory, as a heartbeat reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuFreeBytes {
    pub gpu_uuid: String,
    pub free_bytes: u64,
}

/// How far an attempt got, as it reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TrainingProgress {
    pub step: u64,
    pub total_steps: u64,
    pub loss: f64,
    pub samples_per_second: f64,
    pub memory_in_use_bytes: u64,
    pub memory_peak_bytes: u64,
    /// The worker's estimate of the time left (`carve_core::step_rate`), when it made one.
    pub seconds_left: Option<f64>,
}

/// How far a worker is in pulling an attempt's image.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImagePullProgress {
    /// The image as the job names it.
    pub image: String,
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// A registry credential (a tenant's pull secret) on its way to a worker: never printed,
/// never stored but in the tenant's secrets.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryCredential {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for RegistryCredential {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("RegistryCredential(<redacted>)")
    }
}

/// One message of a worker's session.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkerReport {
    /// Only the first message of a session says hello; one later is refused.
    Hello,
    Heartbeat {
        gpus: Vec<GpuFreeBytes>,
        /// Manifest digests of the images the worker's cache holds, most recently used
        /// first, at most `job_images::MAX_CACHED_IMAGES_READ` (the rest are dropped).
        cached_image_digests: Vec<String>,
    },
    AttemptStarted {
        attempt: AttemptRef,
        /// The checkpoint the attempt loaded; `None` from scratch (or unsaid).
        resumed_from: Option<Checkpoint>,
        /// A command job's argv as the worker rendered it; empty for model jobs.
        command_argv: Vec<String>,
        /// It runs without its container, with the worker's rights; false when contained
        /// or from a worker too old to say.
        uncontained: bool,
        /// The manifest digest of the image the attempt runs in (`sha256:` and 64 hex
        /// digits, checked), `None` without an image.
        image_digest: Option<String>,
    },
    /// The worker is pulling the attempt's image (before its program starts).
    ImagePull {
        attempt: AttemptRef,
        pull: ImagePullProgress,
    },
    Progress {
        attempt: AttemptRef,
        progress: Option<TrainingProgress>,
    },
    Log {
        attempt: AttemptRef,
        level: String,
        message: String,
        /// "stdout" or "stderr" for a command's program output; empty otherwise.
        stream: String,
    },
    CheckpointWritten {
        attempt: AttemptRef,
        checkpoint: Option<Checkpoint>,
    },
    OutOfMemory {
        attempt: AttemptRef,
        report: OutOfMemory,
        /// The last checkpoint the attempt wrote, to resume from.
        checkpoint: Option<Checkpoint>,
        /// Who detected it: Carve's engine, the guard, a framework.
        detected_by: OomSource,
        /// For people: the guard's numbers or the framework's line; may be empty.
        evidence: String,
    },
    AttemptFinished {
        attempt: AttemptRef,
        /// `None` for a value that is no outcome (or `running`): refused.
        outcome: Option<AttemptOutcome>,
        /// 0 when not measured.
        measured_peak_bytes: u64,
        message: String,
        /// Loss, accuracy, steps and throughput, as far as the worker knows them.
        results: AttemptResults,
        /// A command job's profile: one point per run; empty otherwise.
        profile_points: Vec<ProfilePoint>,
    },
}

/// What the scheduler sends down a worker's session.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkerCommand {
    /// Run an attempt in a slice (boxed: it is much the largest command).
    Assignment(Box<Assignment>),
    /// Stop an attempt, giving it `grace_period` before it is killed.
    Cancel {
        attempt: AttemptRef,
        grace_period: Duration,
        reason: String,
    },
    /// Finish the running attempts and take no new ones.
    Drain,
    /// Every report up to `sequence` was handled.
    Ack { sequence: u64 },
    /// The heartbeat `sequence` reached this scheduler while it led (the worker's own
    /// lease counts from it).
    HeartbeatAck { sequence: u64 },
    /// `checkpoint` of `attempt` is stored as its job's checkpoint to resume from: every
    /// other checkpoint file of the job is superseded.
    CheckpointRecorded {
        attempt: AttemptRef,
        checkpoint: Checkpoint,
    },
}

/// An attempt a worker is to run.
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    pub attempt: AttemptRef,
    pub spec_json: String,
    pub config: RunConfig,
    pub gpu_uuid: String,
    pub slice_bytes: u64,
    /// Where to resume from when the file exists, and where to write checkpoints.
    /// The checkpoint an earlier attempt reported; `None` starts from scratch.
    pub resume_from: Option<Checkpoint>,
    /// Run a command job's profile instead of training.
    pub profile: bool,
    /// The job's tenant, whose host uid range the worker runs the attempt under.
    pub tenant: String,
    /// The kind stored with the job at admission: the worker reads the spec as this kind.
    pub kind: JobKind,
    /// The digest the job's first pull resolved its image to; `None` before one.
    pub image_digest: Option<String>,
    /// The credential of the job's `command.image_pull_secret`, only for a job that
    /// names one.
    pub image_pull_credential: Option<RegistryCredential>,
}
