//! The estimator: replays a step plan through the slice allocator bookkeeping, with no
//! data and no math, and reports what the allocator saw.
//!
//! Because the engine executes the very same plan through the very same allocator, the
//! estimate is not a formula that approximates the engine: the peak here *is* the peak of
//! a real step, fragmentation included.

use crate::allocator::{OutOfMemory, SliceAllocator};
use crate::error::FieldError;
use crate::plan::{BufferOwner, MemoryCategory, PlanStep, RunConfig, StepPlan, compile_step_plan};
use crate::validate::ValidatedJob;

/// Bytes held by one owner (a layer, the input, the loss) at the peak.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerBytes {
    /// `layers[3].conv2d`, `input` or `loss`.
    pub label: String,
    pub bytes: u64,
}

/// What one training step needs.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryEstimate {
    pub config: RunConfig,
    /// The allocator's peak bytes in use during a step (rounded sizes).
    pub peak_bytes: u64,
    /// The smallest slice the step runs in: the peak plus the holes best-fit leaves.
    pub required_bytes: u64,
    /// Bytes allocated once per attempt (weights, masters, gradients, optimizer state,
    /// input batches).
    pub persistent_bytes: u64,
    /// Free bytes between live buffers at the peak.
    pub fragmentation_bytes_at_peak: u64,
    /// `fragmentation_bytes_at_peak` as a share of the extent in use at the peak.
    pub fragmentation_at_peak: f64,
    /// Bytes per category at the peak, in [`MemoryCategory::ALL`] order, zeros included.
    pub by_category: Vec<(MemoryCategory, u64)>,
    /// Bytes per owner at the peak, in model order (input first, loss last), owners with
    /// nothing live left out.
    pub by_layer: Vec<LayerBytes>,
    /// The operation during which the peak was reached, e.g. `backward layers[2].conv2d`.
    pub peak_during: String,
}

/// The allocator's view of one replay.
#[derive(Debug, Clone)]
struct Replay {
    peak_bytes: u64,
    high_water_mark: u64,
    persistent_bytes: u64,
    fragmentation_bytes_at_peak: u64,
    extent_at_peak: u64,
    category_bytes_at_peak: [u64; 8],
    /// Where the peak was first reached: the phase and the position of the allocation
    /// in it. `None` when nothing was allocated.
    peak_at: Option<(usize, usize)>,
    /// The rounded size each buffer took when it was allocated (0 if never): the
    /// breakdown by owner at the peak is rebuilt from these after the replay.
    allocated_sizes: Vec<u64>,
}

/// The phases in the order a step runs them (setup once, then one of each).
fn phases(plan: &StepPlan) -> [&Vec<PlanStep>; 4] {
    [
        &plan.setup,
        &plan.micro_batch,
        &plan.update,
        &plan.evaluation,
    ]
}

/// Runs setup, one micro-batch, the update and an evaluation batch through an allocator of `limit` bytes.
/// One micro-batch stands for all of them: each phase frees all it allocates and the
/// allocator coalesces fully, so every repetition starts from the same state.
///
/// Each step costs O(log n) in the allocator and O(1) here: the per-owner breakdown and
/// the description of the operation at the peak are not copied at every new peak (that
/// made a replay quadratic in the number of layers) but rebuilt once afterwards from
/// where the peak was (`owner_bytes_at_peak`, `describe_next_operation`).
fn replay_plan(plan: &StepPlan, limit: u64) -> Result<Replay, OutOfMemory> {
    let mut allocator = SliceAllocator::new(limit);
    let mut offsets: Vec<Option<u64>> = vec![None; plan.buffers.len()];
    let mut category_bytes = [0u64; 8];
    let mut replay = Replay {
        peak_bytes: 0,
        high_water_mark: 0,
        persistent_bytes: 0,
        fragmentation_bytes_at_peak: 0,
        extent_at_peak: 0,
        category_bytes_at_peak: [0; 8],
        peak_at: None,
        allocated_sizes: vec![0; plan.buffers.len()],
    };
    for (phase_index, phase) in phases(plan).into_iter().enumerate() {
        for (position, step) in phase.iter().enumerate() {
            match step {
                PlanStep::Allocate(id) => {
                    let buffer = plan.buffer(*id);
                    let allocation = allocator.allocate(buffer.bytes)?;
                    offsets[id.0] = Some(allocation.offset);
                    replay.allocated_sizes[id.0] = allocation.size;
                    category_bytes[buffer.category.index()] += allocation.size;
                    if allocator.in_use() > replay.peak_bytes {
                        replay.peak_bytes = allocator.in_use();
                        replay.extent_at_peak = allocator.live_extent();
                        replay.fragmentation_bytes_at_peak =
                            allocator.live_extent() - allocator.in_use();
                        replay.category_bytes_at_peak = category_bytes;
                        replay.peak_at = Some((phase_index, position));
                    }
                }
                PlanStep::Free(id) => {
                    let buffer = plan.buffer(*id);
                    let offset = offsets[id.0]
                        .take()
                        .expect("plans free only what they allocated (place_by_liveness)");
                    let size = allocator
                        .free(offset)
                        .expect("the offset came from this allocator and was freed once");
                    category_bytes[buffer.category.index()] -= size;
                }
                PlanStep::Run(_) => {}
            }
        }
        if phase_index == 0 {
            replay.persistent_bytes = allocator.in_use();
        }
    }
    replay.high_water_mark = allocator.high_water_mark();
    Ok(replay)
}

