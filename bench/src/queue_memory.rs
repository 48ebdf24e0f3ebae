//! The scheduler with a very long queue: fill the store with queued jobs, start the
//! scheduler on it with no workers (so every job stays queued), let its scheduling passes
//! run, and read its memory (`VmHWM`, `VmRSS`) and CPU from `/proc`.
//!
//! # How the queue is filled, and why that is equivalent to submitting
//!
//! One job is submitted through gRPC to a real scheduler on the database, so admission
//! (validation, estimate, run config, slice size) produces the row. The benchmark then
//! writes copies of that row, each with a new job id, through [`Store::submit_jobs`] —
//! the very call the scheduler's submit batcher makes — in groups of
//! [`FILL_GROUP`] jobs, before the scheduler starts again. The rows are the ones a
//! million gRPC submits would leave (same spec, config, estimate, state, tenant; only
//! ids, sequences and times differ), and what is measured is what the scheduler does
//! with them after a start. Submitting them through gRPC at the measured saturation rate
//! would take several minutes and measure the submit path again, not the queue.

use std::time::{Duration, Instant};

use carve_scheduler::auth::generate_id;
use carve_scheduler::store::{JobFilter, JobRecord, Store};
use serde::Serialize;

use crate::baseline::DatabaseConnection;
use crate::load::Submitter;
use crate::procfs::{MemoryUse, clock_ticks_per_second, cpu_ticks, memory_use, ticks_to_duration};
use crate::prometheus::scrape;
use crate::scheduler_process::SchedulerProcess;
use crate::{BENCH_JOB_SPEC_JSON, BenchError, DatabaseKind};

/// Queued jobs the scheduler has not given a waiting reason yet.
const UNEXPLAINED_JOBS_SQL: &str =
    "SELECT count(*) FROM jobs WHERE state = 'queued' AND waiting_reason = ''";

/// Jobs per `submit_jobs` transaction while filling.
pub const FILL_GROUP: usize = 10_000;

/// The scheduler's memory target with a million queued jobs.
pub const PEAK_RSS_TARGET_BYTES: u64 = 2 << 30;

/// What the queue-memory run measured.
#[derive(Debug, Clone, Serialize)]
pub struct QueueMemoryReport {
    pub backend: DatabaseKind,
    pub queued_jobs: u64,
    pub fill_seconds: f64,
    /// From spawning the scheduler to its first answered gRPC call (store opened,
    /// state recovered).
    pub startup_seconds: f64,
    /// From spawning the scheduler until every queued job had its waiting reason (the
    /// first pass's last write), or `None` when that did not happen within the timeout.
    pub first_pass_seconds: Option<f64>,
    /// Scheduler CPU (user + system) from spawn to the end of the first pass.
    pub first_pass_cpu_seconds: f64,
    /// Memory when the first pass had ended (or at the timeout).
    pub memory_after_first_pass: MemoryUse,
    /// Scheduler CPU per second of wall time while nothing changed, after the first pass
    /// (passes every scheduling interval that find nothing new).
    pub idle_cpu_fraction: f64,
    pub idle_observed_seconds: f64,
    /// One `GET /metrics` (which counts the queued jobs by tenant).
    pub metrics_scrape_seconds: f64,
    pub metrics_queued_jobs: Option<f64>,
    /// Queued jobs still without a waiting reason at the end (0 when the pass explained
    /// every job).
    pub jobs_without_waiting_reason: i64,
    /// The peak over the whole run, read last.
    pub peak_rss_bytes: u64,
    pub peak_rss_target_bytes: u64,
    pub peak_rss_target_met: bool,
}

/// Settings of the queue-memory run.
#[derive(Debug, Clone)]
pub struct QueueMemorySettings {
    pub jobs: u64,
    /// The longest the first pass may take before the run reports it unfinished.
    pub pass_timeout: Duration,
    /// How long to watch the idle scheduler after its first pass.
    pub idle_observation: Duration,
}

