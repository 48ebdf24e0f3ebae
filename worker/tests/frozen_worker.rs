//! A worker frozen (SIGSTOP) for longer than its lease, with real `carve-worker`
//! processes and their engine attempt processes beside a real scheduler (SQLite): the
//! scheduler declares the frozen worker lost and gives its job to the other worker, and
//! the frozen worker's attempt must have stopped before that, though its worker could not
//! stop it (issue 29, point 4). Checked by process (never two attempt processes of the
//! job alive at once, sampled every 20 ms) and by the store (never two running attempts
//! of the job in the scheduler's answers, the old attempt ended before the new one
//! started), and the new attempt resumes from exactly the step the scheduler recorded,
//! though the stale attempt wrote a later checkpoint when it stopped.
//!
//! The deadlines below are hang guards, not timings.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::cluster_service_client::ClusterServiceClient;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::SchedulerConfig;
use carve_worker::leftover_processes::process_start_time;
use tonic::transport::{Channel, Endpoint};

mod support;
use support::{
    authorized, poll_until, process_command_lines, signal, submit_job_id, tiny_job_spec,
    worker_process_command,
};

const ADMIN: &str = "carve_frozen_worker_test_admin_secret";
/// The scheduler's worker lease: the frozen worker is declared lost this long after its
/// last heartbeat arrived.
const LEASE: Duration = Duration::from_secs(4);
/// How long any one wait may take before the test fails (a hang guard).
const HANG_GUARD: Duration = Duration::from_secs(120);

/// The worker processes; each is woken (SIGCONT) and killed when the test ends.
#[derive(Default)]
struct Workers(BTreeMap<&'static str, Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for child in self.0.values_mut() {
            signal(child.id(), "CONT");
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The engine attempt processes of `job_id` alive now: (pid, attempt number), read
/// from their `--checkpoint` argument (`{job}.attempt-{N}.ckpt`).
fn live_attempts(job_id: &str) -> Vec<(u32, u32)> {
    process_command_lines()
        .into_iter()
        .filter_map(|(process_id, arguments)| {
            if arguments.get(1).map(String::as_str) != Some("attempt") {
                return None;
            }
            let position = arguments
                .iter()
                .position(|argument| argument == "--checkpoint")?;
            let checkpoint = PathBuf::from(arguments.get(position + 1)?);
            let name = checkpoint.file_name()?.to_str()?.strip_suffix(".ckpt")?;
            let (job, attempt_number) = name.rsplit_once(".attempt-")?;
            // A zombie has ended; only its status is left to collect.
            process_start_time(process_id)?;
            (job == job_id).then_some((process_id, attempt_number.parse().ok()?))
        })
        .collect()
}

/// Each sample of the job's attempt processes, (pid, attempt), in which two were alive.
type Overlaps = Arc<Mutex<Vec<Vec<(u32, u32)>>>>;

/// Samples `job_id`'s attempt processes until `stop`; keeps each sample with two of them.
fn watch_processes(
    job_id: String,
    stop: Arc<AtomicBool>,
    overlaps: Overlaps,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Acquire) {
            let live = live_attempts(&job_id);
            if live.len() > 1 {
                overlaps.lock().unwrap().push(live);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })
}

