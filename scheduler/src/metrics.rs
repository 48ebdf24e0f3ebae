//! Prometheus metrics: counters the scheduler bumps as things happen, gauges it reads
//! from its live state at scrape time, written in the text exposition format by
//! prometheus-client and served at `GET /metrics` by axum.
//!
//! This module knows nothing of the scheduler: whatever serves the page implements
//! `MetricsSource` (the scheduler does, in `scheduler/views.rs`).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use carve_core::usage::report::UsageFigures;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// Upper bounds of the submit latency buckets, in seconds.
const LATENCY_BUCKETS: [f64; 11] = [
    0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// Counters the scheduler bumps as things happen.
#[derive(Debug)]
pub struct Metrics {
    pub submits_accepted: Counter,
    /// Refused submits, by [`SubmitRejection`]: every reason is on the page from the
    /// start, so a rate over it is 0 rather than absent.
    submits_rejected: Family<RejectionLabel, Counter>,
    pub placements: Counter,
    pub out_of_memory_reports: Counter,
    pub retries: Counter,
    /// Jobs failed out of memory with no retry left: their retry limit reached, or
    /// nothing smaller fits.
    pub oom_retries_exhausted: Counter,
    pub attempts_lost: Counter,
    /// Jobs found placed or running with every attempt ended, moved on at recovery.
    pub stranded_jobs_recovered: Counter,
    /// Times this replica stopped leading at its self-fence, its lease not renewed in
    /// time (the database unreachable, the process frozen).
    pub leader_self_fences: Counter,
    /// Stored specs read (parsed and checked) again after admission: a job first seen
    /// after a restart, or one past the cache of read specs.
    pub stored_spec_reads: Counter,
    /// Attempts asked to stop to make room for an urgent job.
    pub preemptions: Counter,
    pub jobs_succeeded: Counter,
    pub jobs_failed: Counter,
    pub jobs_cancelled: Counter,
    submit_latency: Histogram,
    /// Each tenant's usage over all time by GPU type, as last read from the store.
    tenant_usage: Mutex<TenantUsageBook>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            submits_accepted: Counter::default(),
            submits_rejected: {
                let family = Family::<RejectionLabel, Counter>::default();
                for reason in SubmitRejection::ALL {
                    family
                        .get_or_create(&RejectionLabel {
                            reason: reason.label(),
                        })
                        .inc_by(0);
                }
                family
            },
            placements: Counter::default(),
            out_of_memory_reports: Counter::default(),
            retries: Counter::default(),
            oom_retries_exhausted: Counter::default(),
            attempts_lost: Counter::default(),
            stranded_jobs_recovered: Counter::default(),
            leader_self_fences: Counter::default(),
            stored_spec_reads: Counter::default(),
            preemptions: Counter::default(),
            jobs_succeeded: Counter::default(),
            jobs_failed: Counter::default(),
            jobs_cancelled: Counter::default(),
            submit_latency: Histogram::new(LATENCY_BUCKETS),
            tenant_usage: Mutex::default(),
        }
    }
}

/// How often the tenants' usage counters are read from the store: a read covers every
/// attempt ever recorded, so scrapes in between show the last one.
pub const TENANT_USAGE_READ_INTERVAL: Duration = Duration::from_secs(30);

/// One tenant's usage on one GPU type over all time, as the usage counters show it:
/// the figures of `carve usage` (core's `UsageFigures`) in seconds.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct TenantUsageTotals {
    pub gpu_seconds: f64,
    pub vram_requested_byte_seconds: f64,
    /// Over the attempts whose peak was measured.
    pub vram_used_byte_seconds: f64,
    /// The VRAM requested by those same measured attempts.
    pub vram_requested_measured_byte_seconds: f64,
    pub oom_retries: u64,
    pub preemptions: u64,
}

impl TenantUsageTotals {
    pub fn of(figures: &UsageFigures) -> TenantUsageTotals {
        TenantUsageTotals {
            gpu_seconds: figures.gpu_milliseconds as f64 / 1000.0,
            vram_requested_byte_seconds: figures.vram_requested_byte_milliseconds as f64 / 1000.0,
            vram_used_byte_seconds: figures.vram_used_byte_milliseconds as f64 / 1000.0,
            vram_requested_measured_byte_seconds: figures.vram_requested_measured_byte_milliseconds
                as f64
                / 1000.0,
            oom_retries: figures.oom_retries,
            preemptions: figures.preemptions,
        }
    }