/// Bytes per owner slot (layers, then the input, then the loss) live just after the
/// allocation at `peak_at`: the replay's steps up to there, counted again with the sizes
/// the allocator gave each buffer.
fn owner_bytes_at_peak(plan: &StepPlan, replay: &Replay) -> Vec<u64> {
    let layer_count = plan.layer_labels.len();
    let owner_slot = |owner: BufferOwner| match owner {
        BufferOwner::Layer(index) => index,
        BufferOwner::Data => layer_count,
        BufferOwner::Loss => layer_count + 1,
    };
    let mut owner_bytes = vec![0u64; layer_count + 2];
    let Some((peak_phase, peak_position)) = replay.peak_at else {
        return owner_bytes;
    };
    for (phase_index, phase) in phases(plan).into_iter().enumerate().take(peak_phase + 1) {
        let steps_counted = if phase_index == peak_phase {
            peak_position + 1
        } else {
            phase.len()
        };
        for step in &phase[..steps_counted] {
            match step {
                PlanStep::Allocate(id) => {
                    owner_bytes[owner_slot(plan.buffer(*id).owner)] += replay.allocated_sizes[id.0];
                }
                PlanStep::Free(id) => {
                    owner_bytes[owner_slot(plan.buffer(*id).owner)] -= replay.allocated_sizes[id.0];
                }
                PlanStep::Run(_) => {}
            }
        }
    }
    owner_bytes
}

fn describe_next_operation(plan: &StepPlan, phase_index: usize, rest: &[PlanStep]) -> String {
    use crate::plan::OperationKind;
    let operation = rest.iter().find_map(|step| match step {
        PlanStep::Run(operation) => Some(operation),
        _ => None,
    });
    let Some(operation) = operation else {
        return ["setup", "micro-batch", "update", "evaluation"][phase_index].to_string();
    };
    match operation.kind {
        OperationKind::InitializeParameters => "setup".to_string(),
        OperationKind::LayerForward { layer } => format!("forward {}", plan.layer_labels[layer]),
        OperationKind::LayerRecompute { layer } => {
            format!("recompute {}", plan.layer_labels[layer])
        }
        OperationKind::LossForward => "loss forward".to_string(),
        OperationKind::LossBackward => "loss backward".to_string(),
        OperationKind::LayerBackward { layer } => format!("backward {}", plan.layer_labels[layer]),
        OperationKind::AccumulateGradient { layer } => {
            format!("gradient sum {}", plan.layer_labels[layer])
        }
        OperationKind::CopyGradient { layer } => {
            format!("gradient copy {}", plan.layer_labels[layer])
        }
        OperationKind::CheckOverflow => "loss-scale overflow check".to_string(),
        OperationKind::LayerInference { layer } => {
            format!("evaluation {}", plan.layer_labels[layer])
        }
        OperationKind::LossEvaluate => "evaluation loss".to_string(),
        OperationKind::OptimizerUpdate { layer, .. } => {
            format!("optimizer update {}", plan.layer_labels[layer])
        }
    }
}

