//! `carve submit`, `carve get` and `carve cancel`: a researcher's view of jobs through
//! the JobService (`carve jobs` is job_list.rs).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use carve_proto::v1;

use super::attempt_results::{print_results, progress_text};
use super::connection::{Connection, ConnectionOptions};
use super::failure::{ClientFailure, FailureKind, FailureTally};
use super::output::{
    OutputFormat, age_text, attempt_note, bytes_text, config_text, job_state_name, message_json,
    now_seconds, outcome_name, precision_name, print_message, print_structured, print_wide_table,
    timestamp_text,
};
use super::overrides::{SpecOverride, apply_overrides, parse_override, toml_to_json};
use super::spec_errors::spec_error_in_file;
use super::watch::{follow_job, job_exit, watch_job};
use crate::spec_input::{
    data_base_directory, job_spec_name, make_command_directory_absolute, make_data_paths_absolute,
    read_job_spec_text,
};

#[derive(Debug, clap::Args)]
pub struct SubmitArguments {
    /// The job spec (TOML); `-` reads it from stdin (a file named `-` is `./-`). Relative
    /// data paths are made absolute against the spec's directory (the current directory
    /// for a spec from stdin and for --set values) before it is sent: the worker that
    /// runs the job reads them from a directory of its own.
    file: PathBuf,
    /// Changes a value of the spec before it is sent: a dotted path and a TOML value
    /// (training.batch_size=32, resources.vram=8GiB, model.layers[0].conv2d.filters=16).
    /// Repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = parse_override)]
    overrides: Vec<SpecOverride>,
    /// Watch the job after submitting it (as `carve watch`; the exit code is the job's).
    /// With `-o json` or `-o yaml` the watch goes to stderr and stdout gets one document:
    /// the job as it ended.
    #[arg(long)]
    watch: bool,
    /// Makes retrying safe: a second submit with the same key returns the first job.
    #[arg(long, value_name = "KEY")]
    idempotency_key: Option<String>,
    /// Print only the job id.
    #[arg(short, long, conflicts_with = "output")]
    quiet: bool,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
    output: OutputFormat,
    #[command(flatten)]
    connection: ConnectionOptions,
}

#[derive(Debug, clap::Args)]
pub struct GetArguments {
    /// The jobs: each an id (`job-` may be left off), a unique prefix of one, its short
    /// id (its last hex digits, at least four, as `carve jobs` shows them), or a job's
    /// name (of several, the one still going). With several, each is shown (json and
    /// yaml: a list) and the exit code is the first failure's.
    #[arg(required = true, value_name = "JOB")]
    jobs: Vec<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
    output: OutputFormat,
    #[command(flatten)]
    connection: ConnectionOptions,
}

#[derive(Debug, clap::Args)]
pub struct CancelArguments {
    /// The jobs: each an id (`job-` may be left off), a unique prefix of one, its short
    /// id (as `carve jobs` shows it), or a job's name (of several, the one still going).
    /// With several, each is cancelled and reported (json and yaml: a list); the exit
    /// code is the first failure's.
    #[arg(required = true, value_name = "JOB")]
    jobs: Vec<String>,
    /// Why, for the job's message and its watchers.
    #[arg(long)]
    reason: Option<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
    output: OutputFormat,
    #[command(flatten)]
    connection: ConnectionOptions,
}

/// Reads the job file, applies the overrides and returns the file's text and the spec
/// as JSON.
fn spec_json_from_file(arguments: &SubmitArguments) -> Result<(String, String)> {
    let spec_name = job_spec_name(&arguments.file);
    let text = read_job_spec_text(&arguments.file)
        .with_context(|| format!("cannot read the job file {spec_name}"))?;
    let invalid = |reason: String| {
        anyhow::Error::new(ClientFailure::new(
            FailureKind::InvalidArgument,
            format!("{spec_name}: {reason}"),
        ))
    };
    let mut document: toml::Table =
        toml::from_str(&text).map_err(|error| invalid(error.to_string().trim_end().to_string()))?;
    make_data_paths_absolute(&mut document, data_base_directory(&arguments.file))
        .map_err(invalid)?;
    make_command_directory_absolute(&mut document, data_base_directory(&arguments.file))
        .map_err(invalid)?;
    apply_overrides(&mut document, &arguments.overrides).map_err(invalid)?;
    // What --set wrote is relative to where the command runs.
    make_data_paths_absolute(&mut document, Path::new(".")).map_err(invalid)?;
    let json = toml_to_json(&toml::Value::Table(document), "").map_err(invalid)?;
    Ok((text, json.to_string()))
}

