//! `run(config, listener, shutdown)`: the whole scheduler on a socket it is given, until
//! the shutdown future completes — so tests run the real server in-process on
//! `127.0.0.1:0` (mini-redis's shape).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use carve_proto::ApiError;
use carve_proto::v1::admin_service_server::AdminServiceServer;
use carve_proto::v1::cluster_service_server::ClusterServiceServer;
use carve_proto::v1::job_service_server::JobServiceServer;
use carve_proto::v1::secret_service_server::SecretServiceServer;
use carve_proto::v1::worker_service_server::WorkerServiceServer;
use tokio::net::TcpListener;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;

use crate::auth::{Role, generate_id, generate_secret, hash_secret};
use crate::error::SchedulerError;
use crate::scheduler::sealed_secrets::seal_again;
use crate::scheduler::{Candidate, Scheduler, SchedulerSettings, now_ms};
use crate::services::Services;
use crate::store::leadership::SingleNodeLock;
use crate::store::{Backend, Store, TenantRecord, TokenRecord};

/// Everything the scheduler needs to start.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// `sqlite:///path/carve.db` or `postgres://user@host/db`.
    pub database_url: String,
    pub settings: SchedulerSettings,
    /// An admin secret to accept (stored hashed). Without one, a first start creates an
    /// admin token and writes it to [`GENERATED_ADMIN_TOKEN_FILE`] next to the SQLite
    /// database (mode 0600), logging only that file's path; on PostgreSQL (no data
    /// directory) a first start without one is an error.
    pub admin_token: Option<String>,
    /// Where to serve Prometheus metrics (`GET /metrics`), if anywhere.
    pub metrics_address: Option<std::net::SocketAddr>,
    /// Serve gRPC over TLS with this certificate chain and key (PEM); plain HTTP/2 without.
    pub tls: Option<TlsIdentity>,
}

/// The server's certificate chain and private key, PEM-encoded, and the CA whose
/// certificates clients must show when it requires them (mutual TLS).
#[derive(Clone)]
pub struct TlsIdentity {
    pub certificate_chain_pem: Vec<u8>,
    pub private_key_pem: Vec<u8>,
    /// Require a client certificate signed by this CA (PEM) on every connection.
    pub client_ca_certificate_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        formatter
            .debug_struct("TlsIdentity")
            .field(
                "certificate_chain_pem",
                &format!("{} bytes", self.certificate_chain_pem.len()),
            )
            .field(
                "requires_client_certificates",
                &self.client_ca_certificate_pem.is_some(),
            )
            .finish_non_exhaustive()
    }
}

/// The tenant the first admin token belongs to.
pub const DEFAULT_TENANT: &str = "default";

/// The file, next to the SQLite database, a first start writes the admin token it
/// generates to. Never printed: stderr is the log stream under systemd and Kubernetes,
/// kept and shipped where the token does not belong.
pub const GENERATED_ADMIN_TOKEN_FILE: &str = "admin-token";

/// Where a first start of the store at `database_url` writes a generated admin token:
/// next to a SQLite file; `None` for PostgreSQL and in-memory SQLite.
pub fn generated_admin_token_path(database_url: &str) -> Option<std::path::PathBuf> {
    let file = sqlite_database_file(database_url)?;
    let directory = file.parent().unwrap_or(std::path::Path::new(""));
    Some(directory.join(GENERATED_ADMIN_TOKEN_FILE))
}

/// The SQLite file `database_url` names; `None` for PostgreSQL and in-memory SQLite.
fn sqlite_database_file(database_url: &str) -> Option<std::path::PathBuf> {
    if crate::store::is_postgres_url(database_url)
        || database_url.contains(":memory:")
        || database_url.contains("mode=memory")
    {
        return None;
    }
    let file = match database_url.strip_prefix("sqlite:") {
        Some(rest) => rest.strip_prefix("//").unwrap_or(rest),
        None => database_url,
    };
    let file = file.split('?').next().unwrap_or(file);
    if file.is_empty() {
        return None;
    }
    Some(std::path::PathBuf::from(file))
}

