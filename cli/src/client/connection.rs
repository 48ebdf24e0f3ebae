//! Where the scheduler is and who is calling: the connection options every client
//! command takes, the config file, and the authenticated channel built from them.
//!
//! Each setting is taken from, in order: its flag, its environment variable, the config
//! file (`--config`, `CARVE_CLI_CONFIG`, or `$XDG_CONFIG_HOME/carve/config.toml`, or
//! `~/.config/carve/config.toml`), and the default (`http://127.0.0.1:7470`, where
//! `carve-scheduler` listens unless told otherwise).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use carve_proto::ApiError;
use carve_proto::client::{
    AuthenticatedChannel, BearerToken, ClientIdentity, connect, failover_endpoints,
};
use carve_proto::v1;
use carve_proto::v1::admin_service_client::AdminServiceClient;
use carve_proto::v1::cluster_service_client::ClusterServiceClient;
use carve_proto::v1::job_service_client::JobServiceClient;
use serde::Deserialize;

use super::failure::{
    ClientFailure, FailureKind, IS_IT_RUNNING, cannot_reach, connection_lost, lower_os_error,
    status_failure,
};

/// Where `carve-scheduler` listens by default (its `--listen`), as an endpoint.
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:7470";

/// Rounds over several replicas looking for the leader (half a second apart) before
/// settling for any that answers: a failover takes about the leader's lease.
const LEADER_SEARCH_ROUNDS: u32 = 3;

/// How long connecting may take before the scheduler counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long [`Connection::reopen_within`] keeps trying: a failover takes about the
/// leader's lease, a restart a few seconds.
pub const REOPEN_PATIENCE: Duration = Duration::from_secs(60);

/// How long a call retried after its connection broke waits for a scheduler to answer
/// again: a failover takes about the leader's lease (10 s by default).
const RETRY_PATIENCE: Duration = Duration::from_secs(20);

/// The connection options of every command that talks to a scheduler.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Connection")]
pub struct ConnectionOptions {
    /// The scheduler's gRPC endpoint: http://HOST:PORT, or https://HOST:PORT for TLS;
    /// several replicas comma-separated (the leader is found among them)
    /// [default: http://127.0.0.1:7470]
    #[arg(long, env = "CARVE_ENDPOINT", global = true)]
    pub endpoint: Option<String>,
    /// The bearer token to authenticate with (see `carve admin tokens create`).
    #[arg(long, env = "CARVE_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<String>,
    /// A PEM file with the certificate authority that signed the scheduler's TLS
    /// certificate (https:// endpoints; without it the system's roots are used).
    #[arg(long, env = "CARVE_CA_CERT", global = true)]
    pub ca_cert: Option<PathBuf>,
    /// A PEM file with this client's certificate chain, for a scheduler that requires
    /// client certificates (mutual TLS); needs --tls-key.
    #[arg(long, env = "CARVE_TLS_CERT", global = true)]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "CARVE_TLS_KEY", global = true)]
    pub tls_key: Option<PathBuf>,
    /// The config file with `endpoint`, `token` (or `token_file`), `ca_cert`, `tls_cert`
    /// and `tls_key`
    /// [default: $XDG_CONFIG_HOME/carve/config.toml or ~/.config/carve/config.toml]
    #[arg(long, env = "CARVE_CLI_CONFIG", global = true)]
    pub config: Option<PathBuf>,
}

/// The config file's contents. Relative paths are relative to the file's directory.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    endpoint: Option<String>,
    token: Option<String>,
    token_file: Option<PathBuf>,
    ca_cert: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
}

/// The settings after every source was consulted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedConnection {
    pub endpoint: String,
    pub token: Option<String>,
    pub ca_cert: Option<PathBuf>,
    /// The client certificate chain and key files, for mutual TLS.
    pub client_certificate: Option<ClientCertificateFiles>,
}

/// A client certificate chain and its key, as files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCertificateFiles {
    pub certificate: PathBuf,
    pub key: PathBuf,
}

/// The config file used when none is named: under `$XDG_CONFIG_HOME`, else `~/.config`.
fn default_config_path() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|value| !value.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".config")))?;
    Some(base.join("carve").join("config.toml"))
}

fn read_config_file(path: &Path) -> Result<ConfigFile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the config file {}", path.display()))?;
    let file: ConfigFile = toml::from_str(&text).map_err(|error| {
        ClientFailure::new(
            FailureKind::InvalidArgument,
            format!(
                "config file {}: {}",
                path.display(),
                error.to_string().trim_end()
            ),
        )
    })?;
    if file.token.is_some() && file.token_file.is_some() {
        return Err(ClientFailure::new(
            FailureKind::InvalidArgument,
            format!(
                "config file {}: token and token_file: set only one",
                path.display()
            ),
        )
        .into());
    }
    Ok(file)
}

