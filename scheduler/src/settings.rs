//! The `carve-scheduler` binary's settings (a module of `main.rs`, not of the library):
//! every setting has a flag, a `CARVE_*` environment variable (both read by clap, so
//! `--help` lists them) and a key of the `--config` TOML file, and takes the first of
//! flag, variable, file and default that gives it. [`resolve`] is that rule, written
//! once; [`Settings::load`] then reads the files the settings name.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use carve_proto::logging::LogFormat;
use carve_scheduler::scheduler::sealed_secrets::SecretsKey;
use carve_scheduler::scheduler::{PreemptionSettings, SchedulerSettings};
use carve_scheduler::server::{SchedulerConfig, TlsIdentity};
use clap::Parser;
use serde::Deserialize;

/// Where the scheduler listens when nothing says otherwise.
const DEFAULT_LISTEN: &str = "127.0.0.1:7470";

#[derive(Debug, Parser)]
#[command(
    name = "carve-scheduler",
    version,
    about = "The Carve scheduler (gRPC)",
    after_help = "Each setting comes from its flag, else its environment variable, else the \
                  --config file's key of the same name (listen, lease_seconds, ...), else \
                  its default."
)]
pub struct Arguments {
    /// A TOML file with the same settings, keyed by the flags' names with underscores
    /// (listen, database, lease_seconds, scheduling_interval_ms, ...).
    #[arg(long, env = "CARVE_CONFIG")]
    pub config: Option<PathBuf>,
    /// The admin token to accept (the secret itself). Prefer the environment variable or
    /// --admin-token-file: other users of the machine can read a command line. An admin
    /// token file, given any way, wins over this.
    #[arg(long, env = "CARVE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Log lines as `text` (coloured on a terminal) or `json` (one object a line, for log
    /// pipelines). A flag only: logging starts before the config file is read.
    #[arg(long, env = "CARVE_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
    #[command(flatten)]
    pub given: GivenSettings,
}

/// The settings as one source gives them: the flags and environment (clap merges those
/// two, the flag first) or the config file. `None` where that source is silent.
#[derive(Debug, Default, Clone, PartialEq, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GivenSettings {
    /// Address to listen on [default: 127.0.0.1:7470].
    #[arg(long, env = "CARVE_LISTEN")]
    pub listen: Option<String>,
    /// Database: sqlite:///path/carve.db (default: in the user's data directory) or postgres://...
    #[arg(long, env = "CARVE_DATABASE_URL", hide_env_values = true)]
    pub database: Option<String>,
    /// A file holding the admin token to accept. Without one (or --admin-token), a first
    /// start on SQLite generates one into `admin-token` next to the database (mode 0600).
    #[arg(long, env = "CARVE_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Seconds without a heartbeat after which a worker loses its attempts [default: 30].
    #[arg(long, env = "CARVE_LEASE_SECONDS")]
    pub lease_seconds: Option<u64>,
    /// Seconds between worker heartbeats [default: 5].
    #[arg(long, env = "CARVE_HEARTBEAT_SECONDS")]
    pub heartbeat_seconds: Option<u64>,
    /// Milliseconds between scheduling passes when nothing (a submit, a report) starts one
    /// sooner, and at most the heartbeat interval; at least 1 [default: 2000].
    #[arg(long, env = "CARVE_SCHEDULING_INTERVAL_MS")]
    pub scheduling_interval_ms: Option<u64>,
    /// Let a job that cannot be placed evict lower-priority attempts (and a tenant under
    /// its fair share reclaim from one over it): on or off [default: on].
    #[arg(long, env = "CARVE_PREEMPTION", value_parser = parse_on_off)]
    pub preemption: Option<bool>,
    /// Seconds an attempt runs before it can be preempted [default: 300].
    #[arg(long, env = "CARVE_PREEMPTION_MIN_RUN_TIME_SECONDS")]
    pub preemption_min_run_time_seconds: Option<u64>,
    /// Preemptions of one job per hour, after which it is not preempted again [default: 2].
    #[arg(long, env = "CARVE_PREEMPTION_MAX_PER_HOUR")]
    pub preemption_max_per_hour: Option<u32>,
    /// Seconds a preempted attempt has to checkpoint and stop before it is killed
    /// [default: 30].
    #[arg(long, env = "CARVE_PREEMPTION_GRACE_SECONDS")]
    pub preemption_grace_seconds: Option<u64>,
    /// Ignored, and said so at start (kept so that configurations naming it still
    /// start): the workers' own `--checkpoint-dir` says where attempts write, and an
    /// attempt resumes only from a checkpoint an earlier attempt reported.
    #[arg(long, env = "CARVE_CHECKPOINT_DIR", hide = true)]
    pub checkpoint_dir: Option<String>,
    /// Replicas on PostgreSQL: milliseconds the leader's lease lasts without renewal,
    /// about the longest a failover takes [default: 10000].
    #[arg(long, env = "CARVE_LEADER_LEASE_MS")]
    pub leader_lease_ms: Option<u64>,
    /// Replicas on PostgreSQL: this replica's endpoint as clients reach it, told to
    /// clients of standbys [default: http:// and the listening address].
    #[arg(long, env = "CARVE_ADVERTISE_ENDPOINT")]
    pub advertise_endpoint: Option<String>,
    /// MiB below which no command job's slice is sized, whatever its memory model
    /// measured (0: no floor) [default: 256].
    #[arg(long, env = "CARVE_MIN_SLICE_MIB")]
    pub min_slice_mib: Option<u64>,
    /// Hours after which a tenant's past usage counts half as much in fair share
    /// (Slurm's PriorityDecayHalfLife) [default: 168, 7 days].
    #[arg(long, env = "CARVE_FAIR_SHARE_HALF_LIFE_HOURS")]
    pub fair_share_half_life_hours: Option<u64>,
    /// Serve Prometheus metrics at http://ADDRESS/metrics.
    #[arg(long, env = "CARVE_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Serve gRPC over TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, env = "CARVE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "CARVE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require every client (workers, carve) to show a certificate signed by this CA
    /// (PEM): mutual TLS. Needs --tls-cert.
    #[arg(long, env = "CARVE_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// A file holding the key tenants' secrets (registry credentials) are sealed with in
    /// the database: 64 hexadecimal digits (`openssl rand -hex 32`), readable by the
    /// scheduler's user alone. Without one they are stored as they are.
    #[arg(long, env = "CARVE_SECRETS_KEY_FILE")]
    pub secrets_key_file: Option<PathBuf>,
    /// A key --secrets-key-file replaced (same form): values it sealed still open, and
    /// the scheduler seals them again with the new key at start. Repeat for more.
    #[arg(long = "secrets-previous-key-file", value_name = "FILE")]
    #[serde(default)]
    pub secrets_previous_key_files: Vec<PathBuf>,
}

