//! The watchdog over the device memory of the worker's attempts on real GPUs. Every
//! [`WATCH_INTERVAL`] it reads NVML's per-process usage of the GPUs its attempts run on
//! and each attempt's processes: the members of its container's cgroup when it runs in
//! one ([`WatchedAttempt::container_processes`]), else the attempt process and its
//! descendants (from `/proc`). Then:
//! - an attempt whose processes hold more than its slice plus the context allowance is
//!   warned about (a log line, again only at a new peak) and, once that was seen in
//!   [`BREACH_READINGS_TO_STOP`] of the readings of the last [`BREACH_WINDOW`], stopped:
//!   it ends FAILED with a message naming the numbers;
//! - an attempt that runs under the guard with a process on its GPU that has no slot in
//!   the attempt's guard account (the guard never saw it: `LD_PRELOAD` removed, a
//!   statically linked driver) is stopped the same way, counted in a window of its own.
//!   A slot holds the pid the process sees in its own (innermost) pid namespace, NVML
//!   the host pid, so the two are matched through `/proc/<pid>/status`. Engine attempts
//!   do not run under the guard and get only the first rule.
//!
//! Breaches are counted in a window, not timed from their start: a program that dips
//! under its limit for one reading every few seconds would restart such a clock for
//! ever while holding memory that is not its own most of the time.
//!
//! The decisions are pure ([`judge_round`]); the readings come through a [`WatchSource`]
//! ([`SystemWatchSource`] on a node, in `system_readings.rs`) and the attempts through
//! [`WatchedAttempts`], so the whole round is tested without NVML. Limits: an attempt
//! without a container (or whose cgroup cannot be read) is its process tree, which a
//! process leaves by double-forking to init; the worker must run in the host's pid
//! namespace, whose pids NVML reports; and nothing is seen between two readings.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use carve_core::bytes::HumanBytes;
use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use tokio::sync::mpsc;

use crate::attempt_process::AttemptControl;
use crate::nvml::ProcessUsage;

mod system_readings;

pub use system_readings::{
    SystemWatchSource, innermost_pid_from_status, parent_from_stat, process_ids_from_cgroup_procs,
    read_cgroup_members, read_innermost_pids, read_process_parents,
};

/// How often the watchdog reads. NVML's per-process query and a walk of `/proc` take
/// milliseconds; once a second keeps a breach's cost to a neighbour to seconds.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// In how many of the readings within [`BREACH_WINDOW`] a rule must be seen breached
/// before the attempt is stopped. NVML's numbers trail the program: a framework that
/// frees and allocates again, an allocator trimming its pool at the next synchronize,
/// or a process NVML listed as it exited all read as a breach once, and two such
/// passing readings can fall close together. Three within the window are no longer
/// passing: the program holds what is not its own. A steady breach is stopped at its
/// third reading, two seconds after the first, so a neighbour is short of memory for
/// seconds, about as with the continuous 3 s this replaces.
pub const BREACH_READINGS_TO_STOP: usize = 3;

/// How far back breaches are counted: the readings taken less than this before the
/// current one (at [`WATCH_INTERVAL`], the last ten readings). A reading within the
/// limit does not clear the count, so a program that dips under its limit for a
/// reading between breaches is stopped all the same. Ten seconds bounds what goes
/// unseen: a program over its limit in one reading of every four is stopped (three
/// breaches in ten seconds), and one that stays under it longer holds memory not its
/// own in two readings of ten at most; a longer window would also add up an honest
/// program's rare passing readings over a long run into a stop.
pub const BREACH_WINDOW: Duration = Duration::from_secs(10);

/// The SIGTERM-to-SIGKILL time of a stop: short, since the attempt is taking memory
/// that is not its own, but enough for a framework to flush its logs.
pub const STOP_GRACE_PERIOD: Duration = Duration::from_secs(2);

