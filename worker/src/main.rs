//! `carve-worker`: the GPU node agent. Parses and checks its flags, then runs
//! `carve_worker::run_worker` until SIGINT/SIGTERM. The hidden `attempt` subcommand is
//! the attempt process the worker starts for every attempt; the hidden `supervise`, the
//! supervisor of every run of a command job's program (`command_supervisor.rs`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use carve_core::bytes::parse_byte_size;
use carve_core::spec::parse_duration;
use carve_proto::client::ClientIdentity;
use carve_proto::logging::{LogFormat, init_logging};
use carve_worker::attempt_child::{AttemptArguments, attempt_command};
use carve_worker::attempt_limits::{DEFAULT_MEASURE_INTERVAL, RunLimits};
use carve_worker::command_supervisor::{SuperviseArguments, supervise_command};
use carve_worker::gang_member::{GangSettings, parse_gang_ports};
use carve_worker::gpus::parse_simulated_gpus;
use carve_worker::image::{ImageSettings, RegistryAuthority, read_registry_authority};
use carve_worker::sandbox::cdi::DEFAULT_CDI_DIRECTORIES;
use carve_worker::sandbox::{
    AttemptLimits, DEFAULT_FIRST_HOST_UID, SandboxPolicy, SandboxSettings, TenantLimits,
    parse_tenant_limits,
};
use carve_worker::token_file::worker_token;
use carve_worker::worker::DEFAULT_CONTEXT_BYTES;
use carve_worker::{WorkerConfig, run_worker};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "carve-worker",
    version,
    about = "Carve's GPU node agent: offers this node's GPUs to the scheduler and runs attempts in slices",
    subcommand_negates_reqs = true,
    args_conflicts_with_subcommands = true
)]
struct Arguments {
    #[command(subcommand)]
    command: Option<Command>,
    /// The scheduler, e.g. http://scheduler:7470 (https:// for a scheduler serving TLS);
    /// replicas comma-separated (http://a:7470,http://b:7470): the worker moves to the
    /// next when one fails or is a standby.
    #[arg(long, env = "CARVE_SCHEDULER", required = true)]
    scheduler: Option<String>,
    /// The file holding this worker's token (a token with the worker role), readable by
    /// its owner alone (mode 0600 or 0400). Without it, systemd's credential
    /// carve-worker-token ($CREDENTIALS_DIRECTORY/carve-worker-token, from
    /// LoadCredential=). The token itself is never taken from the environment or the
    /// command line: the programs the worker runs could read both.
    #[arg(long, env = "CARVE_WORKER_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// The certificate (PEM) to trust for an https:// scheduler (a private CA or a
    /// self-signed certificate); without it the system's roots are trusted.
    #[arg(long, env = "CARVE_CA_CERT")]
    ca_cert: Option<PathBuf>,
    /// This worker's client certificate chain (PEM), for a scheduler that requires client
    /// certificates (its --tls-client-ca); needs --tls-key.
    #[arg(long, env = "CARVE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "CARVE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// GPUs to simulate: `2x16GiB` or `16GiB,8GiB`. Offered alone when there is no NVML,
    /// after the real GPUs when there is.
    #[arg(long, env = "CARVE_SIM_GPUS")]
    sim_gpus: Option<String>,
    /// Where attempts write checkpoints.
    #[arg(
        long,
        env = "CARVE_WORKER_CHECKPOINT_DIR",
        default_value = "checkpoints"
    )]
    checkpoint_dir: PathBuf,
    /// What each attempt process takes outside its slice (CUDA context and handles), on
    /// real and simulated GPUs (default 640MiB, measured on an H200 with CUDA 13 and cuDNN 9).
    #[arg(long, env = "CARVE_CONTEXT_BYTES", value_parser = parse_byte_size_argument)]
    context_bytes: Option<u64>,
    /// The guard (libcarve_guard.so) preloaded into command jobs' programs; defaults to
    /// the one next to carve-worker. Required on a worker with real GPUs (checked at
    /// start); on simulated GPUs used when it is there (over a fake driver), else their
    /// programs run without it.
    #[arg(long, env = "CARVE_GUARD_LIBRARY")]
    guard_library: Option<PathBuf>,
    /// The node name to register with; defaults to the host name.
    #[arg(long, env = "CARVE_HOSTNAME")]
    hostname: Option<String>,
    /// Log lines as `text` (coloured on a terminal) or `json` (one object a line, for log
    /// pipelines).
    #[arg(long, env = "CARVE_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    /// The OCI runtime every attempt runs in (its own container); found on PATH (runc,
    /// then crun) without it. The worker refuses to start without one unless
    /// --insecure-no-sandbox.
    #[arg(long, env = "CARVE_OCI_RUNTIME")]
    oci_runtime: Option<PathBuf>,
    /// Run attempts without containers, with the worker's own rights: any tenant's
    /// program can then read other tenants' files and take over the worker. Every such
    /// attempt says so in its log.
    #[arg(long, env = "CARVE_INSECURE_NO_SANDBOX")]
    insecure_no_sandbox: bool,
    /// Host memory each attempt's container may use (its files in /tmp included).
    #[arg(long, env = "CARVE_ATTEMPT_MEMORY", default_value = "16GiB", value_parser = parse_byte_size_argument)]
    attempt_memory: u64,
    /// Processes and threads each attempt's container may have.
    #[arg(long, env = "CARVE_ATTEMPT_PIDS", default_value_t = 4096)]
    attempt_pids: i64,
    /// CPUs' worth of time each attempt's container may use (e.g. 4 or 0.5); no cap
    /// without it.
    #[arg(long, env = "CARVE_ATTEMPT_CPUS")]
    attempt_cpus: Option<f64>,
    /// The size of each container's private /tmp and of its /dev/shm.
    #[arg(long, env = "CARVE_ATTEMPT_SCRATCH", default_value = "1GiB", value_parser = parse_byte_size_argument)]
    attempt_scratch: u64,
    /// The longest any attempt may run, wall clock (e.g. 7d, 48h, 90m, 1h30m), with or
    /// without a container; a job may ask for less (resources.max_duration). An attempt
    /// past it is stopped (SIGTERM, SIGKILL 10 s later) and ends failed. `none`: only
    /// the jobs' own limits.
    #[arg(long, env = "CARVE_ATTEMPT_MAX_DURATION", default_value = "7d", value_parser = parse_max_duration_argument)]
    attempt_max_duration: OrNone<Duration>,
    /// The most a job's checkpoint directory (with its attempt's own directory) may hold
    /// on disk, measured every few seconds; an attempt past it is stopped and ends
    /// failed. `none`: not measured.
    #[arg(long, env = "CARVE_ATTEMPT_CHECKPOINT_LIMIT", default_value = "64GiB", value_parser = parse_checkpoint_limit_argument)]
    attempt_checkpoint_limit: OrNone<u64>,
    /// A host directory every container sees read-only (a shared data set, a Python
    /// environment outside /usr); repeat for more.
    #[arg(long = "sandbox-read-only", value_name = "DIR")]
    sandbox_read_only: Vec<PathBuf>,
    /// A host directory under which jobs may name their working directory (tenants'
    /// code), seen read-only; repeat for more. A job naming another is refused.
    #[arg(long = "sandbox-job-path", value_name = "DIR")]
    sandbox_job_path: Vec<PathBuf>,
    /// A tenant whose containers share the host's network (reading data from object
    /// stores); others have only loopback. Repeat for more.
    #[arg(long = "sandbox-host-network", value_name = "TENANT")]
    sandbox_host_network: Vec<String>,
    /// One tenant's limits instead of the --attempt-* defaults:
    /// TENANT:memory=32GiB,pids=8192,cpus=8,scratch=4GiB (any of them). Repeat for more
    /// tenants. A job may ask for less in [resources], never more.
    #[arg(long = "tenant-limits", value_name = "TENANT:LIMITS", value_parser = parse_tenant_limits_argument)]
    tenant_limits: Vec<(String, TenantLimits)>,
    /// A directory of CDI specs (nvidia-ctk cdi generate), in increasing priority;
    /// repeat for more. A GPU's containers get the device nodes of the spec that names
    /// it, else the built-in list. Default: /etc/cdi and /var/run/cdi.
    #[arg(long = "cdi-dir", value_name = "DIR")]
    cdi_dir: Vec<PathBuf>,
    /// The most bytes of unpacked job images the node keeps when no attempt holds them
    /// (least recently used go first); an image larger than this is refused.
    #[arg(long, env = "CARVE_IMAGE_CACHE_LIMIT", default_value = "100GiB", value_parser = parse_byte_size_argument)]
    image_cache_limit: u64,
    /// A registry (HOST:PORT) reached over plain HTTP; loopback ones always are. Repeat
    /// for more.
    #[arg(long = "insecure-registry", value_name = "HOST:PORT")]
    insecure_registry: Vec<String>,
    /// An OCI image layout directory looked in before any registry, by each image's
    /// org.opencontainers.image.ref.name (an air-gapped node's images). Repeat for more.
    #[arg(long = "image-layout", value_name = "DIR")]
    image_layout: Vec<PathBuf>,
    /// A `docker save` (any Docker version), `podman save` or OCI archive whose images
    /// are read before any registry's, by the names it gives them (an air-gapped node's
    /// images). Unpacked once into the image cache. Repeat for more.
    #[arg(long = "image-archive", value_name = "FILE")]
    image_archive: Vec<PathBuf>,
    /// The certificate authority (a PEM file) that signed a private registry's
    /// certificate, trusted for that registry alone (HOST[:PORT] as image references
    /// write it), which is then always reached over HTTPS. Repeat for more.
    #[arg(long = "registry-ca", value_name = "REGISTRY=FILE", value_parser = read_registry_authority)]
    registry_ca: Vec<RegistryAuthority>,
    /// The address gang members on other nodes reach this node's rank-0 members at
    /// (reported at registration). Default: the local address of this node's route to
    /// the scheduler, else 127.0.0.1.
    #[arg(long, env = "CARVE_ADVERTISE_ADDRESS", value_name = "IP")]
    advertise_address: Option<std::net::IpAddr>,
    /// The ports the scheduler may name as the master port of a gang over several nodes
    /// whose rank 0 runs here, FIRST-LAST. A gang on one node gets a free port the
    /// worker picks instead.
    #[arg(long, env = "CARVE_GANG_PORTS", default_value = "29500-29999", value_parser = parse_gang_ports)]
    gang_ports: std::ops::RangeInclusive<u16>,
}

