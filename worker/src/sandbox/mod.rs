//! Every attempt in its own OCI container: the worker writes a bundle per run of an
//! attempt's program (the engine's attempt process or a command job's program) and starts
//! it with a real OCI runtime (runc, or crun where its cgroup layout is supported), so that
//! a tenant's program touches nothing but its own slice, files and processes.
//!
//! What a container gets (the bundle itself is `bundle.rs`):
//! - a user namespace mapping container ids `0..65536` to the tenant's own host range
//!   (`identities.rs`: two tenants never share a host uid; root inside is nobody outside);
//!   the program runs as [`CONTAINER_UID`] with every capability dropped,
//!   `no_new_privileges` and a seccomp filter that refuses the calls a training program
//!   never needs (ptrace, mount, bpf, keyrings, kernel modules, ...);
//! - its own pid, mount, ipc, uts and cgroup namespaces, and a network namespace with only
//!   loopback unless the operator lets the tenant use the host's network
//!   (`--sandbox-host-network TENANT`): the scheduler and the worker are not reachable;
//! - the host's system directories read-only (until job images exist), a private `/tmp`
//!   and `/dev/shm` with size limits, and only the paths its request names: the job's
//!   directories read-write (owned by the tenant's uid, 0700), its program, spec and data
//!   read-only; nothing of the worker (no token, no records, no other job's directories);
//! - only its own GPU's device nodes (plus `nvidiactl`, `nvidia-uvm`);
//! - a cgroup with host memory, pids and CPU limits ([`AttemptLimits`]).
//!
//! Ending a run ends its whole container: when its first process exits the kernel kills
//! the rest of its pid namespace; a stop signals every process of the container through
//! the runtime (`kill --all`); a worker that comes back after a `kill -9` ends every
//! container in its runtime state directory before it runs anything
//! ([`Sandbox::remove_leftover_containers`]).

mod bundle;
pub mod cdi;
mod cgroups;
mod gang_network;
mod identities;
mod image_bundle;
mod limits;
mod runtime;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Mutex;

pub use bundle::{AttemptLimits, ContainerRequest, HostPath, gpu_device_nodes};
pub use cgroups::AttemptCgroup;
pub use identities::{TenantIdentities, TenantIdentity};
pub use limits::{TenantLimits, effective_limits, parse_tenant_limits};
pub use runtime::{Container, find_runtime};

use crate::error::WorkerError;

/// The uid and gid the program runs as inside its container; it maps to the tenant's
/// host range + 1000, never to a uid of the host's own users.
pub const CONTAINER_UID: u32 = 1000;

/// Host ids given to each tenant, as container ids `0..IDS_PER_TENANT` (the usual
/// subordinate-id range, so programs that switch users inside still map).
pub const IDS_PER_TENANT: u32 = 65_536;

/// The first host uid of the tenants' ranges: far above the host's own users and the
/// ranges `useradd` hands out in `/etc/subuid` (100000 + 65536 per user).
pub const DEFAULT_FIRST_HOST_UID: u32 = 1_000_000_000;

/// Whether attempts run in containers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxPolicy {
    /// A production worker: it refuses to start without a runtime.
    Required,
    /// `carve dev` and tests on a machine without a runtime: contain attempts when a
    /// runtime is found, otherwise run them uncontained and say so loudly.
    IfAvailable,
    /// `--insecure-no-sandbox`: attempts run with the worker's rights, and each says so.
    Off,
}