/// An attempt the watchdog watches: one on a real GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchedAttempt {
    pub attempt: v1::AttemptRef,
    pub gpu_uuid: String,
    /// The attempt process: the root of its process tree, which is what the attempt's
    /// processes are taken to be when it has no container or its container's list
    /// cannot be read.
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
    /// The `cgroup.procs` file of the attempt's container's cgroup (host pids, one a
    /// line), for an attempt that runs in a container. Its members (and those of the
    /// cgroups below it) are the attempt's processes: a process cannot leave its cgroup
    /// as it can leave a process tree.
    pub container_processes: Option<PathBuf>,
}

impl WatchedAttempt {
    /// What the attempt's processes may hold on the GPU: slice plus context.
    pub fn allowed_bytes(&self) -> u64 {
        self.slice_bytes.saturating_add(self.context_bytes)
    }
}

/// What one round reads for its attempts, each named once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchTargets {
    pub gpu_uuids: Vec<String>,
    pub guard_accounts: Vec<PathBuf>,
    pub container_process_files: Vec<PathBuf>,
}

impl WatchTargets {
    pub fn of(attempts: &[WatchedAttempt]) -> WatchTargets {
        fn sorted<T: Ord>(mut items: Vec<T>) -> Vec<T> {
            items.sort();
            items.dedup();
            items
        }
        WatchTargets {
            gpu_uuids: sorted(attempts.iter().map(|w| w.gpu_uuid.clone()).collect()),
            guard_accounts: sorted(
                attempts
                    .iter()
                    .filter_map(|w| w.guard_account.clone())
                    .collect(),
            ),
            container_process_files: sorted(
                attempts
                    .iter()
                    .filter_map(|w| w.container_processes.clone())
                    .collect(),
            ),
        }
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
    /// By container `cgroup.procs` file: its processes (host pids). A file that could
    /// not be read is missing.
    pub container_members: HashMap<PathBuf, HashSet<u32>>,
    /// For the processes on the watched GPUs: host pid -> its pid in its innermost pid
    /// namespace, which is what the guard records in its account. A process missing
    /// here (ended, or `/proc` not read) is taken to be its host pid.
    pub innermost_pids: HashMap<u32, u32>,
}

/// Where readings come from: NVML, `/proc` and the cgroups on a node
/// ([`SystemWatchSource`]), a script in tests.
pub trait WatchSource: Clone + Send + 'static {
    /// Blocking: called on a blocking thread.
    fn read(&self, targets: &WatchTargets) -> WatchReading;
}

/// What the watchdog needs from the worker.
pub trait WatchedAttempts {
    /// The attempts running now on real GPUs.
    fn running(&self) -> Vec<WatchedAttempt>;
    /// Tells one attempt's watcher to stop it; nothing if it has ended meanwhile.
    fn stop(&self, attempt: &v1::AttemptRef, control: AttemptControl);
}

/// An attempt's processes seen over its slice and context, not (yet) stopped for it: a
/// warning.
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
            stream: String::new(),
        }
    }
}

/// What one round decided about one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchFinding {
    /// Over its slice and context, not (yet) in enough readings to be stopped.
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
    /// The readings that saw the attempt over its slice and context.
    overrun_readings: BreachWindow,
    /// The readings that saw a process of the attempt on its GPU without a slot in its
    /// guard account. Counted for the attempt, not per process, so a program that
    /// starts a new unguarded process every few readings is counted all the same.
    unguarded_readings: BreachWindow,
    /// A stop was asked for: nothing more to decide.
    stopped: bool,
}

/// When one rule was seen breached, over the last [`BREACH_WINDOW`].
#[derive(Debug, Default)]
struct BreachWindow {
    breach_times: VecDeque<Instant>,
}

impl BreachWindow {
    /// Counts a reading at `now` that saw the breach, forgets those that fell out of the
    /// window, and says whether the breach has now been seen in enough readings to stop
    /// the attempt.
    fn breached_enough_at(&mut self, now: Instant) -> bool {
        while self
            .breach_times
            .front()
            .is_some_and(|&time| now.duration_since(time) >= BREACH_WINDOW)
        {
            self.breach_times.pop_front();
        }
        self.breach_times.push_back(now);
        self.breach_times.len() >= BREACH_READINGS_TO_STOP
    }
}

