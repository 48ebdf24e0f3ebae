//! The limits the worker itself keeps on every attempt, in a container or not: how long
//! it may run (wall clock) and how much its directories may hold on disk. A container's
//! cgroup bounds what the kernel can count (host memory, pids, CPU; see
//! [`crate::sandbox::AttemptLimits`]); these two it cannot, so the worker checks them.
//!
//! - **`max_duration`**: the shorter of the worker's `--attempt-max-duration` (default
//!   [`DEFAULT_MAX_DURATION`]) and the job's own `resources.max_duration`. Each attempt
//!   has the whole of it from its start (a retry starts again; a profile attempt's runs
//!   count together). Past it the attempt is stopped (SIGTERM, so a trainer can
//!   checkpoint, SIGKILL after [`DURATION_STOP_GRACE_PERIOD`]) and ends FAILED: run again,
//!   it would only run as long again.
//! - **The checkpoint directory's size**: `--attempt-checkpoint-limit` (default
//!   [`DEFAULT_CHECKPOINT_LIMIT_BYTES`]) over what the attempt's program may write: the
//!   job's directory (`{checkpoint_dir}`, kept across its attempts) and the attempt's own
//!   (a command job's working directory when it names none, its profile's scratch).
//!   Measured every [`RunLimits::measure_interval`] on a blocking thread, as `du -x`
//!   does: allocated blocks (a sparse file counts what it holds), a hard-linked file
//!   once, symbolic links never followed, no other file system entered, and at most
//!   [`MOST_MEASURED_ENTRIES`] entries, past which the attempt is stopped as well (so
//!   that no directory is too large to measure). Past the limit it is stopped (SIGKILL
//!   after [`CHECKPOINT_STOP_GRACE_PERIOD`]: a checkpoint now would only add to it) and
//!   ends FAILED with the numbers.
//!
//! The decisions are pure ([`judge_attempt`], [`effective_max_duration`]); the loop
//! ([`run_attempt_limits`]) runs for the worker's lifetime, with or without a session,
//! beside the watchdog, and reaches the attempts through [`LimitedAttempts`]. Limits of
//! the measurement: what is written between two measurements is seen at the next one,
//! and a directory swapped for a symbolic link between reading its entry and listing it
//! is listed where the link points (bounded by the entry count, and only ever counted
//! against the attempt itself).

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use carve_core::bytes::HumanBytes;
use carve_core::spec::format_duration;
use carve_proto::v1;
use tokio::task::JoinHandle;

use crate::attempt_process::AttemptControl;

/// The worker's wall-clock limit per attempt when the operator names none: a week, longer
/// than any training run that checkpoints should go without a restart, and short enough
/// that a forgotten `sleep infinity` gives its slice back.
pub const DEFAULT_MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3_600);

/// The limit on a job's directories when the operator names none: room for the
/// checkpoints of a multi-billion-parameter model with its optimizer state, and far from
/// a node's disk.
pub const DEFAULT_CHECKPOINT_LIMIT_BYTES: u64 = 64 << 30;

/// How often the directories are measured when the operator's config names no interval.
pub const DEFAULT_MEASURE_INTERVAL: Duration = Duration::from_secs(5);

/// How often the loop looks at the running attempts' times (and collects a measurement).
pub const CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The most entries (files, directories, links) one measurement walks for an attempt;
/// a directory with more is stopped as too large to measure.
pub const MOST_MEASURED_ENTRIES: u64 = 1_000_000;

/// The SIGTERM-to-SIGKILL time of a stop for running too long: what a user's cancel
/// gets, time for a trainer to write its checkpoint.
pub const DURATION_STOP_GRACE_PERIOD: Duration = Duration::from_secs(10);

/// The SIGTERM-to-SIGKILL time of a stop for a directory over its limit: short, since
/// whatever the program writes meanwhile adds to it.
pub const CHECKPOINT_STOP_GRACE_PERIOD: Duration = Duration::from_secs(2);

/// The operator's limits (`--attempt-max-duration`, `--attempt-checkpoint-limit`). They
/// sit in [`crate::WorkerConfig`] rather than in the sandbox's settings because the
/// worker, not the container, enforces them: they hold with `--insecure-no-sandbox` too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunLimits {
    /// The longest an attempt may run; `None`: only as long as its job asks, if it does.
    pub max_duration: Option<Duration>,
    /// The most an attempt's directories may hold on disk; `None`: not measured.
    pub checkpoint_bytes: Option<u64>,
    /// How often they are measured.
    pub measure_interval: Duration,
}

