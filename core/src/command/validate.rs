//! Checking a command job, and reading a spec of either kind.
//!
//! A spec is a command job when its top level has a `command` table; every other spec is
//! a model job, read by `crate::validate` as before, so its errors are unchanged. Which
//! kind a text is, and reading either, is `crate::workload`'s; the functions here that
//! read either kind forward to it.

use crate::error::FieldError;
use crate::plan::RunConfig;
use crate::shrink::divisors_descending;
use crate::spec::{Precision, ShrinkStrategy, VramRequest, check_command_gpus};
use crate::validate::{MAX_BATCH_SIZE, validate_name, validate_oom_policy, validate_resources};

use super::image::{check_secret_name, parse_image_reference};
use super::memory_model::learning::check_declared_vram_is_a_size;
use super::render::{TemplatePiece, parse_template};
use super::spec::{CommandJobSpec, CommandSpec};

/// A command job that passed every check.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedCommandJob {
    pub spec: CommandJobSpec,
}

impl ValidatedCommandJob {
    /// The configuration of the first attempt: `batch_size` is `global_batch`,
    /// `micro_batch_size` the spec's micro-batch, `precision` the starting precision,
    /// `recompute_segment_layers` unset (any value means "recompute on" for a command
    /// job), and no engine settings (a workspace and prefetch slots mean nothing to a
    /// program Carve does not run itself).
    pub fn initial_config(&self) -> RunConfig {
        let command = &self.spec.command;
        RunConfig {
            batch_size: command.global_batch,
            micro_batch_size: command.micro_batch.unwrap_or(command.global_batch),
            precision: command
                .precision
                .or_else(|| command.precisions.first().copied())
                .unwrap_or_default(),
            recompute_segment_layers: None,
            engine: None,
        }
    }

    /// The two micro-batch sizes the profile measures (equal when `global_batch` is 1).
    pub fn profile_micro_batches(&self) -> [u64; 2] {
        if let Some(micro_batches) = self.spec.command.profile.micro_batches {
            return micro_batches;
        }
        let first = self.initial_config().micro_batch_size;
        let second = divisors_descending(self.spec.command.global_batch)
            .into_iter()
            .find(|divisor| *divisor <= first / 2)
            .unwrap_or(first);
        [first, second]
    }
}

/// A stored or submitted spec of either kind: the workload (`crate::workload`), under the
/// name it had before it moved there.
pub use crate::workload::Workload as ValidatedSpec;

/// Every check of a command job: name (the model jobs' rule), argv not empty, placeholders
/// known (`render::PLACEHOLDERS`) and well formed, `{max_steps}` needs `steps`, `vram =
/// "auto"` needs `{max_steps}` in argv or env (the profile must be able to stop the
/// program), environment variable names valid and not Carve's own (`CARVE_*`,
/// `LD_PRELOAD`, `CUDA_VISIBLE_DEVICES`), an absolute working directory, `global_batch`
/// at least 1 with a micro-batch that divides it, `precisions` not empty and without
/// duplicates, `precision` one of them, an image reference the worker can pull and a
/// pull secret that names a tenant secret (`image.rs`), profile steps >= 1 and its micro-batches
/// divisors, the resources and OOM policy as for model jobs, a declared vram of at least
/// 1 MiB (`vram = 2` is a size written without its unit, refused; strategies a command job
/// cannot use, `workspace`, are refused; `mixed_precision` needs a half precision in
/// `precisions`; `recompute` needs `command.recompute`).
///
/// The one exception to refusing: a strategy list equal to the default (what a spec
/// without `oom.strategies` gets) is narrowed to the strategies this job can use, so a
/// command job file need not write the list out.
pub fn validate_command_job_spec(
    mut spec: CommandJobSpec,
) -> Result<ValidatedCommandJob, FieldError> {
    validate_name(&spec.name)?;
    let command = &spec.command;
    let uses_max_steps = validate_templates(command)?;
    validate_environment_names(command)?;
    let named_paths = command
        .working_directory
        .iter()
        .map(|directory| ("command.working_directory".to_string(), directory))
        .chain(
            command
                .read_only_paths
                .iter()
                .enumerate()
                .map(|(index, path)| (format!("command.read_only_paths[{index}]"), path)),
        );
    for (field, path) in named_paths {
        if !path.starts_with('/') || path.contains('\0') {
            return Err(FieldError::new(
                field,
                format!("{path:?} must be an absolute path without NUL characters"),
            ));
        }
    }
    validate_image(command)?;
    validate_batches(command)?;
    validate_precisions(command)?;
    match (command.steps, &uses_max_steps) {
        (Some(0), _) => return Err(FieldError::new("command.steps", "must be at least 1")),
        (None, Some(field)) => {
            return Err(FieldError::new(
                "command.steps",
                format!("must be set: {field} uses {{max_steps}}, which renders it"),
            ));
        }
        _ => {}
    }
    if spec.resources.vram == VramRequest::Auto && uses_max_steps.is_none() {
        return Err(FieldError::new(
            "command.argv",
            "resources.vram = \"auto\" measures the program in a short profile run, which \
             {max_steps} (in command.argv or command.env) stops; use it, or give \
             resources.vram a size",
        ));
    }
    validate_profile(command)?;
    check_command_gpus(spec.resources.gpus)?;
    validate_resources(&spec.resources)?;
    check_declared_vram_is_a_size(spec.resources.vram)?;
    if spec.oom.strategies == ShrinkStrategy::default_order() {
        spec.oom.strategies.retain(|strategy| {
            *strategy != ShrinkStrategy::Workspace
                && (*strategy != ShrinkStrategy::MixedPrecision || has_half_precision(command))
                && (*strategy != ShrinkStrategy::Recompute || command.recompute.is_some())
        });
    }
    validate_oom_policy(&spec.oom, command.global_batch, "command.global_batch")?;
    validate_command_strategies(&spec)?;
    Ok(ValidatedCommandJob { spec })
}

