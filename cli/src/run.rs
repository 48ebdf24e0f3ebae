//! `carve run JOB.toml`: trains a job locally inside a slice — the same code a worker's
//! attempt process runs.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use carve_core::FieldError;
use carve_core::bytes::{HumanBytes, parse_byte_size};
use carve_core::estimator::estimate_job;
use carve_core::plan::RunConfig;
use carve_core::shrink::{OomObservation, plan_shrink};
use carve_core::spec::{Precision, VramRequest};
use carve_core::validate::{parse_job_spec_toml, validate_job_spec};
use carve_engine::EngineError;
use carve_engine::cuda::{CudaBackend, CudaTraining};
use carve_engine::data::open_data_sets;
use carve_engine::trainer::{Progress, TrainingOptions, train};
use serde_json::json;

use crate::client::failure::FailureKind;
use crate::elapsed::{duration_text, timing_text};
use crate::estimate::config_json;
use crate::spec_input::{
    data_base_directory, job_spec_name, print_job_spec_warnings, read_job_spec_text,
    refuse_command_job,
};

/// How often a long run prints its progress at least, besides every twentieth of it: a
/// slow step must not leave the screen still for minutes.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

#[derive(Debug, clap::Args)]
pub struct RunArguments {
    /// The job spec (TOML); `-` reads it from stdin (a file named `-` is `./-`). Relative
    /// data paths are relative to the spec's directory, or to the current directory when
    /// the spec comes from stdin.
    job: PathBuf,
    /// The slice size (e.g. 2GiB). Defaults to resources.vram, or the estimate when that is "auto".
    #[arg(long, value_parser = parse_slice)]
    slice: Option<u64>,
    /// Where the training runs.
    #[arg(long, value_enum, default_value_t = BackendChoice::Cpu)]
    backend: BackendChoice,
    /// The GPU to train on with `--backend cuda`.
    #[arg(long, default_value_t = 0)]
    cuda_device: usize,
    /// Resume from this checkpoint.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Write checkpoints here (every training.checkpoint_every_steps and at the end).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Overrides the micro-batch size (the batch is split and gradients accumulated).
    #[arg(long)]
    micro_batch_size: Option<u64>,
    /// Overrides the precision (fp32, fp16, bf16).
    #[arg(long, value_parser = parse_precision)]
    precision: Option<Precision>,
    /// Recompute activations in backward, keeping every N-th layer's input.
    #[arg(long)]
    recompute_segment_layers: Option<u64>,
    /// Overrides the convolution workspace limit (e.g. 64MiB, 0).
    #[arg(long, value_parser = parse_byte_size_argument)]
    workspace_limit: Option<u64>,
    /// Stop after this many steps in total (a checkpoint is written there).
    #[arg(long)]
    stop_after_steps: Option<u64>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = crate::estimate::OutputFormat::Table)]
    output: crate::estimate::OutputFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackendChoice {
    Cpu,
    Cuda,
}

fn parse_slice(text: &str) -> Result<u64, String> {
    match parse_byte_size(text) {
        Ok(0) => Err("a slice must be larger than 0 bytes".to_string()),
        Ok(bytes) => Ok(bytes),
        Err(error) => Err(error.to_string()),
    }
}

fn parse_byte_size_argument(text: &str) -> Result<u64, String> {
    parse_byte_size(text).map_err(|error| error.to_string())
}

fn parse_precision(text: &str) -> Result<Precision, String> {
    Precision::from_name(text)
        .ok_or_else(|| format!("`{text}` is not a precision (fp32, fp16, bf16)"))
}

