//! The real scheduler in-process on 127.0.0.1:0 over a real SQLite file, and the calls
//! the server tests make through real gRPC clients: start a cluster, a tenant with its
//! user and worker tokens, submit, get, wait for a state. Included with `#[path]` by the
//! test files that need it, next to `worker.rs`.

#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::admin_service_client::AdminServiceClient;
use carve_proto::v1::cluster_service_client::ClusterServiceClient;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::{SchedulerConfig, run};
use carve_scheduler::store::Store;
use tonic::transport::Channel;

use super::test_worker::{TestWorker, authorized};

pub const ADMIN: &str = "carve_test_admin_secret";

pub struct Cluster {
    pub address: String,
    pub metrics_address: std::net::SocketAddr,
    pub _directory: tempfile::TempDir,
    _shutdown: tokio::sync::oneshot::Sender<()>,
}

impl Cluster {
    /// A second store on this cluster's database, as another replica would open it.
    pub async fn other_replica(&self) -> Store {
        Store::open(&sqlite_url(self._directory.path()))
            .await
            .unwrap()
    }
}

/// The URL of the SQLite file `carve.db` in `directory`.
pub fn sqlite_url(directory: &Path) -> String {
    format!("sqlite://{}", directory.join("carve.db").display())
}

/// The tests' scheduler settings (short heartbeats, passes and backoff) with `lease`, on
/// `database_url`, with [`ADMIN`] as the admin token and no TLS.
pub fn test_config(
    database_url: String,
    lease: Duration,
    metrics_address: Option<std::net::SocketAddr>,
) -> SchedulerConfig {
    SchedulerConfig {
        database_url,
        settings: SchedulerSettings {
            lease_duration: lease,
            heartbeat_interval: Duration::from_millis(100),
            scheduling_interval: Duration::from_millis(50),
            infrastructure_retry_backoff: Duration::from_millis(100),
            ..SchedulerSettings::default()
        },
        admin_token: Some(ADMIN.into()),
        metrics_address,
        tls: None,
    }
}

pub async fn start(lease: Duration) -> Cluster {
    start_adjusted(lease, |_| {}).await
}

/// [`start`], with the tests' settings changed by `adjust` first.
pub async fn start_adjusted(
    lease: Duration,
    adjust: impl FnOnce(&mut SchedulerSettings),
) -> Cluster {
    let directory = tempfile::tempdir().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let (shutdown, shutdown_signal) = tokio::sync::oneshot::channel::<()>();
    // A free port for the metrics page (bound and released: a small race, fine in tests).
    let metrics_address = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut config = test_config(sqlite_url(directory.path()), lease, Some(metrics_address));
    adjust(&mut config.settings);
    tokio::spawn(async move {
        run(config, listener, async {
            let _ = shutdown_signal.await;
        })
        .await
        .unwrap();
    });
    Cluster {
        address,
        metrics_address,
        _directory: directory,
        _shutdown: shutdown,
    }
}

/// A cluster with `lease`, a channel to it, and the user and worker tokens of `tenant`
/// (made with no quota): what most server tests start from. Keep the cluster bound to a
/// name: dropping it stops the scheduler.
pub async fn start_for_tenant(lease: Duration, tenant: &str) -> (Cluster, Channel, String, String) {
    let cluster = start(lease).await;
    let channel = channel(&cluster).await;
    let (user, worker) = tenant_with_tokens(&channel, tenant, v1::Quota::default()).await;
    (cluster, channel, user, worker)
}

/// [`start_for_tenant`], and the tenant's worker connected with one 16 GiB GPU, `gpu-a`.
pub async fn start_with_worker(
    lease: Duration,
    tenant: &str,
) -> (Cluster, Channel, String, String, TestWorker) {
    let (cluster, channel, user, worker_token) = start_for_tenant(lease, tenant).await;
    let worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    (cluster, channel, user, worker_token, worker)
}

pub async fn channel(cluster: &Cluster) -> Channel {
    connect(&cluster.address).await
}

/// A channel to the scheduler at `address`, once it accepts connections (within 5 s).
pub async fn connect(address: &str) -> Channel {
    connect_within(address, Duration::from_secs(5)).await
}

/// A channel to the scheduler at `address`, once it accepts connections; fails the test
/// when it does not within `patience`.
pub async fn connect_within(address: &str, patience: Duration) -> Channel {
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        if let Ok(channel) = Channel::from_shared(address.to_string())
            .unwrap()
            .connect()
            .await
        {
            return channel;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the scheduler did not come up at {address}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A scheduler on `database_url` (either database), and a channel to it; it stops when
/// the sender drops.
pub async fn start_on_database(database_url: &str) -> (tokio::sync::oneshot::Sender<()>, Channel) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let config = test_config(database_url.to_string(), Duration::from_secs(30), None);
    let (shutdown, signal) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        run(config, listener, async {
            let _ = signal.await;
        })
        .await
        .unwrap();
    });
    (shutdown, connect(&address).await)
}

