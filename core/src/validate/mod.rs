//! Reading and checking job specs: strict parsing with field paths, then every semantic
//! check and shape inference through the layers.
//!
//! All size arithmetic is checked, so an absurd spec (a 10^12-pixel image, a batch of 2^60)
//! is an error that names the field, never an overflow.
//!
//! One file per part of the spec: `parse` (text to `JobSpec`), `model` (layers and shape
//! inference), `training`, `data`; the name, resources and OOM policy checks are short
//! and stay here.

use std::collections::HashSet;

use crate::error::FieldError;
use crate::model::ModelGraph;
use crate::spec::{
    JobSpec, OomPolicySpec, Precision, ResourcesSpec, VramRequest, check_model_gpus,
};

mod data;
mod model;
mod parse;
mod training;

pub use data::require_absolute_data_paths;
pub use parse::{load_job_spec_toml, parse_job_spec_json, parse_job_spec_toml};
pub(crate) use parse::{parse_json, parse_toml};

/// Per-sample elements above this are refused: 2^40 fp32 values is 4 TiB for one sample,
/// far beyond any GPU, and keeping a bound leaves room for batch and byte multiplication.
pub const MAX_ELEMENTS_PER_SAMPLE: u64 = 1 << 40;

/// Models with more layers than this are refused at `model.layers`. Validating,
/// estimating and shrink-planning a job cost time in proportion to its layer count, and a
/// submit pays for them, so the count is bounded. Real models fit with room: ResNet-152 is
/// about 500 layers here (every conv, batch norm and activation counts), large graph
/// models a few thousand. The scheduler may refuse a larger spec early with this same
/// number.
pub const MAX_MODEL_LAYERS: usize = 4096;

/// Batches above this are refused (`training.batch_size`, `command.global_batch`): the
/// shrink planners enumerate a batch's divisors, and no GPU trains 16M samples at once.
pub const MAX_BATCH_SIZE: u64 = 1 << 24;

/// A spec that passed every check, with its model's shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedJob {
    pub spec: JobSpec,
    pub graph: ModelGraph,
}

impl ValidatedJob {
    /// What in the spec is allowed but probably a mistake. Nothing here stops the job; a
    /// front end shows these to the person who wrote the spec.
    pub fn warnings(&self) -> Vec<SpecWarning> {
        model::channels_first_warning(&self.spec.model.input_shape)
            .into_iter()
            .collect()
    }
}

/// A valid setting that looks like a mistake, with the field it is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecWarning {
    /// Path of the field, as in [`FieldError::field`].
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for SpecWarning {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "{}: {}", self.field, self.message)
    }
}

/// Every semantic check of a spec; returns the model graph with inferred shapes.
pub fn validate_job_spec(spec: JobSpec) -> Result<ValidatedJob, FieldError> {
    validate_name(&spec.name)?;
    let graph = model::infer_model_graph(&spec)?;
    training::validate_training(&spec)?;
    data::validate_data(&spec, &graph)?;
    check_model_gpus(spec.resources.gpus)?;
    validate_resources(&spec.resources)?;
    validate_oom_policy(&spec.oom, spec.training.batch_size, "training.batch_size")?;
    Ok(ValidatedJob { spec, graph })
}

/// A job name is short and safe in paths and logs.
pub(crate) fn validate_name(name: &str) -> Result<(), FieldError> {
    if name.is_empty() {
        return Err(FieldError::new("name", "must not be empty"));
    }
    if name.len() > 128 {
        return Err(FieldError::new(
            "name",
            format!("is {} characters long; the limit is 128", name.len()),
        ));
    }
    if let Some(bad) = name.chars().find(|character| {
        !(character.is_ascii_alphanumeric() || matches!(character, '-' | '_' | '.'))
    }) {
        return Err(FieldError::new(
            "name",
            format!("{bad:?} is not allowed; use letters, digits, '-', '_' and '.'"),
        ));
    }
    Ok(())
}

// The number rules the layer and training checks share; each message says the rule
// the value broke.

fn positive_finite(value: f64, field: &str) -> Result<(), FieldError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(FieldError::new(
            field,
            format!("{value} must be a finite number > 0"),
        ))
    }
}

fn in_unit_interval(value: f64, field: &str) -> Result<(), FieldError> {
    if (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        Err(FieldError::new(field, format!("{value} must be in [0, 1)")))
    }
}

fn non_negative_finite(value: f64, field: &str) -> Result<(), FieldError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(FieldError::new(
            field,
            format!("{value} must be a finite number >= 0"),
        ))
    }
}

/// The `[resources]` checks, the same for every kind of job but `gpus`, which each kind
/// checks itself (`check_model_gpus`, `check_command_gpus`).
pub(crate) fn validate_resources(resources: &ResourcesSpec) -> Result<(), FieldError> {
    if resources.vram == VramRequest::Bytes(0) {
        return Err(FieldError::new(
            "resources.vram",
            "must be \"auto\" or more than 0 bytes",
        ));
    }
    resources.max_duration_limit()?;
    resources.host_limits()?;
    Ok(())
}

/// The `[oom]` checks, the same for every kind of job; `batch_size` is the effective
/// batch the micro-batch floor must fit in, named `batch_field` in the message.
pub(crate) fn validate_oom_policy(
    policy: &OomPolicySpec,
    batch_size: u64,
    batch_field: &str,
) -> Result<(), FieldError> {
    let mut seen = HashSet::new();
    for (index, strategy) in policy.strategies.iter().enumerate() {
        if !seen.insert(*strategy) {
            return Err(FieldError::new(
                format!("oom.strategies[{index}]"),
                format!("{} is listed twice", strategy.name()),
            ));
        }
    }
    if policy.min_micro_batch == 0 {
        return Err(FieldError::new("oom.min_micro_batch", "must be at least 1"));
    }
    if policy.min_micro_batch > batch_size {
        return Err(FieldError::new(
            "oom.min_micro_batch",
            format!(
                "{} is larger than {batch_field} {batch_size}",
                policy.min_micro_batch
            ),
        ));
    }
    if policy.half_precision == Precision::Fp32 {
        return Err(FieldError::new(
            "oom.half_precision",
            "must be fp16 or bf16",
        ));
    }
    if policy.max_retries > 100 {
        return Err(FieldError::new(
            "oom.max_retries",
            format!("{} is more than the limit of 100", policy.max_retries),
        ));
    }
    Ok(())
}
