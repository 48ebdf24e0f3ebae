//! `carve` against a frozen scheduler replica (issue 29): two replicas on PostgreSQL,
//! each its own process (this program, run with the role variable set), the leader
//! frozen with SIGSTOP. `carve jobs` listing both moves on to the standby within its
//! deadline (`--timeout`) and answers; listing only the frozen one it fails, saying the
//! scheduler did not answer, instead of blocking for the whole freeze. The leader's lease
//! is long, so the standby does not take over during the test: what is shown is the
//! deadline, not a failover. Then `carve watch` of a job, its leader frozen mid-watch
//! (a short lease this time, so the standby takes over): the watch hears nothing, asks
//! the frozen leader within its deadline, moves to the new leader and sees the job's
//! cancel there, instead of waiting silently for the whole freeze. The test waits at
//! most a minute for each run of carve (a guard against hanging, not a bound on how
//! fast).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use carve_proto::client::BearerToken;
use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::SchedulerConfig;
use carve_scheduler::store::Store;
use carve_testing::PgServer;
use tonic::transport::Endpoint;

const ADMIN: &str = "carve_frozen_replica_admin_secret";
/// Set in a replica process's environment: its database.
const REPLICA_DATABASE: &str = "CARVE_FROZEN_REPLICA_DATABASE";
/// Set in a replica process's environment: the file it writes its port to.
const REPLICA_PORT_FILE: &str = "CARVE_FROZEN_REPLICA_PORT_FILE";
/// Set in a replica process's environment: its leader lease in milliseconds.
const REPLICA_LEASE_MS: &str = "CARVE_FROZEN_REPLICA_LEASE_MS";
/// Longer than the test: nobody takes the frozen leader's place meanwhile.
const LEADER_LEASE: Duration = Duration::from_secs(600);
/// The watch's replicas: the standby takes the frozen leader's place soon.
const SHORT_LEADER_LEASE: Duration = Duration::from_secs(2);
const PATIENCE: Duration = Duration::from_secs(60);

const JOB: &str = r#"{
  "name": "listed-while-frozen",
  "model": { "input_shape": [4], "loss": "softmax_cross_entropy", "layers": [ { "dense": { "units": 2 } } ] },
  "training": { "batch_size": 8, "steps": 1, "optimizer": { "sgd": { "learning_rate": 0.1 } } },
  "data": { "format": "synthetic", "samples": 16 }
}"#;