/// A new token of `role` for `tenant`, made with the admin token.
pub async fn create_token(
    channel: &Channel,
    tenant: &str,
    role: v1::Role,
    time_to_live: Option<prost_types::Duration>,
) -> Result<v1::CreateTokenResponse, tonic::Status> {
    AdminServiceClient::new(channel.clone())
        .create_token(authorized(
            v1::CreateTokenRequest {
                tenant: tenant.into(),
                role: role as i32,
                description: "test".into(),
                time_to_live,
            },
            ADMIN,
        ))
        .await
        .map(tonic::Response::into_inner)
}

/// A tenant with `quota`, and the secrets of a user token and a worker token of it.
pub async fn tenant_with_tokens(
    channel: &Channel,
    tenant: &str,
    quota: v1::Quota,
) -> (String, String) {
    let [user, worker] = carve_testing::cluster::tenant_with_tokens(
        channel,
        ADMIN,
        tenant,
        quota,
        &[v1::Role::User, v1::Role::Worker],
    )
    .await
    .try_into()
    .expect("two tokens");
    (user, worker)
}

/// `GET /metrics` over a plain socket, as a scraper does.
pub async fn scrape(address: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut connection = tokio::net::TcpStream::connect(address).await.unwrap();
    connection
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    connection.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    response.split_once("\r\n\r\n").unwrap().1.to_string()
}

pub const JOB: &str = r#"{
  "name": "small",
  "model": {
    "input_shape": [8, 8, 1],
    "loss": "softmax_cross_entropy",
    "layers": [
      { "conv2d": { "filters": 8, "kernel": 3, "padding": "same" } },
      { "relu": {} },
      { "flatten": {} },
      { "dense": { "units": 4 } }
    ]
  },
  "training": { "batch_size": 64, "steps": 10, "optimizer": { "adam": { "learning_rate": 0.001 } } },
  "data": { "format": "synthetic", "samples": 256 }
}"#;

pub async fn submit(
    channel: &Channel,
    token: &str,
    spec: &str,
    key: &str,
) -> Result<v1::SubmitJobResponse, tonic::Status> {
    JobServiceClient::new(channel.clone())
        .submit_job(authorized(
            v1::SubmitJobRequest {
                spec_json: spec.into(),
                idempotency_key: key.into(),
            },
            token,
        ))
        .await
        .map(|response| response.into_inner())
}

/// Submits [`JOB`] under `name` as `token`; answers the new job.
pub async fn submit_named(channel: &Channel, token: &str, name: &str) -> v1::Job {
    let spec = JOB.replace("\"small\"", &format!("\"{name}\""));
    submit(channel, token, &spec, "")
        .await
        .unwrap()
        .job
        .unwrap()
}

/// A job of [`JOB`] that `token` submits (no idempotency key), and its first assignment,
/// which `worker` receives.
pub async fn submit_and_place(
    channel: &Channel,
    token: &str,
    worker: &mut TestWorker,
) -> (v1::Job, v1::scheduler_message::Assignment) {
    let job = submit(channel, token, JOB, "").await.unwrap().job.unwrap();
    (job, worker.next_assignment().await)
}

pub async fn get(channel: &Channel, token: &str, job_id: &str) -> Result<v1::Job, tonic::Status> {
    JobServiceClient::new(channel.clone())
        .get_job(authorized(
            v1::GetJobRequest {
                job_id: job_id.into(),
            },
            token,
        ))
        .await
        .map(|response| response.into_inner().job.unwrap())
}