    /// Each number the larger of the two: a counter never goes down. A running attempt
    /// counts to the read's moment, and its stored end may be a little earlier than a
    /// read that already counted it running.
    fn at_least(self, before: TenantUsageTotals) -> TenantUsageTotals {
        TenantUsageTotals {
            gpu_seconds: self.gpu_seconds.max(before.gpu_seconds),
            vram_requested_byte_seconds: self
                .vram_requested_byte_seconds
                .max(before.vram_requested_byte_seconds),
            vram_used_byte_seconds: self
                .vram_used_byte_seconds
                .max(before.vram_used_byte_seconds),
            vram_requested_measured_byte_seconds: self
                .vram_requested_measured_byte_seconds
                .max(before.vram_requested_measured_byte_seconds),
            oom_retries: self.oom_retries.max(before.oom_retries),
            preemptions: self.preemptions.max(before.preemptions),
        }
    }
}

/// The usage counters' values by (tenant, GPU type), and when they were read.
#[derive(Debug, Default)]
struct TenantUsageBook {
    read_at: Option<Instant>,
    totals: BTreeMap<(String, String), TenantUsageTotals>,
}

/// Why a submit was refused: the `reason` label of `carve_submits_rejected_total`. A closed
/// set, so the label's values stay few whatever callers send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitRejection {
    /// The spec or another request field is malformed (INVALID_ARGUMENT).
    InvalidSpec,
    /// No token, or an unknown, expired or revoked one.
    Unauthenticated,
    /// The token's role may not submit.
    PermissionDenied,
    /// Over the tenant's VRAM or running-jobs quota however long it waits.
    Quota,
    /// Larger than every GPU, even after shrinking where the job allows it.
    TooLarge,
    /// The tenant spent its budget of validation and estimation compute for now.
    ComputeBudget,
    /// An idempotency key reused with another spec.
    IdempotencyConflict,
    /// The store or another dependency is down; a retry may succeed.
    Unavailable,
    /// Anything else (an unknown tenant, a bug).
    Other,
}

impl SubmitRejection {
    pub const ALL: [SubmitRejection; 9] = [
        SubmitRejection::InvalidSpec,
        SubmitRejection::Unauthenticated,
        SubmitRejection::PermissionDenied,
        SubmitRejection::Quota,
        SubmitRejection::TooLarge,
        SubmitRejection::ComputeBudget,
        SubmitRejection::IdempotencyConflict,
        SubmitRejection::Unavailable,
        SubmitRejection::Other,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            SubmitRejection::InvalidSpec => "invalid_spec",
            SubmitRejection::Unauthenticated => "unauthenticated",
            SubmitRejection::PermissionDenied => "permission_denied",
            SubmitRejection::Quota => "quota",
            SubmitRejection::TooLarge => "too_large",
            SubmitRejection::ComputeBudget => "compute_budget",
            SubmitRejection::IdempotencyConflict => "idempotency_conflict",
            SubmitRejection::Unavailable => "unavailable",
            SubmitRejection::Other => "other",
        }
    }
}

/// The GPUs of one model on the workers that are not lost.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GpuCapacity {
    pub gpus: u64,
    /// Every byte of those GPUs.
    pub total_bytes: u64,
    /// What slices may use on the GPUs of ready workers: total minus the CUDA context.
    /// A draining worker's GPUs take no new slices, so they count here as 0.
    pub allocatable_bytes: u64,
}

