//! What an attempt leaves behind for its researcher (issue 19), end to end: the real
//! scheduler in-process, the real worker in-process with a simulated GPU, and real
//! attempt processes training a tiny job. A finished attempt's results (final loss,
//! steps, throughput, times) are kept; the program's own output and its progress are
//! lines of the attempt in the job's logs; an attempt resumed from a checkpoint shows the
//! step it really loaded. Each test runs on SQLite and on a PostgreSQL server this test
//! binary starts.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::SchedulerConfig;
use carve_testing::PgServer;
use carve_worker::gpus::SimulatedGpu;
use carve_worker::{StartedAttemptProcess, WorkerConfig, run_worker};
use tokio::sync::{mpsc, oneshot};
use tonic::transport::Channel;

// The chaos test's helpers are not all used here.
#[allow(dead_code)]
mod support;
use support::{alice_with_tokens, authorized, poll_until, tiny_job_spec};

const ADMIN: &str = "carve_attempt_output_admin_secret";

/// How long any one wait may take before the test fails.
const WAIT: Duration = Duration::from_secs(60);

/// Declares each test once per database: `sqlite::NAME` and `postgres::NAME`.
macro_rules! on_both_databases {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let directory = tempfile::tempdir().unwrap();
                    let url = format!("sqlite://{}", directory.path().join("carve.db").display());
                    crate::$name(directory.path(), url).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let directory = tempfile::tempdir().unwrap();
                    let url = crate::postgres_database().await;
                    crate::$name(directory.path(), url).await;
                }
            )*
        }
    };
}

on_both_databases!(
    a_finished_attempt_keeps_its_results_and_its_output_is_in_the_logs,
    a_resumed_attempt_shows_the_step_it_loaded,
);

/// A new database on the PostgreSQL server this binary shares between its tests.
async fn postgres_database() -> String {
    static SERVER: OnceLock<Result<PgServer, carve_testing::TestingError>> = OnceLock::new();
    let server = match SERVER.get_or_init(PgServer::start) {
        Ok(server) => server,
        Err(reason) => panic!("{reason}"),
    };
    server
        .create_database("attempt_output")
        .await
        .unwrap_or_else(|error| panic!("{error}"))
}

/// The scheduler on `database_url` and a worker whose attempts run `program`, with the
/// user's token and the worker's started attempt processes.
struct Cluster {
    channel: Channel,
    user: String,
    checkpoints: PathBuf,
    started_processes: mpsc::UnboundedReceiver<StartedAttemptProcess>,
    _stop_scheduler: oneshot::Sender<()>,
    _stop_worker: oneshot::Sender<()>,
}

impl Cluster {
    async fn start(directory: &Path, database_url: String, program: PathBuf) -> Cluster {
        let checkpoints = directory.join("checkpoints");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        let (stop_scheduler, stopped) = oneshot::channel::<()>();
        let settings = SchedulerSettings {
            lease_duration: Duration::from_secs(30),
            heartbeat_interval: Duration::from_millis(200),
            scheduling_interval: Duration::from_millis(50),
            checkpoint_directory: checkpoints.display().to_string(),
            infrastructure_retry_backoff: Duration::from_millis(100),
        };
        let config = SchedulerConfig {
            database_url,
            settings,
            admin_token: Some(ADMIN.into()),
            metrics_address: None,
            tls: None,
        };
        tokio::spawn(carve_scheduler::server::run(config, listener, async {
            let _ = stopped.await;
        }));
        let channel = poll_channel(&address).await;
        let (user, worker_token) = alice_with_tokens(&channel, ADMIN).await;
        let gpus = vec![SimulatedGpu {
            total_bytes: 1 << 30,
        }];
        let mut config = WorkerConfig::new(address, worker_token, gpus, program);
        config.hostname = "output-node".into();
        config.discover_real_gpus = false;
        config.context_bytes = 64 << 20;
        config.checkpoint_directory = checkpoints.clone();
        let (observer, started_processes) = mpsc::unbounded_channel();
        config.process_observer = Some(observer);
        let (stop_worker, worker_stopped) = oneshot::channel::<()>();
        tokio::spawn(run_worker(config, async {
            let _ = worker_stopped.await;
        }));
        Cluster {
            channel,
            user,
            checkpoints,
            started_processes,
            _stop_scheduler: stop_scheduler,
            _stop_worker: stop_worker,
        }
    }

    fn jobs(&self) -> JobServiceClient<Channel> {
        JobServiceClient::new(self.channel.clone())
    }

    async fn submit(&self, spec: String) -> v1::Job {
        let request = v1::SubmitJobRequest {
            spec_json: spec,
            idempotency_key: String::new(),
        };
        let response = self
            .jobs()
            .submit_job(authorized(request, &self.user))
            .await;
        response.unwrap().into_inner().job.unwrap()
    }

    async fn get(&self, job_id: &str) -> v1::Job {
        let request = v1::GetJobRequest {
            job_id: job_id.into(),
        };
        let response = self.jobs().get_job(authorized(request, &self.user)).await;
        response.unwrap().into_inner().job.unwrap()
    }

