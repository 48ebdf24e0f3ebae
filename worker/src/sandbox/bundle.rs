//! The bundle of one container run: `config.json` (built with the `oci-spec` crate) and an
//! empty, read-only root directory on which the runtime mounts the host's system
//! directories read-only and only the paths the run's request names. What goes in and
//! why is in the module docs of [`crate::sandbox`].

use std::collections::HashSet;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use carve_core::spec::HostLimitsRequest;
use oci_spec::runtime::{
    Arch, LinuxBuilder, LinuxCapabilities, LinuxCpuBuilder, LinuxDeviceBuilder,
    LinuxDeviceCgroupBuilder, LinuxDeviceType, LinuxIdMappingBuilder, LinuxMemoryBuilder,
    LinuxNamespaceBuilder, LinuxNamespaceType, LinuxPidsBuilder, LinuxResourcesBuilder,
    LinuxSeccomp, LinuxSeccompAction, LinuxSeccompBuilder, LinuxSyscallBuilder, Mount,
    MountBuilder, ProcessBuilder, RootBuilder, Spec, SpecBuilder, UserBuilder,
    get_default_maskedpaths, get_default_readonly_paths,
};

use super::identities::TenantIdentity;
use super::{CONTAINER_UID, SandboxSettings};
use crate::error::WorkerError;
use crate::simulated_gpu_ledger::SIMULATED_GPU_DEVICE_PATH;

/// The host's system directories every container sees read-only: the programs and
/// libraries a job runs with until it brings its own image.
pub(super) const SYSTEM_DIRECTORIES: [&str; 8] = [
    "/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc",
];

/// Host paths hidden even inside the read-only system directories: Carve's own
/// configuration, where operators keep token files.
const HIDDEN_HOST_PATHS: [&str; 1] = ["/etc/carve"];

/// `PATH` inside the container when the job sets none.
pub(super) const DEFAULT_PATH: &str =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// System calls a training program never needs and a hostile one would use to reach
/// past its container: debugging other processes and reading their memory, mounting,
/// new namespaces, kernel modules and kexec, eBPF and perf, the kernel keyring,
/// userfaultfd, file handles that open files outside the mount tree, the clock, swap and
/// reboot. Refused with EPERM; everything else is allowed (as Docker's default profile
/// does for these).
const REFUSED_SYSTEM_CALLS: [&str; 34] = [
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "mount",
    "umount2",
    "pivot_root",
    "setns",
    "unshare",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "bpf",
    "perf_event_open",
    "add_key",
    "request_key",
    "keyctl",
    "userfaultfd",
    "open_by_handle_at",
    "name_to_handle_at",
    "acct",
    "quotactl",
    "swapon",
    "swapoff",
    "reboot",
    "syslog",
    "iopl",
    "ioperm",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
];

/// Each attempt's limits: operator defaults (`--attempt-memory` and friends).
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptLimits {
    /// Host memory of the whole container (the page cache of its files included).
    pub memory_bytes: u64,
    /// Processes and threads of the whole container: a fork bomb stops here.
    pub pids: i64,
    /// CPUs' worth of time per period; `None`: no cap.
    pub cpus: Option<f64>,
    /// The private `/tmp` (memory-backed, counted in `memory_bytes`).
    pub tmp_bytes: u64,
    /// The private `/dev/shm` (PyTorch's data loader workers pass batches through it).
    pub shm_bytes: u64,
}

impl Default for AttemptLimits {
    fn default() -> Self {
        AttemptLimits {
            memory_bytes: 16 << 30,
            pids: 4096,
            cpus: None,
            tmp_bytes: 1 << 30,
            shm_bytes: 1 << 30,
        }
    }
}

/// A host path a container sees at the same path (so every path in a job's argv and
/// files means the same inside and out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPath {
    pub path: PathBuf,
    pub writable: bool,
}

impl HostPath {
    pub fn read_only(path: impl Into<PathBuf>) -> HostPath {
        HostPath {
            path: path.into(),
            writable: false,
        }
    }

    pub fn writable(path: impl Into<PathBuf>) -> HostPath {
        HostPath {
            path: path.into(),
            writable: true,
        }
    }
}

