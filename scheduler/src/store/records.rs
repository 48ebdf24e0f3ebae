//! The rows the store keeps, as plain structs with typed states (how those are read
//! from their columns is `columns.rs`).
//!
//! The run config and the estimate are JSON read and written through `json_columns.rs`;
//! the other JSON blobs but the out-of-memory report (job spec, GPUs) are stored as text
//! exactly as given and parsed by their readers.
//! Times are milliseconds since the Unix epoch, chosen by the caller (the scheduler owns
//! the clock). Ids are chosen by the caller.

use carve_core::allocator::OutOfMemory;
use carve_core::command::metrics::Metric;

use super::columns::TextColumn;
pub use carve_core::command::memory_model::ProfilePoint;
pub use carve_core::command::oom::OomSource;
pub use carve_core::job_state::{AttemptOutcome, JobState};
pub use carve_core::workload::JobKind;

/// Where a worker stands (`WorkerRecord::state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkerState {
    /// Heartbeating and taking new attempts.
    Ready,
    /// Finishing its attempts; takes no new ones.
    Draining,
    /// Its lease ran out.
    Lost,
}

impl WorkerState {
    pub const ALL: [WorkerState; 3] =
        [WorkerState::Ready, WorkerState::Draining, WorkerState::Lost];

    /// The lowercase name used in messages and the store.
    pub fn name(self) -> &'static str {
        match self {
            WorkerState::Ready => "ready",
            WorkerState::Draining => "draining",
            WorkerState::Lost => "lost",
        }
    }
}

/// What a token may do (`TokenRecord::role`), and so who is calling (`auth::Caller`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    User,
    Admin,
    Worker,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::User, Role::Admin, Role::Worker];

    pub fn name(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Admin => "admin",
            Role::Worker => "worker",
        }
    }

    pub fn from_name(name: &str) -> Option<Role> {
        match name {
            "user" => Some(Role::User),
            "admin" => Some(Role::Admin),
            "worker" => Some(Role::Worker),
            _ => None,
        }
    }
}

/// A tenant: a group of users whose jobs share a quota. The name is the id.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct TenantRecord {
    pub name: String,
    /// Sum of the slice sizes of its running attempts; `None` means no limit.
    pub vram_quota_bytes: Option<i64>,
    /// Attempts placed or running at once; `None` means no limit.
    pub max_running_jobs: Option<i64>,
    pub fair_share_weight: i64,
    pub created_at_ms: i64,
}

/// A bearer token, stored by the hash of its secret (the secret itself is never stored).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct TokenRecord {
    pub id: String,
    /// The tenant it acts for; empty for admin and worker tokens (so it is not a foreign
    /// key to `tenants`).
    pub tenant: String,
    #[sqlx(try_from = "TextColumn<Role>")]
    pub role: Role,
    /// Unique across tokens: `find_token_by_hash` looks tokens up by it.
    pub secret_hash: Vec<u8>,
    pub description: String,
    pub created_at_ms: i64,
    pub expires_at_ms: Option<i64>,
    pub revoked: bool,
    /// When it was revoked; `None` while valid, and for tokens revoked before the store
    /// kept the time.
    pub revoked_at_ms: Option<i64>,
    /// When it last authenticated a call, to about a minute (see
    /// `crate::cache::TOKEN_USE_RECORD_INTERVAL`); `None` if never.
    pub last_used_at_ms: Option<i64>,
}

impl TokenRecord {
    /// Whether it still authenticates calls at `now_ms`: neither revoked nor expired.
    pub fn is_active(&self, now_ms: i64) -> bool {
        !self.revoked && self.expires_at_ms.is_none_or(|expires| expires > now_ms)
    }
}

