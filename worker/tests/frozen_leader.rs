//! A leader frozen (SIGSTOP) for longer than the worker lease, with two real scheduler
//! replicas on PostgreSQL (processes) and a real `carve-worker` process training a real
//! engine attempt (issue 29, point 2): the standby takes the lease over, the worker
//! notices that its session's leader answers nothing and moves to it, and the attempt
//! keeps running there: no attempt lost, the job not retrained from scratch, its
//! checkpoints still recorded through the freeze. When the old leader wakes it acts as a
//! standby (it fenced itself) and the job still has its one attempt.
//!
//! The deadlines below are hang guards, not timings.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::cluster_service_client::ClusterServiceClient;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::SchedulerConfig;
use carve_testing::PgServer;
use tonic::transport::{Channel, Endpoint};

mod support;
use support::{
    authorized, poll_until, process_command_lines, signal, submit_job_id, tiny_job_spec,
    worker_process_command,
};

const ADMIN: &str = "carve_frozen_leader_test_admin_secret";
/// Set in a replica process's environment: its directory (the database URL is in
/// `database` there, its port goes to `port`).
const REPLICA_ROLE: &str = "CARVE_FROZEN_LEADER_REPLICA_DIRECTORY";
/// The scheduler's worker lease; the leader stays frozen for longer.
const WORKER_LEASE: Duration = Duration::from_secs(20);
const LEADER_LEASE: Duration = Duration::from_secs(2);
/// How long any one wait may take before the test fails (a hang guard).
const HANG_GUARD: Duration = Duration::from_secs(120);

/// The entry point of the replica processes `a_frozen_leader...` starts (this test
/// binary again, with [`REPLICA_ROLE`] set); without it, nothing to do.
#[test]
fn replica_process() {
    let Ok(directory) = std::env::var(REPLICA_ROLE) else {
        return;
    };
    let directory = PathBuf::from(directory);
    let database_url = std::fs::read_to_string(directory.join("database")).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let config = SchedulerConfig {
            database_url,
            settings: SchedulerSettings {
                lease_duration: WORKER_LEASE,
                heartbeat_interval: Duration::from_millis(500),
                scheduling_interval: Duration::from_millis(100),
                infrastructure_retry_backoff: Duration::from_millis(100),
                leader_lease: LEADER_LEASE,
                ..SchedulerSettings::default()
            },
            admin_token: Some(ADMIN.into()),
            metrics_address: None,
            tls: None,
        };
        let port_file = directory.join("port");
        std::fs::write(port_file.with_extension("tmp"), port.to_string()).unwrap();
        std::fs::rename(port_file.with_extension("tmp"), &port_file).unwrap();
        carve_scheduler::server::run(config, listener, std::future::pending())
            .await
            .unwrap();
    });
}

/// The processes the test started; each is woken (SIGCONT) and killed at the end.
#[derive(Default)]
struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            signal(child.id(), "CONT");
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts a replica in `directory` on `database_url`; returns it with its endpoint.
async fn start_replica(directory: &Path, database_url: &str) -> (Child, String) {
    std::fs::create_dir_all(directory).unwrap();
    std::fs::write(directory.join("database"), database_url).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "replica_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(REPLICA_ROLE, directory)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let port_file = directory.join("port");
    let port: u16 = poll_until(
        HANG_GUARD,
        Duration::from_millis(20),
        "the replica starts (hang guard)",
        || {
            std::fs::read_to_string(&port_file)
                .ok()
                .and_then(|text| text.parse().ok())
        },
    )
    .await;
    (child, format!("http://127.0.0.1:{port}"))
}

/// A channel whose calls give up after a while: a frozen replica must not hang the test.
async fn channel_to(endpoint: &str) -> Channel {
    Endpoint::from_shared(endpoint.to_string())
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(3))
        .connect_lazy()
}

/// The workers a replica lists when it leads; `None` from a standby (or a frozen one).
async fn workers_if_leading(channel: &Channel) -> Option<Vec<v1::Worker>> {
    ClusterServiceClient::new(channel.clone())
        .list_workers(authorized(v1::ListWorkersRequest::default(), ADMIN))
        .await
        .ok()
        .map(|response| response.into_inner().workers)
}

async fn wait_until<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    mut check: impl FnMut() -> F,
) -> T {
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} (hang guard)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The last checkpoint the scheduler recorded for the job's attempt 1, from the job's log
/// ("checkpoint of step S written to L", written when it stored one).
async fn last_recorded_step(channel: &Channel, user: &str, job_id: &str) -> Option<u64> {
    let lines = JobServiceClient::new(channel.clone())
        .get_job_logs(authorized(
            v1::GetJobLogsRequest {
                job_id: job_id.into(),
                attempt_number: 1,
                // The newest lines: the job writes thousands.
                tail: 200,
                ..Default::default()
            },
            user,
        ))
        .await
        .ok()?
        .into_inner()
        .lines;
    // The largest, not the newest: a leader woken after a freeze may still append the
    // lines it held (older steps) after the new leader's.
    lines
        .iter()
        .filter_map(|line| {
            let rest = line.message.strip_prefix("checkpoint of step ")?;
            rest.split_once(" written to ")?.0.parse().ok()
        })
        .max()
}