fn parse_tenant_limits_argument(text: &str) -> Result<(String, TenantLimits), String> {
    parse_tenant_limits(text).map_err(|error| error.to_string())
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs one attempt (started by the worker, not by people).
    #[command(hide = true)]
    Attempt(AttemptArguments),
    /// Runs a command job's program under its lease (started by the worker, not by people).
    #[command(hide = true)]
    Supervise(SuperviseArguments),
}

fn parse_byte_size_argument(text: &str) -> Result<u64, String> {
    parse_byte_size(text).map_err(|error| error.to_string())
}

/// A limit, or `none` for no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OrNone<T>(Option<T>);

/// `value` read by `parse`, or `none`; a zero limit is refused (it would stop every
/// attempt at once: `none` says what was meant).
fn limit_or_none<T: PartialEq + Default>(
    text: &str,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<OrNone<T>, String> {
    if text.trim().eq_ignore_ascii_case("none") {
        return Ok(OrNone(None));
    }
    let value = parse(text)?;
    if value == T::default() {
        return Err("must be more than 0 (or none for no limit)".into());
    }
    Ok(OrNone(Some(value)))
}

fn parse_max_duration_argument(text: &str) -> Result<OrNone<Duration>, String> {
    limit_or_none(text, parse_duration)
}

fn parse_checkpoint_limit_argument(text: &str) -> Result<OrNone<u64>, String> {
    limit_or_none(text, parse_byte_size_argument)
}

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

fn main() -> ExitCode {
    let arguments = Arguments::parse();
    if let Some(Command::Attempt(attempt)) = &arguments.command {
        // The attempt process: no logging setup, stdout is the report channel.
        return attempt_command(attempt, "carve-worker");
    }
    if let Some(Command::Supervise(supervise)) = &arguments.command {
        // The program's stdout and stderr are the supervisor's: no logging setup.
        return supervise_command(supervise, "carve-worker");
    }
    match run(arguments) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("carve-worker: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(arguments: Arguments) -> Result<()> {
    init_logging(arguments.log_format);
    // Only warned about: a deployment that still sets it must learn that its token now
    // goes in a file, and that the variable would hand the token to every program the
    // worker runs.
    if std::env::var_os("CARVE_TOKEN").is_some() {
        tracing::warn!(
            "CARVE_TOKEN is set but carve-worker ignores it (the programs it runs inherit \
             its environment): give the worker token with --token-file PATH (mode 0600) or \
             systemd's LoadCredential=carve-worker-token:PATH, and unset CARVE_TOKEN"
        );
    }
    // Validate everything that was typed before building anything.
    let credentials_directory = std::env::var_os("CREDENTIALS_DIRECTORY").map(PathBuf::from);
    let token = worker_token(
        arguments.token_file.as_deref(),
        credentials_directory.as_deref(),
    )?;
    let simulated_gpus = match &arguments.sim_gpus {
        Some(text) => parse_simulated_gpus(text)?,
        None => Vec::new(),
    };
    let read = |flag: &str, path: &PathBuf| {
        std::fs::read(path).with_context(|| format!("{flag}: cannot read {}", path.display()))
    };
    let scheduler_ca_certificate_pem = match &arguments.ca_cert {
        Some(path) => Some(read("--ca-cert", path)?),
        None => None,
    };
    let client_identity = match (&arguments.tls_cert, &arguments.tls_key) {
        (Some(certificate), Some(key)) => Some(ClientIdentity {
            certificate_chain_pem: read("--tls-cert", certificate)?,
            private_key_pem: read("--tls-key", key)?,
        }),
        _ => None,
    };
    let program = std::env::current_exe().context("cannot find the carve-worker binary")?;
    let mut config = WorkerConfig::new(
        arguments.scheduler.unwrap_or_default(),
        token,
        simulated_gpus,
        program,
    );
    config.hostname = arguments.hostname.unwrap_or_else(hostname);
    config.checkpoint_directory = arguments.checkpoint_dir;
    config.context_bytes = arguments.context_bytes.unwrap_or(DEFAULT_CONTEXT_BYTES);
    config.scheduler_ca_certificate_pem = scheduler_ca_certificate_pem;
    config.client_identity = client_identity;
    config.guard_library = arguments.guard_library;
    config.sandbox = SandboxSettings {
        policy: if arguments.insecure_no_sandbox {
            SandboxPolicy::Off
        } else {
            SandboxPolicy::Required
        },
        runtime: arguments.oci_runtime,
        first_host_uid: DEFAULT_FIRST_HOST_UID,
        limits: AttemptLimits {
            memory_bytes: arguments.attempt_memory,
            pids: arguments.attempt_pids,
            cpus: arguments.attempt_cpus,
            tmp_bytes: arguments.attempt_scratch,
            shm_bytes: arguments.attempt_scratch,
        },
        read_only_host_paths: arguments.sandbox_read_only,
        host_network_tenants: arguments.sandbox_host_network,
        job_paths: arguments.sandbox_job_path,
        cdi_directories: if arguments.cdi_dir.is_empty() {
            DEFAULT_CDI_DIRECTORIES.iter().map(PathBuf::from).collect()
        } else {
            arguments.cdi_dir
        },
        tenant_limits: arguments.tenant_limits.into_iter().collect(),
        images: Some(ImageSettings {
            cache_limit_bytes: arguments.image_cache_limit,
            insecure_registries: arguments.insecure_registry,
            layout_directories: arguments.image_layout,
            registry_authorities: arguments.registry_ca,
            archives: arguments.image_archive,
            ..ImageSettings::under(&config.checkpoint_directory)
        }),
    };
    config.gang = GangSettings {
        advertise_address: arguments.advertise_address,
        ports: arguments.gang_ports,
    };
    config.run_limits = RunLimits {
        max_duration: arguments.attempt_max_duration.0,
        checkpoint_bytes: arguments.attempt_checkpoint_limit.0,
        measure_interval: DEFAULT_MEASURE_INTERVAL,
    };
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(async {
        let shutdown = carve_proto::client::shutdown_signal();
        run_worker(config, async move {
            shutdown.await;
            tracing::info!("shutting down");
        })
        .await?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(arguments: &[&str]) -> Result<Arguments, clap::Error> {
        let required = ["carve-worker", "--scheduler", "http://scheduler:7470"];
        Arguments::try_parse_from(required.iter().chain(arguments))
    }

    #[test]
    fn log_format_takes_text_or_json() {
        assert_eq!(
            parse(&["--log-format", "json"]).unwrap().log_format,
            LogFormat::Json
        );
        assert_eq!(
            parse(&["--log-format", "text"]).unwrap().log_format,
            LogFormat::Text
        );
        let error = parse(&["--log-format", "colour"]).unwrap_err().to_string();
        assert!(error.contains("--log-format"), "{error}");
    }

    #[test]
    fn a_client_certificate_needs_its_key() {
        assert!(parse(&["--tls-cert", "worker.crt"]).is_err());
        assert!(parse(&["--tls-key", "worker.key"]).is_err());
        let both = parse(&["--tls-cert", "worker.crt", "--tls-key", "worker.key"]).unwrap();
        assert_eq!(both.tls_cert, Some(PathBuf::from("worker.crt")));
        assert_eq!(both.tls_key, Some(PathBuf::from("worker.key")));
    }

    #[test]
    fn the_guard_library_is_optional_and_taken_from_the_flag() {
        assert_eq!(parse(&[]).unwrap().guard_library, None);
        assert_eq!(
            parse(&["--guard-library", "/opt/carve/libcarve_guard.so"])
                .unwrap()
                .guard_library,
            Some(PathBuf::from("/opt/carve/libcarve_guard.so"))
        );
    }

    #[test]
    fn the_worker_s_own_limits_have_defaults_and_none() {
        let defaults = parse(&[]).unwrap();
        assert_eq!(
            defaults.attempt_max_duration,
            OrNone(Some(Duration::from_secs(7 * 24 * 3_600)))
        );
        assert_eq!(defaults.attempt_checkpoint_limit, OrNone(Some(64 << 30)));
        let set = parse(&[
            "--attempt-max-duration",
            "1h30m",
            "--attempt-checkpoint-limit",
            "500MiB",
        ])
        .unwrap();
        assert_eq!(
            set.attempt_max_duration,
            OrNone(Some(Duration::from_secs(5_400)))
        );
        assert_eq!(set.attempt_checkpoint_limit, OrNone(Some(500 << 20)));
        let off = parse(&[
            "--attempt-max-duration",
            "none",
            "--attempt-checkpoint-limit",
            "NONE",
        ])
        .unwrap();
        assert_eq!(off.attempt_max_duration, OrNone(None));
        assert_eq!(off.attempt_checkpoint_limit, OrNone(None));
        for (flag, value, reason) in [
            ("--attempt-max-duration", "0s", "more than 0"),
            ("--attempt-max-duration", "90", "has no unit"),
            ("--attempt-checkpoint-limit", "0", "more than 0"),
            ("--attempt-checkpoint-limit", "lots", "not a number"),
        ] {
            let error = parse(&[flag, value]).unwrap_err().to_string();
            assert!(error.contains(flag) && error.contains(reason), "{error}");
        }
    }

    #[test]
    fn the_token_comes_from_a_file_never_from_a_flag() {
        assert_eq!(parse(&[]).unwrap().token_file, None);
        assert_eq!(
            parse(&["--token-file", "/etc/carve/worker-token"])
                .unwrap()
                .token_file,
            Some(PathBuf::from("/etc/carve/worker-token"))
        );
        let error = parse(&["--token", "carve_secret"]).unwrap_err().to_string();
        assert!(error.contains("--token"), "{error}");
    }
}