pub async fn submit(arguments: SubmitArguments) -> Result<ExitCode> {
    let (text, spec_json) = spec_json_from_file(&arguments)?;
    let connection = Connection::open(&arguments.connection).await?;
    let action = format!("cannot submit {}", arguments.file.display());
    let request = v1::SubmitJobRequest {
        spec_json,
        idempotency_key: arguments.idempotency_key.clone().unwrap_or_default(),
    };
    let submit = |connection: Connection| {
        let request = request.clone();
        async move { connection.jobs().submit_job(request).await }
    };
    // A submit is retried on a broken connection only with an idempotency key: without
    // one a submit the scheduler stored before the connection broke would be made twice
    // (carve makes no key of its own: the key is the user's to reuse on purpose).
    let response = if request.idempotency_key.is_empty() {
        submit(connection.clone())
            .await
            .map(tonic::Response::into_inner)
    } else {
        connection.retrying(submit).await
    }
    .map_err(|status| {
        let status = spec_error_in_file(&status, &text, &arguments.overrides);
        connection.failure(&status, &action)
    })?;
    // Named as `carve estimate` and `carve run` name them; the job was admitted anyway.
    let spec_name = job_spec_name(&arguments.file);
    for warning in &response.warnings {
        eprintln!("{spec_name}: warning: {warning}");
    }
    let job = response
        .job
        .clone()
        .context("the scheduler answered a submit without the job")?;
    let document = !arguments.quiet && arguments.output != OutputFormat::Table;
    if arguments.watch && document {
        eprintln!("submitted {}", job.id);
        let ended = follow_job(&connection, &job.id, false, true).await?;
        print_message(&ended, "carve.v1.Job", arguments.output)?;
        return job_exit(&ended);
    }
    if arguments.quiet {
        println!("{}", job.id);
    } else if document {
        print_message(&response, "carve.v1.SubmitJobResponse", arguments.output)?;
    } else {
        print_submitted(&job, response.created);
    }
    if arguments.watch {
        return watch_job(&connection, &job.id, false).await;
    }
    Ok(ExitCode::SUCCESS)
}

/// The configuration the spec asks for, as the API writes configs; `None` when the stored
/// spec does not read back (it always should).
fn config_as_written(job: &v1::Job) -> Option<v1::RunConfig> {
    let spec = carve_proto::convert::validated_spec_from_json(&job.spec_json).ok()?;
    Some(spec.initial_config().into())
}

/// Whether two configs differ in what the shrink planner turns.
fn config_changed(before: &v1::RunConfig, after: &v1::RunConfig) -> bool {
    (
        before.batch_size,
        before.micro_batch_size,
        before.precision,
        before.recompute_segment_layers,
        before.workspace_limit_bytes,
    ) != (
        after.batch_size,
        after.micro_batch_size,
        after.precision,
        after.recompute_segment_layers,
        after.workspace_limit_bytes,
    )
}

/// Every change of configuration the job went through, oldest first: at submit (to fit
/// its slice or the largest GPU) and after each attempt that ran out of memory.
fn shrink_history(job: &v1::Job) -> Vec<String> {
    let mut history = Vec::new();
    let Some(written) = config_as_written(job) else {
        return history;
    };
    let mut previous = written;
    let mut when = "at submit".to_string();
    let mut configs: Vec<(&v1::RunConfig, String)> = Vec::new();
    for attempt in &job.attempts {
        if let Some(config) = &attempt.config {
            configs.push((config, when.clone()));
        }
        when = format!(
            "after attempt {} ({})",
            attempt.number,
            outcome_name(attempt.outcome).replace('_', " ")
        );
    }
    if let Some(current) = &job.current_config {
        configs.push((current, when));
    }
    for (config, when) in configs {
        if config_changed(&previous, config) {
            history.push(format!(
                "{when}: {} -> {}",
                config_text(Some(&previous)),
                config_text(Some(config))
            ));
        }
        previous = *config;
    }
    history
}

