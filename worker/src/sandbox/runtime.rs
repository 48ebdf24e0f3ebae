//! The OCI runtime's command line: finding and checking it, and the lifecycle calls the
//! worker makes (`run`, `kill --all`, `delete --force`, `list`), each against the
//! worker's own state directory (`--root`) so the worker never sees or touches another
//! user's containers.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use super::cgroups::AttemptCgroup;
use crate::error::WorkerError;

/// Runtimes looked for on `PATH`, in order. runc works on cgroup v1, v2 and the hybrid
/// layout; crun 1.8 refuses the hybrid one, so it comes second.
const RUNTIME_NAMES: [&str; 2] = ["runc", "crun"];

/// The runtime to use: `named` (`--oci-runtime`), checked, or the first of runc and crun
/// on `PATH`.
pub fn find_runtime(named: Option<&Path>) -> Result<PathBuf, WorkerError> {
    let invalid = |reason: String| WorkerError::invalid_setting("--oci-runtime", reason);
    let candidate = match named {
        Some(path) => path.to_path_buf(),
        None => RUNTIME_NAMES
            .iter()
            .find_map(|name| find_on_path(name))
            .ok_or_else(|| {
                invalid(
                    "no OCI runtime on PATH (runc or crun): install one (apt-get install runc), \
                     name it, or start with --insecure-no-sandbox"
                        .to_string(),
                )
            })?,
    };
    let output = std::process::Command::new(&candidate)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|error| invalid(format!("cannot run {}: {error}", candidate.display())))?;
    if !output.status.success() {
        return Err(invalid(format!(
            "{} --version failed ({}): {}",
            candidate.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    let version = String::from_utf8_lossy(&output.stdout);
    tracing::info!(
        runtime = %candidate.display(),
        version = %version.lines().next().unwrap_or_default(),
        "found the container runtime"
    );
    Ok(candidate)
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|directory| directory.join(name))
            .find(|candidate| candidate.is_file())
    })
}

/// The names of the containers in `state_directory`, as `runtime list -q` gives them.
pub fn list_containers(runtime: &Path, state_directory: &Path) -> Vec<String> {
    let output = std::process::Command::new(runtime)
        .arg("--root")
        .arg(state_directory)
        .args(["list", "-q"])
        .stdin(Stdio::null())
        .output();
    match output {
        Ok(output) if output.status.success() => String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .map(str::to_string)
            .collect(),
        Ok(output) => {
            tracing::warn!(
                stderr = %String::from_utf8_lossy(&output.stderr).trim(),
                "cannot list the containers of a previous run"
            );
            Vec::new()
        }
        Err(error) => {
            tracing::warn!(%error, "cannot list the containers of a previous run");
            Vec::new()
        }
    }
}

/// One run's container, as the runtime knows it.
#[derive(Debug, Clone)]
pub struct Container {
    runtime: PathBuf,
    state_directory: PathBuf,
    name: String,
    bundle: PathBuf,
    cgroup: AttemptCgroup,
    processes_file: PathBuf,
    memory_limit_bytes: u64,
}

impl Container {
    pub(super) fn new(
        runtime: PathBuf,
        state_directory: PathBuf,
        name: String,
        bundle: PathBuf,
        cgroup: AttemptCgroup,
        memory_limit_bytes: u64,
    ) -> Container {
        Container {
            runtime,
            state_directory,
            name,
            bundle,
            processes_file: cgroup.processes_file(),
            cgroup,
            memory_limit_bytes,
        }
    }

    /// The host memory limit, when the program's container reached it: the kernel's
    /// OOM killer then killed a process in it (the program itself, when it ended by
    /// SIGKILL). Read after the program ended and before [`Container::remove`].
    pub fn reached_memory_limit(&self) -> Option<u64> {
        self.cgroup
            .reached_memory_limit(self.memory_limit_bytes)
            .then_some(self.memory_limit_bytes)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The runtime and its state directory, which a command run's supervisor
    /// (`command_supervisor.rs`) signals the container through.
    pub fn runtime(&self) -> &Path {
        &self.runtime
    }

    pub fn state_directory(&self) -> &Path {
        &self.state_directory
    }

    /// The `cgroup.procs` file listing every process of the container (host pids): what
    /// the watchdog counts, since a process cannot leave its cgroup.
    pub fn processes_file(&self) -> &Path {
        &self.processes_file
    }

    fn runtime_command(&self) -> std::process::Command {
        let mut command = std::process::Command::new(&self.runtime);
        command
            .arg("--root")
            .arg(&self.state_directory)
            .stdin(Stdio::null());
        command
    }

    /// `runtime run --bundle B NAME`: in the foreground, so its stdout and stderr are the
    /// program's, it forwards the signals it gets to the program, and it exits with the
    /// program's status and removes the container.
    pub(super) fn run_command(&self) -> tokio::process::Command {
        let mut command = tokio::process::Command::from(self.runtime_command());
        command
            .arg("run")
            .arg("--bundle")
            .arg(&self.bundle)
            .arg(&self.name);
        command
    }

    /// The host pid of the container's first process (the program), once the runtime
    /// has created it; `None` when it ended or never started within a second. This is
    /// the process an operator (or the kernel) would kill, and what the worker records.
    pub async fn program_process_id(&self) -> Option<u32> {
        for _ in 0..100 {
            let output = tokio::process::Command::from(self.runtime_command())
                .args(["state", &self.name])
                .output()
                .await
                .ok()?;
            if output.status.success() {
                let state: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
                if let Some(pid) = state["pid"].as_u64().filter(|pid| *pid > 0) {
                    return u32::try_from(pid).ok();
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        None
    }

    /// Sends `signal` (`TERM`, `KILL`) to every process of the container, not only its
    /// first: a process the program started in a session of its own is reached too.
    pub fn signal_all(&self, signal: &str) -> std::io::Result<()> {
        let output = self
            .runtime_command()
            .args(["kill", "--all", &self.name, signal])
            .output()?;
        if output.status.success() {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "{} kill {signal} {}: {}",
                self.runtime.display(),
                self.name,
                String::from_utf8_lossy(&output.stderr).trim()
            )))
        }
    }

    /// Kills whatever still runs in the container and removes it and its bundle. Safe
    /// to call for a container that ended or never started.
    pub fn remove(&self) {
        let _ = self
            .runtime_command()
            .args(["delete", "--force", &self.name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        self.cgroup.remove();
        if let Err(error) = std::fs::remove_dir_all(&self.bundle)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(bundle = %self.bundle.display(), %error, "cannot remove a bundle");
        }
    }
}
