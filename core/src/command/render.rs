//! Placeholders to the argv and environment of one run of a command job.

use std::collections::BTreeMap;

use crate::error::FieldError;
use crate::plan::RunConfig;

use super::validate::ValidatedCommandJob;

/// Every placeholder a command may use, written `{name}`; `{{` and `}}` stand for literal
/// braces.
pub const PLACEHOLDERS: &[&str] = &[
    "micro_batch",
    "accumulation_steps",
    "global_batch",
    "precision",
    "checkpoint_dir",
    "max_steps",
];

/// The environment variables the worker sets for every run of a command job, whether or
/// not the program reads them (the same values as the placeholders).
pub const ENVIRONMENT_MICRO_BATCH: &str = "CARVE_MICRO_BATCH";
pub const ENVIRONMENT_ACCUMULATION_STEPS: &str = "CARVE_ACCUMULATION_STEPS";
pub const ENVIRONMENT_GLOBAL_BATCH: &str = "CARVE_GLOBAL_BATCH";
pub const ENVIRONMENT_PRECISION: &str = "CARVE_PRECISION";
pub const ENVIRONMENT_CHECKPOINT_DIR: &str = "CARVE_CHECKPOINT_DIR";
/// Set only when the run has a step limit (the profile, or a spec with `steps`).
pub const ENVIRONMENT_MAX_STEPS: &str = "CARVE_MAX_STEPS";
/// "1" when recomputation is on, "0" otherwise.
pub const ENVIRONMENT_RECOMPUTE: &str = "CARVE_RECOMPUTE";

/// One run: the program, its arguments and the environment Carve adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedCommand {
    pub argv: Vec<String>,
    /// The spec's `env`, rendered, then the `CARVE_*` variables above.
    pub env: BTreeMap<String, String>,
    pub working_directory: Option<String>,
}

impl RenderedCommand {
    /// The argv as one line a person can read (and paste into a shell): arguments with
    /// spaces or quotes are quoted.
    pub fn display_line(&self) -> String {
        todo!()
    }
}

/// Renders `job` for a run with `config`. `max_steps` is the profile's step count in a
/// profile run and `None` in a full run (then `{max_steps}` renders the spec's `steps`).
/// Recomputation on (`config.recompute_segment_layers` set) appends the spec's
/// `recompute.argv`. Errors name the field (`command.argv[3]`) only for what validation
/// cannot rule out (a config the job does not allow: a precision not in `precisions`, a
/// micro-batch that does not divide `global_batch`).
pub fn render_command(
    job: &ValidatedCommandJob,
    config: &RunConfig,
    checkpoint_dir: &str,
    max_steps: Option<u64>,
) -> Result<RenderedCommand, FieldError> {
    let _ = (job, config, checkpoint_dir, max_steps);
    todo!()
}