impl GivenSettings {
    /// The settings of a `--config` file; an unknown key or a bad value is an error that
    /// names the file and the key.
    pub fn from_file(path: &Path) -> Result<GivenSettings> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("bad config file {}", path.display()))
    }
}

/// Where the admin token comes from.
#[derive(Clone, PartialEq)]
pub enum AdminTokenSource {
    /// A file to read it from (its contents, trimmed).
    File(PathBuf),
    /// The secret itself.
    Secret(String),
}

impl std::fmt::Debug for AdminTokenSource {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AdminTokenSource::File(path) => formatter.debug_tuple("File").field(path).finish(),
            // Settings are logged and printed by failing tests; the secret is not.
            AdminTokenSource::Secret(_) => formatter.write_str("Secret(..)"),
        }
    }
}

/// Every setting decided: what [`resolve`] makes of the sources.
#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: String,
    /// `None`: the default database in the user's data directory, made by [`Settings::load`].
    pub database: Option<String>,
    pub admin_token: Option<AdminTokenSource>,
    pub scheduler: SchedulerSettings,
    pub metrics_listen: Option<SocketAddr>,
    /// The certificate chain and key files, when serving TLS.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// The CA client certificates must be signed by, when requiring them.
    pub tls_client_ca: Option<PathBuf>,
    /// Settings given that no longer do anything, each with why: said at start.
    pub ignored: Vec<String>,
    /// The file of the key secrets are sealed with.
    pub secrets_key_file: Option<PathBuf>,
    /// The files of the keys it replaced.
    pub secrets_previous_key_files: Vec<PathBuf>,
}

/// `on`/`off` (or `true`/`false`), for a switch given as a flag or variable.
fn parse_on_off(value: &str) -> Result<bool, String> {
    match value {
        "on" | "true" => Ok(true),
        "off" | "false" => Ok(false),
        other => Err(format!("{other:?} is neither on nor off")),
    }
}

/// `value`, refused when it is 0; `setting` names it (flag, variable, key).
fn not_zero(value: Option<u64>, setting: &str, unit: &str) -> Result<Option<u64>> {
    if value == Some(0) {
        bail!("{setting} is 0: it must be at least 1 {unit}");
    }
    Ok(value)
}