/// Writes a generated admin token to `path`, readable by its owner alone (0600),
/// replacing a file left from an earlier database: a new file is created rather than
/// an existing one opened, so neither its old mode nor a link planted there is used.
fn write_admin_token_file(path: &std::path::Path, secret: &str) -> Result<(), SchedulerError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let failed = |error: std::io::Error| {
        SchedulerError::Api(ApiError::Unavailable(format!(
            "cannot write the generated admin token to {}: {error}",
            path.display()
        )))
    };
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(failed(error)),
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(failed)?;
    file.write_all(format!("{secret}\n").as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(failed)
}

/// What reflection describes: carve's services and the health service served beside them.
fn reflection_builder() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(carve_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

/// Creates the default tenant and the admin token on a first start. A generated token
/// is written to `generated_token_path` before its hash is stored (so a token is never
/// stored that nobody holds); returns that path when it did.
async fn bootstrap(
    store: &Store,
    admin_token: Option<&str>,
    generated_token_path: Option<&std::path::Path>,
) -> Result<Option<std::path::PathBuf>, SchedulerError> {
    let now = now_ms();
    if store.list_tenants().await?.is_empty() {
        let created = store
            .create_tenant(&TenantRecord {
                name: DEFAULT_TENANT.into(),
                vram_quota_bytes: None,
                max_running_jobs: None,
                fair_share_weight: 1,
                created_at_ms: now,
            })
            .await;
        match created {
            // Another replica starting at the same time created it.
            Err(SchedulerError::Api(ApiError::AlreadyExists { .. })) | Ok(()) => {}
            Err(error) => return Err(error),
        }
    }
    let (secret, generated) = match admin_token {
        Some(secret) => (secret.to_string(), false),
        None if store
            .list_tokens(None)
            .await?
            .iter()
            .any(|token| token.role == Role::Admin && !token.revoked) =>
        {
            return Ok(None);
        }
        None => {
            let Some(path) = generated_token_path else {
                return Err(SchedulerError::invalid_argument(
                    "admin_token",
                    "a first start on this database must be given an admin token \
                     (--admin-token-file or CARVE_ADMIN_TOKEN): it has no data directory \
                     to write a generated one to",
                ));
            };
            let secret = generate_secret();
            write_admin_token_file(path, &secret)?;
            (secret, true)
        }
    };
    let hash = hash_secret(&secret);
    if store.find_token_by_hash(&hash).await?.is_none() {
        let created = store
            .create_token(&TokenRecord {
                id: generate_id("token"),
                tenant: DEFAULT_TENANT.into(),
                role: Role::Admin,
                secret_hash: hash,
                description: "bootstrap admin token".into(),
                created_at_ms: now,
                expires_at_ms: None,
                revoked: false,
                revoked_at_ms: None,
                last_used_at_ms: None,
            })
            .await;
        match created {
            // Another replica starting at the same time stored the same token.
            Err(SchedulerError::Api(ApiError::AlreadyExists { .. })) | Ok(()) => {}
            Err(error) => return Err(error),
        }
    }
    Ok(generated_token_path
        .filter(|_| generated)
        .map(std::path::Path::to_path_buf))
}

/// Runs the scheduler until `shutdown` completes.
pub async fn run(
    config: SchedulerConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), SchedulerError> {
    run_announcing_readiness(config, listener, shutdown, |_| {}).await
}

/// Runs the scheduler until `shutdown` completes, calling `ready` with the listening
/// address once it holds its SQLite lock, has opened and migrated the store and is about
/// to serve. The binary prints its "listening" line there, not at bind time: scripts and
/// tests that wait for that line must find the single-node lock already taken, or a
/// second scheduler started right after it could take the lock first.
pub async fn run_announcing_readiness(
    config: SchedulerConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: impl FnOnce(Option<std::net::SocketAddr>) + Send,
) -> Result<(), SchedulerError> {
    // SQLite is single-node: a second scheduler on the same file is refused before it
    // touches the database. Held until `run` returns.
    let single_node_lock = match sqlite_database_file(&config.database_url) {
        Some(file) => Some(SingleNodeLock::acquire(&file).await?),
        None => None,
    };
    let store = Store::open(&config.database_url).await?;
    let generated_token_path = generated_admin_token_path(&config.database_url);
    if let Some(path) = bootstrap(
        &store,
        config.admin_token.as_deref(),
        generated_token_path.as_deref(),
    )
    .await?
    {
        // Only its hash is stored, so the file is the one copy.
        eprintln!(
            "admin token created and written to {} (readable by this user alone)",
            path.display()
        );
    }
    if config.settings.sealing.key.is_none() {
        tracing::warn!(
            "tenants' secrets (registry credentials) are stored unsealed in the database: \
             give the scheduler --secrets-key-file to seal them"
        );
    }
    // After a key rotation (or a key first set), values the old key sealed (or none did)
    // are sealed with the new one, so the old key can go.
    let sealed_again = seal_again(&store, &config.settings.sealing).await?;
    if sealed_again > 0 {
        tracing::info!(
            sealed_again,
            "tenants' secrets sealed again with the current --secrets-key-file"
        );
    }
    let postgres = store.backend() == Backend::Postgres;
    let scheduler = Arc::new(Scheduler::new(
        store,
        config.settings.clone(),
        crate::convert::job_update_to_stored_event,
    ));
    let candidate = Candidate {
        holder: generate_id("replica"),
        endpoint: config
            .settings
            .advertise_endpoint
            .clone()
            .unwrap_or_else(|| {
                let scheme = if config.tls.is_some() {
                    "https"
                } else {
                    "http"
                };
                match listener.local_addr() {
                    Ok(address) => format!("{scheme}://{address}"),
                    Err(_) => String::new(),
                }
            }),
        lease: config.settings.leader_lease,
    };
    let leadership = if postgres {
        // Replicas on PostgreSQL: one leads (it recovers the live state when it takes
        // over), the others stand by.
        scheduler.join_leadership(&candidate).await?;
        Some(tokio::spawn(
            scheduler.clone().keep_leadership(candidate.clone()),
        ))
    } else {
        scheduler.recover().await?;
        None
    };
    let background = tokio::spawn(background_loop(scheduler.clone()));
    let metrics = match config.metrics_address {
        Some(address) => {
            let listener = TcpListener::bind(address).await.map_err(|error| {
                ApiError::Unavailable(format!("cannot serve metrics on {address}: {error}"))
            })?;
            tracing::info!(address = ?listener.local_addr().ok(), "metrics at /metrics");
            Some(tokio::spawn(crate::metrics::serve_metrics(
                listener,
                scheduler.clone(),
            )))
        }
        None => None,
    };
    let services = Services {
        scheduler: scheduler.clone(),
    };
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<JobServiceServer<Services>>()
        .await;
    let reflection_failed = |error| ApiError::Internal(format!("reflection: {error}"));
    // v1alpha beside v1: grpcio-reflection (Python) and older grpcurl speak only v1alpha.
    // Each lists the other, which its builder does not add on its own.
    let reflection = reflection_builder()
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(reflection_failed)?;
    let reflection_v1alpha = reflection_builder()
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(reflection_failed)?;
    let address = listener.local_addr().ok();
    tracing::info!(?address, "scheduler listening");
    ready(address);
    let keepalive = http2_keepalive(&config.settings);
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(keepalive))
        .http2_keepalive_timeout(Some(keepalive));
    if let Some(tls) = &config.tls {
        let mut tls_config = tonic::transport::ServerTlsConfig::new().identity(
            tonic::transport::Identity::from_pem(&tls.certificate_chain_pem, &tls.private_key_pem),
        );
        if let Some(client_ca) = &tls.client_ca_certificate_pem {
            // Required, not optional: a connection without such a certificate is refused
            // in the handshake, before any call (and its token) is read.
            tls_config =
                tls_config.client_ca_root(tonic::transport::Certificate::from_pem(client_ca));
        }
        builder = builder
            .tls_config(tls_config)
            .map_err(|error| ApiError::InvalidArgument {
                field: "tls".into(),
                reason: format!("the certificate or key is not usable: {error}"),
            })?;
    }
    // Replies go out at once: without TCP_NODELAY (which tonic sets only on sockets it
    // accepts itself, not on a given listener's), a small reply waits for the client's
    // delayed ACK, and a client that sends its next call only after the answer (a
    // closed loop, like `carve submit` in a script) waited ~40 ms per call: measured
    // with carve-submit-bench, 16 closed-loop clients got 338 submits/s at p50 48 ms.
    let incoming = TcpListenerStream::new(listener).map(|accepted| {
        accepted.inspect(|stream| {
            if let Err(error) = stream.set_nodelay(true) {
                tracing::warn!(%error, "could not set tcp_nodelay on a connection");
            }
        })
    });
    let result = builder
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(UndecodableRequestsAreInvalid(JobServiceServer::new(
            services.clone(),
        )))
        .add_service(UndecodableRequestsAreInvalid(AdminServiceServer::new(
            services.clone(),
        )))
        .add_service(UndecodableRequestsAreInvalid(ClusterServiceServer::new(
            services.clone(),
        )))
        .add_service(UndecodableRequestsAreInvalid(SecretServiceServer::new(
            services.clone(),
        )))
        .add_service(UndecodableRequestsAreInvalid(WorkerServiceServer::new(
            services,
        )))
        .serve_with_incoming_shutdown(incoming, {
            let scheduler = scheduler.clone();
            async move {
                shutdown.await;
                scheduler.begin_shutdown();
            }
        })
        .await
        .map_err(|error| SchedulerError::Api(ApiError::Unavailable(format!("server: {error}"))));
    background.abort();
    if let Some(leadership) = leadership {
        leadership.abort();
        scheduler.release_leadership(&candidate).await;
    }
    if let Some(metrics) = metrics {
        metrics.abort();
    }
    // Log lines are written in groups every ~150 ms; write the last group before going.
    // (A crash loses that group: log lines are best effort, acknowledged jobs are not.)
    scheduler.flush_logs().await;
    if let Some(lock) = single_node_lock {
        lock.release().await;
    }
    result
}

