//! Regression tests for the smaller defects of issue 13, each against the real server
//! (in-process on 127.0.0.1:0, or the binary itself): cluster views that showed every
//! tenant's jobs, the admin token printed to the log stream, files and directories
//! readable by others, tenant names outside the documented rule, sub-second token
//! lifetimes refused, and undecodable request bodies answered as server errors.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use bytes::{Buf, BufMut};
use carve_proto::ApiError;
use carve_proto::v1;
use carve_proto::v1::admin_service_client::AdminServiceClient;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::error::SchedulerError;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::{GENERATED_ADMIN_TOKEN_FILE, SchedulerConfig, run};
use carve_scheduler::store::{Store, TenantRecord};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::{Code, Status};

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::{TestWorker, authorized};

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{
    ADMIN, JOB, connect, create_tenant, create_token, get_worker, list_workers, sqlite_url, submit,
};

/// A scheduler running in-process until `shutdown` is dropped.
struct Server {
    address: String,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), SchedulerError>>,
}

impl Server {
    async fn start(database_url: String, admin_token: Option<&str>) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        let (shutdown, shutdown_signal) = tokio::sync::oneshot::channel::<()>();
        let config = SchedulerConfig {
            database_url,
            settings: SchedulerSettings {
                heartbeat_interval: Duration::from_millis(100),
                scheduling_interval: Duration::from_millis(50),
                ..SchedulerSettings::default()
            },
            admin_token: admin_token.map(str::to_string),
            metrics_address: None,
            tls: None,
        };
        let task = tokio::spawn(run(config, listener, async {
            let _ = shutdown_signal.await;
        }));
        Server {
            address,
            shutdown: Some(shutdown),
            task,
        }
    }

    async fn channel(&self) -> Channel {
        connect(&self.address).await
    }

    async fn stop(mut self) -> Result<(), SchedulerError> {
        drop(self.shutdown.take());
        self.task.await.unwrap()
    }
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

async fn user_token(channel: &Channel, tenant: &str) -> String {
    create_tenant(channel, ADMIN, tenant).await.unwrap();
    create_token(channel, tenant, v1::Role::User, None)
        .await
        .unwrap()
        .secret
}

fn only_slice(worker: &v1::Worker) -> v1::Slice {
    let slices: Vec<&v1::Slice> = worker.gpus.iter().flat_map(|gpu| &gpu.slices).collect();
    assert_eq!(slices.len(), 1, "{worker:?}");
    slices[0].clone()
}

/// Defect 7: ListWorkers and GetWorker showed every slice's tenant and job to any
/// tenant. Another tenant now sees the slice's memory only; its own tenant and admins
/// see it whole.
#[tokio::test]
async fn worker_views_show_other_tenants_slices_as_anonymous_memory() {
    let directory = tempfile::tempdir().unwrap();
    let server = Server::start(sqlite_url(directory.path()), Some(ADMIN)).await;
    let channel = server.channel().await;
    let alice = user_token(&channel, "alice").await;
    let bob = user_token(&channel, "bob").await;
    let worker_token = create_token(&channel, "alice", v1::Role::Worker, None)
        .await
        .unwrap()
        .secret;
    let mut worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    let job = submit(&channel, &alice, JOB, "")
        .await
        .unwrap()
        .job
        .unwrap();
    let assignment = worker.next_assignment().await;
    worker.started(&assignment).await;

    for token in [ADMIN, alice.as_str()] {
        for seen in [
            only_slice(&list_workers(&channel, token).await[0]),
            only_slice(&get_worker(&channel, token, &worker.id).await),
        ] {
            assert_eq!(seen.job_id, job.id);
            assert_eq!(seen.tenant, "alice");
            assert_eq!(seen.attempt_number, 1);
            assert_eq!(seen.bytes, assignment.slice_bytes);
        }
    }
    for seen in [
        only_slice(&list_workers(&channel, &bob).await[0]),
        only_slice(&get_worker(&channel, &bob, &worker.id).await),
    ] {
        assert_eq!(
            seen,
            v1::Slice {
                gpu_uuid: "gpu-a".into(),
                bytes: assignment.slice_bytes,
                worker_id: worker.id.clone(),
                ..v1::Slice::default()
            },
            "bob sees alice's slice as memory in use, nothing more"
        );
    }
    let shown = format!("{:?}", list_workers(&channel, &bob).await);
    assert!(
        !shown.contains(&job.id) && !shown.contains("alice"),
        "{shown}"
    );
    server.stop().await.unwrap();
}

