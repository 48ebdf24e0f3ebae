//! `carve-submit-bench`: a real `carve-scheduler` (a child process, on 127.0.0.1) under
//! submit load over gRPC, on SQLite and on a private PostgreSQL server, next to the
//! store's own limit measured in the same run; and (`queue-memory`) the scheduler's
//! memory and passes with a million queued jobs. See BENCHMARKS.md for how to run it and
//! what it measured.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use carve_bench::baseline::measure_store_limit;
use carve_bench::latency::LatencySummary;
use carve_bench::load::{LoadOutcome, Submitter, run_paced, run_saturation};
use carve_bench::pacing::{PacedSchedule, parse_duration, parse_rates};
use carve_bench::procfs::{clock_ticks_per_second, cpu_ticks, ticks_to_duration};
use carve_bench::prometheus::{sample_value, scrape};
use carve_bench::queue_memory::{QueueMemorySettings, measure_queue_memory};
use carve_bench::report::{
    BackendReport, MachineInfo, PhaseReport, QueueMemoryRun, SubmitReport, load_average,
    render_queue_memory, render_submit_report,
};
use carve_bench::scheduler_process::SchedulerProcess;
use carve_bench::{BENCH_JOB_SPEC_JSON, DatabaseKind, parse_backends};
use carve_scheduler::store::{JobFilter, Store};
use carve_testing::PgServer;
use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "carve-submit-bench",
    about = "Submit throughput and latency of a real carve-scheduler, against the store's own limit",
    args_conflicts_with_subcommands = true
)]
struct Arguments {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    submit: SubmitArguments,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Paced and saturating submit load (the default).
    Submit(SubmitArguments),
    /// The scheduler's memory and passes with many queued jobs.
    QueueMemory(QueueMemoryArguments),
}

#[derive(Debug, Clone, Args)]
struct SubmitArguments {
    /// How long each load phase and each baseline runs (8s, 500ms, 2m).
    #[arg(long, default_value = "5s")]
    duration: String,
    /// Paced (open-loop) rates in jobs per second, comma-separated; empty for none.
    #[arg(long, default_value = "1000,2000,5000")]
    rates: String,
    /// Closed-loop clients of the saturation phase; 0 skips it.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Databases to run on: sqlite, postgres.
    #[arg(long, default_value = "sqlite,postgres")]
    backends: String,
    /// HTTP/2 connections the load is spread over.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Rows per transaction of the batched store-limit baseline; 0 skips both baselines.
    #[arg(long, default_value_t = 512)]
    baseline_batch: usize,
    /// Print the report as JSON on stdout (progress still goes to stderr).
    #[arg(long)]
    json: bool,
    /// The carve-scheduler binary (default: next to this executable).
    #[arg(long)]
    scheduler_binary: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
struct QueueMemoryArguments {
    /// Queued jobs to fill the store with.
    #[arg(long, default_value_t = 1_000_000)]
    jobs: u64,
    /// The database: sqlite or postgres.
    #[arg(long, default_value = "sqlite")]
    backend: String,
    /// The longest the first scheduling pass may take (10m, 600s).
    #[arg(long, default_value = "10m")]
    pass_timeout: String,
    /// How long to watch the idle scheduler after its first pass.
    #[arg(long, default_value = "10s")]
    idle: String,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// The carve-scheduler binary (default: next to this executable).
    #[arg(long)]
    scheduler_binary: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let arguments = Arguments::parse();
    match arguments.command {
        Some(Command::QueueMemory(queue_memory)) => run_queue_memory(queue_memory).await,
        Some(Command::Submit(submit)) => run_submit(submit).await,
        None => run_submit(arguments.submit).await,
    }
}

/// Where each phase's fresh database comes from.
struct Databases {
    directory: tempfile::TempDir,
    postgres: Option<PgServer>,
    next: u32,
}

impl Databases {
    fn new(backends: &[DatabaseKind]) -> Result<Databases> {
        let postgres = if backends.contains(&DatabaseKind::Postgres) {
            eprintln!("starting a private postgres server");
            Some(PgServer::start()?)
        } else {
            None
        };
        Ok(Databases {
            directory: tempfile::tempdir().context("create a temp dir for the databases")?,
            postgres,
            next: 0,
        })
    }