/// Estimates a compiled plan.
pub fn estimate_plan(plan: &StepPlan) -> MemoryEstimate {
    let unbounded = replay_plan(plan, u64::MAX).expect("an unbounded region never runs out");
    // Best fit in a region that ends at the high-water mark can choose differently from
    // one with a huge tail (the tail is no longer the largest block), so the size is
    // confirmed by a replay and grown in small steps in the rare case it falls short.
    let mut required_bytes = unbounded.high_water_mark;
    while replay_plan(plan, required_bytes).is_err() {
        required_bytes = required_bytes
            .saturating_add((required_bytes / 64).max(crate::allocator::ALLOCATION_ALIGNMENT));
    }
    let layer_count = plan.layer_labels.len();
    let owner_bytes = owner_bytes_at_peak(plan, &unbounded);
    let mut by_layer = Vec::new();
    let mut push_owner = |label: &str, bytes: u64| {
        if bytes > 0 {
            by_layer.push(LayerBytes {
                label: label.to_string(),
                bytes,
            });
        }
    };
    push_owner("input", owner_bytes[layer_count]);
    for (index, label) in plan.layer_labels.iter().enumerate() {
        push_owner(label, owner_bytes[index]);
    }
    push_owner("loss", owner_bytes[layer_count + 1]);
    let peak_during = match unbounded.peak_at {
        Some((phase_index, position)) => {
            describe_next_operation(plan, phase_index, &phases(plan)[phase_index][position..])
        }
        None => String::from("setup"),
    };
    MemoryEstimate {
        config: plan.config,
        peak_bytes: unbounded.peak_bytes,
        required_bytes,
        persistent_bytes: unbounded.persistent_bytes,
        fragmentation_bytes_at_peak: unbounded.fragmentation_bytes_at_peak,
        fragmentation_at_peak: if unbounded.extent_at_peak == 0 {
            0.0
        } else {
            unbounded.fragmentation_bytes_at_peak as f64 / unbounded.extent_at_peak as f64
        },
        by_category: MemoryCategory::ALL
            .iter()
            .map(|category| {
                (
                    *category,
                    unbounded.category_bytes_at_peak[category.index()],
                )
            })
            .collect(),
        by_layer,
        peak_during,
    }
}

/// Compiles and estimates `job` run with `config`.
pub fn estimate_job(job: &ValidatedJob, config: &RunConfig) -> Result<MemoryEstimate, FieldError> {
    Ok(estimate_plan(&compile_step_plan(job, config)?))
}

/// Replays `plan` in a slice of `limit` bytes: `Ok` with the peak when it fits, the
/// allocator's `OutOfMemory` at the point of failure when it does not.
pub fn try_plan_in_slice(plan: &StepPlan, limit: u64) -> Result<u64, OutOfMemory> {
    replay_plan(plan, limit).map(|replay| replay.peak_bytes)
}

/// The largest batch (one micro-batch: no accumulation) whose step needs at most
/// `slice_bytes` under `config`'s other settings, `None` when not even one sample fits.
/// The need grows with the batch, so a doubling search then a bisection finds it in
/// about 2·log2(batch) estimates.
pub fn largest_batch_fitting(
    job: &ValidatedJob,
    config: &RunConfig,
    slice_bytes: u64,
) -> Option<u64> {
    let fits = |batch: u64| {
        let candidate = RunConfig {
            batch_size: batch,
            micro_batch_size: batch,
            ..*config
        };
        estimate_job(job, &candidate).is_ok_and(|estimate| estimate.required_bytes <= slice_bytes)
    };
    if !fits(1) {
        return None;
    }
    // Past 2^24 samples a step is not a batch anyone trains with.
    let (mut fitting, mut failing) = (1u64, 2u64);
    while failing <= 1 << 24 && fits(failing) {
        fitting = failing;
        failing *= 2;
    }
    if failing > 1 << 24 {
        return Some(fitting);
    }
    while failing - fitting > 1 {
        let middle = fitting + (failing - fitting) / 2;
        if fits(middle) {
            fitting = middle;
        } else {
            failing = middle;
        }
    }
    Some(fitting)
}