/// Each setting from `given` (flags, then environment), else from `file`, else its
/// default; `admin_token` is `--admin-token` / `CARVE_ADMIN_TOKEN`, which an admin token
/// file from any source overrides (as it always has).
pub fn resolve(
    given: GivenSettings,
    file: GivenSettings,
    admin_token: Option<String>,
) -> Result<Settings> {
    let defaults = SchedulerSettings::default();
    // A zero interval would keep a loop running with no pause (and a worker's heartbeat
    // timer refuses a zero period).
    let scheduling_interval = not_zero(
        given.scheduling_interval_ms.or(file.scheduling_interval_ms),
        "the scheduling interval (--scheduling-interval-ms, CARVE_SCHEDULING_INTERVAL_MS, \
         scheduling_interval_ms)",
        "millisecond",
    )?
    .map_or(defaults.scheduling_interval, Duration::from_millis);
    let fair_share_half_life = not_zero(
        given
            .fair_share_half_life_hours
            .or(file.fair_share_half_life_hours),
        "the fair-share half-life (--fair-share-half-life-hours, \
         CARVE_FAIR_SHARE_HALF_LIFE_HOURS, fair_share_half_life_hours)",
        "hour",
    )?
    .map_or(defaults.fair_share_half_life, |hours| {
        Duration::from_secs(hours.saturating_mul(3600))
    });
    let heartbeat_interval = not_zero(
        given.heartbeat_seconds.or(file.heartbeat_seconds),
        "the heartbeat interval (--heartbeat-seconds, CARVE_HEARTBEAT_SECONDS, \
         heartbeat_seconds)",
        "second",
    )?
    .map_or(defaults.heartbeat_interval, Duration::from_secs);
    let lease_duration = not_zero(
        given.lease_seconds.or(file.lease_seconds),
        "the lease (--lease-seconds, CARVE_LEASE_SECONDS, lease_seconds)",
        "second",
    )?
    .map_or(defaults.lease_duration, Duration::from_secs);
    let leader_lease = not_zero(
        given.leader_lease_ms.or(file.leader_lease_ms),
        "the leader's lease (--leader-lease-ms, CARVE_LEADER_LEASE_MS, leader_lease_ms)",
        "millisecond",
    )?
    .map_or(defaults.leader_lease, Duration::from_millis);
    let tls = match (
        given.tls_cert.or(file.tls_cert),
        given.tls_key.or(file.tls_key),
    ) {
        (Some(certificate), Some(key)) => Some((certificate, key)),
        (None, None) => None,
        _ => bail!("TLS needs both a certificate and a key (tls_cert and tls_key)"),
    };
    let tls_client_ca = given.tls_client_ca.or(file.tls_client_ca);
    if tls_client_ca.is_some() && tls.is_none() {
        bail!("client certificates (tls_client_ca) need TLS: set tls_cert and tls_key too");
    }
    let admin_token = match given.admin_token_file.or(file.admin_token_file) {
        Some(path) => Some(AdminTokenSource::File(path)),
        None => admin_token.map(AdminTokenSource::Secret),
    };
    Ok(Settings {
        listen: given
            .listen
            .or(file.listen)
            .unwrap_or_else(|| DEFAULT_LISTEN.to_string()),
        database: given.database.or(file.database),
        admin_token,
        scheduler: SchedulerSettings {
            lease_duration,
            heartbeat_interval,
            scheduling_interval,
            infrastructure_retry_backoff: defaults.infrastructure_retry_backoff,
            preemption: PreemptionSettings {
                enabled: given
                    .preemption
                    .or(file.preemption)
                    .unwrap_or(defaults.preemption.enabled),
                min_run_time: given
                    .preemption_min_run_time_seconds
                    .or(file.preemption_min_run_time_seconds)
                    .map_or(defaults.preemption.min_run_time, Duration::from_secs),
                max_per_job_per_hour: given
                    .preemption_max_per_hour
                    .or(file.preemption_max_per_hour)
                    .unwrap_or(defaults.preemption.max_per_job_per_hour),
                grace_period: given
                    .preemption_grace_seconds
                    .or(file.preemption_grace_seconds)
                    .map_or(defaults.preemption.grace_period, Duration::from_secs),
            },
            leader_lease,
            advertise_endpoint: given.advertise_endpoint.or(file.advertise_endpoint),
            min_slice_bytes: given
                .min_slice_mib
                .or(file.min_slice_mib)
                .map_or(defaults.min_slice_bytes, |mib| mib.saturating_mul(1 << 20)),
            fair_share_half_life,
            // Read by `Settings::load`, with the other files.
            sealing: Default::default(),
        },
        ignored: given
            .checkpoint_dir
            .or(file.checkpoint_dir)
            .map(|directory| {
                format!(
                    "checkpoint_dir ({directory}) is ignored: each worker's --checkpoint-dir \
                     says where its attempts write, and an attempt resumes only from a \
                     checkpoint an earlier attempt reported"
                )
            })
            .into_iter()
            .collect(),
        metrics_listen: given.metrics_listen.or(file.metrics_listen),
        tls,
        tls_client_ca,
        secrets_key_file: given.secrets_key_file.or(file.secrets_key_file),
        secrets_previous_key_files: if given.secrets_previous_key_files.is_empty() {
            file.secrets_previous_key_files
        } else {
            given.secrets_previous_key_files
        },
    })
}