/// The pids of the attempt processes of `job_id` alive now.
fn attempt_processes(job_id: &str) -> Vec<u32> {
    process_command_lines()
        .into_iter()
        .filter(|(_, arguments)| {
            arguments.get(1).map(String::as_str) == Some("attempt")
                && arguments.iter().any(|argument| argument.contains(job_id))
        })
        .map(|(process_id, _)| process_id)
        .collect()
}

async fn get_job(channel: &Channel, user: &str, job_id: &str) -> Option<v1::Job> {
    JobServiceClient::new(channel.clone())
        .get_job(authorized(
            v1::GetJobRequest {
                job_id: job_id.into(),
            },
            user,
        ))
        .await
        .ok()?
        .into_inner()
        .job
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_loses_no_attempt_its_worker_moves_to_the_new_leader() {
    let directory = tempfile::tempdir().unwrap();
    let postgres = PgServer::start().unwrap();
    let database_url = postgres.create_database("frozen_leader").await.unwrap();
    let mut processes = Processes::default();
    let (first, first_endpoint) =
        start_replica(&directory.path().join("replica-a"), &database_url).await;
    processes.0.push(first);
    let first_channel = channel_to(&first_endpoint).await;
    wait_until("the first replica leads", || {
        workers_if_leading(&first_channel)
    })
    .await;
    let (second, second_endpoint) =
        start_replica(&directory.path().join("replica-b"), &database_url).await;
    processes.0.push(second);
    let second_channel = channel_to(&second_endpoint).await;

    let secrets = carve_testing::cluster::tenant_with_tokens(
        &first_channel,
        ADMIN,
        "frozen",
        v1::Quota::default(),
        &[v1::Role::User, v1::Role::Worker],
    )
    .await;
    let (user, worker_token) = (&secrets[0], &secrets[1]);
    let checkpoints = directory.path().join("checkpoints");
    std::fs::create_dir_all(&checkpoints).unwrap();
    processes.0.push(
        worker_process_command(
            &format!("{first_endpoint},{second_endpoint}"),
            worker_token,
            &checkpoints,
            "frozen-leader-node",
        )
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap(),
    );
    let job_id = submit_job_id(
        &first_channel,
        user,
        tiny_job_spec("long", 50_000_000, 50, ""),
    )
    .await;
    let (first, second, job) = (&first_channel, &second_channel, job_id.as_str());
    let before_step = wait_until("the job runs and checkpoints", || async move {
        last_recorded_step(first, user, job).await
    })
    .await;

    let process_before = attempt_processes(job);
    assert_eq!(process_before.len(), 1, "{process_before:?}");
    // Freeze the leader for longer than the worker lease.
    let frozen = processes.0[0].id();
    signal(frozen, "STOP");
    let frozen_at = tokio::time::Instant::now();
    wait_until(
        "the worker holds its session with the new leader",
        || async move {
            workers_if_leading(second).await.filter(|workers| {
                workers.iter().any(|worker| {
                    worker.hostname == "frozen-leader-node"
                        && worker.state == v1::WorkerState::Ready as i32
                })
            })
        },
    )
    .await;
    // Past the worker lease, counted from the freeze (a wait, not a timing).
    tokio::time::sleep_until(frozen_at + WORKER_LEASE + Duration::from_secs(2)).await;
    let during = get_job(&second_channel, user, &job_id)
        .await
        .expect("the new leader answers");
    assert_eq!(during.attempts.len(), 1, "an attempt was lost: {during:#?}");
    assert_eq!(
        during.attempts[0].outcome,
        v1::AttemptOutcome::Running as i32,
        "{during:#?}"
    );
    // The attempt reported to the new leader all along: its checkpoints moved on from
    // where they were at the freeze (the job is not retrained from scratch).
    let moved_on = wait_until("a checkpoint recorded by the new leader", || async move {
        last_recorded_step(second, user, job)
            .await
            .filter(|step| *step > before_step)
    })
    .await;
    let after_move = get_job(second, user, job).await.unwrap();
    assert_eq!(after_move.attempts.len(), 1, "{after_move:#?}");

    // The old leader wakes: it fenced itself and acts as a standby.
    signal(frozen, "CONT");
    let woken = wait_until("the woken replica answers as a standby", || async move {
        match ClusterServiceClient::new(first.clone())
            .list_workers(authorized(v1::ListWorkersRequest::default(), ADMIN))
            .await
        {
            Err(status) if status.code() == tonic::Code::Unavailable => Some(status),
            _ => None,
        }
    })
    .await;
    assert!(
        woken.message().contains("standby") || woken.message().contains("no longer leads"),
        "{woken:?}"
    );
    let after = get_job(&second_channel, user, &job_id).await.unwrap();
    assert_eq!(after.attempts.len(), 1, "{after:#?}");
    assert_eq!(
        after.attempts[0].outcome,
        v1::AttemptOutcome::Running as i32,
        "{after:#?}"
    );
    assert!(last_recorded_step(second, user, job).await >= Some(moved_on));
    // The same process trained throughout: the job was never started again.
    assert_eq!(attempt_processes(job), process_before);
    JobServiceClient::new(second_channel.clone())
        .cancel_job(authorized(
            v1::CancelJobRequest {
                job_id: job_id.clone(),
                reason: "the test is over".into(),
            },
            user,
        ))
        .await
        .unwrap();
}
