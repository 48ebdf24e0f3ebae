//! The next configuration of a command job after an OOM, in one step, from the memory
//! model: the job's strategies in its order (`mixed_precision`, `accumulate`,
//! `recompute`, `shrink_batch`), the gentlest level of each that the model says fits, as
//! `crate::shrink` does for model jobs.

use crate::error::CoreError;
use crate::plan::RunConfig;
use crate::shrink::{OomObservation, ShrinkDecision};

use super::memory_model::CommandMemoryModel;
use super::validate::ValidatedCommandJob;

/// Picks the next config for `job` after `current` ran out of memory (or, with no
/// observation, before a first attempt) in a slice of `slice_bytes`.
///
/// The budget is the slice (or the smaller limit the OOM report shows the attempt had).
/// With an observation, the model is first raised to cover what the attempt needed at
/// the moment it failed (`in_use + requested` at `current`). Then, in the job's order:
/// `mixed_precision` moves to the job's half precision (`validate::half_precision_for`);
/// `accumulate` picks the largest divisor of `global_batch` (at least
/// `oom.min_micro_batch`) whose need fits, accumulation = global / micro; `recompute`
/// turns recomputation on (`recompute_segment_layers = Some(1)`); `shrink_batch` lowers
/// `global_batch` itself (changes the training; only if listed). A strategy that alone
/// does not fit keeps its strongest level and the next is tried on top. The decision's
/// `estimate` is `model.estimate(config)`; its steps describe each change ("micro-batch
/// 256 -> 64 (4 accumulation steps)"). Nothing the strategies reach fits:
/// `CoreError::DoesNotFit` with the smallest need reached.
pub fn plan_command_shrink(
    job: &ValidatedCommandJob,
    model: &CommandMemoryModel,
    current: &RunConfig,
    observation: Option<&OomObservation>,
    slice_bytes: u64,
) -> Result<ShrinkDecision, CoreError> {
    let _ = (job, model, current, observation, slice_bytes);
    todo!()
}
