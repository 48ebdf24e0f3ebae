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
//!
//! The search is bounded: each configuration is compiled and estimated at most once per
//! call, and the compiles and replays are counted in plan steps against
//! [`SHRINK_BUDGET_PLAN_STEPS`]. A model deep enough to exhaust it (thousands of layers
//! with many candidate levels) gets [`CoreError::ShrinkBudgetExhausted`] instead of
//! holding a scheduler thread for seconds.

use std::collections::HashMap;
use std::fmt;

use crate::allocator::OutOfMemory;
use crate::bytes::HumanBytes;
use crate::error::CoreError;
use crate::estimator::{MemoryEstimate, estimate_plan, try_plan_in_slice};
use crate::model::LayerOp;
use crate::plan::{EngineSettings, RunConfig, StepPlan, compile_step_plan, workspace_elements};
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

/// The most plan steps one [`plan_shrink`] call compiles and replays before it gives up
/// with [`CoreError::ShrinkBudgetExhausted`]. A compile and each replay of a plan count
/// its steps (allocate, run, free) once; estimating a candidate is about three of those
/// (compile, the replay, the replay that confirms the slice size).
///
/// Sized at about twice the whole default search (mixed precision, every micro-batch size
/// of a batch of 32, every recompute segment length, every workspace level) of a dense
/// model at the layer limit, [`crate::validate::MAX_MODEL_LAYERS`], which takes 12.5M
/// steps and 0.8 s; a search that spends it all takes 1.7 s of one core (BENCHMARKS.md,
/// "Admission cost by model size"). Real models are far below it: their plans have
/// thousands of steps, not tens of thousands.
pub const SHRINK_BUDGET_PLAN_STEPS: u64 = 25_000_000;

/// Picks the next config for `job` after `current` ran out of memory (or before a first
/// attempt, with no observation) in a slice of `slice_bytes`.
pub fn plan_shrink(
    job: &ValidatedJob,
    current: &RunConfig,
    observation: Option<&OomObservation>,
    slice_bytes: u64,
) -> Result<ShrinkDecision, CoreError> {
    plan_shrink_with_budget(
        job,
        current,
        observation,
        slice_bytes,
        SHRINK_BUDGET_PLAN_STEPS,
    )
}

/// [`plan_shrink`] with its work budget given in plan steps, so that tests can reach the
/// limit with a small model.
pub fn plan_shrink_with_budget(
    job: &ValidatedJob,
    current: &RunConfig,
    observation: Option<&OomObservation>,
    slice_bytes: u64,
    budget_plan_steps: u64,
) -> Result<ShrinkDecision, CoreError> {
    let margin = observation.map_or(0, OomObservation::unaccounted_bytes);
    // The attempt may have had less than the slice it was given (a reservation that came
    // up short): its report's limit is what it really had.
    let usable_bytes = observation.map_or(slice_bytes, |observation| {
        slice_bytes.min(observation.report.limit)
    });
    let budget_bytes = usable_bytes.saturating_sub(margin);
    let policy = &job.spec.oom;
    let mut search = CandidateSearch {
        job,
        budget_bytes,
        budget_plan_steps,
        estimates: HashMap::new(),
        candidate_replays: 0,
        plan_steps_replayed: 0,
    };
    let mut config = *current;
    let mut steps = Vec::new();
    let (fits, mut estimate) = search.judge(&config, None)?;
    if fits {
        return Ok(ShrinkDecision {
            config,
            estimate,
            steps,
            budget_bytes,
        });
    }
    for strategy in &policy.strategies {
        let candidates = candidate_configs(&mut search, &config, *strategy, &estimate)?;
        let mut strongest: Option<(RunConfig, MemoryEstimate)> = None;
        for candidate in candidates {
            let (fits, candidate_estimate) = search.judge(&candidate, Some(&estimate))?;
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
        strategies: strategy_names(&policy.strategies),
    })
}