fn print_submitted(job: &v1::Job, created: bool) {
    if created {
        println!("submitted job {} ({})", job.id, job.name);
    } else {
        println!(
            "job {} ({}) already exists for this idempotency key; nothing was submitted",
            job.id, job.name
        );
    }
    println!("  state:     {}", job_state_name(job.state));
    if let Some(estimate) = &job.estimate {
        println!(
            "  estimate:  {} required (peak {})",
            bytes_text(Some(estimate.required_bytes)),
            bytes_text(Some(estimate.peak_bytes))
        );
    }
    println!("  config:    {}", config_text(job.current_config.as_ref()));
    for change in shrink_history(job) {
        println!("  shrunk {change}");
    }
    if !job.waiting_reason.is_empty() {
        println!("  waiting:   {}", job.waiting_reason);
    }
}

pub async fn get(arguments: GetArguments) -> Result<ExitCode> {
    let connection = Connection::open(&arguments.connection).await?;
    let mut failures = FailureTally::default();
    let mut found = Vec::new();
    for reference in &arguments.jobs {
        match connection.fetch_job(reference).await {
            Ok(job) if arguments.output == OutputFormat::Table => {
                if !found.is_empty() {
                    println!();
                }
                print_job_details(&job);
                found.push(job);
            }
            Ok(job) => found.push(job),
            Err(error) if arguments.jobs.len() == 1 => return Err(error),
            Err(error) => failures.record(&error),
        }
    }
    print_jobs_document(&found, arguments.jobs.len(), arguments.output)?;
    Ok(failures.exit_code())
}

/// The jobs in `format` when it is a document format: one job as itself (as before
/// several could be asked for), several as a list. Tables are printed as they come.
fn print_jobs_document(jobs: &[v1::Job], asked: usize, format: OutputFormat) -> Result<()> {
    match (format, jobs) {
        (OutputFormat::Table, _) => Ok(()),
        (format, [job]) if asked == 1 => print_message(job, "carve.v1.Job", format),
        (format, jobs) => {
            let list = jobs
                .iter()
                .map(|job| message_json(job, "carve.v1.Job"))
                .collect::<Result<Vec<_>>>()?;
            print_structured(&serde_json::Value::Array(list), format)
        }
    }
}

fn print_job_details(job: &v1::Job) {
    let now = now_seconds();
    println!("job {}  {}", job.id, job.name);
    println!("  tenant:     {}", job.tenant);
    println!("  state:      {}", job_state_name(job.state));
    if !job.waiting_reason.is_empty() {
        println!("  waiting:    {}", job.waiting_reason);
    }
    if !job.message.is_empty() {
        println!("  message:    {}", job.message);
    }
    println!(
        "  submitted:  {} ({} ago)",
        timestamp_text(job.created_at.as_ref()),
        age_text(job.created_at.as_ref(), now)
    );
    if job.finished_at.is_some() {
        println!("  finished:   {}", timestamp_text(job.finished_at.as_ref()));
    }
    if !job.image_digest.is_empty() {
        // The bytes every attempt of the job runs, whatever its tag names now.
        println!("  image:      {}", job.image_digest);
    }
    if let Some(progress) = progress_text(job) {
        println!("  progress:   {progress}");
    }
    if let Some(written) = config_as_written(job) {
        println!("  as written: {}", config_text(Some(&written)));
    }
    println!("  config:     {}", config_text(job.current_config.as_ref()));
    if let Some(estimate) = &job.estimate {
        println!(
            "  estimate:   {} required, peak {}{}",
            bytes_text(Some(estimate.required_bytes)),
            bytes_text(Some(estimate.peak_bytes)),
            if estimate.peak_during.is_empty() {
                String::new()
            } else {
                format!(" during {}", estimate.peak_during)
            }
        );
        let categories: Vec<String> = estimate
            .by_category
            .iter()
            .filter(|category| category.bytes > 0)
            .map(|category| format!("{} {}", category.category, bytes_text(Some(category.bytes))))
            .collect();
        if !categories.is_empty() {
            println!("  at peak:    {}", categories.join(", "));
        }
    }
    if let Some(model) = &job.memory_model {
        if model.measured {
            println!(
                "  memory:     {} + {} per sample of the micro-batch (measured at {}{})",
                bytes_text(Some(model.fixed_bytes)),
                bytes_text(Some(model.per_sample_bytes)),
                precision_name(model.precision),
                if model.recompute {
                    ", recompute on"
                } else {
                    ""
                }
            );
        } else {
            println!(
                "  memory:     unmeasured: sized at {} (a fallback, not a measurement)",
                bytes_text(Some(model.fixed_bytes))
            );
        }
        if !model.basis.is_empty() {
            println!(
                "  model:      {} (carve reset-model forgets it)",
                model.basis
            );
        }
    }
    let history = shrink_history(job);
    if !history.is_empty() {
        println!("  shrunk:");
        for change in history {
            println!("    {change}");
        }
    }
    if job.attempts.is_empty() {
        println!("  attempts:   none yet");
        return;
    }
    println!();
    let rows: Vec<[String; 9]> = job
        .attempts
        .iter()
        .map(|attempt| {
            [
                attempt.number.to_string(),
                outcome_name(attempt.outcome),
                config_text(attempt.config.as_ref()),
                bytes_text(Some(attempt.slice_bytes)),
                bytes_text(Some(attempt.estimate_bytes)),
                bytes_text(attempt.measured_peak_bytes),
                attempt.worker_id.clone(),
                attempt.gpu_uuid.clone(),
                attempt_note(attempt),
            ]
        })
        .collect();
    // One job's detail, not a list: whole cells (the worker and GPU ids are there to copy).
    print_wide_table(
        [
            "ATTEMPT", "OUTCOME", "CONFIG", "SLICE", "ESTIMATE", "PEAK", "WORKER", "GPU", "NOTE",
        ],
        &rows,
    );
    print_attempt_stories(job);
    println!();
    print_results(job);
}