/// One run to contain (`Default`: tests name only what they set).
#[derive(Debug, Clone, Default)]
pub struct ContainerRequest {
    /// The container's name: unique among this worker's running containers.
    pub name: String,
    /// Whose program it is: its host ids and network policy follow.
    pub tenant: String,
    pub argv: Vec<String>,
    /// The whole environment (nothing of the worker's is added).
    pub environment: Vec<(String, String)>,
    pub working_directory: PathBuf,
    /// What it may see of the host besides the system directories.
    pub host_paths: Vec<HostPath>,
    /// Device nodes it may use (its GPU's: [`gpu_device_nodes`]).
    pub devices: Vec<PathBuf>,
    /// Its simulated GPU's ledger socket (`simulated_gpu_ledger.rs`), bound at
    /// [`SIMULATED_GPU_DEVICE_PATH`]: the fake driver's device, as `/dev/nvidiaN` is the
    /// real driver's.
    pub simulated_gpu_socket: Option<PathBuf>,
    /// What the job asks of its host limits (`[resources]`): it may only lower the
    /// worker's (`limits.rs`).
    pub asked_limits: HostLimitsRequest,
}

/// The device nodes of the GPU with NVML index `index`: its own node and the driver's
/// shared control nodes, those present on this host (a CDI spec, where the NVIDIA
/// container toolkit wrote one, lists the same for the usual driver layouts).
pub fn gpu_device_nodes(index: u32) -> Vec<PathBuf> {
    [
        format!("/dev/nvidia{index}"),
        "/dev/nvidiactl".to_string(),
        "/dev/nvidia-uvm".to_string(),
        "/dev/nvidia-uvm-tools".to_string(),
    ]
    .into_iter()
    .map(PathBuf::from)
    .filter(|path| path.exists())
    .collect()
}

fn spec_error(error: oci_spec::OciSpecError) -> WorkerError {
    WorkerError::AttemptProcess(format!("cannot build the container's config: {error}"))
}

/// The container's `config.json` for `request`.
pub fn container_spec(
    request: &ContainerRequest,
    identity: &TenantIdentity,
    settings: &SandboxSettings,
    host_network: bool,
    cgroups_path: &Path,
) -> Result<Spec, WorkerError> {
    let limits = &settings.limits;
    let mut environment: Vec<String> = request
        .environment
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    if !request.environment.iter().any(|(name, _)| name == "PATH") {
        environment.push(format!("PATH={DEFAULT_PATH}"));
    }
    if !request.environment.iter().any(|(name, _)| name == "HOME") {
        environment.push("HOME=/tmp".to_string());
    }
    let no_capabilities = LinuxCapabilities::default();
    let no_capabilities = {
        let mut capabilities = no_capabilities;
        capabilities.set_bounding(Some(HashSet::new()));
        capabilities.set_effective(Some(HashSet::new()));
        capabilities.set_inheritable(Some(HashSet::new()));
        capabilities.set_permitted(Some(HashSet::new()));
        capabilities.set_ambient(Some(HashSet::new()));
        capabilities
    };
    let process = ProcessBuilder::default()
        .terminal(false)
        .user(
            UserBuilder::default()
                .uid(CONTAINER_UID)
                .gid(CONTAINER_UID)
                .build()
                .map_err(spec_error)?,
        )
        .args(request.argv.clone())
        .env(environment)
        .cwd(request.working_directory.clone())
        .no_new_privileges(true)
        .capabilities(no_capabilities)
        // No rlimits: the worker's own are inherited (a user namespace cannot raise them,
        // and the cgroup is what limits the container as a whole).
        .rlimits(Vec::new())
        .build()
        .map_err(spec_error)?;

    let mut namespaces = vec![
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Cgroup,
        LinuxNamespaceType::User,
    ];
    if !host_network {
        // A namespace of its own has only loopback, which the runtime brings up.
        namespaces.push(LinuxNamespaceType::Network);
    }
    let namespaces = namespaces
        .into_iter()
        .map(|kind| LinuxNamespaceBuilder::default().typ(kind).build())
        .collect::<Result<Vec<_>, _>>()
        .map_err(spec_error)?;
    let id_mapping = LinuxIdMappingBuilder::default()
        .container_id(0u32)
        .host_id(identity.first_host_id)
        .size(identity.size)
        .build()
        .map_err(spec_error)?;

    let (devices, device_rules) = devices(&request.devices)?;
    let mut memory = LinuxMemoryBuilder::default().limit(saturating_i64(limits.memory_bytes));
    if cgroup_v1_memory_swap_accounted() {
        // Equal to the limit: no swap, so over the limit is the OOM killer, not a
        // thrashing node.
        memory = memory.swap(saturating_i64(limits.memory_bytes));
    }
    let mut resources = LinuxResourcesBuilder::default()
        .devices(device_rules)
        .memory(memory.build().map_err(spec_error)?)
        .pids(
            LinuxPidsBuilder::default()
                .limit(limits.pids)
                .build()
                .map_err(spec_error)?,
        );
    if let Some(cpus) = limits.cpus {
        const PERIOD_MICROSECONDS: u64 = 100_000;
        resources = resources.cpu(
            LinuxCpuBuilder::default()
                .period(PERIOD_MICROSECONDS)
                .quota((cpus * PERIOD_MICROSECONDS as f64).round() as i64)
                .build()
                .map_err(spec_error)?,
        );
    }
    let mut masked_paths = get_default_maskedpaths();
    masked_paths.extend(HIDDEN_HOST_PATHS.iter().map(|path| path.to_string()));
    let linux = LinuxBuilder::default()
        .namespaces(namespaces)
        .uid_mappings(vec![id_mapping])
        .gid_mappings(vec![id_mapping])
        .resources(resources.build().map_err(spec_error)?)
        .cgroups_path(cgroups_path.to_path_buf())
        .devices(devices)
        .seccomp(seccomp_filter()?)
        .masked_paths(masked_paths)
        .readonly_paths(get_default_readonly_paths())
        .build()
        .map_err(spec_error)?;

    SpecBuilder::default()
        .version("1.0.2")
        .root(
            RootBuilder::default()
                .path("rootfs")
                .readonly(true)
                .build()
                .map_err(spec_error)?,
        )
        .hostname("attempt")
        .process(process)
        .mounts(mounts(request, settings, host_network)?)
        .linux(linux)
        .build()
        .map_err(spec_error)
}