    /// A new, empty database: a SQLite path or a `postgres://` URL.
    async fn fresh(&mut self, kind: DatabaseKind) -> Result<String> {
        self.next += 1;
        Ok(match kind {
            DatabaseKind::Sqlite => self
                .directory
                .path()
                .join(format!("bench-{}.db", self.next))
                .to_string_lossy()
                .into_owned(),
            DatabaseKind::Postgres => {
                let server = self
                    .postgres
                    .as_ref()
                    .context("no postgres server was started")?;
                server.create_database("bench").await?
            }
        })
    }
}

/// How one phase loads the scheduler.
#[derive(Debug, Clone, Copy)]
enum Load {
    Paced(PacedSchedule),
    Saturation {
        concurrency: usize,
        duration: Duration,
    },
}

async fn run_submit(arguments: SubmitArguments) -> Result<()> {
    let duration = parse_duration(&arguments.duration)?;
    let rates = parse_rates(&arguments.rates)?;
    let backends = parse_backends(&arguments.backends)?;
    if arguments.connections == 0 {
        anyhow::bail!("connections: must be at least 1");
    }
    let schedules = rates
        .iter()
        .map(|rate| PacedSchedule::new(*rate, duration))
        .collect::<Result<Vec<_>, _>>()?;
    let binary = SchedulerProcess::find_binary(arguments.scheduler_binary.as_deref())?;
    let mut machine = MachineInfo::read();
    let mut databases = Databases::new(&backends)?;
    let mut report = SubmitReport {
        machine: machine.clone(),
        phase_seconds: duration.as_secs_f64(),
        connections: arguments.connections,
        backends: Vec::new(),
    };
    for kind in backends {
        let mut loads: Vec<Load> = schedules.iter().copied().map(Load::Paced).collect();
        if arguments.concurrency > 0 {
            loads.push(Load::Saturation {
                concurrency: arguments.concurrency,
                duration,
            });
        }
        let mut backend = BackendReport {
            backend: kind,
            durability: Vec::new(),
            phases: Vec::new(),
            store_limit_one_row_per_commit: None,
            store_limit_batched: None,
            saturation_to_one_row_per_commit: None,
            saturation_to_batched: None,
            targets: Vec::new(),
        };
        let mut last_database = None;
        for load in loads {
            let url = databases.fresh(kind).await?;
            eprintln!("{}: {load:?}", kind.name());
            let phase = run_phase(&binary, &url, load, arguments.connections).await?;
            eprintln!(
                "{}: {} -> {:.0} jobs/s, p99 {:.2} ms, {} failed",
                kind.name(),
                phase.label(),
                phase.succeeded_per_second,
                phase.latency.p99_ms,
                phase.failed
            );
            backend.phases.push(phase);
            last_database = Some(url);
        }
        if arguments.baseline_batch > 0 {
            // The baselines insert the row admission stored in the last phase.
            let sample_url = match last_database {
                Some(url) => url,
                None => {
                    let url = databases.fresh(kind).await?;
                    let schedule = PacedSchedule::new(10, Duration::from_millis(100))?;
                    run_phase(&binary, &url, Load::Paced(schedule), 1).await?;
                    url
                }
            };
            let store = Store::open(&sample_url).await?;
            let (jobs, _) = store
                .list_jobs(&JobFilter {
                    page_size: 1,
                    ..JobFilter::default()
                })
                .await?;
            store.close().await;
            let sample = jobs
                .into_iter()
                .next()
                .context("the scheduler stored no job to copy for the baseline")?;
            for rows_per_transaction in [1, arguments.baseline_batch] {
                let url = databases.fresh(kind).await?;
                eprintln!(
                    "{}: store limit, {rows_per_transaction} rows per commit",
                    kind.name()
                );
                let limit =
                    measure_store_limit(kind, &url, &sample, rows_per_transaction, duration)
                        .await?;
                if backend.durability.is_empty() {
                    let store = Store::open(&url).await?;
                    backend.durability = store.durability_settings().await?;
                    store.close().await;
                }
                if rows_per_transaction == 1 {
                    backend.store_limit_one_row_per_commit = Some(limit);
                } else {
                    backend.store_limit_batched = Some(limit);
                }
            }
        }
        backend.judge();
        report.backends.push(backend);
    }
    machine.load_average_at_end = load_average();
    report.machine = machine;
    if arguments.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render_submit_report(&report));
    }
    Ok(())
}