/// The strategies as a `DoesNotFit` error lists them.
pub(crate) fn strategy_names(strategies: &[ShrinkStrategy]) -> String {
    if strategies.is_empty() {
        "none allowed".to_string()
    } else {
        strategies
            .iter()
            .map(|strategy| strategy.name())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The planner's candidates, each compiled and estimated at most once, with the work
/// counted against the budget.
struct CandidateSearch<'a> {
    job: &'a ValidatedJob,
    budget_bytes: u64,
    budget_plan_steps: u64,
    /// Estimates by config: the recompute strategy estimates its levels to order them and
    /// then judges them, and a config can come up again under another strategy.
    estimates: HashMap<RunConfig, MemoryEstimate>,
    candidate_replays: u64,
    plan_steps_replayed: u64,
}

impl CandidateSearch<'_> {
    /// Compiles `config`, charging the compile to the budget.
    fn compile(&mut self, config: &RunConfig) -> Result<StepPlan, CoreError> {
        let plan = compile_step_plan(self.job, config)?;
        self.plan_steps_replayed = self.plan_steps_replayed.saturating_add(plan_steps(&plan));
        Ok(plan)
    }

    /// The estimate of `config`, from the cache or compiled and replayed now. A new
    /// config is refused once the budget is spent; `smallest_so_far` is the config the
    /// search had reached, which the error reports (with `None`, for the first config
    /// judged, nothing is refused).
    fn estimate(
        &mut self,
        config: &RunConfig,
        smallest_so_far: Option<&MemoryEstimate>,
    ) -> Result<MemoryEstimate, CoreError> {
        if let Some(estimate) = self.estimates.get(config) {
            return Ok(estimate.clone());
        }
        if self.plan_steps_replayed >= self.budget_plan_steps
            && let Some(smallest) = smallest_so_far
        {
            return Err(CoreError::ShrinkBudgetExhausted {
                candidate_replays: self.candidate_replays,
                plan_steps_replayed: self.plan_steps_replayed,
                budget_plan_steps: self.budget_plan_steps,
                available_bytes: self.budget_bytes,
                smallest_required_bytes: smallest.required_bytes,
                smallest_config: smallest.config.to_string(),
            });
        }
        let plan = self.compile(config)?;
        let estimate = estimate_plan(&plan);
        // The replay and the one confirming the slice size.
        self.plan_steps_replayed = self
            .plan_steps_replayed
            .saturating_add(plan_steps(&plan).saturating_mul(2));
        self.candidate_replays += 1;
        self.estimates.insert(*config, estimate.clone());
        Ok(estimate)
    }

    /// Estimates `config` and checks it in a slice of exactly the budget.
    fn judge(
        &mut self,
        config: &RunConfig,
        smallest_so_far: Option<&MemoryEstimate>,
    ) -> Result<(bool, MemoryEstimate), CoreError> {
        let estimate = self.estimate(config, smallest_so_far)?;
        if estimate.peak_bytes > self.budget_bytes {
            return Ok((false, estimate));
        }
        // Best fit in a region of exactly the budget can place differently from the
        // estimate's region, so a config whose peak fits is confirmed by a replay there.
        let plan = self.compile(config)?;
        let fits = try_plan_in_slice(&plan, self.budget_bytes).is_ok();
        self.plan_steps_replayed = self.plan_steps_replayed.saturating_add(plan_steps(&plan));
        Ok((fits, estimate))
    }
}

fn plan_steps(plan: &StepPlan) -> u64 {
    (plan.setup.len() + plan.micro_batch.len() + plan.update.len() + plan.evaluation.len()) as u64
}

/// The levels of one strategy applied to `config`, gentlest first.
fn candidate_configs(
    search: &mut CandidateSearch<'_>,
    config: &RunConfig,
    strategy: ShrinkStrategy,
    smallest_so_far: &MemoryEstimate,
) -> Result<Vec<RunConfig>, CoreError> {
    let job = search.job;
    let policy = &job.spec.oom;
    Ok(match strategy {
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
        ShrinkStrategy::Accumulate => accumulate_candidates(config, policy.min_micro_batch),
        ShrinkStrategy::Recompute => {
            let layer_count = job.graph.layers.len() as u64;
            let current_segment = config.recompute_segment_layers.unwrap_or(1);
            // Every segment length costs about one extra forward pass, so the order that
            // matters is memory: the estimator sorts them.
            let mut candidates: Vec<(u64, RunConfig)> = Vec::new();
            for segment in segment_lengths(layer_count) {
                if segment == current_segment {
                    continue;
                }
                let candidate = RunConfig {
                    recompute_segment_layers: Some(segment),
                    ..*config
                };
                match search.estimate(&candidate, Some(smallest_so_far)) {
                    Ok(estimate) => candidates.push((estimate.required_bytes, candidate)),
                    // A level the model cannot compile is not a candidate.
                    Err(CoreError::InvalidSpec(_)) => {}
                    Err(other) => return Err(other),
                }
            }
            candidates.sort_by_key(|(required_bytes, _)| std::cmp::Reverse(*required_bytes));
            candidates
                .into_iter()
                .map(|(_, candidate)| candidate)
                .collect()
        }
        ShrinkStrategy::Workspace => {
            let mut caps = Vec::new();
            let mut cap = config.workspace_limit_bytes() / 2;
            while cap >= 1 << 20 {
                caps.push(cap);
                cap /= 2;
            }
            if config.workspace_limit_bytes() > 0 {
                caps.push(0);
            }
            // A cap that leaves every layer's workspace as it is compiles to the current
            // plan, which did not fit and is not smaller, so it is not worth a replay (a
            // model without convolutions has no workspace to cap at all).
            let workspaces_by_layer = |config: &RunConfig| -> Vec<Option<u64>> {
                job.graph
                    .layers
                    .iter()
                    .map(|layer| workspace_elements(layer, config))
                    .collect()
            };
            let current_workspaces = workspaces_by_layer(config);
            // A model job's config has the engine's knobs (checked before any plan); one
            // without them has no workspace to cap.
            let Some(engine) = config.engine else {
                return Ok(Vec::new());
            };
            caps.into_iter()
                .map(|workspace_limit_bytes| RunConfig {
                    engine: Some(EngineSettings {
                        workspace_limit_bytes,
                        ..engine
                    }),
                    ..*config
                })
                .filter(|candidate| workspaces_by_layer(candidate) != current_workspaces)
                .collect()
        }
        ShrinkStrategy::ShrinkBatch => shrink_batch_candidates(config, policy.min_micro_batch),
    })
}

