//! The results of a submit benchmark run, as JSON (`--json`) or as plain-text tables, and
//! the targets they are judged against (reported, never asserted).

use std::fmt::Write as _;

use serde::Serialize;

use crate::DatabaseKind;
use crate::baseline::StoreLimit;
use crate::latency::LatencySummary;
use crate::queue_memory::QueueMemoryReport;

/// Sustained submits a second the scheduler should reach on SQLite on a 2-core machine.
pub const SQLITE_SUSTAINED_TARGET: f64 = 5_000.0;
/// The same on PostgreSQL.
pub const POSTGRES_SUSTAINED_TARGET: f64 = 3_000.0;
/// The p99 latency target at the paced rate of [`P99_TARGET_RATE`] jobs a second.
pub const P99_TARGET_MS: f64 = 15.0;
pub const P99_TARGET_RATE: u32 = 1_000;

/// Where the numbers came from.
#[derive(Debug, Clone, Serialize)]
pub struct MachineInfo {
    pub cpus: usize,
    pub cpu_model: String,
    pub memory_bytes: u64,
    /// `/proc/loadavg`'s 1-minute figure when the run started and ended: other work on
    /// the machine shows here.
    pub load_average_at_start: f64,
    pub load_average_at_end: f64,
}

impl MachineInfo {
    pub fn read() -> MachineInfo {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|line| {
                let (key, value) = line.split_once(':')?;
                (key.trim() == "model name").then(|| value.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_bytes =
            crate::procfs::status_kibibytes(&meminfo, "MemTotal").unwrap_or(0) * 1024;
        MachineInfo {
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_model,
            memory_bytes,
            load_average_at_start: load_average(),
            load_average_at_end: 0.0,
        }
    }
}

/// The 1-minute load average.
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// One load phase against a fresh scheduler on a fresh database.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseReport {
    /// `paced` or `saturation`.
    pub mode: String,
    pub target_rate_per_second: Option<u32>,
    pub concurrency: Option<usize>,
    pub sent: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub first_error: Option<String>,
    pub seconds: f64,
    pub succeeded_per_second: f64,
    pub latency: LatencySummary,
    /// The scheduler's CPU (user + system, every thread: gRPC, admission, the batcher,
    /// scheduling passes) per 1,000 acknowledged submits.
    pub server_cpu_ms_per_1000_submits: f64,
    /// From `/metrics`: transactions the submit batcher committed in this phase, and the
    /// submits they answered.
    pub groups_committed: u64,
    pub jobs_committed: u64,
    pub mean_group_size: f64,
}

impl PhaseReport {
    pub fn label(&self) -> String {
        match (self.target_rate_per_second, self.concurrency) {
            (Some(rate), _) => format!("paced {rate}/s"),
            (None, Some(concurrency)) => format!("saturation x{concurrency}"),
            _ => self.mode.clone(),
        }
    }
}

/// A target and whether the run met it.
#[derive(Debug, Clone, Serialize)]
pub struct TargetCheck {
    pub name: String,
    pub target: String,
    pub measured: String,
    pub met: bool,
}

/// Everything measured on one database.
#[derive(Debug, Clone, Serialize)]
pub struct BackendReport {
    pub backend: DatabaseKind,
    /// As the database reports them (`Store::durability_settings`).
    pub durability: Vec<(String, String)>,
    pub phases: Vec<PhaseReport>,
    pub store_limit_one_row_per_commit: Option<StoreLimit>,
    pub store_limit_batched: Option<StoreLimit>,
    /// Saturation submits a second divided by the store's rows a second.
    pub saturation_to_one_row_per_commit: Option<f64>,
    pub saturation_to_batched: Option<f64>,
    pub targets: Vec<TargetCheck>,
}

impl BackendReport {
    /// Fills in the ratios and the target checks from the phases and the baselines.
    pub fn judge(&mut self) {
        let saturation = self
            .phases
            .iter()
            .find(|phase| phase.mode == "saturation")
            .map(|phase| phase.succeeded_per_second);
        let ratio = |limit: &Option<StoreLimit>| {
            Some(saturation? / limit.as_ref()?.rows_per_second.max(1e-9))
        };
        self.saturation_to_one_row_per_commit = ratio(&self.store_limit_one_row_per_commit);
        self.saturation_to_batched = ratio(&self.store_limit_batched);
        self.targets.clear();
        if let Some(sustained) = saturation {
            let target = match self.backend {
                DatabaseKind::Sqlite => SQLITE_SUSTAINED_TARGET,
                DatabaseKind::Postgres => POSTGRES_SUSTAINED_TARGET,
            };
            self.targets.push(TargetCheck {
                name: format!("{} sustained submits", self.backend.name()),
                target: format!(">= {target:.0} jobs/s"),
                measured: format!("{sustained:.0} jobs/s"),
                met: sustained >= target,
            });
        }
        if let Some(paced) = self
            .phases
            .iter()
            .find(|phase| phase.target_rate_per_second == Some(P99_TARGET_RATE))
        {
            self.targets.push(TargetCheck {
                name: format!("{} p99 at {P99_TARGET_RATE} jobs/s", self.backend.name()),
                target: format!("<= {P99_TARGET_MS} ms"),
                measured: format!("{:.2} ms", paced.latency.p99_ms),
                met: paced.latency.p99_ms <= P99_TARGET_MS && paced.failed == 0,
            });
        }
    }
}

/// A whole `carve-submit-bench` run.
#[derive(Debug, Clone, Serialize)]
pub struct SubmitReport {
    pub machine: MachineInfo,
    pub phase_seconds: f64,
    pub connections: usize,
    pub backends: Vec<BackendReport>,
}

/// A `queue-memory` run.
#[derive(Debug, Clone, Serialize)]
pub struct QueueMemoryRun {
    pub machine: MachineInfo,
    pub result: QueueMemoryReport,
}

fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// The machine a run measured, with its load before and after.
fn machine_line(machine: &MachineInfo) -> String {
    format!(
        "machine: {} cpus, {}, {} RAM; load average {:.2} at start, {:.2} at end",
        machine.cpus,
        machine.cpu_model,
        mib(machine.memory_bytes),
        machine.load_average_at_start,
        machine.load_average_at_end
    )
}

/// The report as plain-text tables.
pub fn render_submit_report(report: &SubmitReport) -> String {
    let mut text = String::new();
    let _ = writeln!(text, "{}", machine_line(&report.machine));
    let _ = writeln!(
        text,
        "each phase: {:.1} s on a fresh scheduler and database, {} gRPC connections\n",
        report.phase_seconds, report.connections
    );
    for backend in &report.backends {
        let durability: Vec<String> = backend
            .durability
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        let _ = writeln!(
            text,
            "== {} ({})",
            backend.backend.name(),
            durability.join(", ")
        );
        let _ = writeln!(
            text,
            "{:<16} {:>7} {:>6} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>7} {:>9}",
            "load",
            "sent",
            "failed",
            "jobs/s",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "p99.9 ms",
            "max ms",
            "cpu ms/1k",
            "groups",
            "jobs/grp"
        );
        for phase in &backend.phases {
            let latency = &phase.latency;
            let _ = writeln!(
                text,
                "{:<16} {:>7} {:>6} {:>9.0} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>10.0} {:>7} {:>9.1}",
                phase.label(),
                phase.sent,
                phase.failed,
                phase.succeeded_per_second,
                latency.p50_ms,
                latency.p90_ms,
                latency.p99_ms,
                latency.p999_ms,
                latency.max_ms,
                phase.server_cpu_ms_per_1000_submits,
                phase.groups_committed,
                phase.mean_group_size
            );
            if let Some(error) = &phase.first_error {
                let _ = writeln!(text, "    first error: {error}");
            }
        }
        let limit = |limit: &Option<StoreLimit>| {
            limit.as_ref().map_or("not measured".to_string(), |limit| {
                format!("{:.0} rows/s", limit.rows_per_second)
            })
        };
        let ratio =
            |ratio: Option<f64>| ratio.map_or("-".to_string(), |ratio| format!("{ratio:.2}"));
        let batch = backend
            .store_limit_batched
            .as_ref()
            .map_or(0, |limit| limit.rows_per_transaction);
        let _ = writeln!(
            text,
            "store limit (plain sqlx inserts, same durability): 1 row/commit {}, {batch} rows/commit {}",
            limit(&backend.store_limit_one_row_per_commit),
            limit(&backend.store_limit_batched)
        );
        let _ = writeln!(
            text,
            "carve saturation / store limit: {} of 1 row/commit, {} of {batch} rows/commit",
            ratio(backend.saturation_to_one_row_per_commit),
            ratio(backend.saturation_to_batched)
        );
        for target in &backend.targets {
            let _ = writeln!(
                text,
                "target {}: {} measured {} -> {}",
                target.name,
                target.target,
                target.measured,
                if target.met { "met" } else { "NOT met" }
            );
        }
        let _ = writeln!(text);
    }
    text
}

/// A queue-memory run as plain text.
pub fn render_queue_memory(run: &QueueMemoryRun) -> String {
    let result = &run.result;
    let mut text = String::new();
    let _ = writeln!(text, "{}", machine_line(&run.machine));
    let _ = writeln!(
        text,
        "{} queued jobs on {} (filled in {:.1} s)",
        result.queued_jobs,
        result.backend.name(),
        result.fill_seconds
    );
    let _ = writeln!(text, "startup to serving: {:.2} s", result.startup_seconds);
    let _ = writeln!(
        text,
        "first pass done after: {} ({:.1} s of scheduler CPU)",
        result
            .first_pass_seconds
            .map_or("did not finish".to_string(), |seconds| format!(
                "{seconds:.1} s"
            )),
        result.first_pass_cpu_seconds
    );
    let _ = writeln!(
        text,
        "memory after the first pass: rss {}, peak {}",
        mib(result.memory_after_first_pass.rss_bytes),
        mib(result.memory_after_first_pass.peak_rss_bytes)
    );
    let _ = writeln!(
        text,
        "idle afterwards: {:.1} % of a core over {:.0} s",
        result.idle_cpu_fraction * 100.0,
        result.idle_observed_seconds
    );
    let _ = writeln!(
        text,
        "GET /metrics: {:.3} s, carve_queued_jobs = {}",
        result.metrics_scrape_seconds,
        result
            .metrics_queued_jobs
            .map_or("missing".to_string(), |count| format!("{count:.0}"))
    );
    let _ = writeln!(
        text,
        "queued jobs without a waiting reason at the end: {}",
        result.jobs_without_waiting_reason
    );
    let _ = writeln!(
        text,
        "target peak rss <= {}: measured {} -> {}",
        mib(result.peak_rss_target_bytes),
        mib(result.peak_rss_bytes),
        if result.peak_rss_target_met {
            "met"
        } else {
            "NOT met"
        }
    );
    text
}
