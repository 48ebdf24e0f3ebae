//! Three `carve-scheduler` replicas on the tests' private PostgreSQL: the leader is
//! killed with SIGKILL twice, during a storm of submits and while attempts run. A new
//! replica must lead within the leader's lease plus a few seconds, no acknowledged job
//! may be lost, no job may run twice at once, and every job must finish. The clients
//! fail over as carve and the worker do: on a broken connection or UNAVAILABLE (a
//! standby) they try the next replica.

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_proto::v1::worker_service_client::WorkerServiceClient;
use carve_testing::PgServer;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/worker.rs"]
mod test_worker;
use cluster::ADMIN;
use test_worker::authorized;

/// The leader's lease: a takeover comes at most this long after the leader dies, plus
/// a standby's polling period (a quarter of it) and its recovery.
const LEADER_LEASE: Duration = Duration::from_secs(2);
/// How long after a kill a new leader must be serving.
const FAILOVER_LIMIT: Duration = Duration::from_secs(7);
const JOBS_PER_SUBMITTER: usize = 15;
const SUBMITTERS: usize = 4;
/// How long the worker lets each attempt run before reporting it succeeded.
const ATTEMPT_RUN_TIME: Duration = Duration::from_millis(700);

const JOB: &str = r#"{
  "name": "tiny",
  "model": { "input_shape": [4], "loss": "softmax_cross_entropy", "layers": [ { "dense": { "units": 2 } } ] },
  "training": { "batch_size": 8, "steps": 1, "optimizer": { "sgd": { "learning_rate": 0.1 } } },
  "data": { "format": "synthetic", "samples": 16 }
}"#;

/// Starts one replica on `database_url`; returns it with its endpoint.
fn start_replica(directory: &std::path::Path, database_url: &str) -> (Child, String) {
    let token_file = directory.join("admin.token");
    std::fs::write(&token_file, ADMIN).unwrap();
    cluster::spawn_scheduler_binary(&[
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--database".into(),
        database_url.into(),
        "--admin-token-file".into(),
        token_file.into(),
        "--leader-lease-ms".into(),
        LEADER_LEASE.as_millis().to_string().into(),
        "--lease-seconds".into(),
        "8".into(),
        "--heartbeat-seconds".into(),
        "1".into(),
        "--scheduling-interval-ms".into(),
        "100".into(),
    ])
}

/// The leadership row: (epoch, endpoint) of a leader whose lease runs.
async fn current_leader(database: &sqlx::PgPool) -> Option<(i64, String)> {
    sqlx::query_as(
        "SELECT epoch, endpoint FROM leadership \
         WHERE expires_at_ms >= (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT",
    )
    .fetch_optional(database)
    .await
    .ok()
    .flatten()
}

