//! The shrink planner: after an attempt runs out of memory, pick the next configuration
//! in one step — the largest one that fits, using only the strategies the job allows, in
//! its order of preference.
//!
//! Every candidate is judged by the estimator (a replay of its plan in a slice of the
//! budget's size), so the planner never halves blindly and never proposes a config that
//! the allocator bookkeeping says will run out again.
//!
//! Strategies are tried in the job's order. Within a strategy the gentlest level that fits
//! wins; if no level of it fits alone, its strongest level is kept and the next strategy
//! is tried on top, so the result combines as few changes as possible.

use std::fmt;

use crate::allocator::OutOfMemory;
use crate::bytes::HumanBytes;
use crate::error::CoreError;
use crate::estimator::{MemoryEstimate, estimate_plan, try_plan_in_slice};
use crate::model::LayerOp;
use crate::plan::{RunConfig, compile_step_plan};
use crate::spec::{Precision, ShrinkStrategy};
use crate::validate::ValidatedJob;

/// What an attempt that ran out of memory reported, with what the estimator had predicted
/// for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OomObservation {
    pub report: OutOfMemory,
    /// `required_bytes` of the failed attempt's estimate.
    pub estimated_required_bytes: u64,
}

impl OomObservation {
    /// Memory the estimator did not see: the attempt needed at least `in_use + requested`
    /// at the moment it failed. When that is above the estimate, the difference (cuDNN
    /// handles, a library's private buffers) is kept free in the next attempt.
    pub fn unaccounted_bytes(&self) -> u64 {
        self.report
            .in_use
            .saturating_add(self.report.requested)
            .saturating_sub(self.estimated_required_bytes)
    }
}

/// One change the planner made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShrinkStep {
    pub strategy: ShrinkStrategy,
    /// For people: what changed and what it costs.
    pub description: String,
}

impl fmt::Display for ShrinkStep {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}: {}", self.strategy.name(), self.description)
    }
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ShrinkDecision {
    pub config: RunConfig,
    pub estimate: MemoryEstimate,
    /// Empty when the current config already fits the budget.
    pub steps: Vec<ShrinkStep>,
    /// The slice size (or the smaller limit the attempt really had) less what the last OOM
    /// showed the estimator misses.
    pub budget_bytes: u64,
}

/// Picks the next config for `job` after `current` ran out of memory (or before a first
/// attempt, with no observation) in a slice of `slice_bytes`.
pub fn plan_shrink(
    job: &ValidatedJob,
    current: &RunConfig,
    observation: Option<&OomObservation>,
    slice_bytes: u64,
) -> Result<ShrinkDecision, CoreError> {
    let margin = observation.map_or(0, OomObservation::unaccounted_bytes);
    // The attempt may have had less than the slice it was given (a reservation that came
    // up short): its report's limit is what it really had.
    let usable_bytes = observation.map_or(slice_bytes, |observation| {
        slice_bytes.min(observation.report.limit)
    });
    let budget_bytes = usable_bytes.saturating_sub(margin);
    let policy = &job.spec.oom;
    let mut config = *current;
    let mut steps = Vec::new();
    let (fits, mut estimate) = judge(job, &config, budget_bytes)?;
    if fits {
        return Ok(ShrinkDecision {
            config,
            estimate,
            steps,
            budget_bytes,
        });
    }
    for strategy in &policy.strategies {
        let candidates = candidate_configs(job, &config, *strategy);
        let mut strongest: Option<(RunConfig, MemoryEstimate)> = None;
        for candidate in candidates {
            let (fits, candidate_estimate) = judge(job, &candidate, budget_bytes)?;
            if fits {
                steps.push(describe_step(job, *strategy, &config, &candidate));
                return Ok(ShrinkDecision {
                    config: candidate,
                    estimate: candidate_estimate,
                    steps,
                    budget_bytes,
                });
            }
            let smaller = strongest
                .as_ref()
                .is_none_or(|(_, best)| candidate_estimate.required_bytes < best.required_bytes);
            if smaller {
                strongest = Some((candidate, candidate_estimate));
            }
        }
        if let Some((candidate, candidate_estimate)) = strongest
            && candidate_estimate.required_bytes < estimate.required_bytes
        {
            steps.push(describe_step(job, *strategy, &config, &candidate));
            config = candidate;
            estimate = candidate_estimate;
        }
    }
    Err(CoreError::DoesNotFit {
        available_bytes: budget_bytes,
        smallest_required_bytes: estimate.required_bytes,
        smallest_config: config.to_string(),
        strategies: if policy.strategies.is_empty() {
            "none allowed".to_string()
        } else {
            policy
                .strategies
                .iter()
                .map(|strategy| strategy.name())
                .collect::<Vec<_>>()
                .join(", ")
        },
    })
}

/// Estimates `config` and checks it in a slice of exactly `budget_bytes`.
fn judge(
    job: &ValidatedJob,
    config: &RunConfig,
    budget_bytes: u64,
) -> Result<(bool, MemoryEstimate), CoreError> {
    let plan = compile_step_plan(job, config)?;
    let estimate = estimate_plan(&plan);
    let fits =
        estimate.peak_bytes <= budget_bytes && try_plan_in_slice(&plan, budget_bytes).is_ok();
    Ok((fits, estimate))
}