/// What prost's decode errors start with, in the INTERNAL status tonic answers them with.
const PROST_DECODE_ERROR_PREFIX: &str = "failed to decode Protobuf message";

/// One of the API's services, whose answers to requests that do not decode are
/// INVALID_ARGUMENT rather than INTERNAL.
///
/// tonic's prost codec turns a request body that is not the method's message into
/// `Status::internal` (gRPC's status-code guide files parse errors there), so a client
/// that sent garbage is told the server is broken. A request that never decoded never
/// reached a handler, so the codec is the only source of such a status: it is rewritten,
/// through `ApiError` like every other status, into the client's fault. Unary and
/// server-streaming calls decode their request before any handler runs, and tonic
/// answers a failure there with the status in the response headers, which is where
/// this looks; a bad message inside a client stream (the worker session) reaches its
/// handler as an error from the stream instead.
#[derive(Debug, Clone)]
pub struct UndecodableRequestsAreInvalid<S>(pub S);

impl<S: NamedService> NamedService for UndecodableRequestsAreInvalid<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, RequestBody, ResponseBody> Service<http::Request<RequestBody>>
    for UndecodableRequestsAreInvalid<S>
where
    S: Service<
            http::Request<RequestBody>,
            Response = http::Response<ResponseBody>,
            Error = Infallible,
        >,
    S::Future: Send + 'static,
{
    type Response = http::Response<ResponseBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, context: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(context)
    }

    fn call(&mut self, request: http::Request<RequestBody>) -> Self::Future {
        let method = request.uri().path().to_string();
        let answer = self.0.call(request);
        Box::pin(async move {
            let mut response = answer.await?;
            invalid_argument_for_decode_errors(&method, response.headers_mut());
            Ok(response)
        })
    }
}

