//! The step plan: one training step compiled into the ordered list of what it does —
//! allocate a buffer, run an operation that reads these buffers and writes those, free a
//! buffer.
//!
//! This is the single description of a step's memory behaviour. The engine executes it on
//! a backend and the estimator replays it through the slice allocator bookkeeping without
//! data or math, so the estimate is the allocator's real peak and there is no second copy
//! of the allocation logic to drift (docs/design.md, "The memory model").
//!
//! A plan has four phases:
//! - `setup`, run once per attempt: weights, fp32 masters (mixed precision), gradients,
//!   optimizer state and the prefetched input batches. Nothing in it is freed during
//!   training.
//! - `micro_batch`, run `accumulation_steps` times per step: forward, loss, backward, with
//!   gradients accumulated into the persistent gradient buffers.
//! - `update`, run once per step: the optimizer.
//! - `evaluation`, run once per micro-batch of the test set after training: forward in
//!   inference mode (each output freed once the next layer has read it) and the loss.
//!
//! Every buffer allocated in `micro_batch`, `update` or `evaluation` is freed in the same
//! phase, so the allocator is back in the same state after each phase (coalescing is
//! complete) and one replay of each phase gives the peak of any number of repetitions.
//!
//! Buffers are placed by liveness: allocated just before the first operation that touches
//! them, freed just after the last one. Which buffers backward reads is decided by the
//! layer (`LayerNode::backward_reads_input` / `_output`), and with recomputation the
//! backward of a segment reads fresh copies made by re-running its forward.

use std::fmt;

use crate::bytes::HumanBytes;
use crate::error::FieldError;
use crate::model::ModelGraph;
use crate::spec::{JobSpec, Precision};

mod backward;
mod compile;
mod liveness;
mod operands;

pub use compile::{
    CONVOLUTION_WORKSPACE_HEADROOM, compile_step_plan, im2col_workspace_elements,
    workspace_elements,
};
pub use operands::{
    BatchNormGradients, BatchNormParameters, GradientSumOperands, InitializeOperands,
    KernelParameters, LayerBackwardOperands, LayerForwardOperands, LayerParameters,
    LossGradientOperands, LossOperands, OperandError, OptimizerOperands, OptimizerState,
    OverflowOperands, ParameterGradients, half_gradient_layout,
};

/// How one attempt runs a job: the knobs the shrink planner turns.
///
/// The batch, micro-batch, precision and recomputation are knobs of every kind of job;
/// the rest are Carve's own engine's ([`EngineSettings`]), which only a model job has: a
/// command job's config has `engine: None`, not zeros standing for "no such knob".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RunConfig {
    /// The effective batch the optimizer sees.
    pub batch_size: u64,
    /// Samples per forward/backward pass; divides `batch_size`.
    pub micro_batch_size: u64,
    pub precision: Precision,
    /// With `Some(k)`, only every k-th layer's input is kept in forward and the layers in
    /// between are recomputed in backward.
    pub recompute_segment_layers: Option<u64>,
    /// The engine's knobs: `Some` for a model job, `None` for a command job (a program
    /// Carve does not run has neither a convolution workspace nor prefetch slots).
    pub engine: Option<EngineSettings>,
}

/// The knobs only Carve's own engine has, so only a model job's [`RunConfig`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EngineSettings {
    /// The most one convolution may take as workspace (cuDNN workspace or im2col buffer).
    pub workspace_limit_bytes: u64,
    /// Micro-batches of input kept on the device ahead of use (1 to 16).
    pub prefetch_batches: u64,
}

impl RunConfig {
    /// The configuration the job asks for.
    pub fn from_spec(spec: &JobSpec) -> RunConfig {
        let accumulation_steps = spec.training.accumulation_steps.max(1);
        RunConfig {
            batch_size: spec.training.batch_size,
            micro_batch_size: spec.training.batch_size / accumulation_steps,
            precision: spec.training.precision,
            recompute_segment_layers: spec.training.recompute_segment_layers,
            engine: Some(EngineSettings {
                workspace_limit_bytes: spec.training.workspace_limit.0,
                prefetch_batches: spec.data.prefetch_batches,
            }),
        }
    }

    /// The engine's knobs, which a model job's config must have: an error naming
    /// `prefetch_batches` (the knob every model job sets to at least 1) for a config
    /// without them (a command job's).
    pub fn engine_settings(&self) -> Result<EngineSettings, FieldError> {
        self.engine.ok_or_else(|| {
            FieldError::new(
                "prefetch_batches",
                "is missing: a model job's run config needs the engine's prefetch_batches \
                 (1 to 16) and workspace_limit_bytes",
            )
        })
    }