/// How a stop message says how often the breach was seen.
fn breach_count_phrase() -> String {
    format!(
        "in {BREACH_READINGS_TO_STOP} of its last {} s of readings",
        BREACH_WINDOW.as_secs()
    )
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

/// The attempt's processes (host pids) in this reading: its container's members, or
/// its process tree.
pub fn attempt_processes(watched: &WatchedAttempt, reading: &WatchReading) -> HashSet<u32> {
    if let Some(members) = watched
        .container_processes
        .as_ref()
        .and_then(|file| reading.container_members.get(file))
    {
        return members.clone();
    }
    // No container, or its list could not be read: the container is still being made
    // (runc has not made its cgroup yet) or is ending (its cgroup is gone). The process
    // tree is the best reading left for those seconds; it misses only processes that
    // left the tree.
    process_tree(watched.process_id, &reading.parents)
}

/// The pure part of the watchdog: what to do about each attempt after one reading at
/// `now`. `memory` carries the breaches within the window and the warnings already
/// given, and forgets attempts that are no longer in `attempts`.
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
        // No reading of its GPU: nothing seen either way, so the breaches counted
        // within the window stay as they are, as they do through a reading within the
        // limit.
        let Some(processes) = reading.gpu_processes.get(&watched.gpu_uuid) else {
            continue;
        };
        let members = attempt_processes(watched, reading);
        let on_gpu: Vec<&ProcessUsage> = processes
            .iter()
            .filter(|process| members.contains(&process.process_id))
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

/// The overrun rule: the attempt's usage over slice + context. Warns (pushing onto
/// `findings`) at each new peak; returns the stop message once the overrun was seen in
/// [`BREACH_READINGS_TO_STOP`] readings within the window.
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
        return None;
    }
    if remembered.overrun_readings.breached_enough_at(now) {
        return Some(format!(
            "stopped by the worker: attempt {} held {} of device memory on its gpu, more \
             than its slice of {} plus the context allowance of {}; it was over its slice \
             {}",
            attempt_key(&watched.attempt),
            HumanBytes(used_bytes),
            HumanBytes(watched.slice_bytes),
            HumanBytes(watched.context_bytes),
            breach_count_phrase(),
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

/// The guard rule, for attempts under the guard: a process of the attempt on the GPU
/// with no slot in the account. Returns the stop message once that was seen in
/// [`BREACH_READINGS_TO_STOP`] readings within the window.
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
    // The guard runs inside the process and records the pid the process sees, its
    // pid in its innermost namespace (1 for a container's first process), where NVML
    // lists the host pid. Outside a container the two are the same.
    let innermost_pid = |process: &ProcessUsage| {
        reading
            .innermost_pids
            .get(&process.process_id)
            .copied()
            .unwrap_or(process.process_id)
    };
    let unguarded = on_gpu
        .iter()
        .find(|process| !slots.contains(&innermost_pid(process)))?;
    if !remembered.unguarded_readings.breached_enough_at(now) {
        return None;
    }
    let namespace_note = match innermost_pid(unguarded) {
        pid if pid == unguarded.process_id => String::new(),
        pid => format!(" (pid {pid} in its container)"),
    };
    let account_note = unreadable
        .map(|reason| format!(" (its guard account cannot be read: {reason})"))
        .unwrap_or_default();
    Some(format!(
        "stopped by the worker: process {}{namespace_note} of attempt {} used the gpu \
         without the guard (was LD_PRELOAD removed?): it held {} of device memory with no \
         slot in the attempt's guard account; the attempt had such a process {}\
         {account_note}",
        unguarded.process_id,
        attempt_key(&watched.attempt),
        HumanBytes(unguarded.used_bytes),
        breach_count_phrase(),
    ))
}

/// One round: reads through `source` on a blocking thread, decides, warns (tracing and
/// a log line to the scheduler through `reports`) and stops through `attempts`. `now`
/// is the time the round counts its breaches at.
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
    let targets = WatchTargets::of(&watched);
    let source = source.clone();
    let reading = match tokio::task::spawn_blocking(move || source.read(&targets)).await {
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

#[cfg(test)]
mod tests;