/// The operator's sandbox settings.
#[derive(Debug, Clone)]
pub struct SandboxSettings {
    pub policy: SandboxPolicy,
    /// `--oci-runtime`: the runtime to use; found on `PATH` (runc, then crun) without it.
    pub runtime: Option<PathBuf>,
    /// The first host uid of the tenants' ranges ([`DEFAULT_FIRST_HOST_UID`]).
    pub first_host_uid: u32,
    /// Each attempt's limits.
    pub limits: AttemptLimits,
    /// Host directories every container also sees read-only (`--sandbox-read-only`: a
    /// conda or a virtual environment outside `/usr`, a shared data set).
    pub read_only_host_paths: Vec<PathBuf>,
    /// Tenants whose containers share the host's network (`--sandbox-host-network`).
    pub host_network_tenants: Vec<String>,
    /// Host directories under which a job may name its working directory
    /// (`--sandbox-job-path`), read-only: where the operator puts tenants' code. A job
    /// that names a directory elsewhere is refused, whatever the file permissions say:
    /// otherwise a tenant could name another's checkpoints, or the worker's files.
    pub job_paths: Vec<PathBuf>,
    /// Where CDI specs are read (`--cdi-dir`; [`cdi::DEFAULT_CDI_DIRECTORIES`]), in
    /// increasing priority: a real GPU's container gets the device nodes of the spec
    /// that names it, else the built-in list ([`gpu_devices`]).
    pub cdi_directories: Vec<PathBuf>,
    /// Tenants' overrides of `limits` (`--tenant-limits`); a job may lower its own
    /// further ([`effective_limits`]).
    pub tenant_limits: BTreeMap<String, TenantLimits>,
    /// Job images (`crate::image`): the cache's place, limit and sources; `None`: the
    /// defaults under the worker's directory (`images/`).
    pub images: Option<crate::image::ImageSettings>,
}

impl Default for SandboxSettings {
    fn default() -> Self {
        SandboxSettings {
            policy: SandboxPolicy::IfAvailable,
            runtime: None,
            first_host_uid: DEFAULT_FIRST_HOST_UID,
            limits: AttemptLimits::default(),
            read_only_host_paths: Vec::new(),
            host_network_tenants: Vec::new(),
            job_paths: Vec::new(),
            cdi_directories: cdi::DEFAULT_CDI_DIRECTORIES
                .iter()
                .map(PathBuf::from)
                .collect(),
            tenant_limits: BTreeMap::new(),
            images: None,
        }
    }
}

/// The worker's sandbox: a checked runtime, where its state and bundles live, and the
/// tenants' host ids.
#[derive(Debug)]
pub struct Sandbox {
    runtime: PathBuf,
    /// The worker's own directory (checkpoints, records, bundles), which no job may
    /// name as its own.
    worker_directory: PathBuf,
    state_directory: PathBuf,
    bundle_directory: PathBuf,
    identities: Mutex<TenantIdentities>,
    settings: SandboxSettings,
    /// The node's job images, which only contained attempts run in.
    images: crate::image::ImageCache,
}

/// Why a worker runs its attempts uncontained, for its log and each attempt's log.
pub const UNCONTAINED_WARNING: &str = "this attempt is NOT contained: it runs with the \
     worker's rights (its files, its processes, its network), because the worker has no \
     OCI runtime (install runc) or was started with --insecure-no-sandbox";

/// Why a worker that is not root cannot contain attempts.
const NOT_ROOT: &str = "containers with a user namespace per tenant need the worker to run as \
                        root (as kubelet and slurmd do); or --insecure-no-sandbox";

/// Why attempts under `settings` would run uncontained on this machine, for a front end
/// that says so before it starts a worker (`carve dev`); `None` when they will be
/// contained. The same checks as [`Sandbox::open`], which logs them.
pub fn uncontained_reason(settings: &SandboxSettings) -> Option<String> {
    if settings.policy == SandboxPolicy::Off {
        return Some("--insecure-no-sandbox".to_string());
    }
    if let Err(error) = find_runtime(settings.runtime.as_deref()) {
        return Some(error.to_string());
    }
    (!rustix::process::geteuid().is_root()).then(|| NOT_ROOT.to_string())
}