/// Writes `spec` and an empty root directory into `bundle`. The root belongs to the
/// container's root user (`identity`'s first host id), which makes its mount points;
/// the config, which holds the job's environment (its secrets), is the worker's alone.
pub fn write_bundle(
    bundle: &Path,
    spec: &Spec,
    identity: &TenantIdentity,
) -> Result<(), WorkerError> {
    use std::os::unix::fs::PermissionsExt;
    let root = bundle.join("rootfs");
    let config = bundle.join("config.json");
    let failed = |error: std::io::Error| {
        WorkerError::io(format!("cannot set up {}", bundle.display()), error)
    };
    std::fs::create_dir_all(&root).map_err(failed)?;
    std::fs::set_permissions(bundle, std::fs::Permissions::from_mode(0o711))
        .and_then(|()| std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)))
        .and_then(|()| {
            let owner = Some(identity.first_host_id);
            std::os::unix::fs::chown(&root, owner, owner)
        })
        .map_err(failed)?;
    let text = serde_json::to_vec(spec)
        .map_err(|error| WorkerError::AttemptProcess(format!("the container's config: {error}")))?;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&config)
        .and_then(|mut file| std::io::Write::write_all(&mut file, &text))
        .map_err(failed)
}

fn saturating_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Whether this host's cgroup v1 memory controller accounts swap (`memsw`): only then
/// does the runtime accept a swap limit.
fn cgroup_v1_memory_swap_accounted() -> bool {
    Path::new("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes").exists()
}