impl Default for RunLimits {
    fn default() -> Self {
        RunLimits {
            max_duration: Some(DEFAULT_MAX_DURATION),
            checkpoint_bytes: Some(DEFAULT_CHECKPOINT_LIMIT_BYTES),
            measure_interval: DEFAULT_MEASURE_INTERVAL,
        }
    }
}

/// Who set an attempt's wall-clock limit, for its stop message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitSource {
    /// The job's `resources.max_duration`.
    Job,
    /// The worker's `--attempt-max-duration`.
    Worker,
}

/// An attempt's wall-clock limit and who set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxDuration {
    pub limit: Duration,
    pub set_by: LimitSource,
}

/// The limit that holds: the shorter of the job's and the worker's (the job's when they
/// are equal: it asked); `None` when neither sets one.
pub fn effective_max_duration(
    job: Option<Duration>,
    worker: Option<Duration>,
) -> Option<MaxDuration> {
    let job = job.map(|limit| MaxDuration {
        limit,
        set_by: LimitSource::Job,
    });
    let worker = worker.map(|limit| MaxDuration {
        limit,
        set_by: LimitSource::Worker,
    });
    match (job, worker) {
        (Some(job), Some(worker)) if worker.limit < job.limit => Some(worker),
        (Some(job), _) => Some(job),
        (None, worker) => worker,
    }
}

/// What the job is told when it asked for longer than this worker allows
/// (`resources.max_duration` past `--attempt-max-duration`): the worker's limit holds, and
/// the job learns it as its attempt starts instead of when it is stopped. `None` when the
/// job gets what it asked for.
pub fn shortened_max_duration_warning(
    job: Option<Duration>,
    worker: Option<Duration>,
) -> Option<String> {
    match (job, worker) {
        (Some(job), Some(worker)) if worker < job => Some(format!(
            "this worker stops an attempt after {} (its --attempt-max-duration), shorter than \
             the job's resources.max_duration of {}: this attempt has {} at most",
            format_duration(worker),
            format_duration(job),
            format_duration(worker),
        )),
        _ => None,
    }
}

/// What one measurement found in an attempt's directories.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DirectoryUsage {
    /// Bytes allocated on disk.
    pub bytes: u64,
    /// Entries walked (the directories themselves included).
    pub entries: u64,
    /// Whether the walk stopped at [`MOST_MEASURED_ENTRIES`] before the end.
    pub cut_short: bool,
}

/// A limit an attempt broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitBreach {
    RanTooLong {
        ran_for: Duration,
        max_duration: MaxDuration,
    },
    DirectoryTooLarge {
        usage: DirectoryUsage,
        limit_bytes: u64,
    },
    TooManyEntries {
        usage: DirectoryUsage,
    },
}

impl LimitBreach {
    /// How the attempt ends: FAILED with this message.
    pub fn message(&self, attempt: &v1::AttemptRef) -> String {
        let key = attempt_key(attempt);
        match self {
            LimitBreach::RanTooLong {
                ran_for,
                max_duration,
            } => format!(
                "stopped by the worker: attempt {key} ran for {}, past its max_duration of {} \
                 ({})",
                time_run(*ran_for),
                format_duration(max_duration.limit),
                match max_duration.set_by {
                    LimitSource::Job => "the job's resources.max_duration",
                    LimitSource::Worker => "this worker's --attempt-max-duration",
                }
            ),
            LimitBreach::DirectoryTooLarge { usage, limit_bytes } => format!(
                "stopped by the worker: attempt {key}'s checkpoint directory (with the \
                 attempt's own) holds {} ({} bytes in {} entries), past this worker's limit \
                 of {} (--attempt-checkpoint-limit)",
                HumanBytes(usage.bytes),
                usage.bytes,
                usage.entries,
                HumanBytes(*limit_bytes),
            ),
            LimitBreach::TooManyEntries { usage } => format!(
                "stopped by the worker: attempt {key}'s checkpoint directory (with the \
                 attempt's own) holds more than {MOST_MEASURED_ENTRIES} files and \
                 directories, the most the worker measures ({} in the first \
                 {MOST_MEASURED_ENTRIES})",
                HumanBytes(usage.bytes),
            ),
        }
    }

