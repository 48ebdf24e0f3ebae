//! The next configuration of a command job after an OOM, in one step, from the memory
//! model: the job's strategies in its order (`mixed_precision`, `accumulate`,
//! `recompute`, `shrink_batch`), the gentlest level of each that the model says fits, as
//! `crate::shrink` does for model jobs.

use crate::error::CoreError;
use crate::plan::RunConfig;
use crate::shrink::{
    OomObservation, ShrinkDecision, ShrinkStep, accumulate_candidates, describe_batch_change,
    describe_micro_batch_change, describe_precision_change, shrink_batch_candidates,
    strategy_names,
};
use crate::spec::{Precision, ShrinkStrategy};

use super::memory_model::CommandMemoryModel;
use super::validate::{ValidatedCommandJob, half_precision_for};

/// Picks the next config for `job` after `current` ran out of memory (or, with no
/// observation, before a first attempt) in a slice of `slice_bytes`.
///
/// The budget is the slice (or the smaller limit the OOM report shows the attempt had).
/// With an observation, the model is first raised to cover what the attempt needed at
/// the moment it failed (`in_use + requested` at `current`), and to more than the budget
/// (it ran out there, whatever its numbers say), so `current` is never proposed again.
/// Then, in the job's order:
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
    let budget_bytes = observation.map_or(slice_bytes, |observation| {
        slice_bytes.min(observation.report.limit)
    });
    let model = match observation {
        Some(observation) => {
            let report = &observation.report;
            let needed = report
                .in_use
                .saturating_add(report.requested)
                .max(budget_bytes.saturating_add(1));
            model.refined(current, needed)
        }
        None => *model,
    };
    let fits = |config: &RunConfig| model.need_bytes(config) <= budget_bytes;
    let decision = |config: RunConfig, steps: Vec<ShrinkStep>| ShrinkDecision {
        config,
        estimate: model.estimate(&config),
        steps,
        budget_bytes,
    };
    let mut config = *current;
    let mut steps = Vec::new();
    if fits(&config) {
        return Ok(decision(config, steps));
    }
    let policy = &job.spec.oom;
    for strategy in &policy.strategies {
        let candidates = candidate_configs(job, &config, *strategy);
        if let Some(fitting) = candidates.iter().find(|candidate| fits(candidate)) {
            steps.push(describe_step(*strategy, &config, fitting));
            return Ok(decision(*fitting, steps));
        }
        // Nothing of this strategy fits alone: its strongest level stays, and the next
        // strategy is tried on top of it.
        if let Some(strongest) = candidates
            .iter()
            .min_by_key(|candidate| model.need_bytes(candidate))
            && model.need_bytes(strongest) < model.need_bytes(&config)
        {
            steps.push(describe_step(*strategy, &config, strongest));
            config = *strongest;
        }
    }
    Err(CoreError::DoesNotFit {
        available_bytes: budget_bytes,
        smallest_required_bytes: model.need_bytes(&config),
        smallest_config: describe_config(&config),
        strategies: strategy_names(&policy.strategies),
    })
}

/// The levels of one strategy applied to `config`, gentlest first.
fn candidate_configs(
    job: &ValidatedCommandJob,
    config: &RunConfig,
    strategy: ShrinkStrategy,
) -> Vec<RunConfig> {
    let min_micro_batch = job.spec.oom.min_micro_batch;
    match strategy {
        ShrinkStrategy::MixedPrecision => half_precision_for(job)
            .filter(|_| config.precision == Precision::Fp32)
            .map(|precision| RunConfig {
                precision,
                ..*config
            })
            .into_iter()
            .collect(),
        ShrinkStrategy::Accumulate => accumulate_candidates(config, min_micro_batch),
        ShrinkStrategy::Recompute => {
            if job.spec.command.recompute.is_some() && config.recompute_segment_layers.is_none() {
                vec![RunConfig {
                    recompute_segment_layers: Some(1),
                    ..*config
                }]
            } else {
                Vec::new()
            }
        }
        // Validation refuses it for command jobs: Carve does not choose their algorithms.
        ShrinkStrategy::Workspace => Vec::new(),
        ShrinkStrategy::ShrinkBatch => shrink_batch_candidates(config, min_micro_batch),
    }
}

fn describe_step(strategy: ShrinkStrategy, from: &RunConfig, to: &RunConfig) -> ShrinkStep {
    let description = match strategy {
        ShrinkStrategy::MixedPrecision => describe_precision_change(from, to),
        ShrinkStrategy::Accumulate => describe_micro_batch_change(from, to),
        ShrinkStrategy::Recompute => {
            "recomputation on (the job's recompute arguments): about one extra forward pass"
                .to_string()
        }
        ShrinkStrategy::Workspace => "workspace unchanged".to_string(),
        ShrinkStrategy::ShrinkBatch => describe_batch_change(from, to),
    };
    ShrinkStep {
        strategy,
        description,
    }
}

/// A command job's config in words: the knobs it has (no workspace or prefetch).
fn describe_config(config: &RunConfig) -> String {
    let mut description = if config.micro_batch_size == config.batch_size {
        format!("batch {}", config.batch_size)
    } else {
        format!(
            "batch {} as {} micro-batches of {}",
            config.batch_size,
            config.accumulation_steps(),
            config.micro_batch_size
        )
    };
    description.push_str(&format!(", {}", config.precision));
    if config.recompute_segment_layers.is_some() {
        description.push_str(", recompute on");
    }
    description
}

#[cfg(test)]
mod tests;
