//! Chaos: the real scheduler (its own process, SQLite), two real `carve-worker` processes
//! and their attempt processes, with kill -9 of any of them at seeded random points
//! while jobs run. At the end: every acknowledged job is in a terminal state, no job had
//! two attempts at once (neither in the scheduler's records nor as live processes), and
//! no attempt process is left.
//!
//! It is its own program (`harness = false`): run with the role variable set, it is the
//! scheduler process the test starts and kills. `CARVE_CHAOS_SEED` replays a run.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use carve_engine::rng::Rng;
use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::SchedulerConfig;
use carve_worker::leftover_processes::process_start_time;
use tonic::transport::{Channel, Endpoint};

mod support;
use support::{
    authorized, poll_until, process_command_lines, tiny_job_spec, worker_process_command,
};

const ADMIN: &str = "carve_chaos_test_admin_secret";
/// Set in the environment of the scheduler process: its data directory.
const SCHEDULER_ROLE: &str = "CARVE_CHAOS_SCHEDULER_DIRECTORY";
/// The port for a restarted scheduler (the first start picks one and writes it to
/// `port` in its directory).
const SCHEDULER_PORT: &str = "CARVE_CHAOS_SCHEDULER_PORT";
const WORKERS: [&str; 2] = ["chaos-node-a", "chaos-node-b"];
/// How long the killing goes on, and how long the jobs then have to settle.
const CHAOS: Duration = Duration::from_secs(20);
const SETTLE: Duration = Duration::from_secs(60);

fn main() {
    if let Ok(directory) = std::env::var(SCHEDULER_ROLE) {
        run_scheduler_process(Path::new(&directory));
        return;
    }
    let seed = std::env::var("CARVE_CHAOS_SEED")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(13);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(chaos(seed));
    println!("test chaos (seed {seed}) ... ok");
}