/// `command.image` parses as a reference the worker can pull; `command.image_pull_secret`
/// names a tenant secret and goes with an image.
fn validate_image(command: &CommandSpec) -> Result<(), FieldError> {
    if let Some(image) = &command.image {
        parse_image_reference("command.image", image)?;
    }
    if let Some(secret) = &command.image_pull_secret {
        check_secret_name("command.image_pull_secret", secret)?;
        if command.image.is_none() {
            return Err(FieldError::new(
                "command.image_pull_secret",
                "pulls command.image, which is not set",
            ));
        }
    }
    Ok(())
}

/// Every templated string parses; returns the first field that uses `{max_steps}` in
/// argv or env (the recompute arguments are not counted: the profile runs without them).
fn validate_templates(command: &CommandSpec) -> Result<Option<String>, FieldError> {
    if command.argv.is_empty() {
        return Err(FieldError::new(
            "command.argv",
            "must name the program to run",
        ));
    }
    if command.argv[0].is_empty() {
        return Err(FieldError::new(
            "command.argv[0]",
            "the program must not be empty",
        ));
    }
    let mut uses_max_steps = None;
    let argv_fields = command
        .argv
        .iter()
        .enumerate()
        .map(|(index, argument)| (format!("command.argv[{index}]"), argument, true));
    let env_fields = command
        .env
        .iter()
        .map(|(name, value)| (format!("command.env.{name}"), value, true));
    let recompute_fields =
        command.recompute.iter().flat_map(|recompute| {
            recompute.argv.iter().enumerate().map(|(index, argument)| {
                (format!("command.recompute.argv[{index}]"), argument, false)
            })
        });
    for (field, text, counts_for_profile) in argv_fields.chain(env_fields).chain(recompute_fields) {
        if text.contains('\0') {
            return Err(FieldError::new(field, "must not contain a NUL character"));
        }
        let pieces = parse_template(text).map_err(|reason| FieldError::new(&field, reason))?;
        let has_max_steps = pieces.contains(&TemplatePiece::Placeholder("max_steps"));
        if has_max_steps && counts_for_profile && uses_max_steps.is_none() {
            uses_max_steps = Some(field);
        }
    }
    Ok(uses_max_steps)
}

/// Names a program can be given, and not the ones Carve sets itself.
fn validate_environment_names(command: &CommandSpec) -> Result<(), FieldError> {
    for name in command.env.keys() {
        let field = format!("command.env.{name}");
        let well_formed = name
            .chars()
            .next()
            .is_some_and(|first| first.is_ascii_alphabetic() || first == '_')
            && name
                .chars()
                .all(|character| character.is_ascii_alphanumeric() || character == '_');
        if !well_formed {
            return Err(FieldError::new(
                field,
                "is not a valid environment variable name (letters, digits and '_', not \
                 starting with a digit)",
            ));
        }
        if name.starts_with("CARVE_") || name == "LD_PRELOAD" || name == "CUDA_VISIBLE_DEVICES" {
            return Err(FieldError::new(
                field,
                "is set by Carve itself (CARVE_*, LD_PRELOAD and CUDA_VISIBLE_DEVICES are reserved)",
            ));
        }
    }
    Ok(())
}