/// Why each attempt ran as it did and, for command jobs, what ran and what a profile
/// measured: the lines `get` prints under the attempts table.
fn print_attempt_stories(job: &v1::Job) {
    for attempt in &job.attempts {
        let lines = attempt_story(attempt);
        if lines.is_empty() {
            continue;
        }
        println!();
        let label = if attempt.profile { " (profile)" } else { "" };
        println!("  attempt {}{label}:", attempt.number);
        for line in lines {
            println!("    {line}");
        }
    }
}

/// What `get` says of an attempt that ran without its container.
const UNCONTAINED_LINE: &str =
    "contained: NO — ran with the worker's rights (no OCI runtime, or --insecure-no-sandbox)";

/// One attempt's story lines (none when there is nothing to tell).
fn attempt_story(attempt: &v1::Attempt) -> Vec<String> {
    let mut lines = Vec::new();
    // First: nothing else about the attempt matters as much.
    if attempt.uncontained {
        lines.push(UNCONTAINED_LINE.to_string());
    }
    if !attempt.chosen_because.is_empty() {
        lines.push(format!("why:      {}", attempt.chosen_because));
    }
    if !attempt.command_argv.is_empty() {
        lines.push(format!("ran:      {}", attempt.command_argv.join(" ")));
    }
    if !attempt.profile_points.is_empty() {
        let points: Vec<String> = attempt
            .profile_points
            .iter()
            .map(|point| {
                format!(
                    "micro-batch {}: {}{}",
                    point.micro_batch,
                    bytes_text(Some(point.peak_bytes)),
                    if point.ran_out { " (ran out)" } else { "" }
                )
            })
            .collect();
        lines.push(format!("measured: {}", points.join(", ")));
    }
    if !attempt.oom_detected_by.is_empty() {
        lines.push(format!("oom seen by {}", attempt.oom_detected_by));
    }
    lines
}

pub async fn cancel(arguments: CancelArguments) -> Result<ExitCode> {
    let connection = Connection::open(&arguments.connection).await?;
    let mut failures = FailureTally::default();
    let mut cancelled = Vec::new();
    for reference in &arguments.jobs {
        match cancel_one(&connection, reference, &arguments).await {
            Ok(job) => cancelled.push(job),
            Err(error) if arguments.jobs.len() == 1 => return Err(error),
            Err(error) => failures.record(&error),
        }
    }
    print_jobs_document(&cancelled, arguments.jobs.len(), arguments.output)?;
    Ok(failures.exit_code())
}

