//! `carve sim --trace FILE`: replays a job trace through core's simulator under the
//! whole-GPU, declared-memory and Carve policies and compares them (a table, `-o json`,
//! `--plot FILE.svg`); `carve sim generate` writes a synthetic trace to stdout. With
//! `--preemption` each policy runs twice, without and with preemption, and the table
//! sets the urgent jobs' queueing side by side.
//!
//! This file does the IO core does not: it reads the trace and the job files it names
//! (relative to the trace), and renders the reports. The SVG is written by hand: a line
//! chart needs axes, a few paths and a legend, not a plotting crate.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use carve_core::bytes::{HumanBytes, parse_byte_size};
use carve_core::scheduling::preemption::{self, PreemptionSettings};
use carve_core::simulation::trace::ModelSource;
use carve_core::simulation::{
    Cluster, GeneratorOptions, MemoryOracle, Percentiles, Policy, PolicyReport,
    SimulatedPreemption, SimulationOptions, WaitSummary, Workload, generate_trace, parse_trace,
    simulate,
};
use carve_core::{CoreError, FieldError};
use serde_json::{Value, json};

use crate::estimate::OutputFormat;

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct SimArguments {
    #[command(subcommand)]
    generate: Option<SimCommand>,
    /// The trace: CSV with a header (see docs/simulator.md).
    #[arg(long, required = true)]
    trace: Option<PathBuf>,
    /// NODESxGPUSxSIZE or GPUSxSIZE, e.g. 8x8x80GiB (8 nodes of 8 GPUs of 80 GiB).
    #[arg(long, default_value = "8x8x80GiB")]
    cluster: String,
    /// Which policy to simulate.
    #[arg(long, value_enum, default_value_t = PolicyChoice::All)]
    policy: PolicyChoice,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
    output: OutputFormat,
    /// The same as `-o json` (the flag `carve sim` had before it took `-o`).
    #[arg(long, conflicts_with = "output")]
    json: bool,
    /// Also write GPU memory utilisation over time as an SVG chart.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Memory of each GPU taken by the CUDA context (not usable by jobs), e.g. 512MiB.
    #[arg(long, default_value = "0", value_parser = parse_bytes_argument)]
    gpu_context: u64,
    /// Share of its remaining run time after which a job that does not fit its slice runs
    /// out of memory.
    #[arg(long, default_value_t = SimulationOptions::default().oom_after_fraction)]
    oom_after_fraction: f64,
    /// Seconds a user takes to resubmit a job that ran out of memory.
    #[arg(long, default_value_t = SimulationOptions::default().resubmit_delay_s)]
    resubmit_delay_s: f64,
    /// Seconds of run time between checkpoints.
    #[arg(long, default_value_t = SimulationOptions::default().checkpoint_interval_s)]
    checkpoint_interval_s: f64,
    /// Runs each policy twice, without and with preemption (urgent jobs evict
    /// lower-priority attempts, chosen as the scheduler chooses them), and compares the
    /// urgent jobs' queueing.
    #[arg(long)]
    preemption: bool,
    /// Jobs of at least this priority are the urgent ones the report gives apart (a
    /// trace's `priority` column, else its spec's).
    #[arg(long, default_value_t = SimulationOptions::default().urgent_priority, allow_negative_numbers = true)]
    urgent_priority: i32,
    /// Fair share over time: order tenants by their usage decayed with this half-life in
    /// hours (as the scheduler's --fair-share-half-life-hours) instead of by what they
    /// hold now only.
    #[arg(long)]
    fair_share_half_life_hours: Option<f64>,
    /// With --preemption: an attempt younger than this is never evicted (the scheduler's
    /// default).
    #[arg(long, default_value_t = preemption::DEFAULT_MIN_RUN_TIME_SECONDS)]
    preemption_min_run_time_s: u64,
    /// With --preemption: a job preempted this many times in the last hour is not evicted
    /// again (the scheduler's default).
    #[arg(long, default_value_t = preemption::DEFAULT_MAX_PREEMPTIONS_PER_JOB_PER_HOUR)]
    preemption_max_per_job_per_hour: u32,
    /// With --preemption: seconds a victim takes to stop (the scheduler's grace period).
    #[arg(long, default_value_t = preemption::DEFAULT_GRACE_PERIOD_SECONDS as f64)]
    preemption_grace_period_s: f64,
    /// Place with the gang pass (core's solve_gangs: jobs of several GPUs all at once)
    /// with reservations on, off, or each policy once with each; a trace with gangs
    /// (gpus above 1) gets `on` without the flag. The table then gives gangs' and
    /// single-GPU jobs' queueing apart.
    #[arg(long, value_enum)]
    gang_reservations: Option<GangReservationsChoice>,
    /// With the gang pass: seconds after a job joined the queue from which nothing new is
    /// placed on the GPUs reserved for it (its reservation's bound).
    #[arg(long, default_value_t = SimulationOptions::default().gang_max_wait_s)]
    gang_max_wait_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum GangReservationsChoice {
    On,
    Off,
    Both,
}

/// What the table and `-o json` say a preemption run assumed.
const PREEMPTION_ASSUMPTION: &str = "a preempted attempt stops at the end of the grace \
     period and resumes from its last periodic checkpoint (--checkpoint-interval-s): the run \
     time since is lost (no checkpoint on preemption is modelled)";

#[derive(Debug, clap::Subcommand)]
enum SimCommand {
    /// Writes a synthetic trace (CSV) to stdout, deterministic for a seed.
    Generate(GenerateArguments),
}

#[derive(Debug, clap::Args)]
struct GenerateArguments {
    /// Number of jobs.
    #[arg(long)]
    jobs: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value_t = GeneratorOptions::default().tenants)]
    tenants: usize,
    /// Mean seconds between two submissions (Poisson arrivals).
    #[arg(long, default_value_t = GeneratorOptions::default().mean_interarrival_s)]
    mean_interarrival_s: f64,
    /// Share of jobs whose users declare less memory than the job needs.
    #[arg(long, default_value_t = GeneratorOptions::default().under_declaring_fraction)]
    under_declaring_fraction: f64,
    /// Share of jobs that need more memory than the estimator sees.
    #[arg(long, default_value_t = GeneratorOptions::default().unseen_memory_fraction)]
    unseen_memory_fraction: f64,
    /// Share of jobs that are gangs of 2, 4 or 8 GPUs (rows without a model, the need
    /// per GPU given), as the Alibaba GPU traces' multi-GPU pods.
    #[arg(long, default_value_t = GeneratorOptions::default().gang_fraction)]
    gang_fraction: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PolicyChoice {
    All,
    WholeGpu,
    Declared,
    Carve,
}