impl Sandbox {
    /// The sandbox as `settings` ask, with its files under `worker_directory` (the
    /// checkpoint directory) for the node `hostname`; `None` when attempts run
    /// uncontained (policy `Off`, or `IfAvailable` without a runtime), which is logged
    /// as an error so nobody misses it.
    pub fn open(
        settings: &SandboxSettings,
        worker_directory: &Path,
        hostname: &str,
    ) -> Result<Option<Sandbox>, WorkerError> {
        if settings.policy == SandboxPolicy::Off {
            tracing::error!("--insecure-no-sandbox: {UNCONTAINED_WARNING}");
            return Ok(None);
        }
        let runtime = match find_runtime(settings.runtime.as_deref()) {
            Ok(runtime) => runtime,
            Err(error) if settings.policy == SandboxPolicy::IfAvailable => {
                tracing::error!(%error, "no container runtime: {UNCONTAINED_WARNING}");
                return Ok(None);
            }
            Err(error) => return Err(error),
        };
        if !rustix::process::geteuid().is_root() {
            if settings.policy == SandboxPolicy::IfAvailable {
                tracing::error!("{NOT_ROOT}: {UNCONTAINED_WARNING}");
                return Ok(None);
            }
            return Err(WorkerError::invalid_setting("--oci-runtime", NOT_ROOT));
        }
        let directory = worker_directory.join("sandbox");
        let state_directory = directory.join("runtime-state").join(hostname);
        let bundle_directory = directory.join("bundles").join(hostname);
        for path in [&state_directory, &bundle_directory] {
            std::fs::create_dir_all(path).map_err(|error| {
                WorkerError::io(format!("cannot create {}", path.display()), error)
            })?;
        }
        // The runtime sets a container's root up as the container's root user (the
        // tenant's first host uid), which must pass through every directory above it,
        // whatever the worker's umask; nobody but the worker may list what is there (the
        // configs hold tenants' secrets).
        for path in [
            &directory,
            &directory.join("runtime-state"),
            &directory.join("bundles"),
            &state_directory,
            &bundle_directory,
        ] {
            traversable_only(path)?;
        }
        if let Some(closed) = closed_ancestor(&directory) {
            // Seen on an H100 machine (cgroup v2): runc's bind of every container's root
            // was refused with "permission denied" under mktemp's 0700 directory. Other
            // kernels let it pass, so this is said, not refused; the worker does not
            // change directories it does not own.
            tracing::error!(
                directory = %closed.display(),
                "others may not pass through this directory above the worker's (no o+x):                  on some kernels the runtime cannot reach a container's root through it,                  and every attempt fails to start; run `chmod o+x` on it or use a worker                  directory elsewhere"
            );
        }
        // One table per node: nodes sharing a checkpoint directory (NFS) must not
        // rewrite one file together.
        let identities = TenantIdentities::open(
            &directory.join(format!("tenant-ids-{hostname}.json")),
            settings.first_host_uid,
            IDS_PER_TENANT,
        )?;
        tracing::info!(runtime = %runtime.display(), "every attempt runs in its own container");
        let worker_directory = worker_directory.canonicalize().map_err(|error| {
            WorkerError::io(
                format!("cannot resolve {}", worker_directory.display()),
                error,
            )
        })?;
        let image_settings = settings
            .images
            .clone()
            .unwrap_or_else(|| crate::image::ImageSettings::under(&worker_directory));
        let images = crate::image::ImageCache::open(&image_settings).map_err(|failure| {
            WorkerError::invalid_setting("--image-cache", failure.to_string())
        })?;
        Ok(Some(Sandbox {
            runtime,
            worker_directory,
            state_directory,
            bundle_directory,
            identities: Mutex::new(identities),
            settings: settings.clone(),
            images,
        }))
    }

    /// The host uid and gid `tenant`'s programs run as: the owner to give the
    /// directories they write.
    pub fn program_owner(&self, tenant: &str) -> Result<(u32, u32), WorkerError> {
        let identity = self.identity(tenant)?;
        let id = identity.first_host_id + CONTAINER_UID;
        Ok((id, id))
    }

    fn identity(&self, tenant: &str) -> Result<TenantIdentity, WorkerError> {
        self.identities
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .identity_of(tenant)
    }