/// A job. `submit_sequence` is assigned by the store at submit (whatever the caller put
/// there) and orders jobs newest first in listings.
///
/// Read from its row by `columns.rs` (a value it cannot read names the job's id and the
/// column).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRecord {
    pub id: String,
    /// Must name an existing tenant (a foreign key).
    pub tenant: String,
    pub name: String,
    /// Model job or command job, set at admission: readers read `spec_json` as this kind
    /// (`Workload::from_stored`) and never tell the kind from the text.
    pub kind: JobKind,
    pub spec_json: String,
    pub state: JobState,
    pub priority: i64,
    pub submit_sequence: i64,
    /// Unique per tenant when set; an empty key is stored as no key.
    pub idempotency_key: Option<String>,
    /// The run config the next (or the running) attempt uses, as JSON.
    pub config_json: String,
    /// The estimate of `config_json`, as JSON (`json_columns.rs`; read by `JobRecord::estimate`): job reads
    /// show it as stored, never estimating again.
    pub estimate_json: String,
    /// The slice size `estimate_json` needs.
    pub required_bytes: i64,
    pub waiting_reason: String,
    pub message: String,
    pub created_at_ms: i64,
    pub finished_at_ms: Option<i64>,
    pub checkpoint_location: Option<String>,
    /// The training step `checkpoint_location` holds (0 when unknown: rows from before
    /// steps were stored).
    pub checkpoint_step: i64,
    pub attempts_count: i64,
}

/// What a scheduling pass needs of a queued job, and nothing more: the solver's inputs
/// and the reason the job last waited for (to write only reasons that changed). A pass
/// over a million queued jobs reads these instead of whole [`JobRecord`]s, whose spec,
/// config and estimate JSON it does not use.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct QueuedJob {
    pub id: String,
    pub tenant: String,
    pub priority: i64,
    pub submit_sequence: i64,
    pub required_bytes: i64,
    pub waiting_reason: String,
}

/// How many jobs are queued and the highest `submit_sequence` among them: two numbers
/// that change whenever a job joins or leaves the queue, whichever replica moved it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueFingerprint {
    pub queued_jobs: i64,
    pub highest_submit_sequence: i64,
}

/// What `submit_jobs` did with one job: created it, or found the job an earlier submit
/// with the same `(tenant, idempotency_key)` created (`created == false`, `job` is that
/// existing job).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmitOutcome {
    pub job: JobRecord,
    pub created: bool,
}

/// Filters and a page for `list_jobs`. Filters combine with AND; empty ones match all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobFilter {
    pub tenant: Option<String>,
    /// Jobs in any of these states; empty means every state.
    pub states: Vec<JobState>,
    /// Jobs whose name starts with this (case-sensitive, no wildcards).
    pub name_prefix: Option<String>,
    /// 0 means [`DEFAULT_PAGE_SIZE`]; larger than [`MAX_PAGE_SIZE`] is capped.
    pub page_size: u32,
    /// The `next_page_token` of the previous page; `None` (or empty) for the first.
    pub page_token: Option<String>,
}

/// The page size of `list_jobs` when the filter asks for 0.
pub const DEFAULT_PAGE_SIZE: u32 = 100;
/// The most jobs one `list_jobs` page returns.
pub const MAX_PAGE_SIZE: u32 = 1000;

/// One try at running a job, identified by `(job_id, attempt_number)`. Not `Eq`: its
/// results hold floats.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct AttemptRecord {
    pub job_id: String,
    /// 1 for the first attempt of a job, counting up.
    pub attempt_number: i64,
    pub config_json: String,
    pub estimate_bytes: i64,
    pub slice_bytes: i64,
    pub worker_id: String,
    pub gpu_id: String,
    /// The fencing token of the assignment: reports quoting another epoch are stale.
    pub lease_epoch: i64,
    /// [`AttemptOutcome::Running`] until it ends.
    #[sqlx(try_from = "TextColumn<AttemptOutcome>")]
    pub outcome: AttemptOutcome,
    pub measured_peak_bytes: Option<i64>,
    /// What the attempt reported when it ran out of memory (the `oom_json` column).
    #[sqlx(rename = "oom_json", try_from = "TextColumn<Option<OutOfMemory>>")]
    pub oom: Option<OutOfMemory>,
    pub message: String,
    /// The checkpoint it resumed from, if any.
    pub resumed_from: Option<String>,
    /// The training step of `resumed_from` (0 when unknown).
    pub resumed_from_step: i64,
    /// When it was placed, then when its worker reported it started training.
    pub started_at_ms: i64,
    pub finished_at_ms: Option<i64>,
    /// What it achieved, stored when it ends.
    #[sqlx(flatten)]
    pub results: AttemptResults,
    /// Why it ran as it did and, for command jobs, what ran.
    #[sqlx(flatten)]
    pub details: AttemptDetails,
}

