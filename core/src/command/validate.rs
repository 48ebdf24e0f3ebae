//! Checking a command job, and reading a spec of either kind.
//!
//! A spec is a command job when its top level has a `command` table; every other spec is
//! a model job, read by `crate::validate` as before, so its errors are unchanged.

use crate::error::FieldError;
use crate::plan::RunConfig;
use crate::spec::{OomPolicySpec, Precision, ResourcesSpec};
use crate::validate::{SpecWarning, ValidatedJob};

use super::spec::CommandJobSpec;

/// A command job that passed every check.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedCommandJob {
    pub spec: CommandJobSpec,
}

impl ValidatedCommandJob {
    /// The configuration of the first attempt: `batch_size` is `global_batch`,
    /// `micro_batch_size` the spec's micro-batch, `precision` the starting precision,
    /// `recompute_segment_layers` unset (any value means "recompute on" for a command
    /// job), `workspace_limit_bytes` and `prefetch_batches` 0 (they mean nothing to a
    /// program Carve does not run itself).
    pub fn initial_config(&self) -> RunConfig {
        todo!()
    }

    /// The two micro-batch sizes the profile measures (equal when `global_batch` is 1).
    pub fn profile_micro_batches(&self) -> [u64; 2] {
        todo!()
    }
}

/// A stored or submitted spec of either kind.
#[derive(Debug, Clone, PartialEq)]
pub enum ValidatedSpec {
    Model(ValidatedJob),
    Command(ValidatedCommandJob),
}

impl ValidatedSpec {
    pub fn name(&self) -> &str {
        match self {
            ValidatedSpec::Model(job) => &job.spec.name,
            ValidatedSpec::Command(job) => &job.spec.name,
        }
    }

    pub fn priority(&self) -> i32 {
        match self {
            ValidatedSpec::Model(job) => job.spec.priority,
            ValidatedSpec::Command(job) => job.spec.priority,
        }
    }

    pub fn resources(&self) -> &ResourcesSpec {
        match self {
            ValidatedSpec::Model(job) => &job.spec.resources,
            ValidatedSpec::Command(job) => &job.spec.resources,
        }
    }

    pub fn oom(&self) -> &OomPolicySpec {
        match self {
            ValidatedSpec::Model(job) => &job.spec.oom,
            ValidatedSpec::Command(job) => &job.spec.oom,
        }
    }

    /// The configuration the spec asks for.
    pub fn initial_config(&self) -> RunConfig {
        match self {
            ValidatedSpec::Model(job) => RunConfig::from_spec(&job.spec),
            ValidatedSpec::Command(job) => job.initial_config(),
        }
    }

    /// What is allowed but probably a mistake.
    pub fn warnings(&self) -> Vec<SpecWarning> {
        match self {
            ValidatedSpec::Model(job) => job.warnings(),
            ValidatedSpec::Command(_) => Vec::new(),
        }
    }
}

/// Every check of a command job: name (the model jobs' rule), argv not empty, placeholders
/// known (`render::PLACEHOLDERS`) and well formed, `{max_steps}` needs `steps`, `vram =
/// "auto"` needs `{max_steps}` in argv or env (the profile must be able to stop the
/// program), environment variable names valid and not Carve's own (`CARVE_*`,
/// `LD_PRELOAD`, `CUDA_VISIBLE_DEVICES`), an absolute working directory, `global_batch`
/// >= 1 with a micro-batch that divides it, `precisions` not empty and without
/// duplicates, `precision` one of them, profile steps >= 1 and its micro-batches
/// divisors, the resources and OOM policy as for model jobs (strategies a command job
/// cannot use, `workspace`, are refused; `mixed_precision` needs a half precision in
/// `precisions`; `recompute` needs `command.recompute`).
pub fn validate_command_job_spec(spec: CommandJobSpec) -> Result<ValidatedCommandJob, FieldError> {
    let _ = spec;
    todo!()
}

/// Reads and checks a spec of either kind from JSON (how it travels over the API).
pub fn parse_spec_json(text: &str) -> Result<ValidatedSpec, FieldError> {
    let _ = text;
    todo!()
}

/// Reads and checks a spec of either kind from a TOML job file.
pub fn load_spec_toml(text: &str) -> Result<ValidatedSpec, FieldError> {
    let _ = text;
    todo!()
}

/// The half precision a command job's `mixed_precision` strategy moves to: the job's
/// `oom.half_precision` when the program accepts it, else the other half precision it
/// accepts.
pub fn half_precision_for(job: &ValidatedCommandJob) -> Option<Precision> {
    let _ = job;
    todo!()
}
