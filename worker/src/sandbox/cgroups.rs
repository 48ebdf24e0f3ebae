//! Where a container's processes are counted and limited: each run gets its own cgroup
//! `carve/<name>` (the attempt's), and the runtime puts the program in a child of it,
//! `carve/<name>/program`, with the limits. The runtime removes the child when the
//! program ends; the worker keeps the parent until it has read from it why the program
//! ended (the memory it reached), then removes it. The same layout on a unified (v2)
//! hierarchy and on v1's per-controller ones.

use std::path::{Path, PathBuf};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// One run's cgroups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptCgroup {
    /// `carve/<name>`, relative to a hierarchy's root.
    relative: PathBuf,
}

impl AttemptCgroup {
    pub fn new(name: &str) -> AttemptCgroup {
        AttemptCgroup {
            relative: Path::new("carve").join(name),
        }
    }

    /// The cgroup the runtime makes for the program (`linux.cgroupsPath`).
    pub fn runtime_path(&self) -> PathBuf {
        Path::new("/").join(&self.relative).join("program")
    }

    fn unified() -> bool {
        Path::new(CGROUP_ROOT).join("cgroup.controllers").exists()
    }

    /// The attempt's cgroup in one controller's hierarchy (v1), or in the unified one.
    fn directory(&self, controller: &str) -> PathBuf {
        if AttemptCgroup::unified() {
            Path::new(CGROUP_ROOT).join(&self.relative)
        } else {
            Path::new(CGROUP_ROOT).join(controller).join(&self.relative)
        }
    }

    /// The `cgroup.procs` of the attempt's cgroup, whose descendants hold every process
    /// of the container (the watchdog reads the cgroups below it too).
    pub fn processes_file(&self) -> PathBuf {
        self.directory("pids").join("cgroup.procs")
    }

    /// Whether the container's memory reached `limit_bytes`, which is how the kernel's
    /// OOM killer came to kill a process in it: on v2 the OOM kills the attempt's
    /// cgroup counts for its descendants (`memory.events`), on v1 (which counts them
    /// only where the limit is, in the child the runtime removed) the attempt's cgroup's
    /// peak, which counts its descendants' memory.
    pub fn reached_memory_limit(&self, limit_bytes: u64) -> bool {
        let memory = self.directory("memory");
        if AttemptCgroup::unified() {
            std::fs::read_to_string(memory.join("memory.events"))
                .ok()
                .and_then(|events| counter(&events, "oom_kill"))
                .is_some_and(|kills| kills > 0)
        } else {
            std::fs::read_to_string(memory.join("memory.max_usage_in_bytes"))
                .ok()
                .and_then(|text| text.trim().parse::<u64>().ok())
                .is_some_and(|peak| peak >= limit_bytes)
        }
    }

    /// Removes the attempt's cgroup and the program's below it, in every hierarchy. Only
    /// empty cgroups can go: one whose processes still run is left (the runtime's
    /// `delete --force` ends them first).
    pub fn remove(&self) {
        let directories: Vec<PathBuf> = if AttemptCgroup::unified() {
            vec![self.directory("")]
        } else {
            let Ok(hierarchies) = std::fs::read_dir(CGROUP_ROOT) else {
                return;
            };
            hierarchies
                .flatten()
                .map(|hierarchy| hierarchy.path().join(&self.relative))
                .collect()
        };
        for directory in directories {
            // The runtime normally removed the program's own already.
            let _ = std::fs::remove_dir(directory.join("program"));
            let _ = std::fs::remove_dir(directory);
        }
    }
}

/// The value of `name` in a flat-keyed cgroup file ("oom_kill 3").
fn counter(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        (key == name).then(|| value.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_program_runs_in_a_child_of_the_attempt_s_cgroup() {
        let cgroup = AttemptCgroup::new("carve-job-1-1");
        assert_eq!(
            cgroup.runtime_path(),
            Path::new("/carve/carve-job-1-1/program")
        );
        assert!(
            cgroup
                .processes_file()
                .ends_with("carve/carve-job-1-1/cgroup.procs")
        );
    }

    #[test]
    fn counters_are_read_by_name() {
        let events = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\n";
        assert_eq!(counter(events, "oom_kill"), Some(1));
        assert_eq!(counter(events, "oom"), Some(2));
        assert_eq!(counter(events, "absent"), None);
    }
}
