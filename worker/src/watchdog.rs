//! The watchdog over the device memory of the worker's attempts on real GPUs. Every
//! [`WATCH_INTERVAL`] it reads NVML's per-process usage of the GPUs its attempts run on,
//! and the process tree of each attempt (the attempt process and its descendants, from
//! `/proc`), and:
//! - an attempt whose tree holds more than its slice plus the context allowance is
//!   warned about (a log line, again only at a new peak) and, once that has lasted
//!   longer than [`GRACE`], stopped: it ends FAILED with a message naming the numbers;
//! - an attempt that runs under the guard whose tree has a process on its GPU without a
//!   slot in the attempt's guard account (the guard never saw it: `LD_PRELOAD` removed,
//!   a statically linked driver) is stopped the same way once that has lasted longer
//!   than [`GRACE`]. Engine attempts do not run under the guard and get only the first
//!   rule.
//!
//! The decisions are pure ([`judge_round`]); the readings come through a [`WatchSource`]
//! and the attempts through [`WatchedAttempts`], so the whole round is tested without
//! NVML. Limits: a process that leaves the tree (a daemon that double-forks to init) is
//! not counted, and NVML must see the worker's process ids (the same pid namespace).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use carve_core::bytes::HumanBytes;
use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use tokio::sync::mpsc;

use crate::attempt_process::AttemptControl;
use crate::guard_environment::account_process_ids;
use crate::nvml::{NvmlHandle, ProcessUsage};

/// How often the watchdog reads. NVML's per-process query and a walk of `/proc` take
/// milliseconds; once a second keeps a breach's cost to a neighbour to seconds.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// How long a breach may last before the attempt is stopped. NVML's numbers trail the
/// program: a framework that frees and allocates again, an allocator trimming its pool
/// at the next synchronize, or a process that has created its CUDA context a moment
/// before the guard registered it all read as a breach for an instant. Three seconds
/// is three readings: a breach that lasts through them is not a passing reading, and a
/// neighbour is short of memory for seconds at most.
pub const GRACE: Duration = Duration::from_secs(3);

/// The SIGTERM-to-SIGKILL time of a stop: short, since the attempt is taking memory
/// that is not its own, but enough for a framework to flush its logs.
pub const STOP_GRACE_PERIOD: Duration = Duration::from_secs(2);

/// An attempt the watchdog watches: one on a real GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchedAttempt {
    pub attempt: v1::AttemptRef,
    pub gpu_uuid: String,
    /// The attempt process: the root of its process tree.
    pub process_id: u32,
    pub slice_bytes: u64,
    /// The context allowance: the GPU's measured per-attempt context reservation
    /// (`--context-bytes`, measured on an H200: see `DEFAULT_CONTEXT_BYTES`), which
    /// placement reserves outside the slice (`gpus.rs`). NVML counts the CUDA context in
    /// a process's usage, so it is allowed on top of the slice.
    pub context_bytes: u64,
    /// The attempt's guard account, for attempts whose programs run under the guard;
    /// `None` for engine attempts, which the engine itself keeps inside their slice.
    pub guard_account: Option<PathBuf>,
}

impl WatchedAttempt {
    /// What the tree may hold on the GPU: slice plus context.
    pub fn allowed_bytes(&self) -> u64 {
        self.slice_bytes.saturating_add(self.context_bytes)
    }
}

/// One round's readings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchReading {
    /// NVML's compute processes by GPU uuid; a GPU that could not be read is missing.
    pub gpu_processes: HashMap<String, Vec<ProcessUsage>>,
    /// Every live process's parent (pid -> ppid).
    pub parents: HashMap<u32, u32>,
    /// By account file: the process ids holding a slot, or why it cannot be read.
    pub guard_slots: HashMap<PathBuf, Result<HashSet<u32>, String>>,
}

/// Where readings come from: NVML and `/proc` on a node ([`SystemWatchSource`]), a
/// script in tests.
pub trait WatchSource: Clone + Send + 'static {
    /// Blocking: called on a blocking thread.
    fn read(&self, gpu_uuids: &[String], guard_accounts: &[PathBuf]) -> WatchReading;
}

/// What the watchdog needs from the worker.
pub trait WatchedAttempts {
    /// The attempts running now on real GPUs.
    fn running(&self) -> Vec<WatchedAttempt>;
    /// Tells one attempt's watcher to stop it; nothing if it has ended meanwhile.
    fn stop(&self, attempt: &v1::AttemptRef, control: AttemptControl);
}

