//! The real worker follows the leader among scheduler replicas on PostgreSQL (issue 29):
//! three replicas, each its own process (this program, run with the role variable set),
//! and the worker's library loop (`run_worker`, what `carve-worker` runs) with simulated
//! GPUs. Its `--scheduler` list puts the leader last: a standby's refusal names the
//! leader and the very next attempt goes there, at once. Then the leader is killed with
//! SIGKILL: while the standbys wait out its lease, the worker's waits stay short (never
//! the doubled backoff of a walk through dead endpoints), a refusal naming a live leader
//! is followed at once, and a job submitted after the kill is placed through the
//! worker's session with the new leader. Behaviour is asserted (which endpoints were
//! tried, why, after what wait), never how fast.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use carve_proto::client::BearerToken;
use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::SchedulerConfig;
use carve_scheduler::store::Store;
use carve_testing::PgServer;
use carve_worker::gpus::SimulatedGpu;
use carve_worker::worker::{ANSWERED_BACKOFF_MAX, AttemptEnd, EndpointReason, SessionAttempt};
use carve_worker::{WorkerConfig, run_worker};
use tokio::sync::{mpsc, oneshot};
use tonic::transport::Endpoint;

const ADMIN: &str = "carve_leader_following_admin_secret";
/// Set in a replica process's environment: its database.
const REPLICA_DATABASE: &str = "CARVE_LEADER_FOLLOWING_REPLICA_DATABASE";
/// Set in a replica process's environment: the file it writes its port to.
const REPLICA_PORT_FILE: &str = "CARVE_LEADER_FOLLOWING_REPLICA_PORT_FILE";
const LEADER_LEASE: Duration = Duration::from_secs(2);
/// How long the test waits for anything before it fails (a guard against hanging, not
/// a bound on how fast).
const PATIENCE: Duration = Duration::from_secs(60);

const JOB: &str = r#"{
  "name": "tiny",
  "model": { "input_shape": [4], "loss": "softmax_cross_entropy", "layers": [ { "dense": { "units": 2 } } ] },
  "training": { "batch_size": 8, "steps": 1, "optimizer": { "sgd": { "learning_rate": 0.1 } } },
  "data": { "format": "synthetic", "samples": 16 }
}"#;

fn main() {
    if let Ok(database_url) = std::env::var(REPLICA_DATABASE) {
        let port_file = PathBuf::from(std::env::var(REPLICA_PORT_FILE).unwrap());
        run_replica(&database_url, &port_file);
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(the_worker_follows_the_leader_a_standby_names());
    println!("test the_worker_follows_the_leader_a_standby_names ... ok");
}

/// A replica process: serves until it is killed.
fn run_replica(database_url: &str, port_file: &Path) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        std::fs::write(port_file.with_extension("tmp"), port.to_string()).unwrap();
        std::fs::rename(port_file.with_extension("tmp"), port_file).unwrap();
        let config = SchedulerConfig {
            database_url: database_url.into(),
            settings: SchedulerSettings {
                leader_lease: LEADER_LEASE,
                heartbeat_interval: Duration::from_secs(1),
                scheduling_interval: Duration::from_millis(100),
                ..SchedulerSettings::default()
            },
            admin_token: Some(ADMIN.into()),
            metrics_address: None,
            tls: None,
        };
        carve_scheduler::server::run(config, listener, std::future::pending())
            .await
            .unwrap();
    });
}

/// The replica processes; SIGKILLed when the test ends, passed or not.
struct Replicas(Vec<Child>);