    /// The SIGTERM-to-SIGKILL time of its stop.
    pub fn grace_period(&self) -> Duration {
        match self {
            LimitBreach::RanTooLong { .. } => DURATION_STOP_GRACE_PERIOD,
            LimitBreach::DirectoryTooLarge { .. } | LimitBreach::TooManyEntries { .. } => {
                CHECKPOINT_STOP_GRACE_PERIOD
            }
        }
    }

    /// The control that stops the attempt for it.
    pub fn stop_control(&self, attempt: &v1::AttemptRef) -> AttemptControl {
        AttemptControl::StopAsFailed {
            grace_period: self.grace_period(),
            reason: self.message(attempt),
        }
    }
}

/// The pure decision for one attempt: `ran_for` its time since it started, `usage` its
/// directories' latest measurement (`None`: none yet), `checkpoint_limit` the worker's.
/// Running past its max_duration comes first: its stop lets the program checkpoint.
pub fn judge_attempt(
    ran_for: Duration,
    max_duration: Option<MaxDuration>,
    usage: Option<DirectoryUsage>,
    checkpoint_limit: Option<u64>,
) -> Option<LimitBreach> {
    if let Some(max_duration) = max_duration
        && ran_for > max_duration.limit
    {
        return Some(LimitBreach::RanTooLong {
            ran_for,
            max_duration,
        });
    }
    let (usage, limit_bytes) = (usage?, checkpoint_limit?);
    if usage.bytes > limit_bytes {
        return Some(LimitBreach::DirectoryTooLarge { usage, limit_bytes });
    }
    if usage.cut_short {
        return Some(LimitBreach::TooManyEntries { usage });
    }
    None
}

/// Measures `directories` together, as the module docs say: a missing one holds
/// nothing, an entry that vanishes meanwhile or cannot be read is skipped, and the
/// walk stops after `most_entries`. Blocking.
pub fn measure_directories(directories: &[PathBuf], most_entries: u64) -> DirectoryUsage {
    let mut usage = DirectoryUsage::default();
    // Hard-linked files already counted, by (device, inode).
    let mut linked: HashSet<(u64, u64)> = HashSet::new();
    for root in directories {
        let Ok(root_metadata) = std::fs::symlink_metadata(root) else {
            continue;
        };
        let device = root_metadata.dev();
        let mut pending = vec![(root.clone(), root_metadata)];
        while let Some((path, metadata)) = pending.pop() {
            if usage.entries >= most_entries {
                usage.cut_short = true;
                return usage;
            }
            usage.entries += 1;
            let counted = metadata.nlink() <= 1
                || metadata.is_dir()
                || linked.insert((metadata.dev(), metadata.ino()));
            if counted {
                usage.bytes = usage
                    .bytes
                    .saturating_add(metadata.blocks().saturating_mul(512));
            }
            // `symlink_metadata`: a link is a link, never a directory.
            if !metadata.is_dir() || metadata.dev() != device {
                continue;
            }
            let Ok(entries) = std::fs::read_dir(&path) else {
                continue;
            };
            for entry in entries.flatten() {
                let child = entry.path();
                if let Ok(child_metadata) = std::fs::symlink_metadata(&child) {
                    pending.push((child, child_metadata));
                }
            }
        }
    }
    usage
}

/// An attempt as the limits see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitedAttempt {
    pub attempt: v1::AttemptRef,
    /// When the worker started it.
    pub started: Instant,
    pub max_duration: Option<MaxDuration>,
    /// The directories its program may write, measured together.
    pub directories: Vec<PathBuf>,
}

/// What the limits need from the worker.
pub trait LimitedAttempts: Send + 'static {
    /// The attempts running now.
    fn running(&self) -> Vec<LimitedAttempt>;
    /// Tells one attempt's watcher to stop it; nothing if it has ended meanwhile.
    fn stop(&self, attempt: &v1::AttemptRef, control: AttemptControl);
}

/// Measurements by [`attempt_key`].
type Measurements = HashMap<String, DirectoryUsage>;

/// The loop's state between rounds.
#[derive(Debug)]
pub struct LimitsWatch {
    limits: RunLimits,
    /// Attempts already told to stop (forgotten once they end).
    stopped: HashSet<String>,
    /// The measurement under way, on a blocking thread.
    measuring: Option<JoinHandle<Measurements>>,
    /// When the last measurement started.
    last_measured: Option<Instant>,
    /// The latest measurement of each attempt.
    measured: Measurements,
}

