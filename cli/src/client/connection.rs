//! Where the scheduler is and who is calling: the connection options every client
//! command takes, the config file, and the authenticated channel built from them.
//!
//! Each setting is taken from, in order: its flag, its environment variable, the config
//! file (`--config`, `CARVE_CLI_CONFIG`, or `$XDG_CONFIG_HOME/carve/config.toml`, or
//! `~/.config/carve/config.toml`), and the default (`http://127.0.0.1:7470`, where
//! `carve-scheduler` listens unless told otherwise).
//!
//! With several replicas the connection goes to the leader: a standby's refusal names it
//! (the `carve-leader` trailer) and it is tried next. Every call has a deadline
//! (`--timeout`, for connecting and for each call), so a replica that accepts the
//! connection but does not answer (a frozen leader) is left for another within it.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use carve_proto::ApiError;
use carve_proto::client::{
    AuthenticatedChannel, BearerToken, ClientIdentity, connect, failover_endpoints,
};
use carve_proto::status::leader_named_by;
use carve_proto::v1;
use carve_proto::v1::admin_service_client::AdminServiceClient;
use carve_proto::v1::cluster_service_client::ClusterServiceClient;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_proto::v1::secret_service_client::SecretServiceClient;
use serde::Deserialize;
use tonic::service::interceptor::InterceptedService;

use super::failure::{
    ClientFailure, FailureKind, IS_IT_RUNNING, cannot_reach, connection_lost, lower_os_error,
    status_failure,
};

/// Where `carve-scheduler` listens by default (its `--listen`), as an endpoint.
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:7470";

/// Rounds over several replicas looking for the leader (half a second apart) before
/// settling for any that answers: a failover takes about the leader's lease.
const LEADER_SEARCH_ROUNDS: u32 = 3;

/// How long connecting, and each call, may take before the scheduler counts as not
/// answering (`--timeout`): long enough for a page of `carve jobs` from a busy
/// scheduler, short beside a freeze.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// How long to wait for a scheduler to connect, and to answer each call, before
    /// trying another replica (or failing): 10s, 2m ... [default: 10s]
    #[arg(long, env = "CARVE_TIMEOUT", global = true)]
    pub timeout: Option<String>,
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
    /// The config file with `endpoint`, `token` (or `token_file`), `ca_cert`, `tls_cert`,
    /// `tls_key` and `timeout`
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
    timeout: Option<String>,
}

