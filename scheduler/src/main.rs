//! `carve-scheduler`: the scheduler binary. Settings come from flags, then environment
//! variables (`CARVE_*`), then a TOML file (`--config`), then defaults.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::{SchedulerConfig, TlsIdentity, run};
use clap::Parser;
use serde::Deserialize;

#[derive(Debug, Parser)]
#[command(
    name = "carve-scheduler",
    version,
    about = "The Carve scheduler (gRPC)"
)]
struct Arguments {
    /// Address to listen on.
    #[arg(long, env = "CARVE_LISTEN")]
    listen: Option<String>,
    /// Database: sqlite:///path/carve.db (default: in the user's data directory) or postgres://...
    #[arg(long, env = "CARVE_DATABASE_URL")]
    database: Option<String>,
    /// A TOML file with the same settings (listen, database, lease_seconds, ...).
    #[arg(long, env = "CARVE_CONFIG")]
    config: Option<PathBuf>,
    /// A file holding the admin token to accept. Without one (or CARVE_ADMIN_TOKEN), a first
    /// start on SQLite generates one into `admin-token` next to the database (mode 0600).
    #[arg(long, env = "CARVE_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// Seconds without a heartbeat after which a worker loses its attempts.
    #[arg(long, env = "CARVE_LEASE_SECONDS")]
    lease_seconds: Option<u64>,
    /// Seconds between worker heartbeats.
    #[arg(long, env = "CARVE_HEARTBEAT_SECONDS")]
    heartbeat_seconds: Option<u64>,
    /// Directory (on the workers) for checkpoints.
    #[arg(long, env = "CARVE_CHECKPOINT_DIR")]
    checkpoint_dir: Option<String>,
    /// Serve Prometheus metrics at http://ADDRESS/metrics.
    #[arg(long, env = "CARVE_METRICS_LISTEN")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Serve gRPC over TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, env = "CARVE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "CARVE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSettings {
    listen: Option<String>,
    database: Option<String>,
    admin_token_file: Option<PathBuf>,
    lease_seconds: Option<u64>,
    heartbeat_seconds: Option<u64>,
    checkpoint_dir: Option<String>,
    metrics_listen: Option<std::net::SocketAddr>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
}

fn default_database() -> Result<String> {
    let base = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".local/share")))
        .context("cannot find a data directory: set --database or HOME")?;
    let directory = base.join("carve");
    std::fs::create_dir_all(&directory)
        .with_context(|| format!("cannot create {}", directory.display()))?;
    // Its database holds every tenant's jobs and the token hashes, and a first start
    // writes the admin token here: this user's alone, also when an older version
    // created it with the umask's mode.
    std::fs::set_permissions(&directory, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("cannot make {} private (0700)", directory.display()))?;
    Ok(format!("sqlite://{}", directory.join("carve.db").display()))
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let arguments = Arguments::parse();
    let file: FileSettings = match &arguments.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            toml::from_str(&text).with_context(|| format!("{}", path.display()))?
        }
        None => FileSettings::default(),
    };
    let listen = arguments
        .listen
        .or(file.listen)
        .unwrap_or_else(|| "127.0.0.1:7470".into());
    let database = match arguments.database.or(file.database) {
        Some(database) => database,
        None => default_database()?,
    };
    let admin_token = match arguments.admin_token_file.or(file.admin_token_file) {
        Some(path) => Some(
            std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read the admin token file {}", path.display()))?
                .trim()
                .to_string(),
        ),
        None => std::env::var("CARVE_ADMIN_TOKEN").ok(),
    };
    let defaults = SchedulerSettings::default();
    let settings = SchedulerSettings {
        lease_duration: arguments
            .lease_seconds
            .or(file.lease_seconds)
            .map_or(defaults.lease_duration, Duration::from_secs),
        heartbeat_interval: arguments
            .heartbeat_seconds
            .or(file.heartbeat_seconds)
            .map_or(defaults.heartbeat_interval, Duration::from_secs),
        scheduling_interval: defaults.scheduling_interval,
        infrastructure_retry_backoff: defaults.infrastructure_retry_backoff,
        checkpoint_directory: arguments
            .checkpoint_dir
            .or(file.checkpoint_dir)
            .unwrap_or(defaults.checkpoint_directory),
    };
    let tls = match (
        arguments.tls_cert.or(file.tls_cert),
        arguments.tls_key.or(file.tls_key),
    ) {
        (Some(certificate), Some(key)) => Some(TlsIdentity {
            certificate_chain_pem: std::fs::read(&certificate).with_context(|| {
                format!("cannot read the TLS certificate {}", certificate.display())
            })?,
            private_key_pem: std::fs::read(&key)
                .with_context(|| format!("cannot read the TLS key {}", key.display()))?,
        }),
        (None, None) => None,
        _ => anyhow::bail!("TLS needs both a certificate and a key (tls_cert and tls_key)"),
    };
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    // The address line is for people and for scripts that started it on port 0.
    eprintln!("carve-scheduler listening on {}", listener.local_addr()?);
    // SIGINT and SIGTERM (what systemd, Docker and Kubernetes send) both drain cleanly.
    let shutdown = carve_proto::client::shutdown_signal();
    run(
        SchedulerConfig {
            database_url: database,
            settings,
            admin_token,
            metrics_address: arguments.metrics_listen.or(file.metrics_listen),
            tls,
        },
        listener,
        shutdown,
    )
    .await?;
    Ok(())
}