impl ConnectionOptions {
    /// Applies the config file and the defaults to what the flags and the environment
    /// gave. A config file named explicitly must exist; the default one may be missing.
    pub fn resolve(&self) -> Result<ResolvedConnection> {
        let (file, file_directory) = match &self.config {
            Some(path) => (
                read_config_file(path)?,
                path.parent().map(Path::to_path_buf),
            ),
            None => match default_config_path() {
                Some(path) if path.is_file() => (
                    read_config_file(&path)?,
                    path.parent().map(Path::to_path_buf),
                ),
                _ => (ConfigFile::default(), None),
            },
        };
        let relative_to_file = |path: PathBuf| match &file_directory {
            Some(directory) if path.is_relative() => directory.join(path),
            _ => path,
        };
        // Several replicas: `a,b,c`, each normalized.
        let endpoint = self
            .endpoint
            .clone()
            .or(file.endpoint)
            .as_deref()
            .unwrap_or(DEFAULT_ENDPOINT)
            .split(',')
            .filter(|one| !one.trim().is_empty())
            .map(normalize_endpoint)
            .collect::<Result<Vec<_>, _>>()?
            .join(",");
        let token = match (&self.token, file.token, file.token_file) {
            (Some(token), _, _) => Some(token.clone()),
            (None, Some(token), _) => Some(token),
            (None, None, Some(token_file)) => {
                let token_file = relative_to_file(token_file);
                let text = std::fs::read_to_string(&token_file).with_context(|| {
                    format!("cannot read the token file {}", token_file.display())
                })?;
                Some(text.trim().to_string())
            }
            (None, None, None) => None,
        };
        let ca_cert = self
            .ca_cert
            .clone()
            .or_else(|| file.ca_cert.map(relative_to_file));
        let client_certificate = match (
            self.tls_cert
                .clone()
                .or_else(|| file.tls_cert.map(relative_to_file)),
            self.tls_key
                .clone()
                .or_else(|| file.tls_key.map(relative_to_file)),
        ) {
            (Some(certificate), Some(key)) => Some(ClientCertificateFiles { certificate, key }),
            (None, None) => None,
            _ => {
                return Err(ClientFailure::new(
                    FailureKind::InvalidArgument,
                    "tls_cert and tls_key: a client certificate needs its key (set both)",
                )
                .into());
            }
        };
        Ok(ResolvedConnection {
            endpoint,
            token: token.filter(|token| !token.is_empty()),
            ca_cert,
            client_certificate,
        })
    }
}

/// Accepts `host:port` as `http://host:port`; only http and https are endpoints.
pub fn normalize_endpoint(text: &str) -> Result<String, ClientFailure> {
    let text = text.trim().trim_end_matches('/');
    let endpoint = if text.contains("://") {
        text.to_string()
    } else {
        format!("http://{text}")
    };
    let invalid = |reason: &str| {
        ClientFailure::new(
            FailureKind::InvalidArgument,
            format!("endpoint: {text:?} {reason}"),
        )
    };
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(invalid("must start with http:// or https://"));
    }
    let uri: tonic::codegen::http::Uri = endpoint
        .parse()
        .map_err(|error| invalid(&format!("is not an address: {error}")))?;
    if uri.host().is_none_or(str::is_empty) {
        return Err(invalid("has no host"));
    }
    Ok(endpoint)
}

/// Opens a channel to `endpoint` whose calls carry `token`, with TLS for https://
/// (trusting `ca_cert`, or the system's roots without it, and showing
/// `client_certificate` when given). A token that cannot be a header is an
/// authentication failure; failing to connect is a [`FailureKind::CannotConnect`].
pub async fn connect_channel(
    endpoint: &str,
    ca_cert: Option<&Path>,
    client_certificate: Option<&ClientCertificateFiles>,
    token: &str,
) -> Result<AuthenticatedChannel> {
    let token = BearerToken::new(token)
        .map_err(|error| ClientFailure::new(FailureKind::Authentication, error.to_string()))?;
    let ca_certificate_pem = match ca_cert {
        Some(path) if endpoint.starts_with("https://") => Some(
            std::fs::read(path)
                .with_context(|| format!("cannot read the ca certificate {}", path.display()))?,
        ),
        Some(path) => {
            return Err(ClientFailure::new(
                FailureKind::InvalidArgument,
                format!(
                    "ca_cert: {} is given but the endpoint {endpoint} is not https://",
                    path.display()
                ),
            )
            .into());
        }
        None => None,
    };
    let read = |what: &str, path: &Path| {
        std::fs::read(path).with_context(|| format!("cannot read the {what} {}", path.display()))
    };
    let client_identity = match client_certificate {
        Some(files) => Some(ClientIdentity {
            certificate_chain_pem: read("client certificate", &files.certificate)?,
            private_key_pem: read("client key", &files.key)?,
        }),
        None => None,
    };
    connect(
        endpoint,
        ca_certificate_pem.as_deref(),
        client_identity.as_ref(),
        token,
        CONNECT_TIMEOUT,
    )
    .await
    .map_err(|error| match error {
        ApiError::Unavailable(cause) => {
            let advice = if cause.contains("CaUsedAsEndEntity") {
                "the scheduler's certificate is a CA's, as a plain `openssl req -x509` makes: \
                 serve a leaf certificate (CA:FALSE, with subjectAltName), see deploy/README.md"
            } else if cause.contains("certificate") {
                "is --ca-cert the authority that signed the scheduler's certificate?"
            } else {
                IS_IT_RUNNING
            };
            cannot_reach(endpoint, &lower_os_error(&cause), advice).into()
        }
        other => ClientFailure::new(FailureKind::InvalidArgument, other.to_string()).into(),
    })
}

