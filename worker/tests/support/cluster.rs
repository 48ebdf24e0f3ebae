//! A real scheduler (in-process) and a real worker (in-process, simulated GPUs) for the
//! worker's end-to-end tests that read jobs, attempts and logs through the job API.
//! Included with `#[path]` by the tests that use it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::scheduler::{PreemptionSettings, SchedulerSettings};
use carve_scheduler::server::SchedulerConfig;
use carve_worker::gpus::SimulatedGpu;
use carve_worker::{StartedAttemptProcess, WorkerConfig, run_worker};
use tokio::sync::{mpsc, oneshot};
use tonic::transport::Channel;

use crate::support::{alice_with_tokens, authorized};

/// How long any one wait may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(60);

/// The scheduler on `database_url` and a worker whose attempts run `program` (one
/// simulated 1 GiB GPU unless `configure` says otherwise), with the user's token and the
/// worker's started attempt processes.
pub struct Cluster {
    pub channel: Channel,
    /// `http://127.0.0.1:PORT` of the scheduler.
    pub address: String,
    pub user: String,
    pub worker_token: String,
    pub checkpoints: PathBuf,
    pub started_processes: mpsc::UnboundedReceiver<StartedAttemptProcess>,
    _stop_scheduler: oneshot::Sender<()>,
    _stop_worker: oneshot::Sender<()>,
}

impl Cluster {
    pub async fn start(
        directory: &Path,
        database_url: String,
        program: PathBuf,
        admin: &str,
        configure: impl FnOnce(&mut WorkerConfig),
    ) -> Cluster {
        let checkpoints = directory.join("checkpoints");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        let (stop_scheduler, stopped) = oneshot::channel::<()>();
        let settings = SchedulerSettings {
            lease_duration: Duration::from_secs(30),
            heartbeat_interval: Duration::from_millis(200),
            scheduling_interval: Duration::from_millis(50),
            infrastructure_retry_backoff: Duration::from_millis(100),
            // Tests preempt young attempts (jobs of equal priority are never preempted).
            preemption: PreemptionSettings {
                min_run_time: Duration::ZERO,
                ..PreemptionSettings::default()
            },
            ..SchedulerSettings::default()
        };
        let config = SchedulerConfig {
            database_url,
            settings,
            admin_token: Some(admin.into()),
            metrics_address: None,
            tls: None,
        };
        tokio::spawn(carve_scheduler::server::run(config, listener, async {
            let _ = stopped.await;
        }));
        let channel = poll_channel(&address).await;
        let (user, worker_token) = alice_with_tokens(&channel, admin).await;
        let gpus = vec![SimulatedGpu {
            total_bytes: 1 << 30,
        }];
        let mut config = WorkerConfig::new(address.clone(), worker_token.clone(), gpus, program);
        config.hostname = "test-node".into();
        config.discover_real_gpus = false;
        config.context_bytes = 64 << 20;
        config.checkpoint_directory = checkpoints.clone();
        let (observer, started_processes) = mpsc::unbounded_channel();
        config.process_observer = Some(observer);
        configure(&mut config);
        let (stop_worker, worker_stopped) = oneshot::channel::<()>();
        tokio::spawn(run_worker(config, async {
            let _ = worker_stopped.await;
        }));
        Cluster {
            channel,
            address,
            user,
            worker_token,
            checkpoints,
            started_processes,
            _stop_scheduler: stop_scheduler,
            _stop_worker: stop_worker,
        }
    }

    pub fn jobs(&self) -> JobServiceClient<Channel> {
        JobServiceClient::new(self.channel.clone())
    }

    pub async fn submit(&self, spec: String) -> v1::Job {
        self.submit_as(&self.user, spec).await
    }

    /// Submits as the user of `token` (another tenant's).
    pub async fn submit_as(&self, token: &str, spec: String) -> v1::Job {
        let request = v1::SubmitJobRequest {
            spec_json: spec,
            idempotency_key: String::new(),
        };
        let response = self.jobs().submit_job(authorized(request, token)).await;
        response.unwrap().into_inner().job.unwrap()
    }

    pub async fn get(&self, job_id: &str) -> v1::Job {
        self.get_as(&self.user, job_id).await
    }

    pub async fn get_as(&self, token: &str, job_id: &str) -> v1::Job {
        let request = v1::GetJobRequest {
            job_id: job_id.into(),
        };
        let response = self.jobs().get_job(authorized(request, token)).await;
        response.unwrap().into_inner().job.unwrap()
    }

    pub async fn wait_for_state(&self, job_id: &str, state: v1::JobState) -> v1::Job {
        self.wait_for_state_as(&self.user, job_id, state).await
    }

    pub async fn wait_for_state_as(
        &self,
        token: &str,
        job_id: &str,
        state: v1::JobState,
    ) -> v1::Job {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let job = self.get_as(token, job_id).await;
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
    pub async fn attempt_lines(&self, job_id: &str, attempt_number: u32) -> Vec<v1::JobLogLine> {
        self.attempt_lines_as(&self.user, job_id, attempt_number)
            .await
    }

    pub async fn attempt_lines_as(
        &self,
        token: &str,
        job_id: &str,
        attempt_number: u32,
    ) -> Vec<v1::JobLogLine> {
        let request = v1::GetJobLogsRequest {
            job_id: job_id.into(),
            attempt_number,
            ..Default::default()
        };
        let response = self.jobs().get_job_logs(authorized(request, token)).await;
        response.unwrap().into_inner().lines
    }

    pub async fn next_process(&mut self) -> StartedAttemptProcess {
        tokio::time::timeout(WAIT, self.started_processes.recv())
            .await
            .expect("an attempt process starts")
            .expect("the worker runs")
    }
}

/// A channel to `address` once the scheduler there accepts connections.
pub async fn poll_channel(address: &str) -> Channel {
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