/// Waits for a leader with an epoch above `above`; returns it and how long it took.
async fn leader_after(database: &sqlx::PgPool, above: i64) -> ((i64, String), Duration) {
    let started = Instant::now();
    loop {
        if let Some((epoch, endpoint)) = current_leader(database).await
            && epoch > above
        {
            return ((epoch, endpoint), started.elapsed());
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no leader above epoch {above} within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn channel_to(endpoint: &str) -> Option<Channel> {
    Endpoint::from_shared(endpoint.to_string())
        .unwrap()
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .ok()
}

/// Submits `key`'s job, trying the replicas in turn until one acknowledges it (the same
/// idempotency key makes a retry of a submit that was stored return the same job).
async fn submit_with_failover(endpoints: &[String], token: &str, key: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    for turn in 0.. {
        assert!(Instant::now() < deadline, "no replica took submit {key}");
        let endpoint = &endpoints[turn % endpoints.len()];
        let Some(channel) = channel_to(endpoint).await else {
            continue;
        };
        let answer = JobServiceClient::new(channel)
            .submit_job(authorized(
                v1::SubmitJobRequest {
                    spec_json: JOB.into(),
                    idempotency_key: key.into(),
                },
                token,
            ))
            .await;
        match answer {
            Ok(response) => return response.into_inner().job.unwrap().id,
            Err(status) if status.code() == tonic::Code::Unavailable => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(status) if status.code() == tonic::Code::Unknown => {}
            Err(status) => panic!("submit {key} refused: {status:?}"),
        }
    }
    unreachable!()
}

/// What the worker saw: each attempt's (job, attempt number) with when it was assigned
/// and when the worker reported it finished.
#[derive(Debug, Default)]
struct WorkerLog {
    runs: Vec<(String, u32, Instant, Option<Instant>)>,
    /// Attempts running now.
    running: usize,
}

/// A worker that fails over as the real one does: one session at a time with the replica
/// whose turn it is, moving to the next when the session breaks or the replica is a
/// standby; its attempts keep running across sessions, their reports wait until a
/// session acknowledges them, and a new session's hello lists what still runs.
async fn failover_worker(endpoints: Vec<String>, token: String, log: Arc<Mutex<WorkerLog>>) {
    let mut worker_id = String::new();
    // By "job/attempt": the attempt and when it was assigned.
    let mut running: HashMap<String, (v1::AttemptRef, Instant)> = HashMap::new();
    let mut unacknowledged: Vec<v1::worker_message::Body> = Vec::new();
    for turn in 0.. {
        let endpoint = &endpoints[turn % endpoints.len()];
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Some(channel) = channel_to(endpoint).await else {
            continue;
        };
        let mut client = WorkerServiceClient::new(channel);
        let gpu_total = 80u64 << 30;
        let registered = client
            .register(authorized(
                v1::RegisterWorkerRequest {
                    hostname: "ha-worker".into(),
                    gpus: vec![v1::Gpu {
                        uuid: "GPU-ha".into(),
                        index: 0,
                        model_name: "simulated".into(),
                        total_bytes: gpu_total,
                        context_bytes: 256 << 20,
                        free_bytes: gpu_total - (256 << 20),
                        simulated: true,
                        slices: vec![],
                        compute_capability: "9.0".into(),
                    }],
                    version: "test".into(),
                    previous_worker_id: worker_id.clone(),
                    ..Default::default()
                },
                &token,
            ))
            .await;
        let Ok(registered) = registered else {
            continue;
        };
        worker_id = registered.into_inner().worker_id;
        let (outgoing, receiver) = mpsc::channel(1024);
        // Reports are numbered from 1; the hello and heartbeats carry 0 (never acked).
        let mut sequence = 1u64;
        let send = |body: v1::worker_message::Body, sequence: &mut u64| {
            let numbered = matches!(
                body,
                v1::worker_message::Body::AttemptStarted(_)
                    | v1::worker_message::Body::AttemptFinished(_)
            );
            let message = v1::WorkerMessage {
                sequence: if numbered { *sequence } else { 0 },
                body: Some(body),
            };
            if numbered {
                *sequence += 1;
            }
            outgoing.try_send(message).is_ok()
        };
        send(
            v1::worker_message::Body::Hello(v1::worker_message::Hello {
                worker_id: worker_id.clone(),
                // What runs, and what ended with its report still to come.
                running_attempts: running
                    .values()
                    .map(|(attempt, _)| attempt.clone())
                    .chain(unacknowledged.iter().filter_map(|body| match body {
                        v1::worker_message::Body::AttemptFinished(finished) => {
                            finished.attempt.clone()
                        }
                        _ => None,
                    }))
                    .collect(),
            }),
            &mut sequence,
        );
        // Reports not acknowledged by the last session go again, renumbered.
        let mut sent: Vec<(u64, v1::worker_message::Body)> = Vec::new();
        for body in unacknowledged.drain(..) {
            sent.push((sequence, body.clone()));
            send(body, &mut sequence);
        }
        let Ok(session) = client
            .session(authorized(ReceiverStream::new(receiver), &token))
            .await
        else {
            unacknowledged.extend(sent.into_iter().map(|(_, body)| body));
            continue;
        };
        let mut incoming = session.into_inner();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    send(v1::worker_message::Body::Heartbeat(
                        v1::worker_message::Heartbeat::default(),
                    ), &mut sequence);
                    let done: Vec<String> = running
                        .iter()
                        .filter(|(_, (_, assigned))| assigned.elapsed() >= ATTEMPT_RUN_TIME)
                        .map(|(key, _)| key.clone())
                        .collect();
                    for key in done {
                        let (attempt, _) = running.remove(&key).unwrap();
                        {
                            let mut log = log.lock().unwrap();
                            log.running -= 1;
                            let run = log.runs.iter_mut().rev().find(|run| {
                                run.0 == attempt.job_id && run.1 == attempt.attempt_number
                            });
                            run.unwrap().3 = Some(Instant::now());
                        }
                        let body = v1::worker_message::Body::AttemptFinished(
                            v1::worker_message::AttemptFinished {
                                attempt: Some(attempt),
                                outcome: v1::AttemptOutcome::Succeeded as i32,
                                final_loss: Some(0.1),
                                measured_peak_bytes: 1 << 20,
                                ..Default::default()
                            },
                        );
                        sent.push((sequence, body.clone()));
                        send(body, &mut sequence);
                    }
                }
                message = incoming.next() => {
                    let Some(Ok(message)) = message else { break };
                    match message.body {
                        Some(v1::scheduler_message::Body::Assignment(assignment)) => {
                            let attempt = assignment.attempt.unwrap();
                            let key = format!("{}/{}", attempt.job_id, attempt.attempt_number);
                            {
                                let mut log = log.lock().unwrap();
                                log.running += 1;
                                log.runs.push((
                                    attempt.job_id.clone(),
                                    attempt.attempt_number,
                                    Instant::now(),
                                    None,
                                ));
                            }
                            running.insert(key, (attempt.clone(), Instant::now()));
                            let body = v1::worker_message::Body::AttemptStarted(
                                v1::worker_message::AttemptStarted {
                                    attempt: Some(attempt),
                                    reserved_bytes: assignment.slice_bytes,
                                    resumed_from: None,
                                    command_argv: Vec::new(),
                                    uncontained: false,
                                    image_digest: String::new(),
                                },
                            );
                            sent.push((sequence, body.clone()));
                            send(body, &mut sequence);
                        }
                        Some(v1::scheduler_message::Body::Ack(ack)) => {
                            sent.retain(|(number, _)| *number > ack.sequence);
                        }
                        Some(v1::scheduler_message::Body::Cancel(cancel)) => {
                            let attempt = cancel.attempt.unwrap();
                            let key = format!("{}/{}", attempt.job_id, attempt.attempt_number);
                            if running.remove(&key).is_some() {
                                log.lock().unwrap().running -= 1;
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
        unacknowledged.extend(sent.into_iter().map(|(_, body)| body));
    }
}

/// Waits until the worker runs at least one attempt.
async fn until_attempts_run(log: &Mutex<WorkerLog>) {
    let started = Instant::now();
    while log.lock().unwrap().running == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no attempt ran within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_loses_no_job_and_runs_none_twice() {
    let postgres = PgServer::start().unwrap_or_else(|reason| panic!("{reason}"));
    let database_url = postgres.url("postgres");
    let database = sqlx::PgPool::connect(&database_url).await.unwrap();
    let directory = tempfile::tempdir().unwrap();
    let mut replicas: HashMap<String, Child> = HashMap::new();
    let mut endpoints = Vec::new();
    for _ in 0..3 {
        let (child, endpoint) = start_replica(directory.path(), &database_url);
        endpoints.push(endpoint.clone());
        replicas.insert(endpoint, child);
    }
    let ((mut epoch, mut leader), _) = leader_after(&database, 0).await;
    let admin = cluster::connect(&endpoints[0]).await;
    let (user, worker_token) =
        cluster::tenant_with_tokens(&admin, "ha", v1::Quota::default()).await;

    let log = Arc::new(Mutex::new(WorkerLog::default()));
    let worker = tokio::spawn(failover_worker(
        endpoints.clone(),
        worker_token,
        log.clone(),
    ));
    let acknowledged = Arc::new(Mutex::new(HashSet::new()));
    let mut submitters = Vec::new();
    for submitter in 0..SUBMITTERS {
        let endpoints = endpoints.clone();
        let user = user.clone();
        let acknowledged = acknowledged.clone();
        submitters.push(tokio::spawn(async move {
            for number in 0..JOBS_PER_SUBMITTER {
                let key = format!("ha-{submitter}-{number}");
                // Start at a different replica each: standbys take submits too.
                let mut rotated = endpoints.clone();
                rotated.rotate_left((submitter + number) % endpoints.len());
                let id = submit_with_failover(&rotated, &user, &key).await;
                acknowledged.lock().unwrap().insert(id);
                tokio::time::sleep(Duration::from_millis(60)).await;
            }
        }));
    }

    let mut failovers = Vec::new();
    for kill in 0..2 {
        // Mid-storm (the first kill) and while attempts run (both).
        while acknowledged.lock().unwrap().len() < 8 + kill * 20 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        until_attempts_run(&log).await;
        let mut child = replicas.remove(&leader).expect("the leader is one of ours");
        child.kill().unwrap();
        child.wait().unwrap();
        let killed_epoch = epoch;
        ((epoch, leader), _) = {
            let (new, took) = leader_after(&database, killed_epoch).await;
            failovers.push(took);
            (new, took)
        };
        assert!(
            replicas.contains_key(&leader),
            "the new leader {leader} is a live replica"
        );
        let took = *failovers.last().unwrap();
        assert!(
            took <= FAILOVER_LIMIT,
            "a new leader took {took:?} (limit {FAILOVER_LIMIT:?}, lease {LEADER_LEASE:?})"
        );
    }
    for submitter in submitters {
        submitter.await.unwrap();
    }
    let acknowledged = acknowledged.lock().unwrap().clone();
    assert_eq!(acknowledged.len(), SUBMITTERS * JOBS_PER_SUBMITTER);

    // Every acknowledged job is stored and finishes.
    let started = Instant::now();
    loop {
        let states: Vec<(String, String)> = sqlx::query_as("SELECT id, state FROM jobs")
            .fetch_all(&database)
            .await
            .unwrap();
        let stored: HashMap<String, String> = states.into_iter().collect();
        for id in &acknowledged {
            assert!(stored.contains_key(id), "acknowledged job {id} was lost");
        }
        let unfinished: Vec<_> = stored
            .iter()
            .filter(|(_, state)| state.as_str() != "succeeded")
            .collect();
        if unfinished.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(40),
            "jobs not finished within 40 s of the storm: {unfinished:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    worker.abort();

    // No job ran twice at once: the worker never held two attempts of one job together,
    // and the store has one succeeded attempt per job, each placed under a leader epoch.
    let runs = std::mem::take(&mut log.lock().unwrap().runs);
    let mut by_job: HashMap<&str, Vec<(Instant, Option<Instant>)>> = HashMap::new();
    for (job, _, assigned, finished) in &runs {
        by_job
            .entry(job.as_str())
            .or_default()
            .push((*assigned, *finished));
    }
    for (job, mut spans) in by_job {
        spans.sort_by_key(|span| span.0);
        for pair in spans.windows(2) {
            let ended = pair[0].1.expect("an attempt replaced by another had ended");
            assert!(ended <= pair[1].0, "job {job} ran two attempts at once");
        }
    }
    let attempts: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT job_id, COUNT(*), MIN(leader_epoch) FROM attempts \
         WHERE outcome = 'succeeded' GROUP BY job_id",
    )
    .fetch_all(&database)
    .await
    .unwrap();
    assert_eq!(attempts.len(), acknowledged.len());
    for (job, succeeded, leader_epoch) in attempts {
        assert_eq!(succeeded, 1, "job {job} succeeded {succeeded} times");
        assert!(leader_epoch >= 1, "job {job} was placed outside any epoch");
    }
    eprintln!(
        "failover (kill -9 of the leader to a new leader's lease in the store): {:?}",
        failovers
    );
    for (_, mut child) in replicas {
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[test]
fn a_second_scheduler_on_one_sqlite_file_is_refused() {
    let directory = tempfile::tempdir().unwrap();
    let database_url = format!("sqlite://{}", directory.path().join("carve.db").display());
    let (mut first, _) = start_replica(directory.path(), &database_url);
    // Its stderr goes to a file, not a pipe, so waiting with a deadline needs no reader.
    let stderr_path = directory.path().join("second.stderr");
    let mut second = Command::new(env!("CARGO_BIN_EXE_carve-scheduler"))
        .args(["--listen", "127.0.0.1:0", "--database", &database_url])
        .arg("--admin-token-file")
        .arg(directory.path().join("admin.token"))
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .expect("the scheduler binary starts");
    // A second scheduler that took the lock runs until killed: a deadline turns that
    // into this test's failure rather than a CI run that never ends.
    let status = wait_timeout::ChildExt::wait_timeout(&mut second, Duration::from_secs(60))
        .unwrap()
        .unwrap_or_else(|| {
            let _ = second.kill();
            let _ = second.wait();
            let _ = first.kill();
            panic!(
                "the second scheduler still ran after 60 s: {}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            )
        });
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(!status.success(), "the second one ran: {stderr}");
    assert!(
        stderr.contains("another carve-scheduler already runs on the SQLite database")
            && stderr.contains("PostgreSQL"),
        "{stderr}"
    );
    first.kill().unwrap();
    first.wait().unwrap();
    // The lock goes with the process: a scheduler started after it runs.
    let (mut again, _) = start_replica(directory.path(), &database_url);
    again.kill().unwrap();
    again.wait().unwrap();
}