impl PolicyChoice {
    fn policies(self) -> Vec<Policy> {
        match self {
            PolicyChoice::All => Policy::ALL.to_vec(),
            PolicyChoice::WholeGpu => vec![Policy::WholeGpu],
            PolicyChoice::Declared => vec![Policy::Declared],
            PolicyChoice::Carve => vec![Policy::Carve],
        }
    }
}

/// Core names the option's field (`mean_interarrival_s`); people typed the flag.
fn as_flag_error(error: CoreError) -> anyhow::Error {
    match error {
        CoreError::InvalidSpec(FieldError { field, reason }) => {
            anyhow!("--{}: {reason}", field.replace('_', "-"))
        }
        other => anyhow!(other),
    }
}

fn parse_bytes_argument(text: &str) -> Result<u64, String> {
    parse_byte_size(text).map_err(|error| error.to_string())
}

pub fn run(arguments: SimArguments) -> Result<ExitCode> {
    if let Some(SimCommand::Generate(generate)) = arguments.generate {
        let text = generate_trace(&GeneratorOptions {
            jobs: generate.jobs,
            seed: generate.seed,
            tenants: generate.tenants,
            mean_interarrival_s: generate.mean_interarrival_s,
            under_declaring_fraction: generate.under_declaring_fraction,
            unseen_memory_fraction: generate.unseen_memory_fraction,
            gang_fraction: generate.gang_fraction,
        })
        .map_err(as_flag_error)?;
        print!("{text}");
        return Ok(ExitCode::SUCCESS);
    }
    let trace_path = arguments
        .trace
        .ok_or_else(|| anyhow!("--trace FILE is required (or run `carve sim generate`)"))?;
    let cluster = Cluster::parse(&arguments.cluster).map_err(as_flag_error)?;
    let options = SimulationOptions {
        gpu_context_bytes: arguments.gpu_context,
        oom_after_fraction: arguments.oom_after_fraction,
        resubmit_delay_s: arguments.resubmit_delay_s,
        checkpoint_interval_s: arguments.checkpoint_interval_s,
        urgent_priority: arguments.urgent_priority,
        fair_share_half_life_s: arguments
            .fair_share_half_life_hours
            .map(|hours| hours * 3600.0),
        gang_reservations: match arguments.gang_reservations {
            None => None,
            Some(GangReservationsChoice::Off) => Some(false),
            Some(GangReservationsChoice::On | GangReservationsChoice::Both) => Some(true),
        },
        gang_max_wait_s: arguments.gang_max_wait_s,
        ..SimulationOptions::default()
    };
    options.check(&cluster).map_err(as_flag_error)?;
    let preemption = SimulatedPreemption {
        limits: PreemptionSettings {
            min_run_time_seconds: arguments.preemption_min_run_time_s,
            max_preemptions_per_job_per_hour: arguments.preemption_max_per_job_per_hour,
        },
        grace_period_s: arguments.preemption_grace_period_s,
    };
    let runs: Vec<SimulationOptions> = if arguments.preemption {
        let with_preemption = SimulationOptions {
            preemption: Some(preemption),
            ..options
        };
        with_preemption.check(&cluster).map_err(as_flag_error)?;
        vec![options, with_preemption]
    } else if arguments.gang_reservations == Some(GangReservationsChoice::Both) {
        let without = SimulationOptions {
            gang_reservations: Some(false),
            ..options
        };
        vec![without, options]
    } else {
        vec![options]
    };

    let workload = load_workload(&trace_path)?;
    let started = Instant::now();
    let mut oracle = MemoryOracle::default();
    let mut reports = Vec::new();
    for policy in arguments.policy.policies() {
        for run_options in &runs {
            // Its refusals name an option's field (`preemption`), which people typed as a
            // flag.
            reports.push(
                simulate(&workload, &cluster, policy, run_options, &mut oracle)
                    .map_err(as_flag_error)?,
            );
        }
    }
    eprintln!(
        "simulated {} jobs in {} run{} in {:.2} s",
        workload.jobs.len(),
        reports.len(),
        if reports.len() == 1 { "" } else { "s" },
        started.elapsed().as_secs_f64()
    );

    if let Some(plot) = &arguments.plot {
        let title = format!(
            "{} on {}",
            trace_path.file_name().map_or_else(
                || trace_path.display().to_string(),
                |name| name.to_string_lossy().into_owned()
            ),
            cluster_label(&cluster)
        );
        std::fs::write(plot, utilisation_svg(&reports, &title))
            .with_context(|| format!("cannot write {}", plot.display()))?;
    }
    if arguments.json || arguments.output == OutputFormat::Json {
        let report = json!({
            "trace": trace_path.display().to_string(),
            "jobs": workload.jobs.len(),
            "tenants": workload.tenants.len(),
            "cluster": {
                "nodes": cluster.nodes,
                "gpus_per_node": cluster.gpus_per_node,
                "gpu_bytes": cluster.gpu_bytes,
                "gpu_context_bytes": options.gpu_context_bytes,
            },
            "urgent_priority": options.urgent_priority,
            "preemption": arguments.preemption.then(|| json!({
                "min_run_time_s": preemption.limits.min_run_time_seconds,
                "max_per_job_per_hour": preemption.limits.max_preemptions_per_job_per_hour,
                "grace_period_s": preemption.grace_period_s,
                "assumption": PREEMPTION_ASSUMPTION,
            })),
            "policies": reports.iter().map(report_json).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!(
            "{}",
            report_table(&trace_path, &workload, &cluster, &reports)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads the trace and every job file it names (relative to the trace's folder).
fn load_workload(trace_path: &Path) -> Result<Workload> {
    let text = std::fs::read_to_string(trace_path)
        .with_context(|| format!("cannot read {}", trace_path.display()))?;
    let in_trace = |error: CoreError| anyhow!("{}: {error}", trace_path.display());
    let trace = parse_trace(&text).map_err(in_trace)?;
    let folder = trace_path.parent().unwrap_or(Path::new(""));
    let mut spec_texts = BTreeMap::new();
    for path in trace.spec_files() {
        let resolved = folder.join(path);
        let text = std::fs::read_to_string(&resolved).with_context(|| {
            let row = trace
                .rows
                .iter()
                .find(|row| row.model == ModelSource::SpecFile(path.to_string()))
                .map_or(0, |row| row.row);
            format!(
                "{}: row {row} column spec: cannot read {}",
                trace_path.display(),
                resolved.display()
            )
        })?;
        spec_texts.insert(path.to_string(), text);
    }
    Workload::prepare(&trace, &spec_texts).map_err(in_trace)
}

fn cluster_label(cluster: &Cluster) -> String {
    format!(
        "{} x {} x {} GPUs",
        cluster.nodes,
        cluster.gpus_per_node,
        HumanBytes(cluster.gpu_bytes)
    )
}

fn percentiles_json(percentiles: &Percentiles) -> Value {
    json!({ "p50": percentiles.p50, "p95": percentiles.p95, "p99": percentiles.p99 })
}

fn wait_summary_json(summary: &WaitSummary) -> Value {
    json!({
        "jobs": summary.jobs,
        "started_jobs": summary.started_jobs,
        "mean": summary.mean_s,
        "p50": summary.percentiles.p50,
        "p95": summary.percentiles.p95,
        "max": summary.max_s,
    })
}

/// The policy's name, marked when urgent jobs could preempt.
fn run_label(report: &PolicyReport) -> String {
    let name = report.policy.name();
    match (report.preemption, report.gang_reservations) {
        (true, _) => format!("{name}+preempt"),
        (false, Some(true)) => format!("{name}+resv"),
        (false, Some(false)) => format!("{name}-resv"),
        (false, None) => name.to_string(),
    }
}

fn report_json(report: &PolicyReport) -> Value {
    json!({
        "policy": report.policy.name(),
        "preemption": report.preemption,
        "jobs": report.jobs,
        "succeeded_jobs": report.succeeded_jobs,
        "failed_jobs": report.failed_jobs,
        "rejected_jobs": report.rejected_jobs,
        "unfinished_jobs": report.unfinished_jobs,
        "out_of_memory_attempts": report.out_of_memory_attempts,
        "shrunk_jobs": report.shrunk_jobs,
        "allocated_memory_utilisation": report.allocated_memory_utilisation,
        "used_memory_utilisation": report.used_memory_utilisation,
        "jobs_per_busy_gpu": report.jobs_per_busy_gpu,
        "fragmentation": report.fragmentation,
        "queueing_delay_s": percentiles_json(&report.queueing_delay_s),
        "completion_time_s": percentiles_json(&report.completion_time_s),
        "urgent_queueing_s": wait_summary_json(&report.urgent_queueing),
        "gang_reservations": report.gang_reservations,
        "gang_queueing_s": wait_summary_json(&report.gang_queueing),
        "single_gpu_queueing_s": wait_summary_json(&report.single_queueing),
        "preemptions": report.preemptions,
        "preempted_run_time_lost_s": report.preempted_run_time_lost_s,
        "makespan_s": report.makespan_s,
        "most_allocated_on_one_gpu_bytes": report.most_allocated_on_one_gpu_bytes,
        "usable_bytes_per_gpu": report.usable_bytes_per_gpu,
        "utilisation_over_time": report.utilisation_over_time.iter().map(|sample| json!({
            "time_s": sample.time_s,
            "allocated": sample.allocated,
            "used": sample.used,
        })).collect::<Vec<_>>(),
    })
}

/// `42s`, `7.5m`, `3.2h`, `1.4d`.
fn duration_text(seconds: f64) -> String {
    if seconds < 60.0 {
        format!("{seconds:.0}s")
    } else if seconds < 3600.0 {
        format!("{:.1}m", seconds / 60.0)
    } else if seconds < 86_400.0 {
        format!("{:.1}h", seconds / 3600.0)
    } else {
        format!("{:.1}d", seconds / 86_400.0)
    }
}

fn percentiles_text(percentiles: &Percentiles) -> String {
    format!(
        "{} / {} / {}",
        duration_text(percentiles.p50),
        duration_text(percentiles.p95),
        duration_text(percentiles.p99)
    )
}

/// A group's waits: p50 / p95 / max.
fn wait_text(summary: &WaitSummary) -> String {
    format!(
        "{} / {} / {}",
        duration_text(summary.percentiles.p50),
        duration_text(summary.percentiles.p95),
        duration_text(summary.max_s)
    )
}

/// A row of the table: its label and how to read it from a report.
type TableRow = (&'static str, fn(&PolicyReport) -> String);

fn report_table(
    trace_path: &Path,
    workload: &Workload,
    cluster: &Cluster,
    reports: &[PolicyReport],
) -> String {
    let mut text = String::new();
    let _ = writeln!(
        text,
        "{}: {} jobs, {} tenants, {} distinct models; cluster {}",
        trace_path.display(),
        workload.jobs.len(),
        workload.tenants.len(),
        workload.models.len(),
        cluster_label(cluster)
    );
    let mut rows: Vec<TableRow> = vec![
        ("succeeded", |r| r.succeeded_jobs.to_string()),
        ("failed", |r| r.failed_jobs.to_string()),
        ("rejected at submit", |r| r.rejected_jobs.to_string()),
        ("out-of-memory attempts", |r| {
            r.out_of_memory_attempts.to_string()
        }),
        ("shrunk jobs", |r| r.shrunk_jobs.to_string()),
        ("memory allocated", |r| {
            format!("{:.1}%", 100.0 * r.allocated_memory_utilisation)
        }),
        ("memory really used", |r| {
            format!("{:.1}%", 100.0 * r.used_memory_utilisation)
        }),
        ("jobs per busy GPU", |r| {
            format!("{:.2}", r.jobs_per_busy_gpu)
        }),
        ("fragmentation", |r| {
            format!("{:.1}%", 100.0 * r.fragmentation)
        }),
        ("queueing p50/p95/p99", |r| {
            percentiles_text(&r.queueing_delay_s)
        }),
        ("JCT p50/p95/p99", |r| {
            percentiles_text(&r.completion_time_s)
        }),
        ("makespan", |r| duration_text(r.makespan_s)),
    ];
    let preemption = reports.iter().any(|report| report.preemption);
    let urgent_priority = reports.first().map_or(0, |report| report.urgent_priority);
    if preemption {
        rows.extend([
            (
                "urgent jobs (started)",
                (|r| {
                    format!(
                        "{} ({})",
                        r.urgent_queueing.jobs, r.urgent_queueing.started_jobs
                    )
                }) as fn(&PolicyReport) -> String,
            ),
            ("urgent wait mean", |r| {
                duration_text(r.urgent_queueing.mean_s)
            }),
            ("urgent wait p50/p95/max", |r| {
                let summary = &r.urgent_queueing;
                format!(
                    "{} / {} / {}",
                    duration_text(summary.percentiles.p50),
                    duration_text(summary.percentiles.p95),
                    duration_text(summary.max_s)
                )
            }),
            ("preemptions", |r| r.preemptions.to_string()),
            ("run time lost to preemption", |r| {
                duration_text(r.preempted_run_time_lost_s)
            }),
        ]);
    }
    if reports
        .iter()
        .any(|report| report.gang_reservations.is_some())
    {
        rows.extend([
            (
                "gangs (started)",
                (|r| {
                    format!(
                        "{} ({})",
                        r.gang_queueing.jobs, r.gang_queueing.started_jobs
                    )
                }) as fn(&PolicyReport) -> String,
            ),
            ("gang wait mean", |r| duration_text(r.gang_queueing.mean_s)),
            ("gang wait p50/p95/max", |r| wait_text(&r.gang_queueing)),
            ("1-GPU jobs (started)", |r| {
                format!(
                    "{} ({})",
                    r.single_queueing.jobs, r.single_queueing.started_jobs
                )
            }),
            ("1-GPU wait mean", |r| {
                duration_text(r.single_queueing.mean_s)
            }),
            ("1-GPU wait p50/p95/max", |r| wait_text(&r.single_queueing)),
        ]);
    }
    let label_width = rows.iter().map(|(label, _)| label.len()).max().unwrap_or(0);
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|(_, value)| reports.iter().map(value).collect())
        .collect();
    let column_widths: Vec<usize> = (0..reports.len())
        .map(|column| {
            cells
                .iter()
                .map(|row| row[column].len())
                .chain([run_label(&reports[column]).len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let _ = write!(text, "{:label_width$}", "");
    for (report, width) in reports.iter().zip(&column_widths) {
        let _ = write!(text, "  {:>width$}", run_label(report));
    }
    text.push('\n');
    for ((label, _), row) in rows.iter().zip(&cells) {
        let _ = write!(text, "{label:label_width$}");
        for (cell, width) in row.iter().zip(&column_widths) {
            let _ = write!(text, "  {cell:>width$}");
        }
        text.push('\n');
    }
    if preemption {
        let _ = writeln!(
            text,
            "urgent: priority >= {urgent_priority}; {PREEMPTION_ASSUMPTION}"
        );
    }
    if reports.iter().any(|report| report.unfinished_jobs > 0) {
        text.push_str("warning: some jobs never started (see unfinished_jobs in -o json)\n");
    }
    text
}

fn xml_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A step of 1, 2 or 5 times a power of ten giving at most `most` ticks up to `end`.
fn tick_step(end: f64, most: usize) -> f64 {
    let rough = (end / most as f64).max(f64::MIN_POSITIVE);
    let power = 10f64.powf(rough.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|factor| factor * power)
        .find(|step| end / step <= most as f64)
        .unwrap_or(10.0 * power)
}

/// Memory really used (solid) and allocated (dashed) over time, one colour per policy.
fn utilisation_svg(reports: &[PolicyReport], title: &str) -> String {
    const WIDTH: f64 = 960.0;
    const HEIGHT: f64 = 480.0;
    const LEFT: f64 = 70.0;
    const RIGHT: f64 = 200.0;
    const TOP: f64 = 50.0;
    const BOTTOM: f64 = 60.0;
    const COLOURS: [&str; 3] = ["#d62728", "#ff7f0e", "#1f77b4"];
    let plot_width = WIDTH - LEFT - RIGHT;
    let plot_height = HEIGHT - TOP - BOTTOM;
    let end_hours = reports
        .iter()
        .map(|report| report.makespan_s / 3600.0)
        .fold(0.0, f64::max)
        .max(1e-3);
    let x = |hours: f64| LEFT + plot_width * hours / end_hours;
    let y = |share: f64| TOP + plot_height * (1.0 - share.clamp(0.0, 1.0));

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    );
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15">GPU memory utilisation over time: {}</text>"#,
        LEFT + plot_width / 2.0,
        xml_escape(title)
    );
    // Grid and y axis: 0 to 100% in quarters.
    for quarter in 0..=4 {
        let share = f64::from(quarter) / 4.0;
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{0:.1}" x2="{1:.1}" y2="{0:.1}" stroke="#dddddd"/><text x="{2:.1}" y="{3:.1}" text-anchor="end">{4}%</text>"##,
            y(share),
            LEFT + plot_width,
            LEFT - 6.0,
            y(share) + 4.0,
            quarter * 25
        );
    }
    let step = tick_step(end_hours, 8);
    let mut tick = 0.0;
    while tick <= end_hours + 1e-9 {
        let _ = writeln!(
            svg,
            r##"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="#333333"/><text x="{0:.1}" y="{3:.1}" text-anchor="middle">{4}</text>"##,
            x(tick),
            TOP + plot_height,
            TOP + plot_height + 5.0,
            TOP + plot_height + 20.0,
            format_tick(tick, step)
        );
        tick += step;
    }
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_width}" height="{plot_height}" fill="none" stroke="#333333"/>"##
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time since the first submission (hours)</text>"#,
        LEFT + plot_width / 2.0,
        HEIGHT - 18.0
    );
    let _ = writeln!(
        svg,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">share of the cluster's GPU memory</text>"#,
        TOP + plot_height / 2.0
    );
    for (index, report) in reports.iter().enumerate() {
        let colour = COLOURS[index % COLOURS.len()];
        for (dashed, share_of) in [
            (
                true,
                (|sample: &carve_core::simulation::UtilisationSample| sample.allocated)
                    as fn(&_) -> f64,
            ),
            (
                false,
                |sample: &carve_core::simulation::UtilisationSample| sample.used,
            ),
        ] {
            let points: Vec<String> = std::iter::once(format!("{:.1},{:.1}", x(0.0), y(0.0)))
                .chain(report.utilisation_over_time.iter().map(|sample| {
                    format!(
                        "{:.1},{:.1}",
                        x(sample.time_s / 3600.0),
                        y(share_of(sample))
                    )
                }))
                .collect();
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="{}"{} points="{}"/>"#,
                if dashed { 1.2 } else { 2.0 },
                if dashed {
                    r#" stroke-dasharray="5 4""#
                } else {
                    ""
                },
                points.join(" ")
            );
        }
        let legend_y = TOP + 10.0 + 44.0 * index as f64;
        let legend_x = LEFT + plot_width + 16.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{legend_x}" y1="{legend_y}" x2="{0}" y2="{legend_y}" stroke="{colour}" stroke-width="2"/><text x="{1}" y="{2}">{3} used</text>"#,
            legend_x + 24.0,
            legend_x + 30.0,
            legend_y + 4.0,
            run_label(report)
        );
        let _ = writeln!(
            svg,
            r#"<line x1="{legend_x}" y1="{0}" x2="{1}" y2="{0}" stroke="{colour}" stroke-width="1.2" stroke-dasharray="5 4"/><text x="{2}" y="{3}">{4} allocated</text>"#,
            legend_y + 18.0,
            legend_x + 24.0,
            legend_x + 30.0,
            legend_y + 22.0,
            run_label(report)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn format_tick(value: f64, step: f64) -> String {
    if step >= 1.0 {
        format!("{value:.0}")
    } else {
        let decimals = (-step.log10().floor()) as usize;
        format!("{value:.decimals$}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_numbers() {
        assert_eq!(tick_step(10.0, 8), 2.0);
        assert_eq!(tick_step(37.0, 8), 5.0);
        assert_eq!(tick_step(0.3, 8), 0.05);
        assert_eq!(format_tick(0.15, 0.05), "0.15");
        assert_eq!(duration_text(90.0), "1.5m");
        assert_eq!(duration_text(7200.0), "2.0h");
    }
}