    /// The same config with the engine's workspace cap at `bytes`; a config without the
    /// engine's knobs (a command job's) stays without them.
    pub fn with_workspace_limit(self, bytes: u64) -> RunConfig {
        RunConfig {
            engine: self.engine.map(|engine| EngineSettings {
                workspace_limit_bytes: bytes,
                ..engine
            }),
            ..self
        }
    }

    /// The same config with `batches` prefetched; a config without the engine's knobs
    /// stays without them.
    pub fn with_prefetch_batches(self, batches: u64) -> RunConfig {
        RunConfig {
            engine: self.engine.map(|engine| EngineSettings {
                prefetch_batches: batches,
                ..engine
            }),
            ..self
        }
    }

    /// The convolution workspace cap: the engine's, and 0 (no workspace) for a config
    /// without the engine's knobs, which never reaches a plan ([`RunConfig::check`]
    /// refuses it); for the pure helpers that size a layer's workspace.
    pub fn workspace_limit_bytes(&self) -> u64 {
        self.engine.map_or(0, |engine| engine.workspace_limit_bytes)
    }

    pub fn accumulation_steps(&self) -> u64 {
        self.batch_size / self.micro_batch_size.max(1)
    }

    /// What differs from `before`, for people: "precision fp32 -> bf16, micro-batch 64 ->
    /// 16 (4 accumulation steps), recompute on"; empty when nothing does.
    pub fn describe_change_from(&self, before: &RunConfig) -> String {
        let mut changes = Vec::new();
        if self.batch_size != before.batch_size {
            changes.push(format!(
                "batch {} -> {}",
                before.batch_size, self.batch_size
            ));
        }
        if self.precision != before.precision {
            changes.push(format!(
                "precision {} -> {}",
                before.precision, self.precision
            ));
        }
        if self.micro_batch_size != before.micro_batch_size {
            changes.push(format!(
                "micro-batch {} -> {} ({} accumulation steps)",
                before.micro_batch_size,
                self.micro_batch_size,
                self.accumulation_steps()
            ));
        }
        match (
            before.recompute_segment_layers,
            self.recompute_segment_layers,
        ) {
            (None, Some(_)) => changes.push("recompute on".to_string()),
            (Some(_), None) => changes.push("recompute off".to_string()),
            (Some(old), Some(new)) if old != new => {
                changes.push(format!("recompute segments {old} -> {new} layers"))
            }
            _ => {}
        }
        if let (Some(before), Some(after)) = (before.engine, self.engine)
            && after.workspace_limit_bytes != before.workspace_limit_bytes
        {
            changes.push(format!(
                "workspace {} -> {}",
                crate::bytes::HumanBytes(before.workspace_limit_bytes),
                crate::bytes::HumanBytes(after.workspace_limit_bytes)
            ));
        }
        changes.join(", ")
    }

    /// Checks the settings that need no model: what a worker or a store reading a config
    /// back can check on its own. A model job's: its batch settings
    /// ([`RunConfig::check_batch_settings`]), the engine's knobs present and 1 to 16
    /// prefetched batches.
    pub fn check_settings(&self) -> Result<(), FieldError> {
        self.check_batch_settings()?;
        let engine = self.engine_settings()?;
        if engine.prefetch_batches == 0 || engine.prefetch_batches > 16 {
            return Err(FieldError::new(
                "prefetch_batches",
                format!("{} must be between 1 and 16", engine.prefetch_batches),
            ));
        }
        Ok(())
    }

    /// Checks the knobs every kind of job has: a batch and micro-batch of at least 1, the
    /// micro-batch dividing the batch, and a recompute segment of at least 1 layer.
    pub fn check_batch_settings(&self) -> Result<(), FieldError> {
        if self.batch_size == 0 {
            return Err(FieldError::new("batch_size", "must be at least 1"));
        }
        if self.micro_batch_size == 0 {
            return Err(FieldError::new("micro_batch_size", "must be at least 1"));
        }
        if !self.batch_size.is_multiple_of(self.micro_batch_size) {
            return Err(FieldError::new(
                "micro_batch_size",
                format!(
                    "{} does not divide batch_size {}",
                    self.micro_batch_size, self.batch_size
                ),
            ));
        }
        if self.recompute_segment_layers == Some(0) {
            return Err(FieldError::new(
                "recompute_segment_layers",
                "must be at least 1",
            ));
        }
        Ok(())
    }