impl Arguments {
    /// The settings these arguments (with the environment clap read) and their config
    /// file give.
    pub fn settings(self) -> Result<Settings> {
        let file = match &self.config {
            Some(path) => GivenSettings::from_file(path)?,
            None => GivenSettings::default(),
        };
        resolve(self.given, file, self.admin_token)
    }
}

impl Settings {
    /// The address to listen on and the server's configuration, reading the files the
    /// settings name and making the default database's directory.
    pub fn load(self) -> Result<(String, SchedulerConfig)> {
        for ignored in &self.ignored {
            tracing::warn!("{ignored}");
        }
        let database_url = match self.database {
            Some(database) => database,
            None => default_database()?,
        };
        let admin_token = match self.admin_token {
            Some(AdminTokenSource::File(path)) => Some(
                std::fs::read_to_string(&path)
                    .with_context(|| {
                        format!("cannot read the admin token file {}", path.display())
                    })?
                    .trim()
                    .to_string(),
            ),
            Some(AdminTokenSource::Secret(secret)) => Some(secret),
            None => None,
        };
        let tls = match self.tls {
            Some((certificate, key)) => Some(TlsIdentity {
                certificate_chain_pem: std::fs::read(&certificate).with_context(|| {
                    format!("cannot read the TLS certificate {}", certificate.display())
                })?,
                private_key_pem: std::fs::read(&key)
                    .with_context(|| format!("cannot read the TLS key {}", key.display()))?,
                client_ca_certificate_pem: match &self.tls_client_ca {
                    Some(path) => Some(std::fs::read(path).with_context(|| {
                        format!("cannot read the TLS client CA {}", path.display())
                    })?),
                    None => None,
                },
            }),
            None => None,
        };
        let mut scheduler = self.scheduler;
        if let Some(path) = &self.secrets_key_file {
            scheduler.sealing.key = Some(read_secrets_key(path)?);
        }
        if !self.secrets_previous_key_files.is_empty() && scheduler.sealing.key.is_none() {
            anyhow::bail!(
                "--secrets-previous-key-file needs --secrets-key-file: the key that replaced it"
            );
        }
        for path in &self.secrets_previous_key_files {
            scheduler
                .sealing
                .previous_keys
                .push(read_secrets_key(path)?);
        }
        let config = SchedulerConfig {
            database_url,
            settings: scheduler,
            admin_token,
            metrics_address: self.metrics_listen,
            tls,
        };
        Ok((self.listen, config))
    }
}

/// The secrets key in `path`, refused when other users may read the file (the key
/// opens every tenant's credentials) or when it is not a key.
fn read_secrets_key(path: &Path) -> Result<SecretsKey> {
    use std::io::Read;
    let cannot_read = || format!("cannot read the secrets key file {}", path.display());
    // One open for the mode and the text: the file checked is the file read.
    let mut file = std::fs::File::open(path).with_context(cannot_read)?;
    let mode = file
        .metadata()
        .with_context(cannot_read)?
        .permissions()
        .mode()
        & 0o777;
    if mode & 0o077 != 0 {
        bail!(
            "the secrets key file {} may be read by other users (mode {mode:04o}); make it \
             the scheduler's user's alone: chmod 600 {}",
            path.display(),
            path.display()
        );
    }
    let mut text = String::new();
    file.read_to_string(&mut text).with_context(cannot_read)?;
    SecretsKey::from_hex(&text)
        .map_err(|reason| anyhow::anyhow!("the secrets key file {}: {reason}", path.display()))
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

#[cfg(test)]
mod tests;