/// An attempt's tree seen over its slice and context, within the grace: a warning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceOverrun {
    pub attempt: v1::AttemptRef,
    pub process_id: u32,
    pub used_bytes: u64,
    pub slice_bytes: u64,
    pub context_bytes: u64,
}

impl SliceOverrun {
    /// The warning the scheduler gets, as the attempt's log line.
    pub fn message(&self) -> String {
        format!(
            "attempt {}/{} (pid {}) uses {} of device memory, its slice is {} (plus {} of context)",
            self.attempt.job_id,
            self.attempt.attempt_number,
            self.process_id,
            HumanBytes(self.used_bytes),
            HumanBytes(self.slice_bytes),
            HumanBytes(self.context_bytes),
        )
    }

    pub fn to_log_line(&self) -> v1::worker_message::LogLine {
        v1::worker_message::LogLine {
            attempt: Some(self.attempt.clone()),
            level: "warn".into(),
            message: self.message(),
        }
    }
}

/// What one round decided about one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchFinding {
    /// Over its slice and context, still within the grace.
    Overrun(SliceOverrun),
    /// To be stopped; it ends FAILED with `reason`.
    Stop {
        attempt: v1::AttemptRef,
        reason: String,
    },
}

/// What the watchdog remembers between rounds, by `job/attempt`.
#[derive(Debug, Default)]
pub struct WatchMemory {
    attempts: HashMap<String, AttemptMemory>,
}

#[derive(Debug, Default)]
struct AttemptMemory {
    /// The usage last warned about: a steady breach is warned about once, a new peak
    /// again.
    warned_bytes: Option<u64>,
    /// Since when the tree has been over its slice and context, reading after reading.
    over_since: Option<Instant>,
    /// Since when each process has been on the GPU without a slot in the guard account.
    unguarded_since: HashMap<u32, Instant>,
    /// A stop was asked for: nothing more to decide.
    stopped: bool,
}

/// `job/attempt`: names one attempt.
fn attempt_key(attempt: &v1::AttemptRef) -> String {
    format!("{}/{}", attempt.job_id, attempt.attempt_number)
}

/// `root` and every process descending from it, from a pid -> ppid map. `root` is in
/// the tree even when the map does not have it (it may have just ended, or `/proc`
/// could not be read), so the watch never sees less than the attempt process itself.
pub fn process_tree(root: u32, parents: &HashMap<u32, u32>) -> HashSet<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for (&process, &parent) in parents {
        children.entry(parent).or_default().push(process);
    }
    let mut tree = HashSet::from([root]);
    let mut to_visit = vec![root];
    while let Some(process) = to_visit.pop() {
        for &child in children.get(&process).into_iter().flatten() {
            // A pid is its own ancestor only in a torn reading; never loop on it.
            if tree.insert(child) {
                to_visit.push(child);
            }
        }
    }
    tree
}

/// The parent process id in the text of `/proc/<pid>/stat`: "pid (comm) state ppid ...",
/// where comm may hold spaces and parentheses, so the fields are counted after its last
/// `)`.
pub fn parent_from_stat(stat: &str) -> Option<u32> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace();
    let _state = fields.next()?;
    fields.next()?.parse().ok()
}

/// Every process's parent, read from `proc_root` (`/proc`). A process that ends while
/// it is read is left out.
pub fn read_process_parents(proc_root: &Path) -> HashMap<u32, u32> {
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return HashMap::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let process_id = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            Some((process_id, parent_from_stat(&stat)?))
        })
        .collect()
}