/// The levels of one strategy applied to `config`, gentlest first.
fn candidate_configs(
    job: &ValidatedJob,
    config: &RunConfig,
    strategy: ShrinkStrategy,
) -> Vec<RunConfig> {
    let policy = &job.spec.oom;
    match strategy {
        ShrinkStrategy::MixedPrecision => {
            if config.precision == Precision::Fp32 {
                vec![RunConfig {
                    precision: policy.half_precision,
                    ..*config
                }]
            } else {
                Vec::new()
            }
        }
        ShrinkStrategy::Accumulate => divisors_descending(config.batch_size)
            .into_iter()
            .filter(|micro| *micro < config.micro_batch_size && *micro >= policy.min_micro_batch)
            .map(|micro_batch_size| RunConfig {
                micro_batch_size,
                ..*config
            })
            .collect(),
        ShrinkStrategy::Recompute => {
            let layer_count = job.graph.layers.len() as u64;
            let current_segment = config.recompute_segment_layers.unwrap_or(1);
            // Every segment length costs about one extra forward pass, so the order that
            // matters is memory: the estimator sorts them.
            let mut candidates: Vec<(u64, RunConfig)> = segment_lengths(layer_count)
                .into_iter()
                .filter(|segment| *segment != current_segment)
                .filter_map(|segment| {
                    let candidate = RunConfig {
                        recompute_segment_layers: Some(segment),
                        ..*config
                    };
                    let plan = compile_step_plan(job, &candidate).ok()?;
                    Some((estimate_plan(&plan).required_bytes, candidate))
                })
                .collect();
            candidates.sort_by_key(|(required_bytes, _)| std::cmp::Reverse(*required_bytes));
            candidates
                .into_iter()
                .map(|(_, candidate)| candidate)
                .collect()
        }
        ShrinkStrategy::Workspace => {
            let mut caps = Vec::new();
            let mut cap = config.workspace_limit_bytes / 2;
            while cap >= 1 << 20 {
                caps.push(cap);
                cap /= 2;
            }
            if config.workspace_limit_bytes > 0 {
                caps.push(0);
            }
            caps.into_iter()
                .map(|workspace_limit_bytes| RunConfig {
                    workspace_limit_bytes,
                    ..*config
                })
                .collect()
        }
        ShrinkStrategy::ShrinkBatch => {
            let mut candidates = Vec::new();
            let mut batch_size = config.batch_size / 2;
            while batch_size >= policy.min_micro_batch.max(1) {
                let micro_batch_size = divisors_descending(batch_size)
                    .into_iter()
                    .find(|micro| *micro <= config.micro_batch_size)
                    .unwrap_or(1);
                candidates.push(RunConfig {
                    batch_size,
                    micro_batch_size,
                    ..*config
                });
                batch_size /= 2;
            }
            candidates
        }
    }
}

/// Segment lengths worth trying: all of them for small models, a spread for deep ones.
fn segment_lengths(layer_count: u64) -> Vec<u64> {
    if layer_count <= 64 {
        return (2..=layer_count).collect();
    }
    let mut lengths: Vec<u64> = (2..=16).collect();
    let mut length = 20;
    while length <= layer_count {
        lengths.push(length);
        length = length * 5 / 4;
    }
    lengths
}

fn divisors_descending(number: u64) -> Vec<u64> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut divisor = 1;
    while divisor * divisor <= number {
        if number.is_multiple_of(divisor) {
            small.push(divisor);
            if divisor * divisor != number {
                large.push(number / divisor);
            }
        }
        divisor += 1;
    }
    large.extend(small.into_iter().rev());
    large
}

fn describe_step(
    job: &ValidatedJob,
    strategy: ShrinkStrategy,
    from: &RunConfig,
    to: &RunConfig,
) -> ShrinkStep {
    let description = match strategy {
        ShrinkStrategy::MixedPrecision => format!(
            "{} -> {} activations and gradients, fp32 master weights{}",
            from.precision,
            to.precision,
            if to.precision == Precision::Fp16 {
                ", dynamic loss scaling"
            } else {
                ""
            }
        ),
        ShrinkStrategy::Accumulate => {
            let has_batch_norm = job
                .graph
                .layers
                .iter()
                .any(|layer| matches!(layer.op, LayerOp::BatchNorm { .. }));
            format!(
                "{} micro-batches of {} (was {} of {}), effective batch {} unchanged{}",
                to.accumulation_steps(),
                to.micro_batch_size,
                from.accumulation_steps(),
                from.micro_batch_size,
                to.batch_size,
                if has_batch_norm {
                    format!(
                        "; batch norm now normalizes over {} samples instead of {}",
                        to.micro_batch_size, from.micro_batch_size
                    )
                } else {
                    String::new()
                }
            )
        }
        ShrinkStrategy::Recompute => format!(
            "keep every {}th layer's input and recompute the rest in backward (about one extra forward pass)",
            to.recompute_segment_layers.unwrap_or(1)
        ),
        ShrinkStrategy::Workspace => format!(
            "convolution workspace {} -> {} (slower algorithms may be chosen)",
            HumanBytes(from.workspace_limit_bytes),
            HumanBytes(to.workspace_limit_bytes)
        ),
        ShrinkStrategy::ShrinkBatch => format!(
            "batch {} -> {}: this changes the training (the job allowed it)",
            from.batch_size, to.batch_size
        ),
    };
    ShrinkStep {
        strategy,
        description,
    }
}