fn main() {
    if let Ok(database_url) = std::env::var(REPLICA_DATABASE) {
        let port_file = PathBuf::from(std::env::var(REPLICA_PORT_FILE).unwrap());
        let lease =
            Duration::from_millis(std::env::var(REPLICA_LEASE_MS).unwrap().parse().unwrap());
        run_replica(&database_url, &port_file, lease);
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(carve_moves_past_a_frozen_replica_within_its_deadline());
    println!("test carve_moves_past_a_frozen_replica_within_its_deadline ... ok");
    runtime.block_on(carve_watch_moves_past_a_leader_frozen_mid_watch());
    println!("test carve_watch_moves_past_a_leader_frozen_mid_watch ... ok");
}

/// A replica process: serves until it is killed.
fn run_replica(database_url: &str, port_file: &Path, lease: Duration) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        std::fs::write(port_file.with_extension("tmp"), port.to_string()).unwrap();
        std::fs::rename(port_file.with_extension("tmp"), port_file).unwrap();
        let config = SchedulerConfig {
            database_url: database_url.into(),
            settings: SchedulerSettings {
                leader_lease: lease,
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

/// The replica processes; resumed and SIGKILLed when the test ends, passed or not.
struct Replicas(Vec<Child>);

impl Drop for Replicas {
    fn drop(&mut self) {
        for child in &mut self.0 {
            signal(child, "CONT");
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn signal(child: &Child, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(child.id().to_string())
        .status();
}

fn start_replica(
    directory: &Path,
    name: &str,
    database_url: &str,
    lease: Duration,
) -> (Child, String) {
    let port_file = directory.join(format!("{name}.port"));
    let child = Command::new(std::env::current_exe().unwrap())
        .env(REPLICA_DATABASE, database_url)
        .env(REPLICA_PORT_FILE, &port_file)
        .env(REPLICA_LEASE_MS, lease.as_millis().to_string())
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

async fn wait_for_leader(database: &Store, endpoint: &str) {
    let started = Instant::now();
    loop {
        if let Ok(row) = database.leadership().await
            && row.current
            && row.endpoint == endpoint
        {
            return;
        }
        assert!(started.elapsed() < PATIENCE, "{endpoint} never led");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs `carve` with `arguments`; fails the test if it has not ended within
/// [`PATIENCE`] (it would have blocked on the frozen replica).
fn carve(arguments: &[&str], token: &str) -> Output {
    wait_for_carve(start_carve(arguments, token), arguments)
}

/// `carve` with `arguments`, started, its output piped.
fn start_carve(arguments: &[&str], token: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(arguments)
        .env("CARVE_TOKEN", token)
        .env_remove("CARVE_ENDPOINT")
        // No config file of the machine's: the default one is looked for under here.
        .env_remove("CARVE_CLI_CONFIG")
        .env(
            "XDG_CONFIG_HOME",
            std::env::temp_dir().join("carve-frozen-replica-no-config"),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The output of `child` (`carve arguments`) once it ended; fails the test (killing it)
/// if it has not within [`PATIENCE`].
fn wait_for_carve(child: Child, arguments: &[&str]) -> Output {
    let pid = child.id();
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match finished.recv_timeout(PATIENCE) {
        Ok(output) => output.unwrap(),
        Err(_) => {
            let _ = Command::new("kill")
                .arg("-KILL")
                .arg(pid.to_string())
                .status();
            // What it had said by then: where it was waiting.
            let said = finished
                .recv_timeout(Duration::from_secs(10))
                .ok()
                .and_then(Result::ok)
                .map(|output| {
                    format!(
                        "{}\n{}",
                        String::from_utf8_lossy(&output.stdout),
                        String::from_utf8_lossy(&output.stderr)
                    )
                })
                .unwrap_or_default();
            panic!(
                "carve {arguments:?} was still waiting on the frozen replica after \
                 {PATIENCE:?}; it had said:\n{said}"
            );
        }
    }
}

async fn carve_moves_past_a_frozen_replica_within_its_deadline() {
    let postgres = PgServer::start().unwrap();
    let database_url = postgres.create_database("frozen_replica").await.unwrap();
    let directory = tempfile::tempdir().unwrap();
    let (first, leader) = start_replica(directory.path(), "leader", &database_url, LEADER_LEASE);
    let mut replicas = Replicas(vec![first]);
    // Read only: it never leads, so it never writes what the replicas fence.
    let database = Store::open(&database_url).await.unwrap();
    wait_for_leader(&database, &leader).await;
    let (second, standby) = start_replica(directory.path(), "standby", &database_url, LEADER_LEASE);
    replicas.0.push(second);

    let channel = Endpoint::from_shared(leader.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let [user]: [String; 1] = carve_testing::cluster::tenant_with_tokens(
        &channel,
        ADMIN,
        "acme",
        v1::Quota::default(),
        &[v1::Role::User],
    )
    .await
    .try_into()
    .unwrap();
    let job_id = JobServiceClient::with_interceptor(channel, BearerToken::new(&user).unwrap())
        .submit_job(v1::SubmitJobRequest {
            spec_json: JOB.into(),
            idempotency_key: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap()
        .id;

    // The leader freezes: it accepts connections (the kernel does) and answers nothing.
    signal(&replicas.0[0], "STOP");

    // Listed first, the frozen leader is left for the standby within the deadline.
    let both = format!("{leader},{standby}");
    let listed = carve(&["jobs", "--endpoint", &both, "--timeout", "2s"], &user);
    let stdout = String::from_utf8_lossy(&listed.stdout);
    let stderr = String::from_utf8_lossy(&listed.stderr);
    assert!(listed.status.success(), "{stdout}\n{stderr}");
    // By its id: the table shortens a long name to fit its column.
    assert!(stdout.contains(&job_id), "{stdout}\n{stderr}");

    // Alone, the frozen leader is a failure that names it, not a wait for the freeze.
    let alone = carve(&["jobs", "--endpoint", &leader, "--timeout", "2s"], &user);
    let stderr = String::from_utf8_lossy(&alone.stderr);
    assert!(!alone.status.success(), "{stderr}");
    assert!(stderr.contains(&leader), "{stderr}");
    assert!(stderr.contains("did not answer"), "{stderr}");
}

/// A submitted job's id, through `endpoint` as `user`.
async fn submit(endpoint: &str, user: &str) -> String {
    let channel = Endpoint::from_shared(endpoint.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    JobServiceClient::with_interceptor(channel, BearerToken::new(user).unwrap())
        .submit_job(v1::SubmitJobRequest {
            spec_json: JOB.into(),
            idempotency_key: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap()
        .id
}

async fn carve_watch_moves_past_a_leader_frozen_mid_watch() {
    let postgres = PgServer::start().unwrap();
    let database_url = postgres.create_database("frozen_watch").await.unwrap();
    let directory = tempfile::tempdir().unwrap();
    let (first, leader) = start_replica(
        directory.path(),
        "leader",
        &database_url,
        SHORT_LEADER_LEASE,
    );
    let mut replicas = Replicas(vec![first]);
    let database = Store::open(&database_url).await.unwrap();
    wait_for_leader(&database, &leader).await;
    let (second, standby) = start_replica(
        directory.path(),
        "standby",
        &database_url,
        SHORT_LEADER_LEASE,
    );
    replicas.0.push(second);
    let channel = Endpoint::from_shared(leader.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let [user]: [String; 1] = carve_testing::cluster::tenant_with_tokens(
        &channel,
        ADMIN,
        "acme",
        v1::Quota::default(),
        &[v1::Role::User],
    )
    .await
    .try_into()
    .unwrap();
    // No worker: the job stays queued, and its stream is quiet.
    let job_id = submit(&leader, &user).await;
    let both = format!("{leader},{standby}");
    let arguments = ["watch", &job_id, "--endpoint", &both, "--timeout", "2s"];
    let mut watch = start_carve(&arguments, &user);
    // Its lines, as they come (read on a thread: the test never waits without a
    // deadline).
    let (lines, incoming) = std::sync::mpsc::channel::<String>();
    let stdout = watch.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
            let Ok(line) = line else { return };
            // Shown as it comes: what a failed run had said.
            eprintln!("carve watch: {line}");
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    // The stream's first event, the job's state, says the stream is open on the leader
    // (the line before it, why the job waits, is read before the stream opens).
    let opened = format!("job {job_id} (listed-while-frozen): queued");
    let started = Instant::now();
    loop {
        let left = PATIENCE.saturating_sub(started.elapsed());
        let line = incoming
            .recv_timeout(left)
            .expect("carve watch printed the stream's first event");
        if line == opened {
            break;
        }
    }

    signal(&replicas.0[0], "STOP");
    wait_for_leader(&database, &standby).await;
    // Cancelled through the new leader: the watch sees it only if it moved there.
    let new_leader = Endpoint::from_shared(standby.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut new_leader =
        JobServiceClient::with_interceptor(new_leader, BearerToken::new(&user).unwrap());
    // The store names the new leader before the replica serves as one (it first takes
    // over the cluster's state); until then it answers UNAVAILABLE.
    let started = Instant::now();
    loop {
        let cancelled = new_leader
            .cancel_job(v1::CancelJobRequest {
                job_id: job_id.clone(),
                reason: "cancelled while the leader was frozen".into(),
            })
            .await;
        match cancelled {
            Ok(_) => break,
            Err(status) if status.code() == tonic::Code::Unavailable => {
                assert!(
                    started.elapsed() < PATIENCE,
                    "{standby} never took the cancel: {status}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(status) => panic!("the cancel was refused: {status}"),
        }
    }
    let ended = wait_for_carve(watch, &arguments);
    // The process ended: its stdout is closed and every line is in.
    let rest: Vec<String> = incoming.try_iter().collect();
    let rest = rest.join("\n");
    let stderr = String::from_utf8_lossy(&ended.stderr);
    // carve watch says it reconnects, and why the job ended, on stderr.
    let said = format!("{rest}\n{stderr}");
    assert!(
        said.contains("lost the scheduler at") && said.contains("reconnecting"),
        "{said}"
    );
    assert!(
        said.contains("cancelled while the leader was frozen"),
        "{said}"
    );
    assert!(!ended.status.success(), "a cancelled job: {rest}\n{stderr}");
}