/// The pure part of the watchdog: what to do about each attempt after one reading at
/// `now`. `memory` carries the breaches' start times and the warnings already given, and
/// forgets attempts that are no longer in `attempts`.
pub fn judge_round(
    attempts: &[WatchedAttempt],
    reading: &WatchReading,
    memory: &mut WatchMemory,
    now: Instant,
) -> Vec<WatchFinding> {
    let watched_keys: HashSet<String> = attempts
        .iter()
        .map(|watched| attempt_key(&watched.attempt))
        .collect();
    memory.attempts.retain(|key, _| watched_keys.contains(key));
    let mut findings = Vec::new();
    for watched in attempts {
        let remembered = memory
            .attempts
            .entry(attempt_key(&watched.attempt))
            .or_default();
        if remembered.stopped {
            continue;
        }
        let Some(processes) = reading.gpu_processes.get(&watched.gpu_uuid) else {
            // No reading of its GPU: a breach must be seen to last, reading after reading.
            remembered.over_since = None;
            remembered.unguarded_since.clear();
            continue;
        };
        let tree = process_tree(watched.process_id, &reading.parents);
        let on_gpu: Vec<&ProcessUsage> = processes
            .iter()
            .filter(|process| tree.contains(&process.process_id))
            .collect();
        let stop = judge_unguarded(watched, &on_gpu, reading, remembered, now)
            .or_else(|| judge_overrun(watched, &on_gpu, remembered, now, &mut findings));
        if let Some(reason) = stop {
            remembered.stopped = true;
            findings.push(WatchFinding::Stop {
                attempt: watched.attempt.clone(),
                reason,
            });
        }
    }
    findings
}

/// The overrun rule: the tree's usage over slice + context. Warns (pushing onto
/// `findings`) while within the grace; returns the stop message after it.
fn judge_overrun(
    watched: &WatchedAttempt,
    on_gpu: &[&ProcessUsage],
    remembered: &mut AttemptMemory,
    now: Instant,
    findings: &mut Vec<WatchFinding>,
) -> Option<String> {
    // A process can appear more than once (e.g. once per MIG compute instance).
    let used_bytes: u64 = on_gpu.iter().map(|process| process.used_bytes).sum();
    if used_bytes <= watched.allowed_bytes() {
        remembered.over_since = None;
        return None;
    }
    let since = *remembered.over_since.get_or_insert(now);
    if now.duration_since(since) > GRACE {
        return Some(format!(
            "stopped by the worker: attempt {} held {} of device memory on its gpu for more \
             than {}s, more than its slice of {} plus the context allowance of {}",
            attempt_key(&watched.attempt),
            HumanBytes(used_bytes),
            GRACE.as_secs(),
            HumanBytes(watched.slice_bytes),
            HumanBytes(watched.context_bytes),
        ));
    }
    if remembered.warned_bytes.is_none_or(|last| used_bytes > last) {
        remembered.warned_bytes = Some(used_bytes);
        findings.push(WatchFinding::Overrun(SliceOverrun {
            attempt: watched.attempt.clone(),
            process_id: watched.process_id,
            used_bytes,
            slice_bytes: watched.slice_bytes,
            context_bytes: watched.context_bytes,
        }));
    }
    None
}

/// The guard rule, for attempts under the guard: a process of the tree on the GPU with
/// no slot in the account. Returns the stop message once one has lasted past the grace.
fn judge_unguarded(
    watched: &WatchedAttempt,
    on_gpu: &[&ProcessUsage],
    reading: &WatchReading,
    remembered: &mut AttemptMemory,
    now: Instant,
) -> Option<String> {
    let account = watched.guard_account.as_ref()?;
    let (slots, unreadable) = match reading.guard_slots.get(account) {
        Some(Ok(slots)) => (slots.clone(), None),
        Some(Err(reason)) => (HashSet::new(), Some(reason.as_str())),
        None => (HashSet::new(), Some("it was not read")),
    };
    let unguarded: Vec<&&ProcessUsage> = on_gpu
        .iter()
        .filter(|process| !slots.contains(&process.process_id))
        .collect();
    remembered
        .unguarded_since
        .retain(|process_id, _| unguarded.iter().any(|p| p.process_id == *process_id));
    let mut stop = None;
    for process in unguarded {
        let since = *remembered
            .unguarded_since
            .entry(process.process_id)
            .or_insert(now);
        if stop.is_none() && now.duration_since(since) > GRACE {
            let account_note = unreadable
                .map(|reason| format!(" (its guard account cannot be read: {reason})"))
                .unwrap_or_default();
            stop = Some(format!(
                "stopped by the worker: process {} of attempt {} used the gpu without the \
                 guard (was LD_PRELOAD removed?): it held {} of device memory for more than \
                 {}s with no slot in the attempt's guard account{account_note}",
                process.process_id,
                attempt_key(&watched.attempt),
                HumanBytes(process.used_bytes),
                GRACE.as_secs(),
            ));
        }
    }
    stop
}