/// Exit codes: 0 trained, 1 bad input or a failure, 3 out of memory in the slice.
pub fn run(arguments: RunArguments) -> Result<ExitCode> {
    let job_path = arguments.job.as_path();
    let spec_name = job_spec_name(job_path);
    let text = read_job_spec_text(job_path).with_context(|| format!("cannot read {spec_name}"))?;
    let in_file = |error: FieldError| anyhow::anyhow!("{spec_name}: {error}");
    refuse_command_job(&text, &spec_name).map_err(anyhow::Error::msg)?;
    let job = validate_job_spec(parse_job_spec_toml(&text).map_err(in_file)?).map_err(in_file)?;
    print_job_spec_warnings(&job, &spec_name);
    let mut config = RunConfig::from_spec(&job.spec);
    if let Some(micro_batch_size) = arguments.micro_batch_size {
        config.micro_batch_size = micro_batch_size;
    }
    if let Some(precision) = arguments.precision {
        config.precision = precision;
    }
    if let Some(segment) = arguments.recompute_segment_layers {
        config.recompute_segment_layers = Some(segment);
    }
    if let Some(limit) = arguments.workspace_limit {
        config = config.with_workspace_limit(limit);
    }
    config.check(&job.graph).map_err(in_file)?;
    if arguments.backend == BackendChoice::Cuda
        && let Err(reason) = CudaBackend::available()
    {
        bail!("--backend cuda: CUDA not available: {reason}; use --backend cpu");
    }
    let estimate = estimate_job(&job, &config).map_err(in_file)?;
    let slice_bytes = arguments.slice.unwrap_or(match job.spec.resources.vram {
        VramRequest::Bytes(bytes) => bytes,
        VramRequest::Auto => estimate.required_bytes,
    });
    let data = open_data_sets(&job, data_base_directory(job_path))?;
    let options = TrainingOptions {
        config,
        slice_bytes,
        checkpoint_path: arguments.checkpoint.clone(),
        resume_from: arguments.resume.clone(),
        stop_after_steps: arguments.stop_after_steps,
        stop_requested: None,
    };
    let table = arguments.output == crate::estimate::OutputFormat::Table;
    let backend_name = match arguments.backend {
        BackendChoice::Cpu => "cpu".to_string(),
        BackendChoice::Cuda => format!("cuda:{}", arguments.cuda_device),
    };
    if table {
        eprintln!(
            "training {} on {backend_name} in a {} slice: {} (estimated peak {})",
            job.spec.name,
            HumanBytes(slice_bytes),
            config,
            HumanBytes(estimate.peak_bytes)
        );
    }
    let started = Instant::now();
    // The step training starts from (after a resume, not 0): the pace counts only the
    // steps this run does.
    let mut first_step: Option<u64> = None;
    let mut last_shown = started;
    let mut show_progress = |progress: &Progress| {
        let first_step = *first_step.get_or_insert(progress.step.saturating_sub(1));
        let every = (progress.total_steps / 20).max(1);
        // Every twentieth of the run, and at least every few seconds on a slow one.
        let due = progress.step.is_multiple_of(every)
            || progress.step == progress.total_steps
            || last_shown.elapsed() >= PROGRESS_INTERVAL;
        if table && due {
            last_shown = Instant::now();
            eprintln!(
                "step {}/{}  loss {:.4}  {:.0} samples/s  memory {} (peak {})  {}{}",
                progress.step,
                progress.total_steps,
                progress.loss,
                progress.samples_per_second,
                HumanBytes(progress.memory_in_use_bytes),
                HumanBytes(progress.memory_peak_bytes),
                timing_text(
                    first_step,
                    progress.step,
                    progress.total_steps,
                    started.elapsed()
                ),
                if progress.skipped {
                    "  (update skipped: loss-scale overflow)"
                } else {
                    ""
                }
            );
        }
    };
    let result = match arguments.backend {
        BackendChoice::Cpu => train(&job, &data, &options, &mut show_progress),
        BackendChoice::Cuda => CudaTraining::prepare(&job, &options, arguments.cuda_device)
            .and_then(|prepared| {
                if table {
                    eprintln!("{}", prepared.reservation());
                }
                prepared.train(&job, &data, &options, &mut show_progress)
            }),
    };
    match result {
        Ok(report) => {
            if table {
                println!("steps            {}/{}", report.steps, report.total_steps);
                println!("final loss       {:.6}", report.final_loss);
                if let Some(test_loss) = report.test_loss {
                    println!("test loss        {test_loss:.6}");
                }
                if let Some(accuracy) = report.test_accuracy {
                    println!("test accuracy    {:.2}%", accuracy * 100.0);
                }
                println!(
                    "memory peak      {} (estimated {}) in a {} slice",
                    HumanBytes(report.peak_bytes),
                    HumanBytes(report.estimate.peak_bytes),
                    HumanBytes(report.slice_bytes)
                );
                println!(
                    "throughput       {:.0} samples/s",
                    report.samples_per_second
                );
                println!("elapsed          {}", duration_text(started.elapsed()));
            } else {
                let output = json!({
                    "job": job.spec.name,
                    "backend": backend_name,
                    "config": config_json(&config),
                    "steps": report.steps,
                    "total_steps": report.total_steps,
                    "final_loss": report.final_loss,
                    "test_loss": report.test_loss,
                    "test_accuracy": report.test_accuracy,
                    "peak_bytes": report.peak_bytes,
                    "estimate_bytes": report.estimate.peak_bytes,
                    "required_bytes": report.estimate.required_bytes,
                    "slice_bytes": report.slice_bytes,
                    "samples_per_second": report.samples_per_second,
                    "elapsed_seconds": started.elapsed().as_secs_f64(),
                    "skipped_steps": report.skipped_steps,
                    "checkpoint": report.checkpoint_path.map(|path| path.display().to_string()),
                });
                println!("{}", serde_json::to_string_pretty(&output)?);
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(EngineError::OutOfMemory(report)) => {
            // What the scheduler would run next in the same slice.
            let observation = OomObservation {
                report,
                estimated_required_bytes: estimate.required_bytes,
            };
            let next = plan_shrink(&job, &config, Some(&observation), slice_bytes);
            if table {
                println!("{}", EngineError::OutOfMemory(report));
                match &next {
                    Ok(decision) => {
                        println!("the shrink planner would run next: {}", decision.config);
                        for step in &decision.steps {
                            println!("  - {step}");
                        }
                    }
                    Err(error) => println!("no allowed configuration fits: {error}"),
                }
            } else {
                let next_json = match &next {
                    Ok(decision) => json!({
                        "config": config_json(&decision.config),
                        "estimate_bytes": decision.estimate.peak_bytes,
                        "steps": decision.steps.iter().map(|step| json!({
                            "strategy": step.strategy.name(),
                            "description": step.description,
                        })).collect::<Vec<_>>(),
                    }),
                    Err(error) => json!({ "error": error.to_string() }),
                };
                let output = json!({
                    "job": job.spec.name,
                    "config": config_json(&config),
                    "estimate_bytes": estimate.peak_bytes,
                    "required_bytes": estimate.required_bytes,
                    "slice_bytes": slice_bytes,
                    "oom": {
                        "requested_bytes": report.requested,
                        "in_use_bytes": report.in_use,
                        "limit_bytes": report.limit,
                        "largest_free_bytes": report.largest_free,
                        "peak_bytes": report.peak,
                    },
                    "next": next_json,
                });
                println!("{}", serde_json::to_string_pretty(&output)?);
            }
            Ok(ExitCode::from(FailureKind::OutOfMemory))
        }
        Err(error) => Err(error.into()),
    }
}