/// Defect 9: tenant names outside the documented rule (lowercase letters, digits and
/// '-', at most 63 characters) were accepted. The store applies the rule to every
/// tenant it creates, so no path (the API, the bootstrap, `carve dev`) can skip it.
#[tokio::test]
async fn tenant_names_follow_the_documented_rule_everywhere() {
    let directory = tempfile::tempdir().unwrap();
    let server = Server::start(sqlite_url(directory.path()), Some(ADMIN)).await;
    let channel = server.channel().await;
    let longest = "a".repeat(63);
    for good in ["team-a", "7", longest.as_str()] {
        assert_eq!(
            create_tenant(&channel, ADMIN, good).await.unwrap().name,
            good
        );
    }
    let too_long = "a".repeat(64);
    for bad in [
        "",
        "Team-a",
        "team_a",
        "team.a",
        "team a",
        "équipe",
        too_long.as_str(),
    ] {
        let error = create_tenant(&channel, ADMIN, bad).await.unwrap_err();
        assert_eq!(error.code(), Code::InvalidArgument, "{bad:?}: {error:?}");
        assert!(error.message().starts_with("name: "), "{bad:?}: {error:?}");
    }
    server.stop().await.unwrap();

    let store = Store::open(&sqlite_url(directory.path())).await.unwrap();
    let error = store
        .create_tenant(&TenantRecord {
            name: "Research_Team".into(),
            vram_quota_bytes: None,
            max_running_jobs: None,
            fair_share_weight: 1,
            created_at_ms: 0,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&error, SchedulerError::Api(ApiError::InvalidArgument { field, reason })
            if field == "name" && reason.contains("lowercase letters, digits and '-'")),
        "{error:?}"
    );
}

/// Defect 9: a time to live under one second was refused as "must be positive". Any
/// positive duration is accepted (rounded up to whole milliseconds) and the token
/// expires then; zero, negative and malformed durations are refused for what they are.
#[tokio::test]
async fn sub_second_token_lifetimes_are_accepted() {
    let directory = tempfile::tempdir().unwrap();
    let server = Server::start(sqlite_url(directory.path()), Some(ADMIN)).await;
    let channel = server.channel().await;
    create_tenant(&channel, ADMIN, "alice").await.unwrap();
    // A user token of alice's that lives `seconds` and `nanos`.
    let living = |seconds: i64, nanos: i32| {
        create_token(
            &channel,
            "alice",
            v1::Role::User,
            Some(prost_types::Duration { seconds, nanos }),
        )
    };
    let short = living(0, 800_000_000).await.unwrap();
    let token = short.token.unwrap();
    let lifetime = |token: &v1::Token| {
        let created = token.created_at.unwrap();
        let expires = token.expires_at.unwrap();
        (expires.seconds - created.seconds) * 1000
            + i64::from(expires.nanos - created.nanos) / 1_000_000
    };
    assert_eq!(lifetime(&token), 800);
    let list = |secret: String| {
        let channel = channel.clone();
        async move {
            JobServiceClient::new(channel)
                .list_jobs(authorized(v1::ListJobsRequest::default(), &secret))
                .await
        }
    };
    list(short.secret.clone()).await.expect("valid for 800 ms");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        list(short.secret).await.unwrap_err().code(),
        Code::Unauthenticated
    );

    // One nanosecond is positive: it lives one (rounded up) millisecond.
    let tiny = living(0, 1).await.unwrap();
    assert_eq!(lifetime(&tiny.token.unwrap()), 1);

    for (seconds, nanos, field, words) in [
        (0, 0, "time_to_live", "must be positive"),
        (-5, 0, "time_to_live", "must be positive"),
        (0, -1, "time_to_live", "must be positive"),
        (
            1,
            1_000_000_000,
            "time_to_live.nanos",
            "not a valid nanosecond part",
        ),
        (1, -1, "time_to_live.nanos", "not a valid nanosecond part"),
    ] {
        let error = living(seconds, nanos).await.unwrap_err();
        assert_eq!(error.code(), Code::InvalidArgument, "{seconds}s {nanos}ns");
        assert!(
            error.message().starts_with(&format!("{field}: ")) && error.message().contains(words),
            "{seconds}s {nanos}ns: {}",
            error.message()
        );
    }
    server.stop().await.unwrap();
}