/// One round: reads through `source` on a blocking thread, decides, warns (tracing and
/// a log line to the scheduler through `reports`) and stops through `attempts`. `now`
/// is the time the round counts the grace with.
pub async fn watch_once(
    source: &impl WatchSource,
    attempts: &impl WatchedAttempts,
    memory: &mut WatchMemory,
    reports: &mpsc::UnboundedSender<Body>,
    now: Instant,
) {
    let watched = attempts.running();
    if watched.is_empty() {
        memory.attempts.clear();
        return;
    }
    let mut gpu_uuids: Vec<String> = watched.iter().map(|w| w.gpu_uuid.clone()).collect();
    gpu_uuids.sort();
    gpu_uuids.dedup();
    let guard_accounts: Vec<PathBuf> = watched
        .iter()
        .filter_map(|w| w.guard_account.clone())
        .collect();
    let source = source.clone();
    let reading =
        match tokio::task::spawn_blocking(move || source.read(&gpu_uuids, &guard_accounts)).await {
            Ok(reading) => reading,
            Err(error) => {
                tracing::warn!(%error, "the watchdog's reading stopped");
                return;
            }
        };
    // Only attempts that still run: one may have ended during the reading.
    let running: HashSet<String> = attempts
        .running()
        .iter()
        .map(|w| attempt_key(&w.attempt))
        .collect();
    let watched: Vec<WatchedAttempt> = watched
        .into_iter()
        .filter(|w| running.contains(&attempt_key(&w.attempt)))
        .collect();
    for finding in judge_round(&watched, &reading, memory, now) {
        match finding {
            WatchFinding::Overrun(overrun) => {
                tracing::warn!(
                    job = %overrun.attempt.job_id,
                    attempt = overrun.attempt.attempt_number,
                    process_id = overrun.process_id,
                    used_bytes = overrun.used_bytes,
                    slice_bytes = overrun.slice_bytes,
                    "an attempt uses device memory outside its slice"
                );
                let _ = reports.send(Body::Log(overrun.to_log_line()));
            }
            WatchFinding::Stop { attempt, reason } => {
                tracing::warn!(job = %attempt.job_id, attempt = attempt.attempt_number, %reason, "the watchdog stops an attempt");
                attempts.stop(
                    &attempt,
                    AttemptControl::StopAsFailed {
                        grace_period: STOP_GRACE_PERIOD,
                        reason,
                    },
                );
            }
        }
    }
}

/// The watchdog, for the worker's lifetime: a round every [`WATCH_INTERVAL`]. It runs
/// whether or not the worker has a session (attempts keep running without one); its
/// warnings wait in `reports` like every other report.
pub async fn run_watchdog(
    source: impl WatchSource,
    attempts: impl WatchedAttempts,
    reports: mpsc::UnboundedSender<Body>,
) {
    let mut memory = WatchMemory::default();
    let mut interval = tokio::time::interval(WATCH_INTERVAL);
    // A slow NVML reading delays the next round rather than bunching rounds after it.
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        watch_once(&source, &attempts, &mut memory, &reports, Instant::now()).await;
    }
}

/// Readings on a node: NVML for the GPUs, `/proc` for the trees, the guard accounts.
#[derive(Debug, Clone)]
pub struct SystemWatchSource {
    nvml: NvmlHandle,
    proc_root: PathBuf,
}

impl SystemWatchSource {
    pub fn new(nvml: NvmlHandle) -> SystemWatchSource {
        SystemWatchSource {
            nvml,
            proc_root: PathBuf::from("/proc"),
        }
    }
}

impl WatchSource for SystemWatchSource {
    fn read(&self, gpu_uuids: &[String], guard_accounts: &[PathBuf]) -> WatchReading {
        let mut gpu_processes = HashMap::new();
        for uuid in gpu_uuids {
            match self.nvml.compute_processes(uuid) {
                Ok(processes) => {
                    gpu_processes.insert(uuid.clone(), processes);
                }
                Err(error) => tracing::warn!(%error, "cannot read per-process gpu memory"),
            }
        }
        // No process on the watched GPUs: nothing to place in a tree.
        let parents = if gpu_processes
            .values()
            .any(|processes| !processes.is_empty())
        {
            read_process_parents(&self.proc_root)
        } else {
            HashMap::new()
        };
        let guard_slots = guard_accounts
            .iter()
            .map(|account| (account.clone(), account_process_ids(account)))
            .collect();
        WatchReading {
            gpu_processes,
            parents,
            guard_slots,
        }
    }
}

#[cfg(test)]
mod tests;