/// The rest of an attempt's story: written at placement (`profile`, `chosen_because`),
/// at start (`command_argv_json`, `uncontained`) and at its end (`profile_points_json`,
/// `oom_detected_by`). Empty for rows from before these columns, and the command fields
/// for model jobs.
#[derive(Debug, Clone, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct AttemptDetails {
    /// A command job's profile run, not training.
    pub profile: bool,
    /// Why the attempt ran with its configuration, for people.
    pub chosen_because: String,
    /// The argv the worker rendered (empty when unknown). Column `command_argv_json`:
    /// a JSON list, '' for none.
    #[sqlx(rename = "command_argv_json", try_from = "TextColumn<Vec<String>>")]
    pub command_argv: Vec<String>,
    /// What a profile measured (empty otherwise). Column `profile_points_json`: a JSON
    /// list, '' for none.
    #[sqlx(
        rename = "profile_points_json",
        try_from = "TextColumn<Vec<ProfilePoint>>"
    )]
    pub profile_points: Vec<ProfilePoint>,
    /// Who detected an out-of-memory (`None` for an attempt that did not run out, and
    /// rows from before the column). Stored by name, '' for none.
    #[sqlx(try_from = "TextColumn<Option<OomSource>>")]
    pub oom_detected_by: Option<OomSource>,
    /// Its worker said it ran without its container, with the worker's rights (false
    /// when contained, from a worker too old to say, or before it started).
    pub uncontained: bool,
}

/// What an attempt achieved, as its worker reported at its end; every field is `None`
/// when unknown (a running attempt, an attempt that ended before its first step, rows
/// written before these columns existed).
#[derive(Debug, Clone, Default, PartialEq, sqlx::FromRow)]
pub struct AttemptResults {
    /// Mean training loss of its last step (never NaN or infinite).
    pub final_loss: Option<f64>,
    /// Accuracy on the held-out test set, 0 to 1.
    pub test_accuracy: Option<f64>,
    /// Optimizer steps completed when it ended, counting those before a resume.
    pub steps_done: Option<i64>,
    /// Mean throughput over its own steps.
    pub samples_per_second: Option<f64>,
    /// What a command job's program reported (`val_loss`, `metric_<name>`), bounded as
    /// `carve_core::command::metrics` says. Column `metrics_json`: a JSON list, '' for
    /// none.
    #[sqlx(rename = "metrics_json", try_from = "TextColumn<Vec<Metric>>")]
    pub metrics: Vec<Metric>,
}

impl AttemptRecord {
    /// `job/number`, the way messages name an attempt.
    pub fn display_id(&self) -> String {
        attempt_display_id(&self.job_id, self.attempt_number)
    }
}

pub(crate) fn attempt_display_id(job_id: &str, attempt_number: i64) -> String {
    format!("{job_id}/{attempt_number}")
}

/// A worker node as it registered, with its GPUs as JSON.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct WorkerRecord {
    pub id: String,
    pub hostname: String,
    pub gpus_json: String,
    #[sqlx(try_from = "TextColumn<WorkerState>")]
    pub state: WorkerState,
    pub last_heartbeat_ms: i64,
    /// When it first registered; kept when it registers again.
    pub registered_at_ms: i64,
    pub version: String,
    /// The token that registered it (its id): the only one that may speak for it.
    pub token_id: String,
    /// Why it was drained; empty when it is not draining or no reason was given.
    pub drain_reason: String,
}
