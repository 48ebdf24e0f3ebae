//! `carve estimate JOB.toml`: the estimator and the shrink planner, run locally.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use carve_core::bytes::{HumanBytes, parse_byte_size};
use carve_core::estimator::{MemoryEstimate, estimate_job, largest_batch_fitting};
use carve_core::plan::RunConfig;
use carve_core::shrink::{ShrinkDecision, plan_shrink};
use carve_core::spec::{Precision, VramRequest};
use carve_core::validate::{parse_job_spec_toml, validate_job_spec};
use carve_core::{CoreError, FieldError};
use serde_json::{Value, json};

use crate::client::failure::FailureKind;
use crate::spec_input::{
    job_spec_name, print_job_spec_warnings, read_job_spec_text, refuse_command_job,
};

#[derive(Debug, clap::Args)]
pub struct EstimateArguments {
    /// The job spec (TOML); `-` reads it from stdin (a file named `-` is `./-`).
    job: PathBuf,
    /// Overrides training.batch_size.
    #[arg(long)]
    batch_size: Option<u64>,
    /// Overrides training.precision (fp32, fp16, bf16).
    #[arg(long, value_parser = parse_precision)]
    precision: Option<Precision>,
    /// A slice size (e.g. 16GiB): also show what the shrink planner would run in it.
    /// Defaults to the job's resources.vram when that is a size.
    #[arg(long, value_parser = parse_slice)]
    slice: Option<u64>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
    output: OutputFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

fn parse_precision(text: &str) -> Result<Precision, String> {
    Precision::from_name(text)
        .ok_or_else(|| format!("`{text}` is not a precision (fp32, fp16, bf16)"))
}

fn parse_slice(text: &str) -> Result<u64, String> {
    match parse_byte_size(text) {
        Ok(0) => Err("a slice must be larger than 0 bytes".to_string()),
        Ok(bytes) => Ok(bytes),
        Err(error) => Err(error.to_string()),
    }
}

/// Exit codes: 0 estimated (and fits the slice, if one was given), 1 the spec was
/// rejected, 3 nothing the job allows fits the slice.
pub fn run(arguments: EstimateArguments) -> Result<ExitCode> {
    let spec_name = job_spec_name(&arguments.job);
    let text =
        read_job_spec_text(&arguments.job).with_context(|| format!("cannot read {spec_name}"))?;
    let in_file = |error: FieldError| anyhow::anyhow!("{spec_name}: {error}");
    refuse_command_job(&text, &spec_name).map_err(anyhow::Error::msg)?;
    let mut spec = parse_job_spec_toml(&text).map_err(in_file)?;
    // Overrides go into the spec and through the same validation, so an override that
    // breaks the spec is rejected with the field it changed.
    if let Some(batch_size) = arguments.batch_size {
        spec.training.batch_size = batch_size;
    }
    if let Some(precision) = arguments.precision {
        spec.training.precision = precision;
    }
    let job = validate_job_spec(spec).map_err(in_file)?;
    print_job_spec_warnings(&job, &spec_name);
    let config = RunConfig::from_spec(&job.spec);
    let estimate = estimate_job(&job, &config).map_err(in_file)?;
    let slice = arguments.slice.or(match job.spec.resources.vram {
        VramRequest::Bytes(bytes) => Some(bytes),
        VramRequest::Auto => None,
    });
    let shrink =
        slice.map(|slice_bytes| (slice_bytes, plan_shrink(&job, &config, None, slice_bytes)));

    let fits = match &shrink {
        Some((_, Ok(_))) | None => true,
        Some((_, Err(CoreError::DoesNotFit { .. }))) => false,
        Some((_, Err(error))) => return Err(in_file(FieldError::new("", error.to_string()))),
    };
    // The classic question, "does it fit a 16 GB card at batch N", answered for common
    // card sizes with everything else as configured.
    let largest_batches: Vec<(u64, Option<u64>)> = COMMON_GPU_BYTES
        .iter()
        .map(|bytes| (*bytes, largest_batch_fitting(&job, &config, *bytes)))
        .collect();
    match arguments.output {
        OutputFormat::Json => {
            let mut report = estimate_json(&estimate);
            report["job"] = json!(job.spec.name);
            report["largest_batch"] = largest_batches
                .iter()
                .map(|(bytes, batch)| json!({ "slice_bytes": bytes, "batch_size": batch }))
                .collect();
            report["parameters"] = json!(job.graph.trainable_parameter_elements());
            if let Some((slice_bytes, outcome)) = &shrink {
                report["slice"] = slice_json(*slice_bytes, outcome);
            }
            println!("{}", serde_json::to_string_pretty(&report)?);
        }
        OutputFormat::Table => {
            let mut text = format!(
                "job {}: {} trainable parameters, {}\n",
                job.spec.name,
                job.graph.trainable_parameter_elements(),
                estimate.config
            );
            write_estimate_table(&mut text, &estimate);
            write_largest_batches(&mut text, &config, &largest_batches);
            if let Some((slice_bytes, outcome)) = &shrink {
                write_slice_table(&mut text, *slice_bytes, &estimate, outcome);
            }
            print!("{text}");
        }
    }
    Ok(if fits {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(FailureKind::OutOfMemory)
    })
}

/// The estimate table and the largest batches for the usual cards: what `carve estimate`
/// prints and `carve import keras` prints after writing a job.
pub(crate) fn write_estimate_report(
    text: &mut String,
    job: &carve_core::validate::ValidatedJob,
    config: &RunConfig,
    estimate: &MemoryEstimate,
) {
    write_estimate_table(text, estimate);
    let batches: Vec<(u64, Option<u64>)> = COMMON_GPU_BYTES
        .iter()
        .map(|bytes| (*bytes, largest_batch_fitting(job, config, *bytes)))
        .collect();
    write_largest_batches(text, config, &batches);
}

/// 16, 24 and 80 GiB: the memory of the usual training cards (V100/T4, RTX 4090/A10, A100/H100).
const COMMON_GPU_BYTES: [u64; 3] = [16 << 30, 24 << 30, 80 << 30];

fn write_largest_batches(text: &mut String, config: &RunConfig, batches: &[(u64, Option<u64>)]) {
    let _ = writeln!(
        text,
        "  largest batch that fits ({}, one micro-batch, as configured otherwise):",
        config.precision
    );
    for (bytes, batch) in batches {
        let answer = match batch {
            Some(batch) => batch.to_string(),
            None => "not even 1 sample".to_string(),
        };
        let _ = writeln!(
            text,
            "    {:<18}{:>12}",
            HumanBytes(*bytes).to_string(),
            answer
        );
    }
}

pub fn config_json(config: &RunConfig) -> Value {
    json!({
        "batch_size": config.batch_size,
        "micro_batch_size": config.micro_batch_size,
        "accumulation_steps": config.accumulation_steps(),
        "precision": config.precision.name(),
        "recompute_segment_layers": config.recompute_segment_layers,
        "workspace_limit_bytes": config.engine.map(|engine| engine.workspace_limit_bytes),
        "prefetch_batches": config.engine.map(|engine| engine.prefetch_batches),
    })
}

fn estimate_json(estimate: &MemoryEstimate) -> Value {
    let by_category: serde_json::Map<String, Value> = estimate
        .by_category
        .iter()
        .map(|(category, bytes)| (category.name().to_string(), json!(bytes)))
        .collect();
    let by_layer: Vec<Value> = estimate
        .by_layer
        .iter()
        .map(|layer| json!({ "layer": layer.label, "bytes": layer.bytes }))
        .collect();
    json!({
        "config": config_json(&estimate.config),
        "peak_bytes": estimate.peak_bytes,
        "required_bytes": estimate.required_bytes,
        "persistent_bytes": estimate.persistent_bytes,
        "fragmentation_bytes_at_peak": estimate.fragmentation_bytes_at_peak,
        "fragmentation_at_peak": estimate.fragmentation_at_peak,
        "peak_during": estimate.peak_during,
        "by_category": by_category,
        "by_layer": by_layer,
    })
}

fn slice_json(slice_bytes: u64, outcome: &Result<ShrinkDecision, CoreError>) -> Value {
    match outcome {
        Ok(decision) => json!({
            "slice_bytes": slice_bytes,
            "fits": true,
            "changed": !decision.steps.is_empty(),
            "budget_bytes": decision.budget_bytes,
            "steps": decision.steps.iter().map(|step| json!({
                "strategy": step.strategy.name(),
                "description": step.description,
            })).collect::<Vec<_>>(),
            "estimate": estimate_json(&decision.estimate),
        }),
        Err(error) => json!({
            "slice_bytes": slice_bytes,
            "fits": false,
            "reason": error.to_string(),
        }),
    }
}

fn write_estimate_table(text: &mut String, estimate: &MemoryEstimate) {
    let _ = writeln!(
        text,
        "  peak in use   {:>12}  (during {})",
        HumanBytes(estimate.peak_bytes).to_string(),
        estimate.peak_during
    );
    let _ = writeln!(
        text,
        "  slice needed  {:>12}  (fragmentation at the peak {}, {:.1}%)",
        HumanBytes(estimate.required_bytes).to_string(),
        HumanBytes(estimate.fragmentation_bytes_at_peak),
        estimate.fragmentation_at_peak * 100.0
    );
    let _ = writeln!(
        text,
        "  persistent    {:>12}  (weights, gradients, optimizer state, input batches)",
        HumanBytes(estimate.persistent_bytes).to_string()
    );
    let _ = writeln!(text, "  at the peak, by category:");
    for (category, bytes) in &estimate.by_category {
        if *bytes > 0 {
            let _ = writeln!(
                text,
                "    {:<18}{:>12}",
                category.name(),
                HumanBytes(*bytes).to_string()
            );
        }
    }
    let _ = writeln!(text, "  at the peak, by layer:");
    for layer in &estimate.by_layer {
        let _ = writeln!(
            text,
            "    {:<24}{:>12}",
            layer.label,
            HumanBytes(layer.bytes).to_string()
        );
    }
}

fn write_slice_table(
    text: &mut String,
    slice_bytes: u64,
    estimate: &MemoryEstimate,
    outcome: &Result<ShrinkDecision, CoreError>,
) {
    match outcome {
        Ok(decision) if decision.steps.is_empty() => {
            let _ = writeln!(
                text,
                "fits in a {} slice as written ({} to spare)",
                HumanBytes(slice_bytes),
                HumanBytes(slice_bytes - estimate.required_bytes.min(slice_bytes))
            );
        }
        Ok(decision) => {
            let _ = writeln!(
                text,
                "does not fit in a {} slice as written; the shrink planner would run: {}",
                HumanBytes(slice_bytes),
                decision.config
            );
            for step in &decision.steps {
                let _ = writeln!(text, "  - {step}");
            }
            write_estimate_table(text, &decision.estimate);
        }
        Err(error) => {
            let _ = writeln!(
                text,
                "does not fit in a {} slice: {error}",
                HumanBytes(slice_bytes)
            );
        }
    }
}
