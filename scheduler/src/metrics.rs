//! Prometheus metrics: counters kept as atomics by the scheduler, gauges read from its
//! live state at scrape time, served as the text exposition format over plain HTTP.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::scheduler::Scheduler;

/// Upper bounds of the submit latency buckets, in seconds.
const LATENCY_BUCKETS: [f64; 11] = [
    0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// Counters the scheduler bumps as things happen.
#[derive(Debug, Default)]
pub struct Metrics {
    pub submits_accepted: AtomicU64,
    pub submits_rejected: AtomicU64,
    pub placements: AtomicU64,
    pub out_of_memory_reports: AtomicU64,
    pub retries: AtomicU64,
    pub attempts_lost: AtomicU64,
    pub jobs_succeeded: AtomicU64,
    pub jobs_failed: AtomicU64,
    pub jobs_cancelled: AtomicU64,
    latency_buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    latency_count: AtomicU64,
    latency_sum_micros: AtomicU64,
}

/// Gauges of one moment, by tenant.
#[derive(Debug, Default)]
pub struct ClusterGauges {
    pub queued_jobs: BTreeMap<String, u64>,
    pub running_jobs: BTreeMap<String, u64>,
    pub vram_allocated_bytes: BTreeMap<String, u64>,
    pub vram_estimated_bytes: BTreeMap<String, u64>,
    pub vram_measured_bytes: BTreeMap<String, u64>,
    pub workers_ready: u64,
    pub workers_lost: u64,
    /// The submit batcher's transactions so far (a counter, read at scrape time).
    pub submit_groups_committed: u64,
    /// The submits those transactions answered (a counter, read at scrape time).
    pub submit_jobs_committed: u64,
    /// Scheduling passes that read the whole queue instead of only its new jobs (a
    /// counter, read at scrape time).
    pub queue_full_reads: u64,
    /// Job log lines written to the store so far (a counter, read at scrape time).
    pub log_lines_stored: u64,
    /// Job log lines given up on so far: the writer was behind or the database refused
    /// them (a counter, read at scrape time).
    pub log_lines_dropped: u64,
}

impl Metrics {
    pub fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn observe_submit_latency(&self, latency: Duration) {
        let seconds = latency.as_secs_f64();
        for (bucket, bound) in self.latency_buckets.iter().zip(LATENCY_BUCKETS) {
            if seconds <= bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.latency_count.fetch_add(1, Ordering::Relaxed);
        self.latency_sum_micros
            .fetch_add(latency.as_micros() as u64, Ordering::Relaxed);
    }

    /// The text exposition format.
    pub fn render(&self, gauges: &ClusterGauges) -> String {
        let mut text = String::new();
        let counters = [
            (
                "carve_submits_accepted_total",
                "jobs admitted",
                &self.submits_accepted,
            ),
            (
                "carve_submits_rejected_total",
                "submits refused (bad spec, quota, does not fit)",
                &self.submits_rejected,
            ),
            (
                "carve_placements_total",
                "attempts placed into a slice",
                &self.placements,
            ),
            (
                "carve_out_of_memory_total",
                "attempts that ran out of memory",
                &self.out_of_memory_reports,
            ),
            (
                "carve_retries_total",
                "jobs requeued with a smaller configuration",
                &self.retries,
            ),
            (
                "carve_attempts_lost_total",
                "attempts lost with their worker",
                &self.attempts_lost,
            ),
            (
                "carve_jobs_succeeded_total",
                "jobs that succeeded",
                &self.jobs_succeeded,
            ),
            (
                "carve_jobs_failed_total",
                "jobs that failed",
                &self.jobs_failed,
            ),
            (
                "carve_jobs_cancelled_total",
                "jobs cancelled",
                &self.jobs_cancelled,
            ),
        ];
        for (name, help, counter) in counters {
            let _ = writeln!(
                text,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                counter.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            text,
            "# HELP carve_submit_groups_committed_total submit transactions committed (each covers a group of submits)\n# TYPE carve_submit_groups_committed_total counter\ncarve_submit_groups_committed_total {}",
            gauges.submit_groups_committed
        );
        let _ = writeln!(
            text,
            "# HELP carve_submit_jobs_committed_total submits answered from committed groups\n# TYPE carve_submit_jobs_committed_total counter\ncarve_submit_jobs_committed_total {}",
            gauges.submit_jobs_committed
        );
        let _ = writeln!(
            text,
            "# HELP carve_queue_full_reads_total scheduling passes that read the whole queue (the first, and after the queue changed behind this scheduler)\n# TYPE carve_queue_full_reads_total counter\ncarve_queue_full_reads_total {}",
            gauges.queue_full_reads
        );
        let _ = writeln!(
            text,
            "# HELP carve_log_lines_stored_total job log lines written to the store\n# TYPE carve_log_lines_stored_total counter\ncarve_log_lines_stored_total {}",
            gauges.log_lines_stored
        );
        let _ = writeln!(
            text,
            "# HELP carve_log_lines_dropped_total job log lines dropped (writer behind, or refused by the database)\n# TYPE carve_log_lines_dropped_total counter\ncarve_log_lines_dropped_total {}",
            gauges.log_lines_dropped
        );
        let _ = writeln!(
            text,
            "# HELP carve_submit_latency_seconds time from receiving a submit to its durable acknowledgement\n# TYPE carve_submit_latency_seconds histogram"
        );
        for (bucket, bound) in self.latency_buckets.iter().zip(LATENCY_BUCKETS) {
            let _ = writeln!(
                text,
                "carve_submit_latency_seconds_bucket{{le=\"{bound}\"}} {}",
                bucket.load(Ordering::Relaxed)
            );
        }
        let count = self.latency_count.load(Ordering::Relaxed);
        let _ = writeln!(
            text,
            "carve_submit_latency_seconds_bucket{{le=\"+Inf\"}} {count}"
        );
        let _ = writeln!(
            text,
            "carve_submit_latency_seconds_sum {}",
            self.latency_sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(text, "carve_submit_latency_seconds_count {count}");
        let per_tenant = [
            (
                "carve_queued_jobs",
                "jobs waiting, by tenant",
                &gauges.queued_jobs,
            ),
            (
                "carve_running_jobs",
                "attempts holding a slice, by tenant",
                &gauges.running_jobs,
            ),
            (
                "carve_vram_allocated_bytes",
                "bytes of slices handed out, by tenant",
                &gauges.vram_allocated_bytes,
            ),
            (
                "carve_vram_estimated_bytes",
                "estimated peaks of the running attempts, by tenant",
                &gauges.vram_estimated_bytes,
            ),
            (
                "carve_vram_measured_bytes",
                "measured peaks reported by the running attempts, by tenant",
                &gauges.vram_measured_bytes,
            ),
        ];
        for (name, help, values) in per_tenant {
            let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (tenant, value) in values {
                let _ = writeln!(
                    text,
                    "{name}{{tenant=\"{}\"}} {value}",
                    tenant.replace('"', "'")
                );
            }
        }
        let _ = writeln!(
            text,
            "# HELP carve_workers workers by state\n# TYPE carve_workers gauge\ncarve_workers{{state=\"ready\"}} {}\ncarve_workers{{state=\"lost\"}} {}",
            gauges.workers_ready, gauges.workers_lost
        );
        text
    }
}

/// Serves `GET /metrics` until the task is dropped. Plain HTTP/1.1, one request per
/// connection: all a Prometheus scraper needs.
pub async fn serve_metrics(listener: TcpListener, scheduler: Arc<Scheduler>) {
    loop {
        let Ok((mut connection, _)) = listener.accept().await else {
            continue;
        };
        let scheduler = scheduler.clone();
        tokio::spawn(async move {
            let mut request = Vec::new();
            let mut buffer = [0u8; 1024];
            // Read the request head (bounded), then answer.
            while !request.windows(4).any(|window| window == b"\r\n\r\n") && request.len() < 8192 {
                match tokio::time::timeout(Duration::from_secs(5), connection.read(&mut buffer))
                    .await
                {
                    Ok(Ok(read)) if read > 0 => request.extend_from_slice(&buffer[..read]),
                    _ => return,
                }
            }
            let head = String::from_utf8_lossy(&request);
            let (status, body) = if head.starts_with("GET /metrics") {
                ("200 OK", scheduler.render_metrics().await)
            } else {
                (
                    "404 Not Found",
                    "only /metrics is served here\n".to_string(),
                )
            };
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = connection.write_all(response.as_bytes()).await;
        });
    }
}