/// Sends request bodies as given, bytes for bytes: what a broken or hostile client puts
/// on the wire, framed as gRPC.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

#[derive(Debug)]
struct RawEncoder;

#[derive(Debug)]
struct RawDecoder;

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, destination: &mut EncodeBuf<'_>) -> Result<(), Status> {
        destination.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, source: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        Ok(Some(source.copy_to_bytes(source.remaining()).to_vec()))
    }
}

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

/// Defect 9: a request body that is not the method's message was answered INTERNAL
/// (tonic's default for a decode error), telling the client the server is broken. It is
/// INVALID_ARGUMENT now, for unary and server-streaming methods of every service, over
/// a real socket.
#[tokio::test]
async fn undecodable_request_bodies_are_invalid_argument() {
    let directory = tempfile::tempdir().unwrap();
    let server = Server::start(sqlite_url(directory.path()), Some(ADMIN)).await;
    let channel = server.channel().await;
    let garbage: [Vec<u8>; 3] = [
        // A field tag with wire type 7, which does not exist.
        vec![0xff; 12],
        // Field 1 as a varint where every method's field 1 is a string or a message.
        vec![0x08, 0x96, 0x01],
        // Field 1 as a string that is not UTF-8.
        vec![0x0a, 0x02, 0xc3, 0x28],
    ];
    for method in [
        "/carve.v1.JobService/SubmitJob",
        "/carve.v1.JobService/GetJob",
        "/carve.v1.AdminService/CreateTenant",
        "/carve.v1.ClusterService/GetWorker",
    ] {
        for body in &garbage {
            let mut client = tonic::client::Grpc::new(channel.clone());
            client.ready().await.unwrap();
            let error = client
                .unary(
                    authorized(body.clone(), ADMIN),
                    PathAndQuery::from_static(method),
                    RawCodec,
                )
                .await
                .unwrap_err();
            assert_eq!(
                error.code(),
                Code::InvalidArgument,
                "{method} {body:?}: {error:?}"
            );
            assert!(
                error.message().contains("not a valid") && error.message().contains(method),
                "{method}: {}",
                error.message()
            );
        }
    }
    let mut client = tonic::client::Grpc::new(channel.clone());
    client.ready().await.unwrap();
    let error = client
        .server_streaming(
            authorized(garbage[1].clone(), ADMIN),
            PathAndQuery::from_static("/carve.v1.JobService/WatchJob"),
            RawCodec,
        )
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument, "{error:?}");

    // A well-formed call that fails for another reason keeps its own code.
    let mut client = tonic::client::Grpc::new(channel.clone());
    client.ready().await.unwrap();
    let error = client
        .unary(
            authorized(Vec::new(), ADMIN),
            PathAndQuery::from_static("/carve.v1.JobService/GetJob"),
            RawCodec,
        )
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().starts_with("job_id"), "{}", error.message());
    server.stop().await.unwrap();
}