/// The scheduler process: serves until it is killed.
fn run_scheduler_process(directory: &Path) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let port: u16 = std::env::var(SCHEDULER_PORT)
            .ok()
            .and_then(|text| text.parse().ok())
            .unwrap_or(0);
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        let port_file = directory.join("port");
        std::fs::write(
            port_file.with_extension("tmp"),
            listener.local_addr().unwrap().port().to_string(),
        )
        .unwrap();
        std::fs::rename(port_file.with_extension("tmp"), &port_file).unwrap();
        let config = SchedulerConfig {
            database_url: format!("sqlite://{}", directory.join("carve.db").display()),
            settings: SchedulerSettings {
                lease_duration: Duration::from_secs(2),
                heartbeat_interval: Duration::from_millis(200),
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

/// The test's only randomness, from its seed: SplitMix64 (carve-engine's [`Rng`]) reduced
/// by plain modulo, so that a seed replays the run it always did.
struct Random(Rng);

impl Random {
    fn below(&mut self, bound: u64) -> u64 {
        self.0.next_u64() % bound
    }
}

/// The processes this test started; all are SIGKILLed when it ends, passed or not.
struct Processes {
    directory: PathBuf,
    scheduler: Option<Child>,
    port: Option<u16>,
    workers: BTreeMap<&'static str, Child>,
    worker_tokens: BTreeMap<&'static str, String>,
}

impl Drop for Processes {
    fn drop(&mut self) {
        let children = self.scheduler.iter_mut().chain(self.workers.values_mut());
        for child in children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Processes {
    fn checkpoints(&self) -> PathBuf {
        self.directory.join("checkpoints")
    }

    fn address(&self) -> String {
        format!(
            "http://127.0.0.1:{}",
            self.port.expect("the scheduler started")
        )
    }

    async fn start_scheduler(&mut self) {
        let port_file = self.directory.join("port");
        let _ = std::fs::remove_file(&port_file);
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .env(SCHEDULER_ROLE, &self.directory)
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if let Some(port) = self.port {
            command.env(SCHEDULER_PORT, port.to_string());
        }
        self.scheduler = Some(command.spawn().unwrap());
        let port = poll_until(
            Duration::from_secs(30),
            Duration::from_millis(20),
            "the scheduler process starts",
            || {
                std::fs::read_to_string(&port_file)
                    .ok()
                    .and_then(|text| text.parse().ok())
            },
        )
        .await;
        self.port = Some(port);
    }

    fn kill_scheduler(&mut self) {
        if let Some(mut scheduler) = self.scheduler.take() {
            scheduler.kill().unwrap();
            scheduler.wait().unwrap();
        }
    }

    fn start_worker(&mut self, hostname: &'static str) {
        let child = worker_process_command(
            &self.address(),
            &self.worker_tokens[hostname],
            &self.checkpoints(),
            hostname,
        )
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
        self.workers.insert(hostname, child);
    }

    fn kill_worker(&mut self, hostname: &'static str) {
        if let Some(mut worker) = self.workers.remove(hostname) {
            worker.kill().unwrap();
            worker.wait().unwrap();
        }
    }
}

/// A live attempt process: its job and attempt number, from its `--checkpoint` file
/// name (`{job}.attempt-{N}.ckpt`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct LiveAttempt {
    process_id: u32,
    job_id: String,
    attempt_number: u32,
}

/// The attempt processes running now whose checkpoint is in `checkpoints`.
fn live_attempts(checkpoints: &Path) -> Vec<LiveAttempt> {
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
            if checkpoint.parent()? != checkpoints {
                return None;
            }
            let name = checkpoint.file_name()?.to_str()?.strip_suffix(".ckpt")?;
            let (job_id, attempt_number) = name.rsplit_once(".attempt-")?;
            // A zombie has ended; only its status is left to collect.
            process_start_time(process_id)?;
            Some(LiveAttempt {
                process_id,
                job_id: job_id.to_string(),
                attempt_number: attempt_number.parse().ok()?,
            })
        })
        .collect()
}

/// Samples the live attempt processes until stopped; keeps every sample in which one
/// job had two attempts running at once, and the largest number running together.
#[derive(Debug, Default)]
struct ProcessWatch {
    overlaps: Vec<Vec<LiveAttempt>>,
    most_at_once: usize,
    seen: BTreeSet<(String, u32)>,
}

fn watch_processes(
    checkpoints: PathBuf,
    stop: Arc<AtomicBool>,
    watch: Arc<Mutex<ProcessWatch>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Acquire) {
            let live = live_attempts(&checkpoints);
            let mut by_job: BTreeMap<&str, BTreeSet<u32>> = BTreeMap::new();
            for attempt in &live {
                by_job
                    .entry(&attempt.job_id)
                    .or_default()
                    .insert(attempt.attempt_number);
            }
            let mut watch = watch.lock().unwrap();
            watch.most_at_once = watch.most_at_once.max(live.len());
            for attempt in &live {
                watch
                    .seen
                    .insert((attempt.job_id.clone(), attempt.attempt_number));
            }
            if by_job.values().any(|attempts| attempts.len() > 1) {
                watch.overlaps.push(live.clone());
            }
            drop(watch);
            std::thread::sleep(Duration::from_millis(20));
        }
    })
}

fn job_spec(name: &str, steps: u64) -> String {
    tiny_job_spec(name, steps, 100, "")
}

/// One call with a deadline: a killed scheduler must not hang the test.
async fn bounded<T>(call: impl Future<Output = Result<T, tonic::Status>>) -> Option<T> {
    match tokio::time::timeout(Duration::from_secs(3), call).await {
        Ok(Ok(value)) => Some(value),
        _ => None,
    }
}

/// Creates the tenant and the tokens (one worker token per node) on the first start.
async fn set_up_tenant(channel: &Channel, processes: &mut Processes) -> String {
    let roles: Vec<v1::Role> = std::iter::once(v1::Role::User)
        .chain(WORKERS.iter().map(|_| v1::Role::Worker))
        .collect();
    let mut secrets = carve_testing::cluster::tenant_with_tokens(
        channel,
        ADMIN,
        "chaos",
        v1::Quota::default(),
        &roles,
    )
    .await
    .into_iter();
    let user = secrets.next().expect("a user token");
    for (hostname, secret) in WORKERS.into_iter().zip(secrets) {
        processes.worker_tokens.insert(hostname, secret);
    }
    user
}