/// Gauges of one moment, by tenant: each map holds every tenant, at 0 when it has
/// nothing, so a dashboard never loses a tenant's series.
#[derive(Debug, Default)]
pub struct ClusterGauges {
    pub queued_jobs: BTreeMap<String, u64>,
    pub running_jobs: BTreeMap<String, u64>,
    pub vram_allocated_bytes: BTreeMap<String, u64>,
    pub vram_estimated_bytes: BTreeMap<String, u64>,
    pub vram_measured_bytes: BTreeMap<String, u64>,
    pub workers_ready: u64,
    /// Finishing their attempts, taking no new ones: not counted as ready.
    pub workers_draining: u64,
    pub workers_lost: u64,
    /// GPU capacity by model name. By model rather than by worker or GPU: the series stay
    /// as few as the kinds of hardware, where one per node would grow with the cluster
    /// and leave a stale series behind every replaced node.
    pub gpu_capacity: BTreeMap<String, GpuCapacity>,
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

impl ClusterGauges {
    /// Gives `tenant` a 0 in every per-tenant gauge it has no value in: a missing series
    /// reads as "No data" on a dashboard and drops the tenant from its drop-down.
    pub fn include_tenant(&mut self, tenant: &str) {
        for values in [
            &mut self.queued_jobs,
            &mut self.running_jobs,
            &mut self.vram_allocated_bytes,
            &mut self.vram_estimated_bytes,
            &mut self.vram_measured_bytes,
        ] {
            values.entry(tenant.to_string()).or_insert(0);
        }
    }
}

/// What the metrics page is read from: the counters, and the gauges of now.
pub trait MetricsSource: Send + Sync + 'static {
    fn metrics(&self) -> &Metrics;
    fn cluster_gauges(&self) -> impl Future<Output = ClusterGauges> + Send;
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerStateLabel {
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RejectionLabel {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuModelLabel {
    model: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantGpuTypeLabel {
    tenant: String,
    gpu_type: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildInfoLabel {
    version: &'static str,
    git_commit: &'static str,
}

/// The commit the binary was built from, when the build said (`CARVE_GIT_COMMIT` set
/// in cargo's environment, as the Dockerfiles do): no build script needed.
const GIT_COMMIT: &str = match option_env!("CARVE_GIT_COMMIT") {
    Some(commit) => commit,
    None => "unknown",
};

type U64Gauge = Gauge<u64, AtomicU64>;

impl Metrics {
    pub fn count(counter: &Counter) {
        counter.inc();
    }

    pub fn count_rejected_submit(&self, reason: SubmitRejection) {
        self.submits_rejected
            .get_or_create(&RejectionLabel {
                reason: reason.label(),
            })
            .inc();
    }

    pub fn observe_submit_latency(&self, latency: Duration) {
        self.submit_latency.observe(latency.as_secs_f64());
    }

    /// Whether the tenants' usage should be read again at `now` (never read, or read
    /// [`TENANT_USAGE_READ_INTERVAL`] ago).
    pub fn tenant_usage_read_due(&self, now: Instant) -> bool {
        let book = self.tenant_usage.lock().unwrap_or_else(|p| p.into_inner());
        book.read_at.is_none_or(|read_at| {
            now.saturating_duration_since(read_at) >= TENANT_USAGE_READ_INTERVAL
        })
    }

    /// Takes the tenants' usage as read at `read_at`; each series keeps the larger of
    /// its old and new value (a counter), and a series not read keeps its old value.
    pub fn record_tenant_usage(
        &self,
        totals: impl IntoIterator<Item = ((String, String), TenantUsageTotals)>,
        read_at: Instant,
    ) {
        let mut book = self.tenant_usage.lock().unwrap_or_else(|p| p.into_inner());
        for (key, read) in totals {
            let kept = book.totals.entry(key).or_default();
            *kept = read.at_least(*kept);
        }
        book.read_at = Some(read_at);
    }

    /// The text exposition format.
    pub fn render(&self, gauges: &ClusterGauges) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_text::encode(&mut text, &self.registry(gauges));
        text
    }

    /// A registry of one scrape: the long-lived counters (clones share their values)
    /// next to the gauges read now, so two scrapes at once never mix their readings.
    fn registry(&self, gauges: &ClusterGauges) -> Registry {
        let mut registry = Registry::default();
        // Counter names lose their `_total` here: the encoder adds it back.
        let counters = [
            (
                "carve_submits_accepted",
                "jobs admitted",
                &self.submits_accepted,
            ),
            (
                "carve_placements",
                "attempts placed into a slice",
                &self.placements,
            ),
            (
                "carve_out_of_memory",
                "attempts that ran out of memory",
                &self.out_of_memory_reports,
            ),
            (
                "carve_retries",
                "jobs requeued with a smaller configuration",
                &self.retries,
            ),
            (
                "carve_oom_retries_exhausted",
                "jobs failed out of memory with no retry left (the retry limit reached, or \
                 nothing smaller fits)",
                &self.oom_retries_exhausted,
            ),
            (
                "carve_attempts_lost",
                "attempts lost with their worker",
                &self.attempts_lost,
            ),
            (
                "carve_stranded_jobs_recovered",
                "jobs found placed or running with every attempt ended, moved on at recovery",
                &self.stranded_jobs_recovered,
            ),
            (
                "carve_leader_self_fences",
                "times this replica stopped leading at its self-fence, its lease not renewed \
                 in time",
                &self.leader_self_fences,
            ),
            (
                "carve_stored_spec_reads",
                "stored specs read again after admission (a job first seen after a restart, \
                 or past the cache of read specs)",
                &self.stored_spec_reads,
            ),
            (
                "carve_preemptions",
                "attempts asked to stop to make room for an urgent job",
                &self.preemptions,
            ),
            (
                "carve_jobs_succeeded",
                "jobs that succeeded",
                &self.jobs_succeeded,
            ),
            ("carve_jobs_failed", "jobs that failed", &self.jobs_failed),
            (
                "carve_jobs_cancelled",
                "jobs cancelled",
                &self.jobs_cancelled,
            ),
        ];
        for (name, help, counter) in counters {
            registry.register(name, help, counter.clone());
        }
        registry.register(
            "carve_submits_rejected",
            "submits refused, by reason",
            self.submits_rejected.clone(),
        );
        let read_at_scrape = [
            (
                "carve_submit_groups_committed",
                "submit transactions committed (each covers a group of submits)",
                gauges.submit_groups_committed,
            ),
            (
                "carve_submit_jobs_committed",
                "submits answered from committed groups",
                gauges.submit_jobs_committed,
            ),
            (
                "carve_queue_full_reads",
                "scheduling passes that read the whole queue (the first, and after the queue changed behind this scheduler)",
                gauges.queue_full_reads,
            ),
            (
                "carve_log_lines_stored",
                "job log lines written to the store",
                gauges.log_lines_stored,
            ),
            (
                "carve_log_lines_dropped",
                "job log lines dropped (writer behind, or refused by the database)",
                gauges.log_lines_dropped,
            ),
        ];
        for (name, help, value) in read_at_scrape {
            registry.register(name, help, ConstCounter::new(value));
        }
        registry.register(
            "carve_submit_latency_seconds",
            "time from receiving a submit to its durable acknowledgement",
            self.submit_latency.clone(),
        );
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
            let series = values.iter().map(|(tenant, value)| {
                let tenant = tenant.clone();
                (TenantLabel { tenant }, *value)
            });
            registry.register(name, help, gauge_family(series));
        }
        let workers = [
            ("ready", gauges.workers_ready),
            ("draining", gauges.workers_draining),
            ("lost", gauges.workers_lost),
        ]
        .map(|(state, value)| (WorkerStateLabel { state }, value));
        registry.register("carve_workers", "workers by state", gauge_family(workers));
        register_gpu_capacity(&mut registry, &gauges.gpu_capacity);
        self.register_tenant_usage(&mut registry);
        let build_info = gauge_family([(
            BuildInfoLabel {
                version: env!("CARGO_PKG_VERSION"),
                git_commit: GIT_COMMIT,
            },
            1,
        )]);
        registry.register(
            "carve_build_info",
            "the scheduler's version and commit, at 1",
            build_info,
        );
        registry
    }
}

/// One number of a [`TenantUsageTotals`].
type UsageReading = fn(&TenantUsageTotals) -> f64;

impl Metrics {
    /// The tenants' usage counters, by tenant and GPU type: `carve usage`'s figures over
    /// all time.
    fn register_tenant_usage(&self, registry: &mut Registry) {
        let book = self.tenant_usage.lock().unwrap_or_else(|p| p.into_inner());
        let readings: [(&str, &str, UsageReading); 6] = [
            (
                "carve_tenant_gpu_seconds",
                "seconds of GPU held by the tenant's attempts (one attempt, one GPU), running ones to now, by tenant and GPU type",
                |totals| totals.gpu_seconds,
            ),
            (
                "carve_tenant_vram_requested_byte_seconds",
                "slice bytes times seconds held by the tenant's attempts, by tenant and GPU type",
                |totals| totals.vram_requested_byte_seconds,
            ),
            (
                "carve_tenant_vram_used_byte_seconds",
                "measured peak bytes times seconds held, over the attempts whose peak was measured, by tenant and GPU type",
                |totals| totals.vram_used_byte_seconds,
            ),
            (
                "carve_tenant_vram_requested_measured_byte_seconds",
                "slice bytes times seconds held, over the attempts whose peak was measured (the requested side of carve_tenant_vram_used_byte_seconds), by tenant and GPU type",
                |totals| totals.vram_requested_measured_byte_seconds,
            ),
            (
                "carve_tenant_oom_retries",
                "attempts that retried a job after it ran out of memory, by tenant and GPU type",
                |totals| totals.oom_retries as f64,
            ),
            (
                "carve_tenant_preemptions",
                "attempts stopped for an urgent job, by tenant and GPU type",
                |totals| totals.preemptions as f64,
            ),
        ];
        for (name, help, reading) in readings {
            let family = Family::<TenantGpuTypeLabel, Counter<f64, AtomicU64>>::default();
            for ((tenant, gpu_type), totals) in &book.totals {
                let label = TenantGpuTypeLabel {
                    tenant: tenant.clone(),
                    gpu_type: gpu_type.clone(),
                };
                family.get_or_create(&label).inc_by(reading(totals));
            }
            registry.register(name, help, family);
        }
    }
}

/// One number of a [`GpuCapacity`].
type CapacityReading = fn(&GpuCapacity) -> u64;

/// The GPU capacity gauges, by model.
fn register_gpu_capacity(registry: &mut Registry, capacity: &BTreeMap<String, GpuCapacity>) {
    let readings: [(&str, &str, CapacityReading); 3] = [
        (
            "carve_gpus",
            "GPUs on the workers that are not lost, by model",
            |capacity| capacity.gpus,
        ),
        (
            "carve_gpu_memory_total_bytes",
            "memory of the GPUs on the workers that are not lost, by model",
            |capacity| capacity.total_bytes,
        ),
        (
            "carve_gpu_memory_allocatable_bytes",
            "memory slices may use on the GPUs of ready workers (total minus the CUDA context), by model",
            |capacity| capacity.allocatable_bytes,
        ),
    ];
    for (name, help, reading) in readings {
        let series = capacity.iter().map(|(model, values)| {
            let model = model.clone();
            (GpuModelLabel { model }, reading(values))
        });
        registry.register(name, help, gauge_family(series));
    }
}

/// A gauge family holding each of `series` at its value.
fn gauge_family<Label>(series: impl IntoIterator<Item = (Label, u64)>) -> Family<Label, U64Gauge>
where
    Label: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync,
{
    let family = Family::<Label, U64Gauge>::default();
    for (label, value) in series {
        family.get_or_create(&label).set(value);
    }
    family
}

/// Serves `GET /metrics` until the task is dropped.
pub async fn serve_metrics<Source: MetricsSource>(listener: TcpListener, source: Arc<Source>) {
    let router = Router::new()
        .route("/metrics", get(scrape::<Source>))
        .fallback(|| async { (StatusCode::NOT_FOUND, "only /metrics is served here\n") })
        .with_state(source);
    if let Err(error) = axum::serve(listener, router).await {
        tracing::error!(%error, "the metrics server stopped");
    }
}

async fn scrape<Source: MetricsSource>(State(source): State<Arc<Source>>) -> Response {
    let gauges = source.cluster_gauges().await;
    let text = source.metrics().render(&gauges);
    (
        [
            (header::CONTENT_TYPE, prometheus_text::CONTENT_TYPE),
            // One request per connection, as before axum served this page: scrapers
            // that read the answer to the end of the connection keep working.
            (header::CONNECTION, "close"),
        ],
        text,
    )
        .into_response()
}

#[cfg(test)]
mod tests;