pub async fn wait_for_state(
    channel: &Channel,
    token: &str,
    job_id: &str,
    state: v1::JobState,
) -> v1::Job {
    for _ in 0..200 {
        let job = get(channel, token, job_id).await.unwrap();
        if job.state == state as i32 {
            return job;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("job {job_id} never reached {state:?}");
}

/// The events of a job, its current state first, as `token` watches it (without logs).
pub async fn watch(channel: &Channel, token: &str, job_id: &str) -> tonic::Streaming<v1::JobEvent> {
    JobServiceClient::new(channel.clone())
        .watch_job(authorized(
            v1::WatchJobRequest {
                job_id: job_id.into(),
                include_logs: false,
                ..Default::default()
            },
            token,
        ))
        .await
        .unwrap()
        .into_inner()
}

/// Cancels `job_id` as `token`, for `reason`.
pub async fn cancel(
    channel: &Channel,
    token: &str,
    job_id: &str,
    reason: &str,
) -> Result<v1::CancelJobResponse, tonic::Status> {
    JobServiceClient::new(channel.clone())
        .cancel_job(authorized(
            v1::CancelJobRequest {
                job_id: job_id.into(),
                reason: reason.into(),
            },
            token,
        ))
        .await
        .map(tonic::Response::into_inner)
}

/// The jobs `token` sees that `request` selects.
pub async fn list_jobs(
    channel: &Channel,
    token: &str,
    request: v1::ListJobsRequest,
) -> Result<v1::ListJobsResponse, tonic::Status> {
    JobServiceClient::new(channel.clone())
        .list_jobs(authorized(request, token))
        .await
        .map(tonic::Response::into_inner)
}

/// The log lines of a job that `request` selects, as `token` reads them.
pub async fn job_logs(
    channel: &Channel,
    token: &str,
    request: v1::GetJobLogsRequest,
) -> Result<v1::GetJobLogsResponse, tonic::Status> {
    JobServiceClient::new(channel.clone())
        .get_job_logs(authorized(request, token))
        .await
        .map(tonic::Response::into_inner)
}

/// Every slice held on the cluster, as the admin sees them.
pub async fn list_slices(channel: &Channel) -> Vec<v1::Slice> {
    ClusterServiceClient::new(channel.clone())
        .list_slices(authorized(v1::ListSlicesRequest::default(), ADMIN))
        .await
        .unwrap()
        .into_inner()
        .slices
}

/// The worker `worker_id` as `token` sees it.
pub async fn get_worker(channel: &Channel, token: &str, worker_id: &str) -> v1::Worker {
    ClusterServiceClient::new(channel.clone())
        .get_worker(authorized(
            v1::GetWorkerRequest {
                worker_id: worker_id.into(),
            },
            token,
        ))
        .await
        .unwrap()
        .into_inner()
        .worker
        .unwrap()
}

/// Revokes the token `token_id` with the admin token.
pub async fn revoke_token(channel: &Channel, token_id: &str) {
    AdminServiceClient::new(channel.clone())
        .revoke_token(authorized(
            v1::RevokeTokenRequest {
                token_id: token_id.into(),
            },
            ADMIN,
        ))
        .await
        .unwrap();
}

/// Every log line of `job_id`, as `token` reads them.
pub async fn all_job_logs(channel: &Channel, token: &str, job_id: &str) -> v1::GetJobLogsResponse {
    job_logs(
        channel,
        token,
        v1::GetJobLogsRequest {
            job_id: job_id.into(),
            ..Default::default()
        },
    )
    .await
    .unwrap()
}

/// A new token of `role` for `tenant`, made with the admin token: its id (to revoke it)
/// and its secret.
pub async fn token_with_id(channel: &Channel, tenant: &str, role: v1::Role) -> (String, String) {
    let created = create_token(channel, tenant, role, None).await.unwrap();
    (created.token.unwrap().id, created.secret)
}

/// Creates the tenant `name` (no quota) as `token`.
pub async fn create_tenant(
    channel: &Channel,
    token: &str,
    name: &str,
) -> Result<v1::Tenant, tonic::Status> {
    AdminServiceClient::new(channel.clone())
        .create_tenant(authorized(
            v1::CreateTenantRequest {
                name: name.into(),
                quota: None,
            },
            token,
        ))
        .await
        .map(|response| response.into_inner().tenant.unwrap())
}

/// The value of the metric `name` (a counter or gauge without labels) on a metrics page.
pub fn metric(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {name} in:\n{metrics}"))
        .trim()
        .parse()
        .unwrap()
}

/// Every worker, as `token` sees them.
pub async fn list_workers(channel: &Channel, token: &str) -> Vec<v1::Worker> {
    ClusterServiceClient::new(channel.clone())
        .list_workers(authorized(v1::ListWorkersRequest { states: vec![] }, token))
        .await
        .unwrap()
        .into_inner()
        .workers
}

/// Starts the `carve-scheduler` binary with `arguments` (and `RUST_LOG=warn`) and
/// returns it with the endpoint it printed; its stderr keeps being drained so the child
/// never blocks on a full pipe.
pub fn spawn_scheduler_binary(arguments: &[std::ffi::OsString]) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_carve-scheduler"))
        .args(arguments)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the scheduler binary starts");
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let address = loop {
        let line = lines
            .next()
            .expect("the scheduler prints its address")
            .unwrap();
        if let Some(address) = line.strip_prefix("carve-scheduler listening on ") {
            break address.trim().to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (child, format!("http://{address}"))
}