/// Defect 8: a first start printed the admin token to stderr (the log stream under
/// systemd and Kubernetes). It goes to a file next to the database, readable by its
/// owner alone; the database file is created 0600 too (defect 9).
#[tokio::test]
async fn a_first_start_writes_the_admin_token_to_a_private_file() {
    let directory = tempfile::tempdir().unwrap();
    let token_path = directory.path().join(GENERATED_ADMIN_TOKEN_FILE);
    // A file left by an earlier database is replaced, not reused.
    std::fs::write(&token_path, "carve_stale\n").unwrap();
    std::fs::set_permissions(&token_path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let server = Server::start(sqlite_url(directory.path()), None).await;
    let channel = server.channel().await;
    // The socket accepts before the server has bootstrapped: wait for the new file.
    for _ in 0..500 {
        if std::fs::read_to_string(&token_path).is_ok_and(|text| text != "carve_stale\n") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(mode(&token_path), 0o600);
    assert_eq!(mode(&directory.path().join("carve.db")), 0o600);
    let secret = std::fs::read_to_string(&token_path).unwrap();
    let secret = secret.trim();
    assert!(secret.starts_with("carve_") && secret != "carve_stale");
    let tenants = AdminServiceClient::new(channel.clone())
        .list_tenants(authorized(v1::ListTenantsRequest {}, secret))
        .await
        .expect("the written token is the admin token")
        .into_inner()
        .tenants;
    assert_eq!(tenants[0].name, "default");
    server.stop().await.unwrap();

    // Later starts find the admin token and write nothing.
    let written = std::fs::metadata(&token_path).unwrap().modified().unwrap();
    let again = Server::start(sqlite_url(directory.path()), None).await;
    AdminServiceClient::new(again.channel().await)
        .list_tenants(authorized(v1::ListTenantsRequest {}, secret))
        .await
        .expect("the same token after a restart");
    assert_eq!(std::fs::read_to_string(&token_path).unwrap().trim(), secret);
    assert_eq!(
        std::fs::metadata(&token_path).unwrap().modified().unwrap(),
        written
    );
    again.stop().await.unwrap();

    // Without a data directory there is nowhere to put it: the start fails, saying so.
    let error = Server::start("sqlite::memory:".into(), None)
        .await
        .stop()
        .await
        .unwrap_err();
    assert!(
        matches!(&error, SchedulerError::Api(ApiError::InvalidArgument { field, .. }) if field == "admin_token"),
        "{error:?}"
    );
}

/// An explicitly placed SQLite file is created 0600 by the store itself.
#[tokio::test]
async fn the_store_creates_its_sqlite_file_private() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("elsewhere.db");
    let store = Store::open(path.to_str().unwrap()).await.unwrap();
    store.list_tenants().await.unwrap();
    assert_eq!(mode(&path), 0o600);
    for suffix in ["-wal", "-shm"] {
        let companion = directory.path().join(format!("elsewhere.db{suffix}"));
        if companion.exists() {
            assert_eq!(mode(&companion), 0o600, "{suffix}");
        }
    }
}

/// The binary as a user runs it the first time: no flags but the address. Its data
/// directory is 0700, the database and the admin token file 0600, and the token is
/// nowhere in its output.
#[test]
fn the_binary_keeps_its_data_private_and_never_prints_the_admin_token() {
    let home = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_carve-scheduler"))
        .args(["--listen", "127.0.0.1:0"])
        .env("HOME", home.path())
        .env("XDG_DATA_HOME", home.path().join("data"))
        .env_remove("CARVE_ADMIN_TOKEN")
        .env_remove("CARVE_ADMIN_TOKEN_FILE")
        .env_remove("CARVE_DATABASE_URL")
        .env_remove("CARVE_CONFIG")
        .env_remove("CARVE_LISTEN")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (lines_sender, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            if lines_sender.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });
    let mut output = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !output
        .iter()
        .any(|line: &String| line.contains("admin token created"))
    {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => output.push(line),
            Err(_) => break,
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    while let Ok(line) = lines.recv_timeout(Duration::from_millis(200)) {
        output.push(line);
    }
    let output = output.join("\n");
    let data = home.path().join("data/carve");
    let token_path = data.join(GENERATED_ADMIN_TOKEN_FILE);
    assert!(
        token_path.exists(),
        "no token file; the binary said:\n{output}"
    );
    assert_eq!(mode(&data), 0o700);
    assert_eq!(mode(&data.join("carve.db")), 0o600);
    assert_eq!(mode(&token_path), 0o600);
    let secret = std::fs::read_to_string(&token_path).unwrap();
    assert!(!output.contains(secret.trim()), "{output}");
    assert!(
        output.contains(&token_path.display().to_string()),
        "the path is said: {output}"
    );
}