/// Runs the whole measurement on an empty database at `url` (a SQLite path or a
/// `postgres://` URL). Progress goes to stderr.
pub async fn measure_queue_memory(
    scheduler_binary: &std::path::Path,
    kind: DatabaseKind,
    url: &str,
    settings: &QueueMemorySettings,
) -> Result<QueueMemoryReport, BenchError> {
    if settings.jobs == 0 {
        return Err(BenchError::invalid_argument("jobs", "must be at least 1"));
    }
    let sample = admitted_sample_job(scheduler_binary, url).await?;
    eprintln!(
        "queue-memory: filling {} with {} queued jobs like {} (spec {} bytes)",
        kind.name(),
        settings.jobs,
        sample.id,
        sample.spec_json.len()
    );
    let fill_started = Instant::now();
    fill_queue(url, &sample, settings.jobs - 1).await?;
    let fill_seconds = fill_started.elapsed().as_secs_f64();
    eprintln!("queue-memory: filled in {fill_seconds:.1} s; starting the scheduler");

    let ticks_per_second = clock_ticks_per_second();
    let mut scheduler = SchedulerProcess::start(scheduler_binary, url)?;
    let pid = scheduler.pid();
    let spawned = scheduler.started_at();
    Submitter::connect(
        scheduler.grpc_address(),
        scheduler.admin_token(),
        BENCH_JOB_SPEC_JSON,
        1,
        settings.pass_timeout,
    )
    .await
    .map_err(|error| scheduler.failure(&format!("is not serving ({error})")))?;
    let startup_seconds = spawned.elapsed().as_secs_f64();
    eprintln!("queue-memory: serving after {startup_seconds:.1} s; waiting for the first pass");

    // The first pass has ended when every queued job has a waiting reason (no workers:
    // none can be placed). Counting them is a scan, so it is done only when the
    // scheduler's CPU has gone quiet (less than 10 % of a core over two seconds), and at
    // most every five seconds.
    let quiet_window = Duration::from_secs(2);
    let mut window: std::collections::VecDeque<(Instant, u64)> = Default::default();
    let mut first_pass_seconds = None;
    let mut last_count: Option<Instant> = None;
    let mut observer = DatabaseConnection::open(kind, url).await?;
    let pass_deadline = Instant::now() + settings.pass_timeout;
    loop {
        scheduler.check_running()?;
        let now = Instant::now();
        let ticks = cpu_ticks(pid)?;
        window.push_back((now, ticks));
        while window
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > quiet_window)
        {
            window.pop_front();
        }
        let quiet = window.front().is_some_and(|(oldest_at, oldest_ticks)| {
            let span = now.duration_since(*oldest_at);
            span >= quiet_window - Duration::from_millis(300)
                && ticks_to_duration(ticks - oldest_ticks, ticks_per_second).as_secs_f64()
                    < 0.1 * span.as_secs_f64()
        });
        if quiet && last_count.is_none_or(|at| at.elapsed() > Duration::from_secs(5)) {
            last_count = Some(Instant::now());
            let unexplained = observer.select_integer(UNEXPLAINED_JOBS_SQL).await?;
            if unexplained == 0 {
                first_pass_seconds = Some(now.duration_since(spawned).as_secs_f64());
                break;
            }
        }
        if now > pass_deadline {
            eprintln!(
                "queue-memory: the first pass did not finish within {:?}",
                settings.pass_timeout
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    observer.close().await;
    let first_pass_cpu_seconds = ticks_to_duration(cpu_ticks(pid)?, ticks_per_second).as_secs_f64();
    let memory_after_first_pass = memory_use(pid)?;
    eprintln!(
        "queue-memory: first pass {} s, {first_pass_cpu_seconds:.1} s of CPU, rss {} MiB, peak {} MiB",
        first_pass_seconds.map_or("unfinished".to_string(), |seconds| format!("{seconds:.1}")),
        memory_after_first_pass.rss_bytes >> 20,
        memory_after_first_pass.peak_rss_bytes >> 20
    );

    let idle_started = Instant::now();
    let idle_ticks = cpu_ticks(pid)?;
    tokio::time::sleep(settings.idle_observation).await;
    scheduler.check_running()?;
    let idle_observed_seconds = idle_started.elapsed().as_secs_f64();
    let idle_cpu_fraction = ticks_to_duration(cpu_ticks(pid)? - idle_ticks, ticks_per_second)
        .as_secs_f64()
        / idle_observed_seconds;

    let scrape_started = Instant::now();
    let metrics = scrape(scheduler.metrics_address()).await?;
    let metrics_scrape_seconds = scrape_started.elapsed().as_secs_f64();
    let metrics_queued_jobs = metrics.lines().find_map(|line| {
        line.strip_prefix("carve_queued_jobs{tenant=\"default\"} ")
            .and_then(|value| value.trim().parse::<f64>().ok())
    });
    let peak_rss_bytes = memory_use(pid)?.peak_rss_bytes;
    scheduler.stop().await?;

    let mut connection = DatabaseConnection::open(kind, url).await?;
    let jobs_without_waiting_reason = connection.select_integer(UNEXPLAINED_JOBS_SQL).await?;
    connection.close().await;
    Ok(QueueMemoryReport {
        backend: kind,
        queued_jobs: settings.jobs,
        fill_seconds,
        startup_seconds,
        first_pass_seconds,
        first_pass_cpu_seconds,
        memory_after_first_pass,
        idle_cpu_fraction,
        idle_observed_seconds,
        metrics_scrape_seconds,
        metrics_queued_jobs,
        jobs_without_waiting_reason,
        peak_rss_bytes,
        peak_rss_target_bytes: PEAK_RSS_TARGET_BYTES,
        peak_rss_target_met: peak_rss_bytes <= PEAK_RSS_TARGET_BYTES
            && first_pass_seconds.is_some(),
    })
}

/// Submits the benchmark job once through a real scheduler on `url` and returns the row
/// admission stored for it.
async fn admitted_sample_job(
    scheduler_binary: &std::path::Path,
    url: &str,
) -> Result<JobRecord, BenchError> {
    let scheduler = SchedulerProcess::start(scheduler_binary, url)?;
    let submitter = Submitter::connect(
        scheduler.grpc_address(),
        scheduler.admin_token(),
        BENCH_JOB_SPEC_JSON,
        1,
        Duration::from_secs(60),
    )
    .await
    .map_err(|error| scheduler.failure(&format!("is not serving ({error})")))?;
    let job = submitter
        .submit(String::new())
        .await
        .map_err(|error| scheduler.failure(&format!("refused the sample job: {error}")))?;
    drop(submitter);
    scheduler.stop().await?;
    let store = Store::open(url).await?;
    let sample = store.get_job(&job.id).await?;
    store.close().await;
    Ok(sample)
}

/// Writes `count` copies of `sample` (new ids, no idempotency keys, no waiting reason)
/// in groups of [`FILL_GROUP`], each through the submit path's [`Store::submit_jobs`].
pub async fn fill_queue(url: &str, sample: &JobRecord, count: u64) -> Result<(), BenchError> {
    let store = Store::open(url).await?;
    let mut written = 0u64;
    let mut last_report = Instant::now();
    while written < count {
        let group = (count - written).min(FILL_GROUP as u64) as usize;
        let jobs: Vec<JobRecord> = (0..group)
            .map(|_| JobRecord {
                id: generate_id("job"),
                idempotency_key: None,
                submit_sequence: 0,
                // As admission stores a new job: the scheduler has not explained its wait
                // yet (the sample has been through a pass).
                waiting_reason: String::new(),
                message: String::new(),
                ..sample.clone()
            })
            .collect();
        store.submit_jobs(jobs).await?;
        written += group as u64;
        if last_report.elapsed() > Duration::from_secs(10) {
            eprintln!("queue-memory: {written} of {count} written");
            last_report = Instant::now();
        }
    }
    // Check the fill through the store's own listing, one page.
    let (page, _) = store
        .list_jobs(&JobFilter {
            page_size: 1,
            ..JobFilter::default()
        })
        .await?;
    if page.is_empty() {
        return Err(BenchError::Database(
            "the filled store lists no jobs".into(),
        ));
    }
    store.close().await;
    Ok(())
}