/// Rewrites a decode error's INTERNAL status in `headers` as INVALID_ARGUMENT.
fn invalid_argument_for_decode_errors(method: &str, headers: &mut http::HeaderMap) {
    let Some(status) = tonic::Status::from_header_map(headers) else {
        return;
    };
    if status.code() != tonic::Code::Internal {
        return;
    }
    let Some(detail) = status.message().strip_prefix(PROST_DECODE_ERROR_PREFIX) else {
        return;
    };
    let detail = detail.trim_start_matches(':').trim();
    let error: tonic::Status = ApiError::invalid_argument(
        "",
        format!("the request body is not a valid {method} request: {detail}"),
    )
    .into();
    let mut replacement = http::HeaderMap::new();
    if let Err(error) = error.add_header(&mut replacement) {
        tracing::warn!(%error, "could not rewrite a decode error's status");
        return;
    }
    for name in ["grpc-status", "grpc-message", "grpc-status-details-bin"] {
        headers.remove(name);
    }
    headers.extend(replacement);
}

/// How often the server pings each connection over HTTP/2, and how long it waits for the
/// answer before it closes the connection: a worker frozen (SIGSTOP) or cut off without
/// a FIN holds its session open otherwise, and its stream's tasks with it, until its
/// lease runs out and long after. A heartbeat interval, never under a second: a frozen
/// peer's connection is closed within two of them, and a worker that heartbeats keeps
/// its connection busy anyway (pings then cost nothing).
pub fn http2_keepalive(settings: &SchedulerSettings) -> std::time::Duration {
    settings
        .heartbeat_interval
        .max(std::time::Duration::from_secs(1))
}