/// One phase on a fresh scheduler over the database at `url`.
async fn run_phase(
    binary: &Path,
    url: &str,
    load: Load,
    connections: usize,
) -> Result<PhaseReport> {
    let mut scheduler = SchedulerProcess::start(binary, url)?;
    let submitter = Arc::new(
        Submitter::connect(
            scheduler.grpc_address(),
            scheduler.admin_token(),
            BENCH_JOB_SPEC_JSON,
            connections,
            Duration::from_secs(60),
        )
        .await
        .map_err(|error| scheduler.failure(&format!("is not serving ({error})")))?,
    );
    let ticks_per_second = clock_ticks_per_second();
    let counters = |text: &str| {
        (
            sample_value(text, "carve_submit_groups_committed_total").unwrap_or(0.0) as u64,
            sample_value(text, "carve_submit_jobs_committed_total").unwrap_or(0.0) as u64,
        )
    };
    let (groups_before, jobs_before) = counters(&scrape(scheduler.metrics_address()).await?);
    let ticks_before = cpu_ticks(scheduler.pid())?;
    let (outcome, mode, target_rate, concurrency): (LoadOutcome, &str, _, _) = match load {
        Load::Paced(schedule) => (
            run_paced(Arc::clone(&submitter), schedule, "paced").await?,
            "paced",
            Some(schedule.rate_per_second()),
            None,
        ),
        Load::Saturation {
            concurrency,
            duration,
        } => (
            run_saturation(Arc::clone(&submitter), concurrency, duration, "saturation").await?,
            "saturation",
            None,
            Some(concurrency),
        ),
    };
    let ticks_after = cpu_ticks(scheduler.pid())?;
    let (groups_after, jobs_after) = counters(&scrape(scheduler.metrics_address()).await?);
    scheduler.check_running()?;
    drop(submitter);
    scheduler.stop().await?;
    let server_cpu = ticks_to_duration(ticks_after - ticks_before, ticks_per_second);
    let groups_committed = groups_after.saturating_sub(groups_before);
    let jobs_committed = jobs_after.saturating_sub(jobs_before);
    Ok(PhaseReport {
        mode: mode.to_string(),
        target_rate_per_second: target_rate,
        concurrency,
        sent: outcome.sent,
        succeeded: outcome.succeeded,
        failed: outcome.failed,
        first_error: outcome.first_error.clone(),
        seconds: outcome.elapsed.as_secs_f64(),
        succeeded_per_second: outcome.succeeded_per_second(),
        latency: LatencySummary::of(&outcome.latencies),
        server_cpu_ms_per_1000_submits: server_cpu.as_secs_f64() * 1000.0 * 1000.0
            / outcome.succeeded.max(1) as f64,
        groups_committed,
        jobs_committed,
        mean_group_size: jobs_committed as f64 / groups_committed.max(1) as f64,
    })
}

async fn run_queue_memory(arguments: QueueMemoryArguments) -> Result<()> {
    let backends = parse_backends(&arguments.backend)?;
    let [kind] = backends[..] else {
        anyhow::bail!("backend: name exactly one of sqlite, postgres");
    };
    let settings = QueueMemorySettings {
        jobs: arguments.jobs,
        pass_timeout: parse_duration(&arguments.pass_timeout)?,
        idle_observation: parse_duration(&arguments.idle)?,
    };
    let binary = SchedulerProcess::find_binary(arguments.scheduler_binary.as_deref())?;
    let mut machine = MachineInfo::read();
    let mut databases = Databases::new(&backends)?;
    let url = databases.fresh(kind).await?;
    let result = measure_queue_memory(&binary, kind, &url, &settings).await?;
    machine.load_average_at_end = load_average();
    let run = QueueMemoryRun { machine, result };
    if arguments.json {
        println!("{}", serde_json::to_string_pretty(&run)?);
    } else {
        print!("{}", render_queue_memory(&run));
    }
    Ok(())
}
