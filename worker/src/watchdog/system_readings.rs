//! The watchdog's readings on a node: NVML for the real GPUs, the worker's ledgers for
//! the simulated ones (`simulated_gpu_ledger.rs`, which play the kernel driver's part), `/proc` for process trees and
//! each GPU process's pid inside its container, the containers' `cgroup.procs` files for
//! their members, and the guard accounts. Each is read through a small pure parser so
//! the text formats are tested without a node.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::guard_environment::account_process_ids;
use crate::nvml::NvmlHandle;
use crate::simulated_gpu_ledger::SimulatedGpuLedger;

use super::{WatchReading, WatchSource, WatchTargets};

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

/// A process's pid in its innermost pid namespace, from the text of
/// `/proc/<pid>/status`: the last field of its `NSpid:` line, which lists the pid from
/// the namespace `/proc` was mounted in down to the process's own ("NSpid:\t4711\t12\t1"
/// is pid 1 in its container). `None` without the line (kernels before 4.1) or with a
/// torn one.
pub fn innermost_pid_from_status(status: &str) -> Option<u32> {
    let line = status
        .lines()
        .find_map(|line| line.strip_prefix("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// The innermost pid of each of `process_ids`, read from `proc_root` (`/proc`); a
/// process whose status has no `NSpid:` line is its own host pid there. A process that
/// ended meanwhile is left out, and the watchdog takes its host pid.
pub fn read_innermost_pids(
    proc_root: &Path,
    process_ids: impl IntoIterator<Item = u32>,
) -> HashMap<u32, u32> {
    process_ids
        .into_iter()
        .filter_map(|process_id| {
            let status =
                std::fs::read_to_string(proc_root.join(process_id.to_string()).join("status"))
                    .ok()?;
            let innermost = innermost_pid_from_status(&status).unwrap_or(process_id);
            Some((process_id, innermost))
        })
        .collect()
}

/// The process ids in the text of a `cgroup.procs` file: one a line. A line that is not
/// a number (none should be) is skipped rather than losing the whole list.
pub fn process_ids_from_cgroup_procs(text: &str) -> HashSet<u32> {
    text.lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

/// The processes of a cgroup and of every cgroup below it, from its `cgroup.procs`
/// file. The descendants count too: a cgroup's `cgroup.procs` lists only the processes
/// directly in it, and a container whose cgroup was delegated to it can move a process
/// into a child cgroup it made. An error only when `procs_file` itself cannot be read; a
/// child cgroup removed while it is read is skipped.
pub fn read_cgroup_members(procs_file: &Path) -> std::io::Result<HashSet<u32>> {
    let mut members = process_ids_from_cgroup_procs(&std::fs::read_to_string(procs_file)?);
    let mut to_visit: Vec<PathBuf> = procs_file
        .parent()
        .into_iter()
        .map(Path::to_path_buf)
        .collect();
    while let Some(cgroup) = to_visit.pop() {
        let Ok(entries) = std::fs::read_dir(&cgroup) else {
            continue;
        };
        for entry in entries.flatten() {
            // Not followed through links: a cgroup filesystem has none, and a link could
            // only lead outside the cgroup.
            if !entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                continue;
            }
            let child = entry.path();
            if let Ok(text) = std::fs::read_to_string(child.join("cgroup.procs")) {
                members.extend(process_ids_from_cgroup_procs(&text));
            }
            to_visit.push(child);
        }
    }
    Ok(members)
}

/// Readings on a node: NVML for the real GPUs, the ledgers of the simulated ones, `/proc`
/// for the trees and the innermost pids, the containers' `cgroup.procs`, the guard
/// accounts.
#[derive(Debug, Clone)]
pub struct SystemWatchSource {
    nvml: Option<NvmlHandle>,
    /// By simulated GPU uuid.
    simulated_gpus: HashMap<String, Arc<SimulatedGpuLedger>>,
    proc_root: PathBuf,
}

impl SystemWatchSource {
    pub fn new(
        nvml: Option<NvmlHandle>,
        simulated_gpus: HashMap<String, Arc<SimulatedGpuLedger>>,
    ) -> SystemWatchSource {
        SystemWatchSource {
            nvml,
            simulated_gpus,
            proc_root: PathBuf::from("/proc"),
        }
    }
}

impl WatchSource for SystemWatchSource {
    fn read(&self, targets: &WatchTargets) -> WatchReading {
        let mut gpu_processes = HashMap::new();
        for uuid in &targets.gpu_uuids {
            if let Some(ledger) = self.simulated_gpus.get(uuid) {
                gpu_processes.insert(uuid.clone(), ledger.usage());
                continue;
            }
            let Some(nvml) = &self.nvml else {
                continue;
            };
            match nvml.compute_processes(uuid) {
                Ok(processes) => {
                    gpu_processes.insert(uuid.clone(), processes);
                }
                Err(error) => tracing::warn!(%error, "cannot read per-process gpu memory"),
            }
        }
        let processes_on_gpus: HashSet<u32> = gpu_processes
            .values()
            .flatten()
            .map(|process| process.process_id)
            .collect();
        // No process on the watched GPUs: no attempt to place its processes in, so
        // neither the trees nor the containers are read.
        let (parents, container_members, innermost_pids) = if processes_on_gpus.is_empty() {
            (HashMap::new(), HashMap::new(), HashMap::new())
        } else {
            // A container whose list cannot be read (starting, ending) is left out: the
            // watchdog falls back to the attempt's process tree for it.
            let container_members = targets
                .container_process_files
                .iter()
                .filter_map(|file| Some((file.clone(), read_cgroup_members(file).ok()?)))
                .collect();
            (
                read_process_parents(&self.proc_root),
                container_members,
                read_innermost_pids(&self.proc_root, processes_on_gpus),
            )
        };
        // The accounts last, after NVML: the guard registers a process at its `cuInit`,
        // before it has a context NVML could list, so a process NVML showed has its slot
        // by now.
        let guard_slots = targets
            .guard_accounts
            .iter()
            .map(|account| (account.clone(), account_process_ids(account)))
            .collect();
        WatchReading {
            gpu_processes,
            parents,
            guard_slots,
            container_members,
            innermost_pids,
        }
    }
}