/// A pass never starts sooner than this after the previous one started.
const MIN_PASS_GAP: std::time::Duration = std::time::Duration::from_millis(10);

/// After a pass that took `d`, the next starts no sooner than `PASS_GAP_FACTOR * d` after
/// it started (but never later than the scheduling interval after it ended), so passes
/// take at most 1/`PASS_GAP_FACTOR` of a core unless they are longer than the interval.
/// (4 until passes read only new jobs: cheaper passes then came more often and still
/// took a quarter of a core under a stream of submits, ~18 % of the scheduler's CPU in
/// carve-submit-bench's saturation phase.)
const PASS_GAP_FACTOR: u32 = 8;

/// Passes on every wake-up (submit, report, drain) and at least every scheduling
/// interval; lease checks ride along.
///
/// A pass solves over the whole queue, so its cost grows with the queue: with a long queue and
/// a stream of submits (each one a wake-up), passes back to back would take a core from
/// admission and the submit path. Wake-ups that come during a pass are merged into the
/// next one, and the next one waits for the gap above: a job waits a little longer to be
/// placed when the queue is long, and submits keep their throughput.
async fn background_loop(scheduler: Arc<Scheduler>) {
    loop {
        let started = tokio::time::Instant::now();
        // A standby holds no sessions and places nothing: the leader does.
        let leading = scheduler.is_leading();
        if leading && let Err(error) = scheduler.expire_leases().await {
            tracing::warn!(%error, "lease check failed");
        }
        if let Err(error) = scheduler.recheck_session_tokens().await {
            tracing::warn!(%error, "session token check failed");
        }
        scheduler.release_held_progress();
        if leading && let Err(error) = scheduler.schedule_once().await {
            tracing::warn!(%error, "scheduling pass failed");
        }
        let took = started.elapsed();
        let interval = scheduler
            .settings
            .scheduling_interval
            .min(scheduler.settings.heartbeat_interval);
        let gap = MIN_PASS_GAP
            .max(took * PASS_GAP_FACTOR)
            .min(took + interval);
        scheduler.wait_for_wake(interval).await;
        tokio::time::sleep_until(started + gap).await;
    }
}