impl Drop for Replicas {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts a replica on `database_url`; returns it and its endpoint.
fn start_replica(directory: &Path, name: &str, database_url: &str) -> (Child, String) {
    let port_file = directory.join(format!("{name}.port"));
    let child = Command::new(std::env::current_exe().unwrap())
        .env(REPLICA_DATABASE, database_url)
        .env(REPLICA_PORT_FILE, &port_file)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let port = loop {
        if let Ok(port) = std::fs::read_to_string(&port_file) {
            break port;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "replica {name} never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    (child, format!("http://127.0.0.1:{}", port.trim()))
}

/// The endpoint of the leader whose lease runs, by the database.
async fn current_leader(database: &Store) -> Option<(i64, String)> {
    let row = database.leadership().await.ok()?;
    row.current.then_some((row.epoch, row.endpoint))
}

async fn wait_for_leader(database: &Store, above_epoch: i64) -> (i64, String) {
    let started = Instant::now();
    loop {
        if let Some((epoch, endpoint)) = current_leader(database).await
            && epoch > above_epoch
        {
            return (epoch, endpoint);
        }
        assert!(
            started.elapsed() < PATIENCE,
            "no leader above epoch {above_epoch}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn submit(endpoint: &str, token: &str, key: &str) -> String {
    let channel = Endpoint::from_shared(endpoint.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = JobServiceClient::with_interceptor(channel, BearerToken::new(token).unwrap());
    client
        .submit_job(v1::SubmitJobRequest {
            spec_json: JOB.into(),
            idempotency_key: key.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap()
        .id
}

/// Waits until `job_id` has an attempt: placed, which takes a worker in session with the
/// leader.
async fn wait_for_placement(database: &Store, job_id: &str) {
    let started = Instant::now();
    loop {
        if !database.list_attempts(job_id).await.unwrap().is_empty() {
            return;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "job {job_id} was never placed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn drain(attempts: &mut mpsc::UnboundedReceiver<SessionAttempt>) -> Vec<SessionAttempt> {
    let mut seen = Vec::new();
    while let Ok(attempt) = attempts.try_recv() {
        seen.push(attempt);
    }
    seen
}

async fn the_worker_follows_the_leader_a_standby_names() {
    let postgres = PgServer::start().unwrap();
    let database_url = postgres.create_database("leader_following").await.unwrap();
    // Read only: it never leads, so it never writes what the replicas fence.
    let database = Store::open(&database_url).await.unwrap();
    let directory = tempfile::tempdir().unwrap();

    // The first replica leads (nobody held the lease); the other two stand by.
    let (first, leader) = start_replica(directory.path(), "first", &database_url);
    let mut replicas = Replicas(vec![first]);
    let (epoch, leading) = wait_for_leader(&database, 0).await;
    assert_eq!(leading, leader);
    let (second, standby) = start_replica(directory.path(), "second", &database_url);
    let (third, other_standby) = start_replica(directory.path(), "third", &database_url);
    replicas.0.extend([second, third]);

    let channel = Endpoint::from_shared(leader.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let [user, worker_token]: [String; 2] = carve_testing::cluster::tenant_with_tokens(
        &channel,
        ADMIN,
        "acme",
        v1::Quota::default(),
        &[v1::Role::User, v1::Role::Worker],
    )
    .await
    .try_into()
    .unwrap();

    // The leader is listed last: walking the list would try both standbys first.
    let listed = format!("{standby},{other_standby},{leader}");
    let mut config = WorkerConfig::new(
        listed,
        worker_token,
        vec![SimulatedGpu {
            total_bytes: 1 << 30,
        }],
        PathBuf::from(env!("CARGO_BIN_EXE_carve-worker")),
    );
    config.hostname = "following".into();
    config.discover_real_gpus = false;
    config.context_bytes = 64 << 20;
    config.checkpoint_directory = directory.path().join("checkpoints");
    config.sandbox.policy = carve_worker::sandbox::SandboxPolicy::Off;
    let default_backoff_max = config.reconnect_backoff_max;
    let (observer, mut attempts) = mpsc::unbounded_channel();
    config.session_observer = Some(observer);
    let (stop_worker, stopped) = oneshot::channel::<()>();
    let worker = tokio::spawn(run_worker(config, async {
        let _ = stopped.await;
    }));

    // At start: the first standby listed refuses, naming the leader, and the next attempt
    // goes there at once; the other standby is never asked.
    let first_job = submit(&leader, &user, "before-the-kill").await;
    wait_for_placement(&database, &first_job).await;
    let before_kill = drain(&mut attempts);
    let [to_standby, to_leader] = before_kill.as_slice() else {
        panic!("two attempts before the session with the leader: {before_kill:#?}");
    };
    assert_eq!(
        (to_standby.endpoint.as_str(), to_standby.reason),
        (standby.as_str(), EndpointReason::First)
    );
    assert_eq!(to_leader.endpoint, leader, "{before_kill:#?}");
    assert_eq!(to_leader.reason, EndpointReason::NamedLeader);
    assert_eq!(to_leader.waited, Duration::ZERO);
    assert_eq!(
        to_leader.after,
        Some(AttemptEnd::Refused {
            leader_named: Some(leader.clone())
        })
    );

    // The leader dies. A job submitted to a standby is placed by the new leader through
    // the worker's session with it.
    replicas.0[0].kill().unwrap();
    replicas.0[0].wait().unwrap();
    let after_kill_job = submit(&standby, &user, "after-the-kill").await;
    let (_, new_leader) = wait_for_leader(&database, epoch).await;
    wait_for_placement(&database, &after_kill_job).await;
    let after_kill = drain(&mut attempts);
    assert!(!after_kill.is_empty());
    for attempt in &after_kill {
        // Replicas answered throughout: the wait never grew toward the maximum.
        assert!(
            attempt.waited <= ANSWERED_BACKOFF_MAX && ANSWERED_BACKOFF_MAX < default_backoff_max,
            "a grown backoff: {attempt:#?} in {after_kill:#?}"
        );
        // A refusal naming a live leader sends the next attempt there, at once.
        if let Some(AttemptEnd::Refused {
            leader_named: Some(named),
        }) = &attempt.after
            && *named != leader
        {
            assert_eq!(
                (&attempt.endpoint, attempt.reason, attempt.waited),
                (named, EndpointReason::NamedLeader, Duration::ZERO),
                "{after_kill:#?}"
            );
        }
    }
    // The session that placed the job is with the new leader: the last attempt went there.
    assert_eq!(
        after_kill.last().unwrap().endpoint,
        new_leader,
        "{after_kill:#?}"
    );
    // The dead leader, once it did not answer, was not followed back while the standbys
    // still named it.
    let dead_leader_tries = after_kill
        .iter()
        .filter(|attempt| {
            attempt.endpoint == leader && attempt.reason == EndpointReason::NamedLeader
        })
        .count();
    assert!(dead_leader_tries <= 1, "{after_kill:#?}");

    let _ = stop_worker.send(());
    worker.await.unwrap().unwrap();
}
