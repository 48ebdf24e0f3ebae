//! Load over gRPC: a [`Submitter`] spreads `SubmitJob` calls over a few HTTP/2
//! connections; [`run_paced`] sends at a fixed rate whatever the answers (open loop),
//! [`run_saturation`] keeps N calls in flight (closed loop).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use carve_proto::client::BearerToken;
use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use hdrhistogram::Histogram;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use crate::BenchError;
use crate::latency::{new_latency_histogram, record_micros};
use crate::pacing::PacedSchedule;

/// Submits jobs to one scheduler, as its admin (the default tenant).
#[derive(Debug)]
pub struct Submitter {
    clients: Vec<JobServiceClient<Channel>>,
    admin_token: BearerToken,
    next_client: AtomicUsize,
    spec_json: String,
}

impl Submitter {
    /// Opens `connections` HTTP/2 connections to `address` and waits (up to `ready_within`)
    /// until the scheduler answers a call, so a phase's clock starts on a ready server.
    pub async fn connect(
        address: SocketAddr,
        admin_token: &str,
        spec_json: &str,
        connections: usize,
        ready_within: Duration,
    ) -> Result<Submitter, BenchError> {
        let admin_token = BearerToken::new(admin_token)
            .map_err(|_| BenchError::invalid_argument("admin token", "is not ascii"))?;
        let deadline = Instant::now() + ready_within;
        let endpoint = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|error| BenchError::Scheduler(format!("endpoint {address}: {error}")))?
            .tcp_nodelay(true);
        let mut clients = Vec::with_capacity(connections.max(1));
        for _ in 0..connections.max(1) {
            let channel = loop {
                match endpoint.connect().await {
                    Ok(channel) => break channel,
                    Err(error) if Instant::now() > deadline => {
                        return Err(BenchError::Scheduler(format!(
                            "connect to {address}: {error}"
                        )));
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            };
            clients.push(JobServiceClient::new(channel));
        }
        let submitter = Submitter {
            clients,
            admin_token,
            next_client: AtomicUsize::new(0),
            spec_json: spec_json.to_string(),
        };
        // The listener is bound before the store is opened and recovered; a call is
        // answered only once the services run.
        loop {
            let request = submitter.admin_token.request(v1::ListJobsRequest {
                page_size: 1,
                ..Default::default()
            });
            let remaining = deadline.saturating_duration_since(Instant::now());
            let mut client = submitter.clients[0].clone();
            match tokio::time::timeout(remaining, client.list_jobs(request)).await {
                Ok(Ok(_)) => return Ok(submitter),
                Ok(Err(status)) if status.code() != tonic::Code::Unavailable => {
                    return Err(BenchError::Scheduler(format!("list jobs: {status}")));
                }
                Ok(Err(_)) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                _ => {
                    return Err(BenchError::Scheduler(format!(
                        "{address} did not answer within {ready_within:?}"
                    )));
                }
            }
        }
    }

    /// Submits the benchmark's job once with `idempotency_key`; the error is the status.
    pub async fn submit(&self, idempotency_key: String) -> Result<v1::Job, String> {
        let index = self.next_client.fetch_add(1, Ordering::Relaxed) % self.clients.len();
        let mut client = self.clients[index].clone();
        let request = self.admin_token.request(v1::SubmitJobRequest {
            spec_json: self.spec_json.clone(),
            idempotency_key,
        });
        match client.submit_job(request).await {
            Ok(response) => response
                .into_inner()
                .job
                .ok_or_else(|| "the response has no job".to_string()),
            Err(status) => Err(format!("{:?}: {}", status.code(), status.message())),
        }
    }
}

/// What one load phase measured on the client side.
#[derive(Debug)]
pub struct LoadOutcome {
    pub sent: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub first_error: Option<String>,
    /// From the first send to the last answer.
    pub elapsed: Duration,
    /// Microseconds: from the due time (paced) or the send (saturation) to the answer,
    /// successes only.
    pub latencies: Histogram<u64>,
}

impl LoadOutcome {
    fn new() -> Result<LoadOutcome, BenchError> {
        Ok(LoadOutcome {
            sent: 0,
            succeeded: 0,
            failed: 0,
            first_error: None,
            elapsed: Duration::ZERO,
            latencies: new_latency_histogram()?,
        })
    }

    fn record(&mut self, latency: Duration, result: Result<(), String>) {
        match result {
            Ok(()) => {
                self.succeeded += 1;
                record_micros(&mut self.latencies, latency.as_micros() as u64);
            }
            Err(error) => {
                self.failed += 1;
                self.first_error.get_or_insert(error);
            }
        }
    }

    /// Answered submits per second.
    pub fn succeeded_per_second(&self) -> f64 {
        self.succeeded as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Sends on `schedule`, each submit in its own task, never waiting for earlier answers;
/// latency counts from when each send was due.
pub async fn run_paced(
    submitter: Arc<Submitter>,
    schedule: PacedSchedule,
    key_prefix: &str,
) -> Result<LoadOutcome, BenchError> {
    let (results, mut answers) = mpsc::unbounded_channel();
    let start = Instant::now();
    for index in 0..schedule.count() {
        let due = start + schedule.due_after_start(index);
        tokio::time::sleep_until(due).await;
        let submitter = Arc::clone(&submitter);
        let results = results.clone();
        let key = format!("{key_prefix}-{index}");
        tokio::spawn(async move {
            let result = submitter.submit(key).await.map(drop);
            let _ = results.send((due.elapsed(), result));
        });
    }
    drop(results);
    let mut outcome = LoadOutcome::new()?;
    outcome.sent = schedule.count();
    while let Some((latency, result)) = answers.recv().await {
        outcome.record(latency, result);
    }
    outcome.elapsed = start.elapsed();
    Ok(outcome)
}

/// `concurrency` clients, each submitting again as soon as its last submit is answered,
/// until `duration` has passed.
pub async fn run_saturation(
    submitter: Arc<Submitter>,
    concurrency: usize,
    duration: Duration,
    key_prefix: &str,
) -> Result<LoadOutcome, BenchError> {
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::with_capacity(concurrency);
    for client in 0..concurrency.max(1) {
        let submitter = Arc::clone(&submitter);
        let key_prefix = format!("{key_prefix}-{client}");
        tasks.push(tokio::spawn(async move {
            let mut outcome = LoadOutcome::new()?;
            let mut index = 0u64;
            while Instant::now() < deadline {
                let sent_at = Instant::now();
                let result = submitter.submit(format!("{key_prefix}-{index}")).await;
                outcome.sent += 1;
                outcome.record(sent_at.elapsed(), result.map(drop));
                index += 1;
            }
            Ok::<_, BenchError>(outcome)
        }));
    }
    let mut total = LoadOutcome::new()?;
    for task in tasks {
        let outcome = task
            .await
            .map_err(|error| BenchError::Io(format!("a load task failed: {error}")))??;
        total.sent += outcome.sent;
        total.succeeded += outcome.succeeded;
        total.failed += outcome.failed;
        if total.first_error.is_none() {
            total.first_error = outcome.first_error;
        }
        total
            .latencies
            .add(&outcome.latencies)
            .map_err(|error| BenchError::Io(format!("merge histograms: {error}")))?;
    }
    total.elapsed = start.elapsed();
    Ok(total)
}