/// The mounts, in the order the runtime makes them: the kernel's file systems and the
/// private scratch first, then the host's system directories, then the request's paths
/// (parents before children, so a path inside another stays visible).
fn mounts(
    request: &ContainerRequest,
    settings: &SandboxSettings,
    host_network: bool,
) -> Result<Vec<Mount>, WorkerError> {
    let limits = &settings.limits;
    let kernel = |destination: &str, kind: &str, source: &str, options: &[&str]| {
        MountBuilder::default()
            .destination(destination)
            .typ(kind)
            .source(source)
            .options(
                options
                    .iter()
                    .map(|option| option.to_string())
                    .collect::<Vec<_>>(),
            )
            .build()
            .map_err(spec_error)
    };
    let tmp_size = format!("size={}", limits.tmp_bytes);
    let shm_size = format!("size={}", limits.shm_bytes);
    let mut mounts = vec![
        kernel("/proc", "proc", "proc", &[])?,
        kernel(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        )?,
        kernel(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
            ],
        )?,
        kernel(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", &shm_size],
        )?,
        kernel(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        )?,
        kernel(
            "/tmp",
            "tmpfs",
            "tmpfs",
            &["nosuid", "nodev", "mode=1777", &tmp_size],
        )?,
    ];
    // sysfs can be mounted only by the owner of the network namespace; with the host's
    // network the host's /sys is bound read-only instead.
    mounts.push(if host_network {
        bind("/sys", false)?
    } else {
        kernel(
            "/sys",
            "sysfs",
            "sysfs",
            &["nosuid", "noexec", "nodev", "ro"],
        )?
    });
    for directory in SYSTEM_DIRECTORIES {
        if Path::new(directory).exists() {
            mounts.push(bind(directory, false)?);
        }
    }
    // An operator's path that is gone (an unmounted share) is left out rather than
    // failing every attempt.
    let mut host_paths: Vec<HostPath> = settings
        .read_only_host_paths
        .iter()
        .filter(|path| path.exists())
        .map(HostPath::read_only)
        .chain(request.host_paths.iter().cloned())
        .collect();
    // Parents first; of two requests for one path the writable one wins.
    host_paths.sort_by(|a, b| {
        a.path
            .components()
            .count()
            .cmp(&b.path.components().count())
            .then(a.path.cmp(&b.path))
            .then(b.writable.cmp(&a.writable))
    });
    host_paths.dedup_by(|later, earlier| later.path == earlier.path);
    for host_path in &host_paths {
        if !host_path.path.is_absolute() {
            return Err(WorkerError::AttemptProcess(format!(
                "{} is not an absolute path",
                host_path.path.display()
            )));
        }
        mounts.push(bind(&host_path.path.to_string_lossy(), host_path.writable)?);
    }
    if let Some(socket) = &request.simulated_gpu_socket {
        mounts.push(
            MountBuilder::default()
                .destination(SIMULATED_GPU_DEVICE_PATH)
                .typ("bind")
                .source(socket)
                .options(
                    ["bind", "rw", "nosuid", "nodev"]
                        .iter()
                        .map(|option| option.to_string())
                        .collect::<Vec<_>>(),
                )
                .build()
                .map_err(spec_error)?,
        );
    }
    Ok(mounts)
}

/// A bind mount of a host path at the same path, never with set-uid programs or device
/// nodes.
pub(super) fn bind(path: &str, writable: bool) -> Result<Mount, WorkerError> {
    let access = if writable { "rw" } else { "ro" };
    MountBuilder::default()
        .destination(path)
        .typ("bind")
        .source(path)
        .options(
            ["rbind", access, "nosuid", "nodev"]
                .iter()
                .map(|option| option.to_string())
                .collect::<Vec<_>>(),
        )
        .build()
        .map_err(spec_error)
}

/// The device nodes to bind into the container and the device cgroup's rules: every
/// device refused but these (and the runtime's usual null, zero, random, tty ones).
fn devices(
    nodes: &[PathBuf],
) -> Result<
    (
        Vec<oci_spec::runtime::LinuxDevice>,
        Vec<oci_spec::runtime::LinuxDeviceCgroup>,
    ),
    WorkerError,
> {
    let mut devices = Vec::new();
    let mut rules = vec![
        LinuxDeviceCgroupBuilder::default()
            .allow(false)
            .access("rwm")
            .build()
            .map_err(spec_error)?,
    ];
    for node in nodes {
        let metadata = rustix::fs::stat(node).map_err(|error| {
            WorkerError::io(
                format!("cannot read the device {}", node.display()),
                error.into(),
            )
        })?;
        let major = i64::from(rustix::fs::major(metadata.st_rdev));
        let minor = i64::from(rustix::fs::minor(metadata.st_rdev));
        devices.push(
            LinuxDeviceBuilder::default()
                .path(node.clone())
                .typ(LinuxDeviceType::C)
                .major(major)
                .minor(minor)
                .file_mode(0o666u32)
                .build()
                .map_err(spec_error)?,
        );
        rules.push(
            LinuxDeviceCgroupBuilder::default()
                .allow(true)
                .typ(LinuxDeviceType::C)
                .major(major)
                .minor(minor)
                .access("rw")
                .build()
                .map_err(spec_error)?,
        );
    }
    Ok((devices, rules))
}

/// The filter of [`REFUSED_SYSTEM_CALLS`].
fn seccomp_filter() -> Result<LinuxSeccomp, WorkerError> {
    let refused = LinuxSyscallBuilder::default()
        .names(
            REFUSED_SYSTEM_CALLS
                .iter()
                .map(|name| name.to_string())
                .collect::<Vec<_>>(),
        )
        .action(LinuxSeccompAction::ScmpActErrno)
        .errno_ret(libc_eperm())
        .build()
        .map_err(spec_error)?;
    LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActAllow)
        .architectures(vec![
            Arch::ScmpArchX86_64,
            Arch::ScmpArchX86,
            Arch::ScmpArchX32,
            Arch::ScmpArchAarch64,
            Arch::ScmpArchArm,
        ])
        .syscalls(vec![refused])
        .build()
        .map_err(spec_error)
}