/// An open, authenticated connection to a scheduler.
#[derive(Debug, Clone)]
pub struct Connection {
    pub endpoint: String,
    channel: AuthenticatedChannel,
    /// What it was opened with, to open it again after a failover.
    options: ConnectionOptions,
}

impl Connection {
    /// Resolves the options and connects. A missing token is an authentication failure
    /// before anything is sent.
    pub async fn open(options: &ConnectionOptions) -> Result<Connection> {
        let resolved = options.resolve()?;
        let token = resolved.token.ok_or_else(|| {
            ClientFailure::new(
                FailureKind::Authentication,
                "no token: set --token, CARVE_TOKEN, or token in the config file \
                 (~/.config/carve/config.toml)",
            )
        })?;
        let endpoints = failover_endpoints(&resolved.endpoint).await;
        if let [endpoint] = endpoints.as_slice() {
            let channel = connect_channel(
                endpoint,
                resolved.ca_cert.as_deref(),
                resolved.client_certificate.as_ref(),
                &token,
            )
            .await?;
            return Ok(Connection {
                endpoint: endpoint.clone(),
                channel,
                options: options.clone(),
            });
        }
        // Several replicas: the leader, which answers every call (a standby answers
        // worker, cancel, drain and watch calls UNAVAILABLE); else, while replicas are
        // between leaders, the first that answers at all (it takes submits and reads).
        let mut reachable = None;
        let mut last_error = None;
        for round in 0..LEADER_SEARCH_ROUNDS {
            if round > 0 {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            for endpoint in &endpoints {
                let channel = match connect_channel(
                    endpoint,
                    resolved.ca_cert.as_deref(),
                    resolved.client_certificate.as_ref(),
                    &token,
                )
                .await
                {
                    Ok(channel) => channel,
                    Err(error) => {
                        last_error = Some(error);
                        continue;
                    }
                };
                let connection = Connection {
                    endpoint: endpoint.clone(),
                    channel,
                    options: options.clone(),
                };
                if connection.is_leader_or_alone().await {
                    return Ok(connection);
                }
                reachable.get_or_insert(connection);
            }
        }
        match (reachable, last_error) {
            (Some(connection), _) => Ok(connection),
            (None, Some(error)) => Err(error),
            (None, None) => Err(ClientFailure::new(
                FailureKind::InvalidArgument,
                "endpoint: no endpoint given",
            )
            .into()),
        }
    }

    /// Opens the connection again over every endpoint (the leader first), trying for up
    /// to `patience`: for a call whose connection broke, since a failover moves the
    /// leader to another replica and a restarted scheduler takes a moment to listen.
    pub async fn reopen_within(&self, patience: Duration) -> Result<Connection> {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            match Connection::open(&self.options).await {
                Ok(connection) => return Ok(connection),
                Err(error) if tokio::time::Instant::now() >= deadline => return Err(error),
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }

    /// Runs `call` on this connection; when the connection breaks under it (UNAVAILABLE or
    /// a transport error, not an answer from the scheduler) runs it once more on the
    /// connection opened again over every endpoint, so a read survives a failover.
    /// Only for calls that may safely run twice: reads, and a submit with an
    /// idempotency key (the scheduler answers a repeated key with the job it made).
    pub async fn retrying<T, Call, Answer>(&self, call: Call) -> Result<T, tonic::Status>
    where
        Call: Fn(Connection) -> Answer,
        Answer: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        match call(self.clone()).await {
            Err(status) if connection_lost(&status) => {
                let Ok(again) = self.reopen_within(RETRY_PATIENCE).await else {
                    return Err(status);
                };
                call(again).await.map(tonic::Response::into_inner)
            }
            answer => answer.map(tonic::Response::into_inner),
        }
    }

    /// Whether this scheduler answers calls only a leader answers (a standby says
    /// UNAVAILABLE): a slice listing filtered to nothing, which any token may make.
    async fn is_leader_or_alone(&self) -> bool {
        let answer = self
            .cluster()
            .list_slices(v1::ListSlicesRequest {
                worker_id: "carve-leader-probe".into(),
                ..Default::default()
            })
            .await;
        !matches!(answer, Err(status) if status.code() == tonic::Code::Unavailable)
    }

    pub fn jobs(&self) -> JobServiceClient<AuthenticatedChannel> {
        JobServiceClient::new(self.channel.clone())
    }

    pub fn cluster(&self) -> ClusterServiceClient<AuthenticatedChannel> {
        ClusterServiceClient::new(self.channel.clone())
    }

    pub fn admin(&self) -> AdminServiceClient<AuthenticatedChannel> {
        AdminServiceClient::new(self.channel.clone())
    }

    /// A status from this scheduler as a failure with its exit code; `action` says
    /// what was being done ("cannot get job j-1").
    pub fn failure(&self, status: &tonic::Status, action: &str) -> anyhow::Error {
        status_failure(status, &self.endpoint, action).into()
    }

    /// Gets one job; a missing one is "job X not found" (exit code 6).
    pub async fn fetch_job(&self, job_id: &str) -> Result<v1::Job> {
        let request = v1::GetJobRequest {
            job_id: job_id.to_string(),
        };
        self.retrying(|connection| {
            let request = request.clone();
            async move { connection.jobs().get_job(request).await }
        })
        .await
        .map_err(|status| self.failure(&status, &format!("cannot get job {job_id}")))?
        .job
        .context("the scheduler answered without the job")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_without_a_scheme_is_plain_http() {
        assert_eq!(
            normalize_endpoint("127.0.0.1:7470").unwrap(),
            "http://127.0.0.1:7470"
        );
        assert_eq!(
            normalize_endpoint("https://carve.example:443/").unwrap(),
            "https://carve.example:443"
        );
    }

    #[test]
    fn a_bad_endpoint_names_the_setting_and_the_reason() {
        let error = normalize_endpoint("ftp://host:1").unwrap_err();
        assert_eq!(error.kind, FailureKind::InvalidArgument);
        assert!(error.message.starts_with("endpoint: "), "{}", error.message);
        assert!(error.message.contains("http://"), "{}", error.message);
    }

    #[test]
    fn flags_beat_the_config_file_which_beats_the_default() {
        let directory = tempfile::tempdir().unwrap();
        let config = directory.path().join("config.toml");
        std::fs::write(directory.path().join("token"), "carve_from_file\n").unwrap();
        std::fs::write(
            &config,
            "endpoint = \"http://file:1\"\ntoken_file = \"token\"\nca_cert = \"ca.pem\"\n\
             tls_cert = \"client.pem\"\ntls_key = \"client.key\"\n",
        )
        .unwrap();
        let from_file = ConnectionOptions {
            config: Some(config.clone()),
            ..ConnectionOptions::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(from_file.endpoint, "http://file:1");
        assert_eq!(from_file.token.as_deref(), Some("carve_from_file"));
        assert_eq!(from_file.ca_cert, Some(directory.path().join("ca.pem")));
        assert_eq!(
            from_file.client_certificate,
            Some(ClientCertificateFiles {
                certificate: directory.path().join("client.pem"),
                key: directory.path().join("client.key"),
            })
        );

        let from_flags = ConnectionOptions {
            endpoint: Some("http://flag:2".into()),
            token: Some("carve_flag".into()),
            config: Some(config),
            ..ConnectionOptions::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(from_flags.endpoint, "http://flag:2");
        assert_eq!(from_flags.token.as_deref(), Some("carve_flag"));
    }

    #[test]
    fn a_client_certificate_without_its_key_is_refused() {
        let directory = tempfile::tempdir().unwrap();
        let config = directory.path().join("config.toml");
        std::fs::write(&config, "endpoint = \"https://h:1\"\n").unwrap();
        let error = ConnectionOptions {
            tls_cert: Some("client.pem".into()),
            config: Some(config),
            ..ConnectionOptions::default()
        }
        .resolve()
        .unwrap_err();
        assert!(format!("{error:#}").contains("tls_key"), "{error:#}");
    }

    #[test]
    fn a_config_file_with_an_unknown_key_is_rejected_naming_it() {
        let directory = tempfile::tempdir().unwrap();
        let config = directory.path().join("config.toml");
        std::fs::write(&config, "endpoint = \"http://h:1\"\ntokn = \"x\"\n").unwrap();
        let error = ConnectionOptions {
            config: Some(config),
            ..ConnectionOptions::default()
        }
        .resolve()
        .unwrap_err();
        assert!(format!("{error:#}").contains("tokn"), "{error:#}");
    }
}