impl LimitsWatch {
    pub fn new(limits: RunLimits) -> LimitsWatch {
        LimitsWatch {
            limits,
            stopped: HashSet::new(),
            measuring: None,
            last_measured: None,
            measured: HashMap::new(),
        }
    }

    /// One round at `now`: collects a finished measurement, starts the next when one is
    /// due, and stops each attempt past a limit (once). Returns the breaches it stopped
    /// attempts for.
    pub async fn round(
        &mut self,
        attempts: &impl LimitedAttempts,
        now: Instant,
    ) -> Vec<(v1::AttemptRef, LimitBreach)> {
        let running = attempts.running();
        let keys: HashSet<String> = running.iter().map(|a| attempt_key(&a.attempt)).collect();
        self.stopped.retain(|key| keys.contains(key));
        self.measured.retain(|key, _| keys.contains(key));
        if self.measuring.as_ref().is_some_and(JoinHandle::is_finished)
            && let Some(measuring) = self.measuring.take()
        {
            match measuring.await {
                Ok(measured) => self
                    .measured
                    .extend(measured.into_iter().filter(|(key, _)| keys.contains(key))),
                Err(error) => tracing::warn!(%error, "measuring the attempts' directories stopped"),
            }
        }
        if self.limits.checkpoint_bytes.is_some()
            && self.measuring.is_none()
            && self
                .last_measured
                .is_none_or(|last| now.duration_since(last) >= self.limits.measure_interval)
        {
            let to_measure: Vec<(String, Vec<PathBuf>)> = running
                .iter()
                .filter(|a| !self.stopped.contains(&attempt_key(&a.attempt)))
                .map(|a| (attempt_key(&a.attempt), a.directories.clone()))
                .collect();
            if !to_measure.is_empty() {
                self.last_measured = Some(now);
                self.measuring = Some(tokio::task::spawn_blocking(move || {
                    to_measure
                        .into_iter()
                        .map(|(key, directories)| {
                            (
                                key,
                                measure_directories(&directories, MOST_MEASURED_ENTRIES),
                            )
                        })
                        .collect()
                }));
            }
        }
        let mut breaches = Vec::new();
        for limited in running {
            let key = attempt_key(&limited.attempt);
            if self.stopped.contains(&key) {
                continue;
            }
            let breach = judge_attempt(
                now.saturating_duration_since(limited.started),
                limited.max_duration,
                self.measured.get(&key).copied(),
                self.limits.checkpoint_bytes,
            );
            if let Some(breach) = breach {
                let control = breach.stop_control(&limited.attempt);
                if let AttemptControl::StopAsFailed { reason, .. } = &control {
                    tracing::warn!(job = %limited.attempt.job_id, attempt = limited.attempt.attempt_number, %reason, "an attempt broke its limits");
                }
                attempts.stop(&limited.attempt, control);
                self.stopped.insert(key);
                breaches.push((limited.attempt, breach));
            }
        }
        breaches
    }
}

/// The limits, for the worker's lifetime: a round every [`CHECK_INTERVAL`].
pub async fn run_attempt_limits(limits: RunLimits, attempts: impl LimitedAttempts) {
    let mut watch = LimitsWatch::new(limits);
    let mut interval = tokio::time::interval(CHECK_INTERVAL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        watch.round(&attempts, Instant::now()).await;
    }
}

/// How long an attempt ran, for its stop message, rounded up so that a run just past its
/// limit never reads as the limit: under a minute in tenths of a second (`2.1s`), else
/// in whole seconds as [`format_duration`] writes them (`2h1s`).
fn time_run(ran_for: Duration) -> String {
    if ran_for.subsec_nanos() == 0 {
        return format_duration(ran_for);
    }
    if ran_for >= Duration::from_secs(60) {
        return format_duration(Duration::from_secs(ran_for.as_secs() + 1));
    }
    let tenths = ran_for.as_nanos().div_ceil(100_000_000);
    format!("{}.{}s", tenths / 10, tenths % 10)
}

/// `job/attempt`: names one attempt.
fn attempt_key(attempt: &v1::AttemptRef) -> String {
    format!("{}/{}", attempt.job_id, attempt.attempt_number)
}

#[cfg(test)]
mod tests;