fn libc_eperm() -> u32 {
    rustix::io::Errno::PERM.raw_os_error() as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::IDS_PER_TENANT;

    fn request() -> ContainerRequest {
        ContainerRequest {
            name: "carve-job-1-1".into(),
            tenant: "alice".into(),
            argv: vec!["python3".into(), "train.py".into()],
            environment: vec![("SECRET".into(), "s3cr3t".into())],
            working_directory: "/data/alice/code".into(),
            host_paths: vec![
                HostPath::writable("/var/lib/carve/checkpoints/job-1"),
                HostPath::read_only("/data/alice/code"),
                HostPath::read_only("/data"),
            ],
            devices: Vec::new(),
            simulated_gpu_socket: None,
            asked_limits: HostLimitsRequest::default(),
        }
    }

    fn spec_of(request: &ContainerRequest, host_network: bool) -> serde_json::Value {
        let identity = TenantIdentity {
            first_host_id: 1_000_000_000,
            size: IDS_PER_TENANT,
        };
        let spec = container_spec(
            request,
            &identity,
            &SandboxSettings::default(),
            host_network,
            Path::new("/carve/carve-job-1-1"),
        )
        .unwrap();
        serde_json::to_value(&spec).unwrap()
    }

    #[test]
    fn the_program_gets_only_its_environment_no_capabilities_and_its_tenants_ids() {
        let spec = spec_of(&request(), false);
        let process = &spec["process"];
        let environment: Vec<&str> = process["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|value| value.as_str().unwrap())
            .collect();
        assert!(environment.contains(&"SECRET=s3cr3t"));
        assert!(
            environment
                .iter()
                .any(|variable| variable.starts_with("PATH="))
        );
        assert!(
            !environment
                .iter()
                .any(|variable| variable.starts_with("CARVE_TOKEN"))
        );
        assert_eq!(process["user"]["uid"], 1000);
        assert_eq!(process["noNewPrivileges"], true);
        for set in [
            "bounding",
            "effective",
            "inheritable",
            "permitted",
            "ambient",
        ] {
            assert_eq!(process["capabilities"][set], serde_json::json!([]), "{set}");
        }
        assert_eq!(spec["linux"]["uidMappings"][0]["hostID"], 1_000_000_000u32);
        assert_eq!(spec["linux"]["uidMappings"][0]["containerID"], 0);
        let namespaces: Vec<&str> = spec["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|namespace| namespace["type"].as_str().unwrap())
            .collect();
        for kind in ["pid", "mount", "ipc", "uts", "cgroup", "user", "network"] {
            assert!(namespaces.contains(&kind), "{kind} in {namespaces:?}");
        }
        let host_network = spec_of(&request(), true);
        assert!(
            !host_network["linux"]["namespaces"]
                .as_array()
                .unwrap()
                .iter()
                .any(|namespace| namespace["type"] == "network")
        );
    }

    #[test]
    fn parents_are_mounted_before_children_and_only_the_job_directory_is_writable() {
        let spec = spec_of(&request(), false);
        let binds: Vec<(String, bool)> = spec["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|mount| mount["type"] == "bind")
            .map(|mount| {
                let options = mount["options"].as_array().unwrap();
                (
                    mount["destination"].as_str().unwrap().to_string(),
                    options.contains(&serde_json::json!("rw")),
                )
            })
            .collect();
        let position = |path: &str| binds.iter().position(|(bound, _)| bound == path).unwrap();
        assert!(position("/data") < position("/data/alice/code"));
        let writable: Vec<&str> = binds
            .iter()
            .filter(|(_, writable)| *writable)
            .map(|(path, _)| path.as_str())
            .collect();
        assert_eq!(writable, ["/var/lib/carve/checkpoints/job-1"]);
        assert!(
            spec["linux"]["maskedPaths"]
                .as_array()
                .unwrap()
                .contains(&serde_json::json!("/etc/carve"))
        );
        assert_eq!(
            spec["linux"]["resources"]["pids"]["limit"],
            AttemptLimits::default().pids
        );
        assert_eq!(spec["root"]["readonly"], true);
    }

    #[test]
    fn a_relative_host_path_is_refused() {
        let mut request = request();
        request
            .host_paths
            .push(HostPath::read_only("relative/path"));
        let identity = TenantIdentity {
            first_host_id: 1_000_000_000,
            size: IDS_PER_TENANT,
        };
        let error = container_spec(
            &request,
            &identity,
            &SandboxSettings::default(),
            false,
            Path::new("/carve/x"),
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("relative/path"), "{error}");
    }
}