fn validate_batches(command: &CommandSpec) -> Result<(), FieldError> {
    if command.global_batch == 0 {
        return Err(FieldError::new(
            "command.global_batch",
            "must be at least 1",
        ));
    }
    if command.global_batch > MAX_BATCH_SIZE {
        return Err(FieldError::new(
            "command.global_batch",
            format!(
                "{} is larger than the limit of {MAX_BATCH_SIZE}",
                command.global_batch
            ),
        ));
    }
    if let Some(micro_batch) = command.micro_batch {
        check_divisor(micro_batch, command.global_batch, "command.micro_batch")?;
    }
    Ok(())
}

/// `micro_batch` is at least 1 and divides `global_batch`.
fn check_divisor(micro_batch: u64, global_batch: u64, field: &str) -> Result<(), FieldError> {
    if micro_batch == 0 {
        return Err(FieldError::new(field, "must be at least 1"));
    }
    if !global_batch.is_multiple_of(micro_batch) {
        return Err(FieldError::new(
            field,
            format!("{micro_batch} does not divide command.global_batch {global_batch}"),
        ));
    }
    Ok(())
}

fn validate_precisions(command: &CommandSpec) -> Result<(), FieldError> {
    if command.precisions.is_empty() {
        return Err(FieldError::new(
            "command.precisions",
            "must list at least one precision the program accepts",
        ));
    }
    for (index, precision) in command.precisions.iter().enumerate() {
        if command.precisions[..index].contains(precision) {
            return Err(FieldError::new(
                format!("command.precisions[{index}]"),
                format!("{precision} is listed twice"),
            ));
        }
    }
    if let Some(precision) = command.precision
        && !command.precisions.contains(&precision)
    {
        return Err(FieldError::new(
            "command.precision",
            format!(
                "{precision} is not in command.precisions ({})",
                precision_names(&command.precisions)
            ),
        ));
    }
    Ok(())
}

fn precision_names(precisions: &[Precision]) -> String {
    precisions
        .iter()
        .map(|precision| precision.name())
        .collect::<Vec<_>>()
        .join(", ")
}

fn validate_profile(command: &CommandSpec) -> Result<(), FieldError> {
    if command.profile.steps == 0 {
        return Err(FieldError::new(
            "command.profile.steps",
            "must be at least 1",
        ));
    }
    if let Some(micro_batches) = command.profile.micro_batches {
        for (index, micro_batch) in micro_batches.into_iter().enumerate() {
            check_divisor(
                micro_batch,
                command.global_batch,
                &format!("command.profile.micro_batches[{index}]"),
            )?;
        }
    }
    Ok(())
}

fn has_half_precision(command: &CommandSpec) -> bool {
    command
        .precisions
        .iter()
        .any(|precision| precision.is_mixed())
}

/// The strategies a command job lists are ones it can use.
fn validate_command_strategies(spec: &CommandJobSpec) -> Result<(), FieldError> {
    for (index, strategy) in spec.oom.strategies.iter().enumerate() {
        let reason = match strategy {
            ShrinkStrategy::Workspace => Some(
                "workspace cannot be used by a command job: Carve does not choose its \
                 convolution algorithms (use mixed_precision, accumulate, recompute or \
                 shrink_batch)"
                    .to_string(),
            ),
            ShrinkStrategy::MixedPrecision if !has_half_precision(&spec.command) => Some(format!(
                "mixed_precision needs fp16 or bf16 in command.precisions ({})",
                precision_names(&spec.command.precisions)
            )),
            ShrinkStrategy::Recompute if spec.command.recompute.is_none() => {
                Some("recompute needs command.recompute, the arguments that turn it on".to_string())
            }
            _ => None,
        };
        if let Some(reason) = reason {
            return Err(FieldError::new(format!("oom.strategies[{index}]"), reason));
        }
    }
    Ok(())
}

/// Reads and checks a spec of either kind from JSON (how it travels over the API):
/// [`crate::workload::Workload::from_json`].
pub fn parse_spec_json(text: &str) -> Result<ValidatedSpec, FieldError> {
    ValidatedSpec::from_json(text)
}

/// Reads and checks a spec of either kind from a TOML job file:
/// [`crate::workload::Workload::from_toml`].
pub fn load_spec_toml(text: &str) -> Result<ValidatedSpec, FieldError> {
    ValidatedSpec::from_toml(text)
}

/// The half precision a command job's `mixed_precision` strategy moves to: the job's
/// `oom.half_precision` when the program accepts it, else the other half precision it
/// accepts.
pub fn half_precision_for(job: &ValidatedCommandJob) -> Option<Precision> {
    let accepted = &job.spec.command.precisions;
    let preferred = job.spec.oom.half_precision;
    if preferred.is_mixed() && accepted.contains(&preferred) {
        return Some(preferred);
    }
    accepted
        .iter()
        .copied()
        .find(|precision| precision.is_mixed())
}

#[cfg(test)]
mod tests;