/// `accumulate`'s levels, gentlest first: every smaller micro-batch that divides the
/// batch, down to `min_micro_batch`.
pub(crate) fn accumulate_candidates(config: &RunConfig, min_micro_batch: u64) -> Vec<RunConfig> {
    divisors_descending(config.batch_size)
        .into_iter()
        .filter(|micro| *micro < config.micro_batch_size && *micro >= min_micro_batch)
        .map(|micro_batch_size| RunConfig {
            micro_batch_size,
            ..*config
        })
        .collect()
}

/// `shrink_batch`'s levels, gentlest first: the batch halved again and again, down to
/// `min_micro_batch`, each with the largest micro-batch at most the current one.
pub(crate) fn shrink_batch_candidates(config: &RunConfig, min_micro_batch: u64) -> Vec<RunConfig> {
    let mut candidates = Vec::new();
    let mut batch_size = config.batch_size / 2;
    while batch_size >= min_micro_batch.max(1) {
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

/// The divisors of `number`, largest first.
pub(crate) fn divisors_descending(number: u64) -> Vec<u64> {
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
        ShrinkStrategy::MixedPrecision => describe_precision_change(from, to),
        ShrinkStrategy::Accumulate => {
            let has_batch_norm = job
                .graph
                .layers
                .iter()
                .any(|layer| matches!(layer.op, LayerOp::BatchNorm { .. }));
            let mut description = describe_micro_batch_change(from, to);
            if has_batch_norm {
                description.push_str(&format!(
                    "; batch norm now normalizes over {} samples instead of {}",
                    to.micro_batch_size, from.micro_batch_size
                ));
            }
            description
        }
        ShrinkStrategy::Recompute => format!(
            "keep every {}th layer's input and recompute the rest in backward (about one extra forward pass)",
            to.recompute_segment_layers.unwrap_or(1)
        ),
        ShrinkStrategy::Workspace => format!(
            "convolution workspace {} -> {} (slower algorithms may be chosen)",
            HumanBytes(from.workspace_limit_bytes()),
            HumanBytes(to.workspace_limit_bytes())
        ),
        ShrinkStrategy::ShrinkBatch => describe_batch_change(from, to),
    };
    ShrinkStep {
        strategy,
        description,
    }
}

/// `mixed_precision`'s change, as every planner words it.
pub(crate) fn describe_precision_change(from: &RunConfig, to: &RunConfig) -> String {
    format!(
        "{} -> {} activations and gradients, fp32 master weights{}",
        from.precision,
        to.precision,
        if to.precision == Precision::Fp16 {
            ", dynamic loss scaling"
        } else {
            ""
        }
    )
}

/// `accumulate`'s change, as every planner words it.
pub(crate) fn describe_micro_batch_change(from: &RunConfig, to: &RunConfig) -> String {
    format!(
        "{} micro-batches of {} (was {} of {}), effective batch {} unchanged",
        to.accumulation_steps(),
        to.micro_batch_size,
        from.accumulation_steps(),
        from.micro_batch_size,
        to.batch_size,
    )
}

/// `shrink_batch`'s change, as every planner words it.
pub(crate) fn describe_batch_change(from: &RunConfig, to: &RunConfig) -> String {
    format!(
        "batch {} -> {}: this changes the training (the job allowed it)",
        from.batch_size, to.batch_size
    )
}