async fn connect(address: &str) -> Channel {
    for _ in 0..500 {
        if let Ok(channel) = Endpoint::from_shared(address.to_string())
            .unwrap()
            .connect()
            .await
        {
            return channel;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the scheduler at {address} never answered");
}

async fn get_job(channel: &Channel, user: &str, job_id: &str) -> v1::Job {
    JobServiceClient::new(channel.clone())
        .get_job(authorized(
            v1::GetJobRequest {
                job_id: job_id.into(),
            },
            user,
        ))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap()
}

/// Polls `job_id` until `done` says so (and every answer has at most one running
/// attempt: the store's side of "never two at once"); returns the last answer.
async fn poll_job(
    channel: &Channel,
    user: &str,
    job_id: &str,
    what: &str,
    mut done: impl FnMut(&v1::Job) -> bool,
) -> v1::Job {
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    loop {
        let job = get_job(channel, user, job_id).await;
        let running = job
            .attempts
            .iter()
            .filter(|attempt| attempt.outcome == v1::AttemptOutcome::Running as i32)
            .count();
        assert!(running <= 1, "two running attempts in the store: {job:#?}");
        if done(&job) {
            return job;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} (hang guard)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn ready_workers(channel: &Channel) -> usize {
    ClusterServiceClient::new(channel.clone())
        .list_workers(authorized(
            v1::ListWorkersRequest {
                states: vec![v1::WorkerState::Ready as i32],
            },
            ADMIN,
        ))
        .await
        .map(|response| response.into_inner().workers.len())
        .unwrap_or(0)
}

/// The newest 200 lines of the log of `job_id`'s attempt `attempt_number`.
async fn attempt_log(
    channel: &Channel,
    user: &str,
    job_id: &str,
    attempt_number: u32,
) -> Vec<v1::JobLogLine> {
    JobServiceClient::new(channel.clone())
        .get_job_logs(authorized(
            v1::GetJobLogsRequest {
                job_id: job_id.into(),
                attempt_number,
                // The newest lines: the job writes thousands.
                tail: 200,
                ..Default::default()
            },
            user,
        ))
        .await
        .unwrap()
        .into_inner()
        .lines
}

/// The last checkpoint the scheduler recorded for `attempt_number`, from the job's log
/// ("checkpoint of step S written to L", written when it stored one).
async fn last_recorded_checkpoint(
    channel: &Channel,
    user: &str,
    job_id: &str,
    attempt_number: u32,
) -> Option<(u64, String)> {
    let lines = attempt_log(channel, user, job_id, attempt_number).await;
    lines.iter().rev().find_map(|line| {
        let rest = line.message.strip_prefix("checkpoint of step ")?;
        let (step, location) = rest.split_once(" written to ")?;
        Some((step.parse().ok()?, location.to_string()))
    })
}

fn start_worker(address: &str, token: &str, checkpoints: &Path, hostname: &str) -> Child {
    worker_process_command(address, token, checkpoints, hostname)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// A scheduler on SQLite in `directory` with the test's short lease, and a tenant with
/// a user token and two worker tokens: its address, a channel to it, the three secrets,
/// and the sender that stops it when dropped.
async fn scheduler_with_two_worker_tokens(
    directory: &Path,
) -> (
    String,
    Channel,
    Vec<String>,
    tokio::sync::oneshot::Sender<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let config = SchedulerConfig {
        database_url: format!("sqlite://{}", directory.join("carve.db").display()),
        settings: SchedulerSettings {
            lease_duration: LEASE,
            heartbeat_interval: Duration::from_millis(200),
            scheduling_interval: Duration::from_millis(50),
            infrastructure_retry_backoff: Duration::from_millis(100),
            ..SchedulerSettings::default()
        },
        admin_token: Some(ADMIN.into()),
        metrics_address: None,
        tls: None,
    };
    let (stop_scheduler, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(carve_scheduler::server::run(config, listener, async {
        let _ = stopped.await;
    }));
    let channel = connect(&address).await;
    let secrets = carve_testing::cluster::tenant_with_tokens(
        &channel,
        ADMIN,
        "frozen",
        v1::Quota::default(),
        &[v1::Role::User, v1::Role::Worker, v1::Role::Worker],
    )
    .await;
    (address, channel, secrets, stop_scheduler)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_workers_attempt_stops_before_its_job_runs_elsewhere_which_resumes_from_the_recorded_step()
 {
    let directory = tempfile::tempdir().unwrap();
    let checkpoints = directory.path().join("checkpoints");
    std::fs::create_dir_all(&checkpoints).unwrap();
    let (address, channel, secrets, _stop_scheduler) =
        scheduler_with_two_worker_tokens(directory.path()).await;
    let (user, token_a, token_b) = (&secrets[0], &secrets[1], &secrets[2]);
    let mut workers = Workers::default();
    workers.0.insert(
        "a",
        start_worker(&address, token_a, &checkpoints, "frozen-node-a"),
    );

    // A long job with frequent checkpoints, on worker a (the only one yet).
    let job_id = submit_job_id(&channel, user, tiny_job_spec("long", 50_000_000, 50, "")).await;
    let stop_watching = Arc::new(AtomicBool::new(false));
    let overlaps: Overlaps = Arc::default();
    let watcher = watch_processes(job_id.clone(), stop_watching.clone(), overlaps.clone());
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    while last_recorded_checkpoint(&channel, user, &job_id, 1)
        .await
        .is_none()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a checkpoint recorded (hang guard)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    workers.0.insert(
        "b",
        start_worker(&address, token_b, &checkpoints, "frozen-node-b"),
    );
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    while ready_workers(&channel).await < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "worker b registers (hang guard)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Freeze worker a past its lease. Its attempt process runs on beside it.
    signal(workers.0["a"].id(), "STOP");
    poll_job(
        &channel,
        user,
        &job_id,
        "attempt 2 runs on worker b",
        |job| {
            job.attempts.len() >= 2
                && job.attempts[1].outcome == v1::AttemptOutcome::Running as i32
                && job.attempts[1].started_at.is_some()
        },
    )
    .await;
    // Attempt 2 trains: a checkpoint of its own is recorded.
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    while last_recorded_checkpoint(&channel, user, &job_id, 2)
        .await
        .is_none()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "attempt 2 checkpoints (hang guard)"
        );
        poll_job(&channel, user, &job_id, "", |_| true).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let job = poll_job(&channel, user, &job_id, "", |_| true).await;
    // Worker a wakes: whatever it still held stops now, and attempt 2 trains on.
    signal(workers.0["a"].id(), "CONT");
    poll_until(
        HANG_GUARD,
        Duration::from_millis(20),
        "attempt 1 ends (hang guard)",
        || {
            let live = live_attempts(&job_id);
            (!live.iter().any(|(_, attempt)| *attempt == 1)).then_some(())
        },
    )
    .await;
    let recorded = last_recorded_checkpoint(&channel, user, &job_id, 1)
        .await
        .expect("the scheduler recorded a checkpoint of attempt 1");
    JobServiceClient::new(channel.clone())
        .cancel_job(authorized(
            v1::CancelJobRequest {
                job_id: job_id.clone(),
                reason: "the test is over".into(),
            },
            user,
        ))
        .await
        .unwrap();
    stop_watching.store(true, Ordering::Release);
    watcher.join().unwrap();

    let overlaps = overlaps.lock().unwrap();
    assert!(
        overlaps.is_empty(),
        "two attempt processes of the job ran at once (pid, attempt): {:?}",
        &overlaps[..overlaps.len().min(5)]
    );
    let first = &job.attempts[0];
    let second = &job.attempts[1];
    assert_ne!(first.worker_id, second.worker_id, "{job:#?}");
    assert!(
        [
            v1::AttemptOutcome::Lost as i32,
            v1::AttemptOutcome::Interrupted as i32
        ]
        .contains(&first.outcome),
        "attempt 1 ended lost or interrupted: {first:#?}"
    );
    let millis = |timestamp: &Option<prost_types::Timestamp>| {
        let timestamp = timestamp.as_ref().expect("a timestamp");
        timestamp.seconds * 1000 + i64::from(timestamp.nanos / 1_000_000)
    };
    assert!(
        millis(&first.finished_at) <= millis(&second.started_at),
        "attempt 2 started before attempt 1 ended in the store: {job:#?}"
    );
    let resumed = second.resumed_from.as_ref().expect("attempt 2 resumed");
    assert_eq!(
        (resumed.step, resumed.location.clone()),
        recorded,
        "attempt 2 resumed from what the scheduler recorded for attempt 1"
    );
}

/// What a frozen-worker command job's program is called on its command line
/// (`sh -c SCRIPT NAME {checkpoint_dir}`): how the samples find it.
const COMMAND_PROGRAM_NAME: &str = "frozen-command-program";

/// The command job programs of `job_id` alive now (pids): `/bin/sh` processes named
/// [`COMMAND_PROGRAM_NAME`] whose checkpoint directory is the job's. Their supervisors
/// (`carve-worker supervise ... -- /bin/sh ...`) are not the program and are left out,
/// and so is a program's own child between its fork and its exec (of `sleep`), which
/// still shows the program's command line.
fn live_command_programs(job_id: &str) -> Vec<u32> {
    let matching: Vec<(u32, Option<u32>)> = process_command_lines()
        .into_iter()
        .filter_map(|(process_id, arguments)| {
            let is_program = arguments.first().map(String::as_str) == Some("/bin/sh")
                && arguments.get(3).map(String::as_str) == Some(COMMAND_PROGRAM_NAME)
                && arguments
                    .get(4)
                    .is_some_and(|directory| directory.ends_with(job_id));
            // A zombie has ended; only its status is left to collect.
            (is_program && process_start_time(process_id).is_some())
                .then(|| (process_id, parent_of(process_id)))
        })
        .collect();
    matching
        .iter()
        .filter(|(_, parent)| !matching.iter().any(|(other, _)| Some(*other) == *parent))
        .map(|(process_id, _)| *process_id)
        .collect()
}

/// A process's parent, from `/proc/<pid>/stat` (the field after the state, past the
/// command name in parentheses).
fn parent_of(process_id: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{process_id}/stat")).ok()?;
    let (_, after_name) = stat.rsplit_once(')')?;
    after_name.split_whitespace().nth(1)?.parse().ok()
}

/// A command job's program (the user's own, which holds no lease of its own and ignores
/// SIGTERM) on a worker frozen past its lease: its supervisor stops it before the job
/// runs elsewhere, so never two programs of the job at once (sampled every 20 ms) nor
/// two running attempts in the store. Fails with the supervisor off (`supervision:
/// None` in `worker/command_launch.rs`): both programs ran at once.
///
/// The program checkpoints every 5 steps by rewriting one file in place and printing
/// `CARVE_CHECKPOINT`; the stale one goes on doing so while its worker is frozen. The
/// next attempt resumes from exactly the step the scheduler recorded: the file it is
/// given (`CARVE_RESUME_FROM`) holds that step, and `CARVE_RESUME_STEP` says it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_workers_command_program_is_stopped_by_its_supervisor_before_its_job_runs_elsewhere()
 {
    let directory = tempfile::tempdir().unwrap();
    let checkpoints = directory.path().join("checkpoints");
    std::fs::create_dir_all(&checkpoints).unwrap();
    let (address, channel, secrets, _stop_scheduler) =
        scheduler_with_two_worker_tokens(directory.path()).await;
    let (user, token_a, token_b) = (&secrets[0], &secrets[1], &secrets[2]);
    let mut workers = Workers::default();
    workers.0.insert(
        "a",
        start_worker(&address, token_a, &checkpoints, "frozen-command-node-a"),
    );
    let spec = serde_json::json!({
        "name": "long-command",
        "command": {
            "argv": [
                "/bin/sh", "-c",
                concat!(
                    "trap '' TERM; i=0; ",
                    "if [ -n \"$CARVE_RESUME_FROM\" ]; then i=$(cat \"$CARVE_RESUME_FROM\"); ",
                    "echo \"resumed at step $i, recorded as $CARVE_RESUME_STEP\"; fi; ",
                    "while true; do i=$((i+1)); echo CARVE_PROGRESS step=$i; ",
                    "if [ $((i % 5)) -eq 0 ]; then echo $i > \"$1/model\"; ",
                    "echo \"CARVE_CHECKPOINT step=$i path=model\"; fi; sleep 0.05; done",
                ),
                COMMAND_PROGRAM_NAME, "{checkpoint_dir}",
            ],
            "global_batch": 8, "micro_batch": 8, "steps": 1_000_000_000u64,
        },
        "resources": { "vram": "256MiB" },
    });
    let job_id = submit_job_id(&channel, user, spec.to_string()).await;
    let stop_watching = Arc::new(AtomicBool::new(false));
    let overlaps: Arc<Mutex<Vec<Vec<u32>>>> = Arc::default();
    let watcher = std::thread::spawn({
        let (job_id, stop, overlaps) = (job_id.clone(), stop_watching.clone(), overlaps.clone());
        move || {
            while !stop.load(Ordering::Acquire) {
                let live = live_command_programs(&job_id);
                if live.len() > 1 {
                    overlaps.lock().unwrap().push(live);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    });
    poll_job(&channel, user, &job_id, "attempt 1 starts", |job| {
        job.attempts
            .first()
            .is_some_and(|attempt| attempt.started_at.is_some())
    })
    .await;
    poll_until(
        HANG_GUARD,
        Duration::from_millis(20),
        "the program runs",
        || (!live_command_programs(&job_id).is_empty()).then_some(()),
    )
    .await;
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    while last_recorded_checkpoint(&channel, user, &job_id, 1)
        .await
        .is_none()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "attempt 1 has a recorded checkpoint (hang guard)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    workers.0.insert(
        "b",
        start_worker(&address, token_b, &checkpoints, "frozen-command-node-b"),
    );
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    while ready_workers(&channel).await < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "worker b registers (hang guard)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Freeze worker a past its lease: only its program's supervisor can stop it now.
    signal(workers.0["a"].id(), "STOP");
    poll_job(
        &channel,
        user,
        &job_id,
        "attempt 2 runs on worker b",
        |job| {
            job.attempts.len() >= 2
                && job.attempts[1].outcome == v1::AttemptOutcome::Running as i32
                && job.attempts[1].started_at.is_some()
        },
    )
    .await;
    // Attempt 2's program runs while worker a is still frozen.
    poll_until(
        HANG_GUARD,
        Duration::from_millis(20),
        "attempt 2's program runs",
        || (!live_command_programs(&job_id).is_empty()).then_some(()),
    )
    .await;
    let job = poll_job(&channel, user, &job_id, "", |_| true).await;
    // Attempt 1's reports are fenced now: its last recorded checkpoint is final.
    let (recorded_step, _) = last_recorded_checkpoint(&channel, user, &job_id, 1)
        .await
        .expect("attempt 1 recorded a checkpoint");
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    let resumed = loop {
        let lines = attempt_log(&channel, user, &job_id, 2).await;
        if let Some(line) = lines
            .iter()
            .find(|line| line.message.starts_with("resumed at step "))
        {
            break line.message.clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "attempt 2 says where it resumed (hang guard): {lines:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    signal(workers.0["a"].id(), "CONT");
    JobServiceClient::new(channel.clone())
        .cancel_job(authorized(
            v1::CancelJobRequest {
                job_id: job_id.clone(),
                reason: "the test is over".into(),
            },
            user,
        ))
        .await
        .unwrap();
    stop_watching.store(true, Ordering::Release);
    watcher.join().unwrap();
    // The cancel stops attempt 2's program. Waited for: killing the workers at the end
    // would leave their containers running, their runtime state removed with the
    // test's directory, out of anyone's reach.
    poll_until(
        HANG_GUARD,
        Duration::from_millis(20),
        "the cancelled job's program ends",
        || live_command_programs(&job_id).is_empty().then_some(()),
    )
    .await;

    let overlaps = overlaps.lock().unwrap();
    assert!(
        overlaps.is_empty(),
        "two programs of the job ran at once (pids): {:?}",
        &overlaps[..overlaps.len().min(5)]
    );
    assert_eq!(
        resumed,
        format!("resumed at step {recorded_step}, recorded as {recorded_step}"),
        "attempt 2 resumed from the step the scheduler recorded for attempt 1"
    );
    let (first, second) = (&job.attempts[0], &job.attempts[1]);
    assert_ne!(first.worker_id, second.worker_id, "{job:#?}");
    assert!(
        [
            v1::AttemptOutcome::Lost as i32,
            v1::AttemptOutcome::Interrupted as i32
        ]
        .contains(&first.outcome),
        "attempt 1 ended lost or interrupted: {first:#?}"
    );
}