async fn submit(channel: &Channel, user: &str, name: &str, steps: u64) -> Option<String> {
    let response = bounded(
        JobServiceClient::new(channel.clone()).submit_job(authorized(
            v1::SubmitJobRequest {
                spec_json: job_spec(name, steps),
                idempotency_key: String::new(),
            },
            user,
        )),
    )
    .await?;
    Some(response.into_inner().job?.id)
}

async fn get_job(channel: &Channel, user: &str, job_id: &str) -> Option<v1::Job> {
    let response = bounded(JobServiceClient::new(channel.clone()).get_job(authorized(
        v1::GetJobRequest {
            job_id: job_id.into(),
        },
        user,
    )))
    .await?;
    response.into_inner().job
}

fn is_terminal(state: i32) -> bool {
    [
        v1::JobState::Succeeded,
        v1::JobState::Failed,
        v1::JobState::Cancelled,
    ]
    .iter()
    .any(|terminal| *terminal as i32 == state)
}

fn milliseconds(timestamp: &Option<prost_types::Timestamp>) -> Option<i64> {
    let timestamp = timestamp.as_ref()?;
    Some(timestamp.seconds * 1000 + i64::from(timestamp.nanos / 1_000_000))
}

async fn chaos(seed: u64) {
    let started = Instant::now();
    let directory = tempfile::tempdir().unwrap();
    let mut processes = Processes {
        directory: directory.path().to_path_buf(),
        scheduler: None,
        port: None,
        workers: BTreeMap::new(),
        worker_tokens: BTreeMap::new(),
    };
    std::fs::create_dir_all(processes.checkpoints()).unwrap();
    processes.start_scheduler().await;
    let channel = Endpoint::from_shared(processes.address())
        .unwrap()
        .connect_timeout(Duration::from_secs(1))
        .connect_lazy();
    let user = set_up_tenant(&channel, &mut processes).await;
    for hostname in WORKERS {
        processes.start_worker(hostname);
    }
    let stop_watch = Arc::new(AtomicBool::new(false));
    let watch = Arc::new(Mutex::new(ProcessWatch::default()));
    let watcher = watch_processes(processes.checkpoints(), stop_watch.clone(), watch.clone());

    let mut random = Random(Rng::new(seed));
    let mut acknowledged: Vec<String> = Vec::new();
    let mut submitted = 0u32;
    let mut actions: Vec<String> = Vec::new();
    for _ in 0..3 {
        submitted += 1;
        let steps = 3000 + random.below(3000);
        if let Some(job_id) = submit(&channel, &user, &format!("chaos-{submitted}"), steps).await {
            acknowledged.push(job_id);
        }
    }
    let chaos_ends = Instant::now() + CHAOS;
    while Instant::now() < chaos_ends {
        tokio::time::sleep(Duration::from_millis(800 + random.below(1200))).await;
        match random.below(4) {
            0 => {
                processes.kill_scheduler();
                actions.push("kill -9 the scheduler".into());
                tokio::time::sleep(Duration::from_millis(random.below(1500))).await;
                processes.start_scheduler().await;
            }
            1 => {
                let hostname = WORKERS[random.below(WORKERS.len() as u64) as usize];
                processes.kill_worker(hostname);
                actions.push(format!("kill -9 {hostname}"));
                tokio::time::sleep(Duration::from_millis(random.below(1500))).await;
                processes.start_worker(hostname);
            }
            2 => {
                let mut live = live_attempts(&processes.checkpoints());
                live.sort();
                if live.is_empty() {
                    actions.push("no attempt process to kill".into());
                } else {
                    let victim = &live[random.below(live.len() as u64) as usize];
                    let _ = Command::new("kill")
                        .arg("-KILL")
                        .arg(victim.process_id.to_string())
                        .status();
                    actions.push(format!(
                        "kill -9 attempt {} of {}",
                        victim.attempt_number, victim.job_id
                    ));
                }
            }
            _ => {
                submitted += 1;
                let steps = 2000 + random.below(2000);
                match submit(&channel, &user, &format!("chaos-{submitted}"), steps).await {
                    Some(job_id) => {
                        actions.push(format!("submit {job_id}"));
                        acknowledged.push(job_id);
                    }
                    None => actions.push("a submit that was not acknowledged".into()),
                }
            }
        }
    }
    // Everything runs again; the jobs settle.
    if processes.scheduler.is_none() {
        processes.start_scheduler().await;
    }
    for hostname in WORKERS {
        if !processes.workers.contains_key(hostname) {
            processes.start_worker(hostname);
        }
    }
    let settle_ends = Instant::now() + SETTLE;
    let jobs = loop {
        let mut jobs = Vec::new();
        for job_id in &acknowledged {
            if let Some(job) = get_job(&channel, &user, job_id).await {
                jobs.push(job);
            }
        }
        let settled =
            jobs.len() == acknowledged.len() && jobs.iter().all(|job| is_terminal(job.state));
        if settled {
            break jobs;
        }
        let unsettled: Vec<(String, String, usize)> = jobs
            .iter()
            .filter(|job| !is_terminal(job.state))
            .map(|job| {
                let state = v1::JobState::try_from(job.state)
                    .map(|state| state.as_str_name().to_string())
                    .unwrap_or_default();
                (job.id.clone(), state, job.attempts.len())
            })
            .collect();
        assert!(
            Instant::now() < settle_ends,
            "seed {seed}: jobs never settled ({} of {} readable): {unsettled:?}\nactions: {actions:#?}",
            jobs.len(),
            acknowledged.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // No attempt process is left once every job has ended.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = live_attempts(&processes.checkpoints());
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: attempt processes left after every job ended: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_watch.store(true, Ordering::Release);
    watcher.join().unwrap();
    let watch = watch.lock().unwrap();

    // No job ran two attempts at once: in the scheduler's records...
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for job in &jobs {
        let state = v1::JobState::try_from(job.state).unwrap();
        *outcomes.entry(state.as_str_name().to_string()).or_default() += 1;
        let mut ranges: Vec<(i64, i64, u32)> = job
            .attempts
            .iter()
            .filter_map(|attempt| {
                Some((
                    milliseconds(&attempt.started_at)?,
                    milliseconds(&attempt.finished_at)?,
                    attempt.number,
                ))
            })
            .collect();
        ranges.sort();
        for pair in ranges.windows(2) {
            assert!(
                pair[0].1 <= pair[1].0,
                "seed {seed}: job {} ran attempts {} and {} at once: {job:#?}\nactions: {actions:#?}",
                job.id,
                pair[0].2,
                pair[1].2
            );
        }
    }
    // ... and as processes.
    assert!(
        watch.overlaps.is_empty(),
        "seed {seed}: two attempt processes of one job ran at once: {:?}\nactions: {actions:#?}",
        watch.overlaps
    );
    assert!(
        outcomes
            .get(v1::JobState::Succeeded.as_str_name())
            .copied()
            .unwrap_or(0)
            > 0,
        "seed {seed}: no job succeeded: {outcomes:?}\nactions: {actions:#?}"
    );
    println!(
        "chaos seed {seed}: {} actions ({} kills) in {:.1} s; {} jobs acknowledged of {submitted} \
         submitted, ended {outcomes:?}; {} attempt processes seen, at most {} at once",
        actions.len(),
        actions
            .iter()
            .filter(|action| action.starts_with("kill -9"))
            .count(),
        started.elapsed().as_secs_f64(),
        acknowledged.len(),
        watch.seen.len(),
        watch.most_at_once
    );
    for action in &actions {
        println!("  {action}");
    }
}