    /// A directory a job names (`field`, e.g. `command.working_directory`) as the host
    /// path its container may read: resolved (no symlink leads elsewhere), and only
    /// under one of the operator's [`SandboxSettings::job_paths`] and outside the
    /// worker's own directory.
    pub fn job_path(&self, field: &str, requested: &Path) -> Result<PathBuf, WorkerError> {
        let refused = |reason: String| {
            WorkerError::Attempt(format!("{field}: {}: {reason}", requested.display()))
        };
        let resolved = requested
            .canonicalize()
            .map_err(|error| refused(format!("cannot be resolved ({error})")))?;
        if resolved.starts_with(&self.worker_directory) {
            return Err(refused(format!(
                "is inside the worker's own directory {}",
                self.worker_directory.display()
            )));
        }
        let allowed = self
            .settings
            .job_paths
            .iter()
            .filter_map(|root| root.canonicalize().ok())
            .any(|root| resolved.starts_with(root));
        if !allowed {
            return Err(refused(format!(
                "is not under a directory this worker lets jobs name (--sandbox-job-path: {})",
                self.settings
                    .job_paths
                    .iter()
                    .map(|root| root.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        Ok(resolved)
    }

    /// The operator's default limits for each attempt (a tenant's override and the
    /// job's own ask may change them: [`effective_limits`]).
    pub fn limits(&self) -> &AttemptLimits {
        &self.settings.limits
    }

    /// Writes the bundle of one run and returns the command that runs it (`runtime run`,
    /// whose stdio is the program's, and whose exit status is the program's: see
    /// [`container_exit_status`]) with the handle to stop and remove it.
    pub fn prepare(
        &self,
        request: &ContainerRequest,
    ) -> Result<(tokio::process::Command, Container), WorkerError> {
        let identity = self.identity(&request.tenant)?;
        let host_network = self
            .settings
            .host_network_tenants
            .iter()
            .any(|tenant| tenant == &request.tenant);
        let settings = SandboxSettings {
            limits: effective_limits(
                &self.settings.limits,
                &self.settings.tenant_limits,
                &request.tenant,
                &request.asked_limits,
            ),
            ..self.settings.clone()
        };
        let spec = bundle::container_spec(
            request,
            &identity,
            &settings,
            host_network,
            &AttemptCgroup::new(&request.name).runtime_path(),
        )?;
        let bundle = self.bundle_directory.join(&request.name);
        let container = self.container(&request.name, settings.limits.memory_bytes);
        // A bundle of the same name is a run that a worker killed mid-way left behind.
        container.remove();
        bundle::write_bundle(&bundle, &spec, &identity)?;
        Ok((container.run_command(), container))
    }

    /// The handle of the container `name`, whether or not it exists, whose memory limit
    /// is `memory_bytes`.
    fn container(&self, name: &str, memory_bytes: u64) -> Container {
        Container::new(
            self.runtime.clone(),
            self.state_directory.clone(),
            name.to_string(),
            self.bundle_directory.join(name),
            AttemptCgroup::new(name),
            memory_bytes,
        )
    }

    /// Ends and removes every container in this worker's runtime state: those a
    /// previous life of the worker left running (a `kill -9` of the worker leaves its
    /// containers without their supervisor). Returns their names.
    pub fn remove_leftover_containers(&self) -> Vec<String> {
        let names = runtime::list_containers(&self.runtime, &self.state_directory);
        for name in &names {
            self.container(name, self.settings.limits.memory_bytes)
                .remove();
        }
        // Bundles whose containers never started (or were removed above).
        if let Ok(entries) = std::fs::read_dir(&self.bundle_directory) {
            for entry in entries.flatten() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        names
    }
}

/// The program's exit status from the runtime's: `runc run` exits with the program's
/// code, or with 128 + the signal that ended it, as a shell reports it. `own_codes` are
/// codes above 128 the program is known to exit with itself (the engine's attempt
/// process exits 143 once it checkpointed on SIGTERM); any other such code is read as
/// the signal. (A user program's own `exit(137)` reads as SIGKILL: the runtime does not
/// tell them apart.)
pub fn container_exit_status(status: ExitStatus, own_codes: &[i32]) -> ExitStatus {
    match status.code() {
        Some(code @ 129..=192) if !own_codes.contains(&code) => ExitStatus::from_raw(code - 128),
        _ => status,
    }
}

/// The first directory above `path` that others may not pass through, if any: a
/// container's root user is "others" to the host's directories.
fn closed_ancestor(path: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    path.ancestors().skip(1).find_map(|ancestor| {
        let mode = std::fs::metadata(ancestor).ok()?.permissions().mode();
        (mode & 0o001 == 0).then(|| ancestor.to_path_buf())
    })
}

/// A directory others may pass through but not list (mode 0711).
fn traversable_only(path: &Path) -> Result<(), WorkerError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o711))
        .map_err(|error| WorkerError::io(format!("cannot set up {}", path.display()), error))
}

/// Gives `path` and everything under it to `owner` (uid, gid), and makes `path` itself
/// its owner's alone (0700): a job's directory, which its program writes as its tenant's
/// uid and which no other tenant may read.
pub fn give_directory_to(path: &Path, owner: (u32, u32)) -> Result<(), WorkerError> {
    use std::os::unix::fs::PermissionsExt;
    let failed = |path: &Path, error: std::io::Error| {
        WorkerError::io(format!("cannot give {} to its job", path.display()), error)
    };
    let mut pending = vec![path.to_path_buf()];
    while let Some(next) = pending.pop() {
        std::os::unix::fs::lchown(&next, Some(owner.0), Some(owner.1))
            .map_err(|error| failed(&next, error))?;
        let metadata = std::fs::symlink_metadata(&next).map_err(|error| failed(&next, error))?;
        if metadata.is_dir() {
            for entry in std::fs::read_dir(&next).map_err(|error| failed(&next, error))? {
                pending.push(entry.map_err(|error| failed(&next, error))?.path());
            }
        }
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .map_err(|error| failed(path, error))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_reported_as_128_plus_n_is_that_signal() {
        let killed = container_exit_status(ExitStatus::from_raw(137 << 8), &[]);
        assert_eq!(killed.signal(), Some(9));
        let terminated = container_exit_status(ExitStatus::from_raw(143 << 8), &[]);
        assert_eq!(terminated.signal(), Some(15));
        let checkpointed = container_exit_status(ExitStatus::from_raw(143 << 8), &[143]);
        assert_eq!(checkpointed.code(), Some(143));
        let failed = container_exit_status(ExitStatus::from_raw(2 << 8), &[]);
        assert_eq!(failed.code(), Some(2));
        let out_of_memory = container_exit_status(ExitStatus::from_raw(3 << 8), &[]);
        assert_eq!(out_of_memory.code(), Some(3));
    }

    #[test]
    fn a_directory_others_cannot_pass_above_the_worker_is_found() {
        use std::os::unix::fs::PermissionsExt;
        let directory = tempfile::tempdir().unwrap();
        let worker = directory.path().join("open").join("worker");
        std::fs::create_dir_all(&worker).unwrap();
        let set = |path: &Path, mode| {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        set(directory.path(), 0o755);
        set(&directory.path().join("open"), 0o700);
        assert_eq!(
            closed_ancestor(&worker),
            Some(directory.path().join("open"))
        );
        set(&directory.path().join("open"), 0o711);
        let closed_above = closed_ancestor(&worker);
        assert!(
            closed_above.is_none() || !closed_above.unwrap().starts_with(directory.path()),
            "a passable path is not reported"
        );
    }
}

/// What a real GPU's container is given: its device nodes and the host paths its driver
/// needs bound.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuDevices {
    pub nodes: Vec<PathBuf>,
    pub read_only_paths: Vec<PathBuf>,
}

/// The devices of the GPU of NVML index `index` and uuid `uuid`: from the CDI spec that
/// names it under `cdi_directories`, else (no spec names it, or the one that does is
/// refused, which is logged with why) the built-in list ([`gpu_device_nodes`]).
pub fn gpu_devices(cdi_directories: &[PathBuf], index: u32, uuid: &str) -> GpuDevices {
    match cdi::find_gpu(cdi_directories, index, uuid) {
        Ok(lookup) => {
            for skipped in &lookup.skipped_files {
                tracing::warn!(file = %skipped, "an unreadable CDI spec was skipped");
            }
            if let Some(gpu) = lookup.gpu {
                for left_out in &gpu.left_out {
                    tracing::debug!(spec = %gpu.spec_file.display(), %left_out, "left out of a CDI spec");
                }
                return GpuDevices {
                    nodes: gpu.device_nodes,
                    read_only_paths: gpu.read_only_paths,
                };
            }
        }
        Err(error) => {
            tracing::warn!(%error, "the gpu's devices come from the built-in list instead");
        }
    }
    GpuDevices {
        nodes: gpu_device_nodes(index),
        read_only_paths: Vec::new(),
    }
}