/// The settings after every source was consulted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedConnection {
    pub endpoint: String,
    pub token: Option<String>,
    pub ca_cert: Option<PathBuf>,
    /// The client certificate chain and key files, for mutual TLS.
    pub client_certificate: Option<ClientCertificateFiles>,
    /// The deadline of connecting and of each call.
    pub call_timeout: Duration,
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
        let call_timeout = match self.timeout.clone().or(file.timeout) {
            None => DEFAULT_CALL_TIMEOUT,
            Some(text) => carve_core::spec::parse_duration(&text)
                .ok()
                .filter(|timeout| !timeout.is_zero())
                .ok_or_else(|| {
                    ClientFailure::new(
                        FailureKind::InvalidArgument,
                        format!(
                            "timeout: {text:?} is not a duration above zero; write one such \
                             as 10s or 2m"
                        ),
                    )
                })?,
        };
        Ok(ResolvedConnection {
            endpoint,
            token: token.filter(|token| !token.is_empty()),
            ca_cert,
            client_certificate,
            call_timeout,
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
/// `client_certificate` when given), connecting within [`DEFAULT_CALL_TIMEOUT`]. A token
/// that cannot be a header is an authentication failure; failing to connect is a
/// [`FailureKind::CannotConnect`].
pub async fn connect_channel(
    endpoint: &str,
    ca_cert: Option<&Path>,
    client_certificate: Option<&ClientCertificateFiles>,
    token: &str,
) -> Result<AuthenticatedChannel> {
    connect_channel_within(
        endpoint,
        ca_cert,
        client_certificate,
        token,
        DEFAULT_CALL_TIMEOUT,
    )
    .await
}

/// [`connect_channel`], connecting within `connect_timeout`.
async fn connect_channel_within(
    endpoint: &str,
    ca_cert: Option<&Path>,
    client_certificate: Option<&ClientCertificateFiles>,
    token: &str,
    connect_timeout: Duration,
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
        connect_timeout,
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

/// Gives each call the connection's deadline (`grpc-timeout`): the client stops waiting
/// for the answer's start when it passes (tonic's channel enforces it, whatever the
/// server does) and the server knows it too. For a watch it bounds the wait for the
/// stream to start, not the stream.
#[derive(Debug, Clone, Copy)]
pub struct CallDeadline(pub Duration);

impl tonic::service::Interceptor for CallDeadline {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if !request.metadata().contains_key("grpc-timeout") {
            request.set_timeout(self.0);
        }
        Ok(request)
    }
}

/// The CLI's channel: authenticated, each call under the deadline.
pub type CallChannel = InterceptedService<AuthenticatedChannel, CallDeadline>;

/// An open, authenticated connection to a scheduler.
#[derive(Debug, Clone)]
pub struct Connection {
    pub endpoint: String,
    channel: CallChannel,
    /// Each call's deadline (`--timeout`); a watch also hears from its scheduler within it.
    pub call_timeout: Duration,
    /// What it was opened with, to open it again after a failover.
    options: ConnectionOptions,
}

/// What a replica answered to the leader probe.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ProbeAnswer {
    /// It leads, or is the only scheduler.
    Leads,
    /// A standby, naming the leader when it knows it.
    Standby { leader: Option<String> },
    /// No answer within the deadline, or the connection broke.
    NoAnswer { cause: String },
}

impl Connection {
    /// Resolves the options and connects. A missing token is an authentication failure
    /// before anything is sent.
    pub async fn open(options: &ConnectionOptions) -> Result<Connection> {
        Connection::open_avoiding(options, None).await
    }

    /// [`Connection::open`]; with several replicas, `avoid` (one that just did not
    /// answer) is tried only when no other answers.
    async fn open_avoiding(options: &ConnectionOptions, avoid: Option<&str>) -> Result<Connection> {
        let resolved = options.resolve()?;
        let token = resolved.token.clone().ok_or_else(|| {
            ClientFailure::new(
                FailureKind::Authentication,
                "no token: set --token, CARVE_TOKEN, or token in the config file \
                 (~/.config/carve/config.toml)",
            )
        })?;
        let endpoints = failover_endpoints(&resolved.endpoint).await;
        let connect = |endpoint: String| {
            let resolved = resolved.clone();
            let token = token.clone();
            async move {
                let channel = connect_channel_within(
                    &endpoint,
                    resolved.ca_cert.as_deref(),
                    resolved.client_certificate.as_ref(),
                    &token,
                    resolved.call_timeout,
                )
                .await?;
                Ok::<_, anyhow::Error>(Connection {
                    endpoint,
                    channel: InterceptedService::new(channel, CallDeadline(resolved.call_timeout)),
                    call_timeout: resolved.call_timeout,
                    options: options.clone(),
                })
            }
        };
        if let [endpoint] = endpoints.as_slice() {
            return connect(endpoint.clone()).await;
        }
        // Several replicas: the leader, which answers every call (a standby answers
        // worker, cancel, drain and watch calls UNAVAILABLE, naming the leader, which is
        // tried next); else, while replicas are between leaders, the first that answers
        // at all (it takes submits and reads). A replica that does not answer within the
        // deadline (frozen) is not asked again.
        let mut reachable = None;
        let mut last_error = None;
        // The replica to avoid counts as not answering until the others were tried.
        let avoided = avoid.filter(|avoid| endpoints.iter().any(|endpoint| endpoint != avoid));
        let mut unanswered: HashSet<String> = avoided.iter().map(|one| one.to_string()).collect();
        for round in 0..LEADER_SEARCH_ROUNDS {
            if endpoints
                .iter()
                .all(|endpoint| unanswered.contains(endpoint))
            {
                break;
            }
            if round > 0 {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            let mut to_try: std::collections::VecDeque<String> =
                endpoints.iter().cloned().collect();
            let mut tried: HashSet<String> = HashSet::new();
            while let Some(endpoint) = to_try.pop_front() {
                if unanswered.contains(&endpoint) || !tried.insert(endpoint.clone()) {
                    continue;
                }
                let connection = match connect(endpoint.clone()).await {
                    Ok(connection) => connection,
                    Err(error) => {
                        last_error = Some(error);
                        unanswered.insert(endpoint);
                        continue;
                    }
                };
                match connection.probe_leadership().await {
                    ProbeAnswer::Leads => return Ok(connection),
                    ProbeAnswer::Standby { leader } => {
                        // The named leader goes next, listed or not.
                        if let Some(leader) = leader {
                            to_try.push_front(leader);
                        }
                        reachable.get_or_insert(connection);
                    }
                    ProbeAnswer::NoAnswer { cause } => {
                        last_error = Some(
                            cannot_reach(&endpoint, &cause, "no other replica answered").into(),
                        );
                        unanswered.insert(endpoint);
                    }
                }
            }
        }
        if reachable.is_none()
            && let Some(avoided) = avoided
        {
            match connect(avoided.to_string()).await {
                Ok(connection) => return Ok(connection),
                Err(error) => last_error = Some(error),
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
        // The first time, this replica (which just failed) only when no other answers.
        let mut avoid = Some(self.endpoint.as_str());
        loop {
            match Connection::open_avoiding(&self.options, avoid.take()).await {
                Ok(connection) => return Ok(connection),
                Err(error) if tokio::time::Instant::now() >= deadline => return Err(error),
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }

    /// Runs `call` on this connection; when the connection breaks under it (UNAVAILABLE,
    /// a transport error or the call's deadline, not an answer from the scheduler) runs
    /// it once more on the connection opened again over every endpoint, so a read
    /// survives a failover and a frozen replica. Only for calls that may safely run
    /// twice: reads, and a submit with an idempotency key (the scheduler answers a
    /// repeated key with the job it made).
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
    /// UNAVAILABLE, naming the leader): a slice listing filtered to nothing, which any
    /// token may make.
    async fn probe_leadership(&self) -> ProbeAnswer {
        let answer = self
            .cluster()
            .list_slices(v1::ListSlicesRequest {
                worker_id: "carve-leader-probe".into(),
                ..Default::default()
            })
            .await;
        match answer {
            Err(status) if std::error::Error::source(&status).is_some() => ProbeAnswer::NoAnswer {
                cause: lower_os_error(status.message()),
            },
            Err(status) if status.code() == tonic::Code::Unavailable => ProbeAnswer::Standby {
                leader: leader_named_by(&status).map(str::to_string),
            },
            _ => ProbeAnswer::Leads,
        }
    }

    pub fn jobs(&self) -> JobServiceClient<CallChannel> {
        JobServiceClient::new(self.channel.clone())
    }

    pub fn cluster(&self) -> ClusterServiceClient<CallChannel> {
        ClusterServiceClient::new(self.channel.clone())
    }

    pub fn admin(&self) -> AdminServiceClient<CallChannel> {
        AdminServiceClient::new(self.channel.clone())
    }

    pub fn secrets(&self) -> SecretServiceClient<CallChannel> {
        SecretServiceClient::new(self.channel.clone())
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