/// Cancels the job `reference` names; in a table, says so at once.
async fn cancel_one(
    connection: &Connection,
    reference: &str,
    arguments: &CancelArguments,
) -> Result<v1::Job> {
    let job = connection
        .jobs()
        .cancel_job(v1::CancelJobRequest {
            job_id: reference.to_string(),
            reason: arguments.reason.clone().unwrap_or_default(),
        })
        .await
        .map_err(|status| connection.failure(&status, &format!("cannot cancel job {reference}")))?
        .into_inner()
        .job
        .context("the scheduler answered a cancel without the job")?;
    match arguments.output {
        OutputFormat::Table if job.state == v1::JobState::Cancelled as i32 => {
            println!("job {} ({}) cancelled", job.id, job.name);
        }
        OutputFormat::Table => println!(
            "job {} ({}) is cancelling: its attempt stops within its grace period (state {})",
            job.id,
            job.name,
            job_state_name(job.state)
        ),
        _ => {}
    }
    Ok(job)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(batch: u64, micro: u64, precision: v1::Precision) -> v1::RunConfig {
        v1::RunConfig {
            batch_size: batch,
            micro_batch_size: micro,
            precision: precision as i32,
            recompute_segment_layers: None,
            workspace_limit_bytes: 0,
            prefetch_batches: 2,
        }
    }

    #[test]
    fn the_shrink_history_tells_each_change_and_when_it_happened() {
        let spec_json = carve_proto::convert::job_spec_to_json(
            &carve_core::validate::parse_job_spec_toml(include_str!(
                "../../../examples/mnist-cnn.toml"
            ))
            .unwrap(),
        )
        .unwrap();
        let written = config_as_written(&v1::Job {
            spec_json: spec_json.clone(),
            ..v1::Job::default()
        })
        .unwrap();
        let at_submit = v1::RunConfig {
            micro_batch_size: 16,
            ..written
        };
        let after_oom = v1::RunConfig {
            precision: v1::Precision::Fp16 as i32,
            ..at_submit
        };
        let job = v1::Job {
            spec_json,
            attempts: vec![v1::Attempt {
                number: 1,
                config: Some(at_submit),
                outcome: v1::AttemptOutcome::OutOfMemory as i32,
                ..v1::Attempt::default()
            }],
            current_config: Some(after_oom),
            ..v1::Job::default()
        };
        assert_eq!(
            shrink_history(&job),
            [
                "at submit: batch 64, micro 64, fp32 -> batch 64, micro 16, fp32",
                "after attempt 1 (out of memory): batch 64, micro 16, fp32 -> batch 64, micro 16, fp16"
            ]
        );
        let unchanged = v1::Job {
            current_config: Some(written),
            attempts: Vec::new(),
            ..job
        };
        assert!(shrink_history(&unchanged).is_empty());
        assert!(config_changed(
            &config(8, 8, v1::Precision::Fp32),
            &config(8, 4, v1::Precision::Fp32)
        ));
    }

    #[test]
    fn an_uncontained_attempt_says_so_first_and_a_contained_one_says_nothing_of_it() {
        let contained = v1::Attempt {
            number: 1,
            command_argv: vec!["python3".into(), "train.py".into()],
            ..v1::Attempt::default()
        };
        assert_eq!(attempt_story(&contained), ["ran:      python3 train.py"]);
        let uncontained = v1::Attempt {
            uncontained: true,
            ..contained
        };
        assert_eq!(
            attempt_story(&uncontained),
            [
                "contained: NO — ran with the worker's rights (no OCI runtime, or \
                 --insecure-no-sandbox)",
                "ran:      python3 train.py"
            ]
        );
        // A model job's attempt has no other story: it is still told.
        let engine = v1::Attempt {
            uncontained: true,
            ..v1::Attempt::default()
        };
        assert_eq!(attempt_story(&engine), [UNCONTAINED_LINE]);
        // -o json and yaml carry the field, whatever its value.
        let json = message_json(&uncontained, "carve.v1.Attempt").unwrap();
        assert_eq!(json["uncontained"], serde_json::Value::Bool(true));
        let json = message_json(&v1::Attempt::default(), "carve.v1.Attempt").unwrap();
        assert_eq!(json["uncontained"], serde_json::Value::Bool(false));
    }
}