    /// Checks a config that came from outside (an override, the API) against its model.
    pub fn check(&self, graph: &ModelGraph) -> Result<(), FieldError> {
        self.check_settings()?;
        if let Some(segment) = self.recompute_segment_layers {
            let layer_count = graph.layers.len() as u64;
            if segment > layer_count {
                return Err(FieldError::new(
                    "recompute_segment_layers",
                    format!(
                        "{segment} must be between 1 and the {layer_count} layers of the model"
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Display for RunConfig {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.micro_batch_size == self.batch_size {
            write!(formatter, "batch {}", self.batch_size)?;
        } else {
            write!(
                formatter,
                "batch {} as {} micro-batches of {}",
                self.batch_size,
                self.accumulation_steps(),
                self.micro_batch_size
            )?;
        }
        write!(formatter, ", {}", self.precision)?;
        if let Some(segment) = self.recompute_segment_layers {
            write!(formatter, ", recompute in segments of {segment} layers")?;
        }
        match self.engine {
            Some(engine) => write!(
                formatter,
                ", workspace {}",
                HumanBytes(engine.workspace_limit_bytes)
            ),
            None => Ok(()),
        }
    }
}

/// What a buffer holds, for the breakdowns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemoryCategory {
    /// Parameters in the compute precision (and batch-norm running statistics).
    Weights,
    /// fp32 copies of the parameters under mixed precision.
    MasterWeights,
    /// fp32 gradients, accumulated over micro-batches.
    Gradients,
    OptimizerState,
    /// Prefetched micro-batches of inputs and targets.
    InputBatches,
    /// Layer outputs (and masks, statistics) kept for backward or passed between layers.
    Activations,
    /// Gradients of activations and other short-lived buffers.
    Transients,
    /// Convolution workspace, capped by `workspace_limit_bytes`.
    Workspace,
}

impl MemoryCategory {
    pub const ALL: [MemoryCategory; 8] = [
        MemoryCategory::Weights,
        MemoryCategory::MasterWeights,
        MemoryCategory::Gradients,
        MemoryCategory::OptimizerState,
        MemoryCategory::InputBatches,
        MemoryCategory::Activations,
        MemoryCategory::Transients,
        MemoryCategory::Workspace,
    ];

    pub fn name(self) -> &'static str {
        match self {
            MemoryCategory::Weights => "weights",
            MemoryCategory::MasterWeights => "master_weights",
            MemoryCategory::Gradients => "gradients",
            MemoryCategory::OptimizerState => "optimizer_state",
            MemoryCategory::InputBatches => "input_batches",
            MemoryCategory::Activations => "activations",
            MemoryCategory::Transients => "transients",
            MemoryCategory::Workspace => "workspace",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Index of a buffer in [`StepPlan::buffers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub usize);

/// Who a buffer belongs to, for the per-layer breakdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufferOwner {
    Layer(usize),
    /// Input batches and targets.
    Data,
    /// Loss value, softmax probabilities, the gradient of the loss.
    Loss,
}

/// What a buffer holds, so a backend knows how to create and interpret it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufferRole {
    /// Parameter `parameter` of the owning layer in the compute precision.
    Parameter {
        parameter: usize,
    },
    MasterParameter {
        parameter: usize,
    },
    Gradient {
        parameter: usize,
    },
    /// Optimizer state tensor `slot` (velocity; first/second moment) of a parameter.
    OptimizerState {
        parameter: usize,
        slot: usize,
    },
    /// Prefetch slot `slot`: a micro-batch of inputs.
    InputSlot {
        slot: usize,
    },
    /// Prefetch slot `slot`: the matching targets.
    TargetSlot {
        slot: usize,
    },
    LayerOutput,
    /// One byte per element, the dropout mask.
    DropoutMask,
    /// Per-channel mean and inverse standard deviation of the batch, fp32.
    BatchStatistics,
    /// Gradient with respect to a layer's input.
    InputGradient,
    /// Half-precision weight gradients before they are added to the fp32 gradients.
    HalfGradients,
    Workspace,
    LossValue,
    Probabilities,
    OutputGradient,
    /// The fp16 overflow flag of dynamic loss scaling.
    OverflowFlag,
}

impl BufferRole {
    /// Whether a buffer must hold zeros when it is allocated: what is accumulated into
    /// (gradients, optimizer state), what lives for the whole attempt (zeroed once), and
    /// the small result buffers. Every other buffer is written by the operation that
    /// creates its contents before anything reads it, so a backend may leave it as it
    /// finds it; the cuda backend fills it with NaN in debug builds to prove that.
    pub fn must_start_at_zero(&self) -> bool {
        match self {
            BufferRole::Parameter { .. }
            | BufferRole::MasterParameter { .. }
            | BufferRole::Gradient { .. }
            | BufferRole::OptimizerState { .. }
            | BufferRole::InputSlot { .. }
            | BufferRole::TargetSlot { .. }
            | BufferRole::LossValue
            | BufferRole::OverflowFlag => true,
            BufferRole::LayerOutput
            | BufferRole::DropoutMask
            | BufferRole::BatchStatistics
            | BufferRole::InputGradient
            | BufferRole::HalfGradients
            | BufferRole::Workspace
            | BufferRole::Probabilities
            | BufferRole::OutputGradient => false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElementType {
    F32,
    F16,
    Bf16,
    I32,
    U8,
}

impl ElementType {
    pub fn bytes(self) -> u64 {
        match self {
            ElementType::F32 | ElementType::I32 => 4,
            ElementType::F16 | ElementType::Bf16 => 2,
            ElementType::U8 => 1,
        }
    }

    fn for_compute(precision: Precision) -> ElementType {
        match precision {
            Precision::Fp32 => ElementType::F32,
            Precision::Fp16 => ElementType::F16,
            Precision::Bf16 => ElementType::Bf16,
        }
    }
}

/// One device buffer of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferSpec {
    pub id: BufferId,
    pub role: BufferRole,
    pub owner: BufferOwner,
    pub category: MemoryCategory,
    pub element_type: ElementType,
    pub elements: u64,
    /// `elements * element_type.bytes()`, before the allocator's rounding.
    pub bytes: u64,
}

/// What an operation computes. Reads and writes are listed on the [`Operation`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OperationKind {
    /// Casts the fp32 masters into the compute-precision weights (mixed precision, setup).
    InitializeParameters,
    LayerForward {
        layer: usize,
    },
    /// Forward run again in backward to rebuild what recomputation did not keep.
    LayerRecompute {
        layer: usize,
    },
    LossForward,
    LossBackward,
    /// Writes the input gradient (if any) and adds the weight gradients into the fp32
    /// gradient buffers.
    LayerBackward {
        layer: usize,
    },
    /// `into += from` ([`GradientSumOperands`]): a second branch's gradient summed in place
    /// into a tensor's gradient (a tensor read by several layers gets the sum of theirs). `layer`
    /// is the reader whose gradient is added.
    AccumulateGradient {
        layer: usize,
    },
    /// `into = from` ([`GradientSumOperands`]): an `add` hands its output gradient to each
    /// input; all but one get a copy, since each is then accumulated into separately.
    CopyGradient {
        layer: usize,
    },
    /// Checks the gradients for inf/NaN (dynamic loss scaling under fp16).
    CheckOverflow,
    OptimizerUpdate {
        layer: usize,
        parameter: usize,
    },
    /// Forward in inference mode (batch norm uses its running statistics, dropout passes
    /// through), for evaluating the test set.
    LayerInference {
        layer: usize,
    },
    /// The loss and the probabilities of an evaluation batch.
    LossEvaluate,
}

/// One operation of a phase: the buffers it reads, writes and uses as scratch, in the
/// order liveness allocates them. Which buffer plays which part is not read from these
/// lists by position: the compiler builds each kind from its operands struct and the
/// engine reads them back through the matching accessor (`operands.rs`: for example
/// [`LossOperands`] and [`Operation::loss_operands`]), which checks every buffer's role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    pub kind: OperationKind,
    pub reads: Vec<BufferId>,
    pub writes: Vec<BufferId>,
    /// Scratch buffers alive only during this operation (workspace, half gradients).
    pub scratch: Vec<BufferId>,
}

/// One instruction of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanStep {
    Allocate(BufferId),
    Run(Operation),
    Free(BufferId),
}

/// One training step, compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct StepPlan {
    pub config: RunConfig,
    pub buffers: Vec<BufferSpec>,
    pub setup: Vec<PlanStep>,
    pub micro_batch: Vec<PlanStep>,
    pub update: Vec<PlanStep>,
    /// Forward only, in inference mode, for one micro-batch of the test set. Like the
    /// other phases it frees all it allocates.
    pub evaluation: Vec<PlanStep>,
    /// Labels of the buffer owners, indexed like the layers (`layers[3].conv2d`).
    pub layer_labels: Vec<String>,
}

impl StepPlan {
    pub fn buffer(&self, id: BufferId) -> &BufferSpec {
        &self.buffers[id.0]
    }

    /// The name the per-layer breakdown uses for a buffer's owner.
    pub fn owner_label(&self, owner: BufferOwner) -> &str {
        match owner {
            BufferOwner::Layer(index) => &self.layer_labels[index],
            BufferOwner::Data => "input",
            BufferOwner::Loss => "loss",
        }
    }
}