    async fn wait_for_state(&self, job_id: &str, state: v1::JobState) -> v1::Job {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let job = self.get(job_id).await;
            if job.state == state as i32 {
                return job;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "job {job_id} never became {state:?}: {job:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The log lines of attempt `attempt_number` of the job, as `carve logs --attempt`.
    async fn attempt_lines(&self, job_id: &str, attempt_number: u32) -> Vec<v1::JobLogLine> {
        let request = v1::GetJobLogsRequest {
            job_id: job_id.into(),
            attempt_number,
            ..Default::default()
        };
        let response = self
            .jobs()
            .get_job_logs(authorized(request, &self.user))
            .await;
        response.unwrap().into_inner().lines
    }

    async fn next_process(&mut self) -> StartedAttemptProcess {
        tokio::time::timeout(WAIT, self.started_processes.recv())
            .await
            .expect("an attempt process starts")
            .expect("the worker runs")
    }
}

/// A channel to `address` once the scheduler there accepts connections.
async fn poll_channel(address: &str) -> Channel {
    for _ in 0..250 {
        if let Ok(channel) = Channel::from_shared(address.to_string())
            .unwrap()
            .connect()
            .await
        {
            return channel;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the scheduler did not come up at {address}")
}

fn worker_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_carve-worker"))
}

/// The worker binary behind a script that first writes a warning on stderr, as a
/// training library would.
fn program_warning_first(directory: &Path) -> PathBuf {
    let path = directory.join("warns-then-trains.sh");
    let script = format!(
        "#!/bin/bash\necho 'UserWarning: the data set is small' >&2\nexec \"{}\" \"$@\"\n",
        worker_binary().display()
    );
    std::fs::write(&path, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

async fn a_finished_attempt_keeps_its_results_and_its_output_is_in_the_logs(
    directory: &Path,
    database_url: String,
) {
    let program = program_warning_first(directory);
    let cluster = Cluster::start(directory, database_url, program).await;
    let job = cluster.submit(tiny_job_spec("results", 20, 50, "")).await;
    let finished = cluster
        .wait_for_state(&job.id, v1::JobState::Succeeded)
        .await;
    let attempt = &finished.attempts[0];
    let loss = attempt.final_loss.expect("a final loss");
    assert!(loss.is_finite() && loss > 0.0, "{loss}");
    assert_eq!(attempt.steps_done, Some(20));
    assert!(
        attempt.samples_per_second.is_some_and(|rate| rate > 0.0),
        "{attempt:#?}"
    );
    let (started, ended) = (attempt.started_at.unwrap(), attempt.finished_at.unwrap());
    assert!(
        (ended.seconds, ended.nanos) >= (started.seconds, started.nanos),
        "{attempt:#?}"
    );
    assert_eq!(attempt.progress, None);

    let lines = cluster.attempt_lines(&job.id, 1).await;
    let messages: Vec<&str> = lines.iter().map(|line| line.message.as_str()).collect();
    let warning = lines
        .iter()
        .find(|line| line.message == "UserWarning: the data set is small")
        .unwrap_or_else(|| panic!("the program's stderr is in the logs: {messages:#?}"));
    assert_eq!(warning.level, "warn");
    // The first step and the last are always reported, whatever the interval.
    for step in ["step 1/20:", "step 20/20:"] {
        assert!(
            messages.iter().any(|message| message.starts_with(step)),
            "{step} {messages:#?}"
        );
    }
    assert!(
        messages
            .last()
            .is_some_and(|message| message.starts_with("ended: 20 steps, final loss ")),
        "{messages:#?}"
    );
}

async fn a_resumed_attempt_shows_the_step_it_loaded(directory: &Path, database_url: String) {
    let mut cluster = Cluster::start(directory, database_url, worker_binary()).await;
    let job = cluster.submit(tiny_job_spec("resumed", 400, 25, "")).await;
    let first = cluster.next_process().await;
    let checkpoint = cluster
        .checkpoints
        .join(format!("{}.attempt-1.ckpt", job.id));
    poll_until(
        WAIT,
        Duration::from_millis(10),
        "a checkpoint is written",
        || checkpoint.is_file().then_some(()),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Killed from outside: interrupted, and the next attempt resumes from the file.
    let killed = std::process::Command::new("kill")
        .arg("-KILL")
        .arg(first.process_id.to_string())
        .status()
        .unwrap();
    assert!(killed.success());
    let finished = cluster
        .wait_for_state(&job.id, v1::JobState::Succeeded)
        .await;
    assert_eq!(finished.attempts.len(), 2, "{finished:#?}");
    let resumed = &finished.attempts[1];
    let from = resumed.resumed_from.as_ref().expect("it resumed");
    assert!(
        from.step > 0 && from.step.is_multiple_of(25),
        "resumed from step {}: {finished:#?}",
        from.step
    );
    assert_eq!(from.location, checkpoint.display().to_string());
    assert_eq!(resumed.steps_done, Some(400));
    // The interrupted attempt is kept with how far its reports got (its last checkpoint
    // on disk may be newer than its last report).
    let interrupted = &finished.attempts[0];
    assert!(
        interrupted.steps_done.is_some_and(|steps| steps >= 1),
        "{interrupted:#?}"
    );
    let messages: Vec<String> = cluster
        .attempt_lines(&job.id, 2)
        .await
        .into_iter()
        .map(|line| line.message)
        .collect();
    let said = format!("resumed from step {} (checkpoint ", from.step);
    assert!(
        messages
            .first()
            .is_some_and(|first| first.starts_with(&said)),
        "{said} {messages:#?}"
    );
}
