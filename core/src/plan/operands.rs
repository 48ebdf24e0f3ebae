//! The operands of every operation kind and the parameter tensors of every layer kind, by
//! name: the one place that knows in which order an [`Operation`] lists its buffers and a
//! layer its parameters.
//!
//! The compiler builds each operation from one of the structs here
//! ([`LossOperands::operation`], [`LayerForwardOperands::operation`], ...) and the
//! engine reads it back through the matching accessor on [`Operation`]
//! ([`Operation::loss_operands`], [`Operation::layer_forward_operands`], ...). An accessor
//! checks the operation's kind, its counts and the role and owner of every buffer it
//! names, so a compiler that lists its buffers in another order makes the engine fail
//! with an error naming the operation and the buffer, not read the wrong buffer. Nothing
//! outside this module indexes `reads`, `writes`, `scratch` or a layer's `parameters` by
//! position.
//!
//! The plan's data does not change: an operation still lists its buffers in three flat
//! lists (`reads`, then `writes`, then `scratch`, the order in which liveness allocates
//! them), which the estimator replays.

use std::fmt;
use std::ops::Range;

use super::workspace_elements;
use super::{BufferId, BufferOwner, BufferRole, Operation, OperationKind, PlanStep, StepPlan};
use crate::error::FieldError;
use crate::model::{LayerNode, LayerOp, ModelGraph, ParameterTensor};

/// The operands of an operation are not what its kind and layer say they are: the
/// compiler and the engine disagree about the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperandError(String);

impl OperandError {
    fn new(message: impl Into<String>) -> OperandError {
        OperandError(message.into())
    }
}

impl fmt::Display for OperandError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "the plan's operands: {}", self.0)
    }
}

impl std::error::Error for OperandError {}

/// For the compiler, which reports in field errors: a layer whose parameter tensors are
/// not the ones its kind has.
impl From<OperandError> for FieldError {
    fn from(error: OperandError) -> FieldError {
        FieldError::new("model.layers", error.to_string())
    }
}

// ---------------------------------------------------------------------------------------
// Parameters by name.

/// The parameter names the model gives each tensor (`ParameterTensor::name`).
const KERNEL: &str = "kernel";
const BIAS: &str = "bias";
const GAMMA: &str = "gamma";
const BETA: &str = "beta";
const RUNNING_MEAN: &str = "running_mean";
const RUNNING_VARIANCE: &str = "running_variance";

/// A kernel and an optional bias: conv2d, depthwise conv2d and dense. Both are trained, so
/// the same struct names their gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelParameters<T> {
    pub kernel: T,
    pub bias: Option<T>,
}

/// Batch norm's tensors: the trained scale and shift, and the fp32 running statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchNormParameters<T> {
    pub gamma: T,
    pub beta: T,
    pub running_mean: T,
    pub running_variance: T,
}

/// Batch norm's trained tensors (the running statistics have no gradient).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchNormGradients<T> {
    pub gamma: T,
    pub beta: T,
}

/// One `T` per parameter tensor of a layer (its buffers, its tensors, ...), by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerParameters<T> {
    /// Layers without parameters.
    None,
    Kernel(KernelParameters<T>),
    BatchNorm(BatchNormParameters<T>),
}

/// One `T` per trained parameter tensor of a layer (gradient buffers, where a kernel
/// writes them, the gradients it computed, ...), by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParameterGradients<T> {
    /// Layers without trained parameters.
    None,
    Kernel(KernelParameters<T>),
    BatchNorm(BatchNormGradients<T>),
}

/// Which named set of parameters a layer has, from its kind, checked against the names
/// (and trainability) the model gave its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ParameterSet {
    None,
    Kernel { bias: bool },
    BatchNorm,
}

impl ParameterSet {
    fn of(layer: &LayerNode) -> Result<ParameterSet, OperandError> {
        let set = match layer.op {
            LayerOp::Conv2d { use_bias, .. }
            | LayerOp::DepthwiseConv2d { use_bias, .. }
            | LayerOp::Dense { use_bias, .. } => ParameterSet::Kernel { bias: use_bias },
            LayerOp::BatchNorm { .. } => ParameterSet::BatchNorm,
            LayerOp::MaxPool { .. }
            | LayerOp::AvgPool { .. }
            | LayerOp::GlobalAvgPool
            | LayerOp::Activation(_)
            | LayerOp::Dropout { .. }
            | LayerOp::Flatten
            | LayerOp::ZeroPadding2d { .. }
            | LayerOp::Add
            | LayerOp::Concat => ParameterSet::None,
        };
        let names: Vec<&str> = layer.parameters.iter().map(|tensor| tensor.name).collect();
        let trained: Vec<&str> = layer
            .parameters
            .iter()
            .filter(|tensor| tensor.trainable)
            .map(|tensor| tensor.name)
            .collect();
        if names != set.names() || trained != set.trained_names() {
            return Err(OperandError::new(format!(
                "{} has parameters {names:?} (trained {trained:?}); its kind has {:?} (trained {:?})",
                layer.label(),
                set.names(),
                set.trained_names()
            )));
        }
        Ok(set)
    }

    /// Every tensor, in the order the model lists them.
    fn names(self) -> &'static [&'static str] {
        match self {
            ParameterSet::None => &[],
            ParameterSet::Kernel { bias: false } => &[KERNEL],
            ParameterSet::Kernel { bias: true } => &[KERNEL, BIAS],
            ParameterSet::BatchNorm => &[GAMMA, BETA, RUNNING_MEAN, RUNNING_VARIANCE],
        }
    }

    /// The trained tensors, in the same order.
    fn trained_names(self) -> &'static [&'static str] {
        match self {
            ParameterSet::BatchNorm => &[GAMMA, BETA],
            other => other.names(),
        }
    }
}

/// `values` as an array of exactly `N`, or the error saying how many there were.
fn exactly<T, const N: usize>(
    layer: &LayerNode,
    what: &str,
    values: Vec<T>,
    names: &[&str],
) -> Result<[T; N], OperandError> {
    let count = values.len();
    values.try_into().map_err(|_| {
        OperandError::new(format!(
            "{}: {count} {what}, its kind has {names:?}",
            layer.label()
        ))
    })
}

impl<T> KernelParameters<T> {
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> KernelParameters<U> {
        KernelParameters {
            kernel: f(self.kernel),
            bias: self.bias.map(f),
        }
    }

    fn list(self) -> Vec<T> {
        std::iter::once(self.kernel).chain(self.bias).collect()
    }

    fn from_list(
        layer: &LayerNode,
        what: &str,
        bias: bool,
        values: Vec<T>,
        names: &[&str],
    ) -> Result<KernelParameters<T>, OperandError> {
        Ok(if bias {
            let [kernel, bias] = exactly(layer, what, values, names)?;
            KernelParameters {
                kernel,
                bias: Some(bias),
            }
        } else {
            let [kernel] = exactly(layer, what, values, names)?;
            KernelParameters { kernel, bias: None }
        })
    }
}

impl<T> BatchNormParameters<T> {
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> BatchNormParameters<U> {
        BatchNormParameters {
            gamma: f(self.gamma),
            beta: f(self.beta),
            running_mean: f(self.running_mean),
            running_variance: f(self.running_variance),
        }
    }
}

impl<T> BatchNormGradients<T> {
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> BatchNormGradients<U> {
        BatchNormGradients {
            gamma: f(self.gamma),
            beta: f(self.beta),
        }
    }
}

impl<T> LayerParameters<T> {
    /// Names `values`, one per parameter tensor of `layer` in the order the model lists
    /// them (the order of the plan's `BufferRole::Parameter { parameter }` indices).
    pub fn name(
        layer: &LayerNode,
        values: impl IntoIterator<Item = T>,
    ) -> Result<LayerParameters<T>, OperandError> {
        let set = ParameterSet::of(layer)?;
        let values: Vec<T> = values.into_iter().collect();
        let names = set.names();
        let what = "parameter tensors";
        Ok(match set {
            ParameterSet::None => {
                let [] = exactly(layer, what, values, names)?;
                LayerParameters::None
            }
            ParameterSet::Kernel { bias } => LayerParameters::Kernel(KernelParameters::from_list(
                layer, what, bias, values, names,
            )?),
            ParameterSet::BatchNorm => {
                let [gamma, beta, running_mean, running_variance] =
                    exactly(layer, what, values, names)?;
                LayerParameters::BatchNorm(BatchNormParameters {
                    gamma,
                    beta,
                    running_mean,
                    running_variance,
                })
            }
        })
    }

    /// Every value, in the order the model lists the tensors.
    pub fn list(self) -> Vec<T> {
        match self {
            LayerParameters::None => Vec::new(),
            LayerParameters::Kernel(kernel) => kernel.list(),
            LayerParameters::BatchNorm(batch_norm) => vec![
                batch_norm.gamma,
                batch_norm.beta,
                batch_norm.running_mean,
                batch_norm.running_variance,
            ],
        }
    }

    pub fn map<U>(self, f: impl FnMut(T) -> U) -> LayerParameters<U> {
        match self {
            LayerParameters::None => LayerParameters::None,
            LayerParameters::Kernel(kernel) => LayerParameters::Kernel(kernel.map(f)),
            LayerParameters::BatchNorm(batch_norm) => LayerParameters::BatchNorm(batch_norm.map(f)),
        }
    }

    /// The kernel and bias of a conv2d, depthwise conv2d or dense layer.
    pub fn kernel(self) -> Option<KernelParameters<T>> {
        match self {
            LayerParameters::Kernel(kernel) => Some(kernel),
            _ => None,
        }
    }

    pub fn batch_norm(self) -> Option<BatchNormParameters<T>> {
        match self {
            LayerParameters::BatchNorm(batch_norm) => Some(batch_norm),
            _ => None,
        }
    }
}

impl<'a> LayerParameters<&'a ParameterTensor> {
    /// A layer's own parameter tensors (shapes, element counts), by name.
    pub fn of_layer(layer: &'a LayerNode) -> Result<Self, OperandError> {
        LayerParameters::name(layer, &layer.parameters)
    }
}

impl<T> ParameterGradients<T> {
    /// Names `values`, one per trained parameter tensor of `layer` in the order the model
    /// lists them.
    pub fn name(
        layer: &LayerNode,
        values: impl IntoIterator<Item = T>,
    ) -> Result<ParameterGradients<T>, OperandError> {
        let set = ParameterSet::of(layer)?;
        let values: Vec<T> = values.into_iter().collect();
        let names = set.trained_names();
        let what = "trained parameter tensors";
        Ok(match set {
            ParameterSet::None => {
                let [] = exactly(layer, what, values, names)?;
                ParameterGradients::None
            }
            ParameterSet::Kernel { bias } => ParameterGradients::Kernel(
                KernelParameters::from_list(layer, what, bias, values, names)?,
            ),
            ParameterSet::BatchNorm => {
                let [gamma, beta] = exactly(layer, what, values, names)?;
                ParameterGradients::BatchNorm(BatchNormGradients { gamma, beta })
            }
        })
    }

    /// Every value, in the order the model lists the trained tensors.
    pub fn list(self) -> Vec<T> {
        match self {
            ParameterGradients::None => Vec::new(),
            ParameterGradients::Kernel(kernel) => kernel.list(),
            ParameterGradients::BatchNorm(batch_norm) => vec![batch_norm.gamma, batch_norm.beta],
        }
    }

    pub fn map<U>(self, f: impl FnMut(T) -> U) -> ParameterGradients<U> {
        match self {
            ParameterGradients::None => ParameterGradients::None,
            ParameterGradients::Kernel(kernel) => ParameterGradients::Kernel(kernel.map(f)),
            ParameterGradients::BatchNorm(batch_norm) => {
                ParameterGradients::BatchNorm(batch_norm.map(f))
            }
        }
    }

    pub fn as_mut(&mut self) -> ParameterGradients<&mut T> {
        match self {
            ParameterGradients::None => ParameterGradients::None,
            ParameterGradients::Kernel(kernel) => ParameterGradients::Kernel(KernelParameters {
                kernel: &mut kernel.kernel,
                bias: kernel.bias.as_mut(),
            }),
            ParameterGradients::BatchNorm(batch_norm) => {
                ParameterGradients::BatchNorm(BatchNormGradients {
                    gamma: &mut batch_norm.gamma,
                    beta: &mut batch_norm.beta,
                })
            }
        }
    }

    /// The kernel's and the bias's gradients of a conv2d, depthwise conv2d or dense layer.
    pub fn kernel(self) -> Option<KernelParameters<T>> {
        match self {
            ParameterGradients::Kernel(kernel) => Some(kernel),
            _ => None,
        }
    }

    pub fn batch_norm(self) -> Option<BatchNormGradients<T>> {
        match self {
            ParameterGradients::BatchNorm(batch_norm) => Some(batch_norm),
            _ => None,
        }
    }
}

impl<'a> ParameterGradients<&'a ParameterTensor> {
    /// A layer's own trained parameter tensors, by name.
    pub fn of_layer(layer: &'a LayerNode) -> Result<Self, OperandError> {
        ParameterGradients::name(
            layer,
            layer.parameters.iter().filter(|tensor| tensor.trainable),
        )
    }
}

/// Where each trained tensor's gradient lies in a layer backward's `half_gradients`
/// scratch (mixed precision), in elements: the trained tensors one after the other, in
/// the model's order, `LayerNode::trainable_parameter_elements` in all.
pub fn half_gradient_layout(
    layer: &LayerNode,
) -> Result<ParameterGradients<Range<u64>>, OperandError> {
    let mut offset = 0;
    let ranges: Vec<Range<u64>> = layer
        .parameters
        .iter()
        .filter(|tensor| tensor.trainable)
        .map(|tensor| {
            let range = offset..offset + tensor.elements;
            offset = range.end;
            range
        })
        .collect();
    ParameterGradients::name(layer, ranges)
}

// ---------------------------------------------------------------------------------------
// Operations by name.

/// The state tensors of one parameter's optimizer, by what they hold: none (SGD without
/// momentum), a velocity (SGD with momentum) or the two moments (Adam, AdamW), as many as
/// `OptimizerSpec::state_tensors_per_parameter` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerState<T> {
    None,
    Velocity(T),
    Moments { first: T, second: T },
}

impl<T> OptimizerState<T> {
    /// Names the state tensors from their slots, 0 first.
    pub fn from_slots(slots: impl IntoIterator<Item = T>) -> Result<Self, OperandError> {
        let slots: Vec<T> = slots.into_iter().collect();
        let count = slots.len();
        let mut slots = slots.into_iter();
        Ok(match (slots.next(), slots.next(), slots.next()) {
            (None, _, _) => OptimizerState::None,
            (Some(velocity), None, _) => OptimizerState::Velocity(velocity),
            (Some(first), Some(second), None) => OptimizerState::Moments { first, second },
            _ => {
                return Err(OperandError::new(format!(
                    "{count} optimizer state tensors; an optimizer keeps at most 2"
                )));
            }
        })
    }

    /// The state tensors by slot, 0 first.
    pub fn list(self) -> Vec<T> {
        match self {
            OptimizerState::None => Vec::new(),
            OptimizerState::Velocity(velocity) => vec![velocity],
            OptimizerState::Moments { first, second } => vec![first, second],
        }
    }

    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> OptimizerState<U> {
        match self {
            OptimizerState::None => OptimizerState::None,
            OptimizerState::Velocity(velocity) => OptimizerState::Velocity(f(velocity)),
            OptimizerState::Moments { first, second } => OptimizerState::Moments {
                first: f(first),
                second: f(second),
            },
        }
    }

    /// `map` with a fallible `f`: the first error, if any.
    pub fn try_map<U, E>(
        self,
        mut f: impl FnMut(T) -> Result<U, E>,
    ) -> Result<OptimizerState<U>, E> {
        Ok(match self {
            OptimizerState::None => OptimizerState::None,
            OptimizerState::Velocity(velocity) => OptimizerState::Velocity(f(velocity)?),
            OptimizerState::Moments { first, second } => OptimizerState::Moments {
                first: f(first)?,
                second: f(second)?,
            },
        })
    }

    pub fn as_mut(&mut self) -> OptimizerState<&mut T> {
        match self {
            OptimizerState::None => OptimizerState::None,
            OptimizerState::Velocity(velocity) => OptimizerState::Velocity(velocity),
            OptimizerState::Moments { first, second } => OptimizerState::Moments { first, second },
        }
    }
}

/// `InitializeParameters`: each fp32 master cast into its compute-precision weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitializeOperands<'a> {
    pub masters: &'a [BufferId],
    /// As many as `masters`, the same tensors in the same order.
    pub weights: &'a [BufferId],
}

impl InitializeOperands<'_> {
    /// (master, weights) of each trained tensor.
    pub fn pairs(&self) -> impl Iterator<Item = (BufferId, BufferId)> + '_ {
        self.masters
            .iter()
            .copied()
            .zip(self.weights.iter().copied())
    }

    pub fn operation(&self) -> Operation {
        debug_assert_eq!(self.masters.len(), self.weights.len());
        Operation {
            kind: OperationKind::InitializeParameters,
            reads: self.masters.to_vec(),
            writes: self.weights.to_vec(),
            scratch: Vec::new(),
        }
    }
}

/// `LayerForward`, `LayerRecompute`, `LayerInference`: one layer run forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerForwardOperands<'a> {
    /// One per `LayerNode::inputs`, in order.
    pub inputs: &'a [BufferId],
    pub parameters: LayerParameters<BufferId>,
    /// `None` for a view (flatten), whose output is its input's buffer.
    pub output: Option<BufferId>,
    /// What a training forward keeps for backward besides the output: dropout's mask or
    /// batch norm's per-channel statistics; never in inference.
    pub side_output: Option<BufferId>,
    pub workspace: Option<BufferId>,
}

impl LayerForwardOperands<'_> {
    /// Reads: the inputs, then the parameters. Writes: the output, then the side output.
    /// Scratch: the workspace.
    pub fn operation(&self, kind: OperationKind) -> Operation {
        debug_assert!(matches!(
            kind,
            OperationKind::LayerForward { .. }
                | OperationKind::LayerRecompute { .. }
                | OperationKind::LayerInference { .. }
        ));
        Operation {
            kind,
            reads: self
                .inputs
                .iter()
                .copied()
                .chain(self.parameters.list())
                .collect(),
            writes: self.output.into_iter().chain(self.side_output).collect(),
            scratch: self.workspace.into_iter().collect(),
        }
    }
}

/// `LayerBackward`: one layer's input gradients and parameter gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerBackwardOperands<'a> {
    /// The gradient of the layer's output.
    pub output_gradient: BufferId,
    /// The inputs kept for backward (`LayerNode::backward_reads_input`), else empty.
    pub inputs: &'a [BufferId],
    /// The output kept for backward (`LayerNode::backward_reads_output`).
    pub output: Option<BufferId>,
    /// Dropout's mask or batch norm's statistics, from the forward.
    pub side_output: Option<BufferId>,
    pub parameters: LayerParameters<BufferId>,
    /// The gradients written for the inputs that need one (all of them for batch norm and
    /// concat), in input order.
    pub input_gradients: &'a [BufferId],
    /// The fp32 gradients the computed parameter gradients are added into.
    pub parameter_gradients: ParameterGradients<BufferId>,
    pub workspace: Option<BufferId>,
    /// Mixed precision: where the half-precision parameter gradients are computed before
    /// they are added into `parameter_gradients` ([`half_gradient_layout`]).
    pub half_gradients: Option<BufferId>,
}

impl LayerBackwardOperands<'_> {
    /// Reads: the output gradient, the kept inputs, the kept output, the side output, the
    /// parameters. Writes: the input gradients, then the parameter gradients. Scratch: the
    /// workspace, then the half gradients.
    pub fn operation(&self, layer: usize) -> Operation {
        Operation {
            kind: OperationKind::LayerBackward { layer },
            reads: std::iter::once(self.output_gradient)
                .chain(self.inputs.iter().copied())
                .chain(self.output)
                .chain(self.side_output)
                .chain(self.parameters.list())
                .collect(),
            writes: self
                .input_gradients
                .iter()
                .copied()
                .chain(self.parameter_gradients.list())
                .collect(),
            scratch: self
                .workspace
                .into_iter()
                .chain(self.half_gradients)
                .collect(),
        }
    }
}

/// `LossForward`, `LossEvaluate`: the loss of the model's output against the targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LossOperands {
    /// The model's output (logits for cross-entropy).
    pub output: BufferId,
    pub target: BufferId,
    /// The batch's mean loss, one fp32.
    pub loss: BufferId,
    /// Cross-entropy's softmax, kept for its backward.
    pub probabilities: Option<BufferId>,
}

impl LossOperands {
    /// Reads: output, target. Writes: loss, then the probabilities.
    pub fn operation(&self, kind: OperationKind) -> Operation {
        debug_assert!(matches!(
            kind,
            OperationKind::LossForward | OperationKind::LossEvaluate
        ));
        Operation {
            kind,
            reads: vec![self.output, self.target],
            writes: std::iter::once(self.loss)
                .chain(self.probabilities)
                .collect(),
            scratch: Vec::new(),
        }
    }
}

/// `LossBackward`: the gradient of the loss with respect to the model's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LossGradientOperands {
    /// What the gradient is computed from: the probabilities for cross-entropy (softmax
    /// minus one-hot), the model's output for MSE.
    pub predictions: BufferId,
    pub target: BufferId,
    pub output_gradient: BufferId,
}

impl LossGradientOperands {
    /// Reads: predictions, target. Writes: the output gradient.
    pub fn operation(&self) -> Operation {
        Operation {
            kind: OperationKind::LossBackward,
            reads: vec![self.predictions, self.target],
            writes: vec![self.output_gradient],
            scratch: Vec::new(),
        }
    }
}

/// `AccumulateGradient` (`into += from`) and `CopyGradient` (`into = from`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GradientSumOperands {
    pub from: BufferId,
    pub into: BufferId,
}

impl GradientSumOperands {
    pub fn operation(&self, kind: OperationKind) -> Operation {
        debug_assert!(matches!(
            kind,
            OperationKind::AccumulateGradient { .. } | OperationKind::CopyGradient { .. }
        ));
        Operation {
            kind,
            reads: vec![self.from],
            writes: vec![self.into],
            scratch: Vec::new(),
        }
    }
}

/// `CheckOverflow`: whether every gradient is finite (fp16's dynamic loss scaling).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverflowOperands<'a> {
    pub gradients: &'a [BufferId],
    /// The flag the check raises, scratch.
    pub flag: BufferId,
}

impl OverflowOperands<'_> {
    pub fn operation(&self) -> Operation {
        Operation {
            kind: OperationKind::CheckOverflow,
            reads: self.gradients.to_vec(),
            writes: Vec::new(),
            scratch: vec![self.flag],
        }
    }
}

/// `OptimizerUpdate`: one parameter tensor's update from its gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptimizerOperands {
    pub gradient: BufferId,
    /// The weights the layers compute with.
    pub weights: BufferId,
    /// The fp32 master under mixed precision.
    pub master: Option<BufferId>,
    pub state: OptimizerState<BufferId>,
}

impl OptimizerOperands {
    /// The buffer the update happens on: the fp32 master under mixed precision (the
    /// weights are then rounded from it), else the weights.
    pub fn updated(&self) -> BufferId {
        self.master.unwrap_or(self.weights)
    }

    /// Reads: the gradient. Writes: the weights, the master, the state by slot.
    pub fn operation(&self, layer: usize, parameter: usize) -> Operation {
        Operation {
            kind: OperationKind::OptimizerUpdate { layer, parameter },
            reads: vec![self.gradient],
            writes: std::iter::once(self.weights)
                .chain(self.master)
                .chain(self.state.list())
                .collect(),
            scratch: Vec::new(),
        }
    }
}

/// Takes an operation's buffers apart, one list at a time, checking each buffer's role.
struct Reader<'a, 'p> {
    operation: &'a Operation,
    plan: &'p StepPlan,
}

/// One of an operation's three lists, being taken apart from the front.
struct List<'a> {
    name: &'static str,
    rest: &'a [BufferId],
}

impl<'a, 'p> Reader<'a, 'p> {
    fn new(
        operation: &'a Operation,
        plan: &'p StepPlan,
        kind_fits: bool,
        wanted: &str,
    ) -> Result<Reader<'a, 'p>, OperandError> {
        let reader = Reader { operation, plan };
        if !kind_fits {
            return Err(reader.error(format!("is not {wanted}")));
        }
        Ok(reader)
    }

    fn error(&self, problem: impl fmt::Display) -> OperandError {
        OperandError::new(format!("{:?} {problem}", self.operation.kind))
    }

    fn reads(&self) -> List<'a> {
        List {
            name: "reads",
            rest: &self.operation.reads,
        }
    }

    fn writes(&self) -> List<'a> {
        List {
            name: "writes",
            rest: &self.operation.writes,
        }
    }

    fn scratch(&self) -> List<'a> {
        List {
            name: "scratch",
            rest: &self.operation.scratch,
        }
    }

    /// Checks that `id` is a buffer of the plan whose role and owner `fits` accepts.
    fn check(
        &self,
        id: BufferId,
        what: &str,
        fits: impl Fn(BufferRole, BufferOwner) -> bool,
    ) -> Result<BufferId, OperandError> {
        let spec = self.plan.buffers.get(id.0).ok_or_else(|| {
            self.error(format_args!(
                "names buffer {} as its {what}, which the plan does not have",
                id.0
            ))
        })?;
        if fits(spec.role, spec.owner) {
            Ok(id)
        } else {
            Err(self.error(format_args!(
                "has buffer {} ({:?} of {}) where its {what} belongs",
                id.0,
                spec.role,
                self.plan.owner_label(spec.owner)
            )))
        }
    }

    fn one(
        &self,
        list: &mut List<'a>,
        what: &str,
        fits: impl Fn(BufferRole, BufferOwner) -> bool,
    ) -> Result<BufferId, OperandError> {
        let (first, rest) = list
            .rest
            .split_first()
            .ok_or_else(|| self.error(format_args!("lacks its {what} in {}", list.name)))?;
        list.rest = rest;
        self.check(*first, what, fits)
    }

    fn optional(
        &self,
        list: &mut List<'a>,
        present: bool,
        what: &str,
        fits: impl Fn(BufferRole, BufferOwner) -> bool,
    ) -> Result<Option<BufferId>, OperandError> {
        if present {
            self.one(list, what, fits).map(Some)
        } else {
            Ok(None)
        }
    }

    fn many(
        &self,
        list: &mut List<'a>,
        count: usize,
        what: &str,
        fits: impl Fn(usize, BufferRole, BufferOwner) -> bool,
    ) -> Result<&'a [BufferId], OperandError> {
        if list.rest.len() < count {
            return Err(self.error(format_args!(
                "has {} {} where its {count} {what} belong",
                list.rest.len(),
                list.name
            )));
        }
        let (taken, rest) = list.rest.split_at(count);
        list.rest = rest;
        for (position, id) in taken.iter().enumerate() {
            self.check(*id, what, |role, owner| fits(position, role, owner))?;
        }
        Ok(taken)
    }

    /// A layer's parameter buffers, in the model's order: `Parameter { parameter }` of
    /// that layer, `parameter` counting up from 0.
    fn parameters(
        &self,
        list: &mut List<'a>,
        layer: &LayerNode,
    ) -> Result<LayerParameters<BufferId>, OperandError> {
        let owner = BufferOwner::Layer(layer.index);
        let ids = self.many(
            list,
            layer.parameters.len(),
            "parameters",
            |position, role, buffer_owner| {
                buffer_owner == owner
                    && role
                        == BufferRole::Parameter {
                            parameter: position,
                        }
            },
        )?;
        LayerParameters::name(layer, ids.iter().copied())
    }

    /// Nothing may be left in `list`.
    fn end(&self, list: List<'a>) -> Result<(), OperandError> {
        if list.rest.is_empty() {
            Ok(())
        } else {
            Err(self.error(format_args!(
                "has {} more {} than its kind lists",
                list.rest.len(),
                list.name
            )))
        }
    }
}

/// Whether a buffer holds a tensor a layer reads: the model input or a layer's output.
fn is_tensor(role: BufferRole) -> bool {
    matches!(role, BufferRole::LayerOutput | BufferRole::InputSlot { .. })
}

/// Whether a buffer holds the gradient of a tensor.
fn is_tensor_gradient(role: BufferRole) -> bool {
    matches!(role, BufferRole::InputGradient | BufferRole::OutputGradient)
}

/// What a layer's forward keeps for backward besides its output.
fn side_output_role(layer: &LayerNode) -> Option<BufferRole> {
    match layer.op {
        LayerOp::Dropout { .. } => Some(BufferRole::DropoutMask),
        LayerOp::BatchNorm { .. } => Some(BufferRole::BatchStatistics),
        _ => None,
    }
}

fn has_workspace(layer: &LayerNode, plan: &StepPlan) -> bool {
    workspace_elements(layer, &plan.config).is_some_and(|elements| elements > 0)
}

/// Whether `layer` is the layer of a layer operation `kind`.
fn is_layer_operation(kind: OperationKind, layer: &LayerNode, backward: bool) -> bool {
    match kind {
        OperationKind::LayerForward { layer: index }
        | OperationKind::LayerRecompute { layer: index }
        | OperationKind::LayerInference { layer: index } => !backward && index == layer.index,
        OperationKind::LayerBackward { layer: index } => backward && index == layer.index,
        _ => false,
    }
}

impl Operation {
    /// The masters and weights of `InitializeParameters`, pair by pair.
    pub fn initialize_operands<'a>(
        &'a self,
        plan: &StepPlan,
    ) -> Result<InitializeOperands<'a>, OperandError> {
        let reader = Reader::new(
            self,
            plan,
            self.kind == OperationKind::InitializeParameters,
            "InitializeParameters",
        )?;
        let (mut reads, mut writes) = (reader.reads(), reader.writes());
        let count = self.reads.len();
        let masters = reader.many(&mut reads, count, "masters", |_, role, _| {
            matches!(role, BufferRole::MasterParameter { .. })
        })?;
        let weights = reader.many(&mut writes, count, "weights", |position, role, owner| {
            // The same tensor as the master in the same position.
            let master = plan.buffer(masters[position]);
            owner == master.owner
                && matches!(
                    (role, master.role),
                    (BufferRole::Parameter { parameter }, BufferRole::MasterParameter { parameter: of_master })
                        if parameter == of_master
                )
        })?;
        reader.end(reads)?;
        reader.end(writes)?;
        reader.end(reader.scratch())?;
        Ok(InitializeOperands { masters, weights })
    }

    /// The buffers of `layer`'s forward, recompute or inference.
    pub fn layer_forward_operands<'a>(
        &'a self,
        plan: &StepPlan,
        layer: &LayerNode,
    ) -> Result<LayerForwardOperands<'a>, OperandError> {
        let reader = Reader::new(
            self,
            plan,
            is_layer_operation(self.kind, layer, false),
            &format!("a forward of {}", layer.label()),
        )?;
        let owner = BufferOwner::Layer(layer.index);
        let mut reads = reader.reads();
        let inputs = reader.many(&mut reads, layer.inputs.len(), "inputs", |_, role, _| {
            is_tensor(role)
        })?;
        let parameters = reader.parameters(&mut reads, layer)?;
        reader.end(reads)?;
        let mut writes = reader.writes();
        let output = reader.optional(&mut writes, !layer.is_view(), "output", |role, of| {
            role == BufferRole::LayerOutput && of == owner
        })?;
        let inference = matches!(self.kind, OperationKind::LayerInference { .. });
        let side_role = side_output_role(layer).filter(|_| !inference && !layer.is_view());
        let side_output = reader.optional(
            &mut writes,
            side_role.is_some(),
            "side output",
            |role, of| Some(role) == side_role && of == owner,
        )?;
        reader.end(writes)?;
        let mut scratch = reader.scratch();
        let workspace = reader.optional(
            &mut scratch,
            has_workspace(layer, plan),
            "workspace",
            |role, of| role == BufferRole::Workspace && of == owner,
        )?;
        reader.end(scratch)?;
        Ok(LayerForwardOperands {
            inputs,
            parameters,
            output,
            side_output,
            workspace,
        })
    }

    /// The buffers of `layer`'s backward.
    pub fn layer_backward_operands<'a>(
        &'a self,
        plan: &StepPlan,
        layer: &LayerNode,
    ) -> Result<LayerBackwardOperands<'a>, OperandError> {
        let reader = Reader::new(
            self,
            plan,
            is_layer_operation(self.kind, layer, true),
            &format!("the backward of {}", layer.label()),
        )?;
        let owner = BufferOwner::Layer(layer.index);
        let mut reads = reader.reads();
        let output_gradient = reader.one(&mut reads, "output gradient", |role, _| {
            is_tensor_gradient(role)
        })?;
        let kept_inputs = if layer.backward_reads_input() {
            layer.inputs.len()
        } else {
            0
        };
        let inputs = reader.many(&mut reads, kept_inputs, "inputs", |_, role, _| {
            is_tensor(role)
        })?;
        let output = reader.optional(
            &mut reads,
            layer.backward_reads_output(),
            "output",
            |role, of| role == BufferRole::LayerOutput && of == owner,
        )?;
        let side_role = side_output_role(layer);
        let side_output = reader.optional(
            &mut reads,
            side_role.is_some(),
            "side output",
            |role, of| Some(role) == side_role && of == owner,
        )?;
        let parameters = reader.parameters(&mut reads, layer)?;
        reader.end(reads)?;

        let mut writes = reader.writes();
        // The model indices of the trained tensors, whose gradients follow the input
        // gradients in that order.
        let trained: Vec<usize> = layer
            .parameters
            .iter()
            .enumerate()
            .filter(|(_, tensor)| tensor.trainable)
            .map(|(index, _)| index)
            .collect();
        let input_gradient_count = self.writes.len().saturating_sub(trained.len());
        if input_gradient_count > layer.inputs.len() {
            return Err(reader.error(format_args!(
                "writes {input_gradient_count} input gradients for {} inputs",
                layer.inputs.len()
            )));
        }
        let input_gradients = reader.many(
            &mut writes,
            input_gradient_count,
            "input gradients",
            |_, role, of| role == BufferRole::InputGradient && of == owner,
        )?;
        let gradient_ids = reader.many(
            &mut writes,
            trained.len(),
            "parameter gradients",
            |position, role, of| {
                of == owner
                    && trained.get(position).is_some_and(|parameter| {
                        role == BufferRole::Gradient {
                            parameter: *parameter,
                        }
                    })
            },
        )?;
        let parameter_gradients = ParameterGradients::name(layer, gradient_ids.iter().copied())?;
        reader.end(writes)?;

        let mut scratch = reader.scratch();
        let workspace = reader.optional(
            &mut scratch,
            has_workspace(layer, plan),
            "workspace",
            |role, of| role == BufferRole::Workspace && of == owner,
        )?;
        let half_gradients = reader.optional(
            &mut scratch,
            plan.config.precision.is_mixed() && layer.trainable_parameter_elements() > 0,
            "half gradients",
            |role, of| role == BufferRole::HalfGradients && of == owner,
        )?;
        reader.end(scratch)?;
        Ok(LayerBackwardOperands {
            output_gradient,
            inputs,
            output,
            side_output,
            parameters,
            input_gradients,
            parameter_gradients,
            workspace,
            half_gradients,
        })
    }

    /// The buffers of `LossForward` and `LossEvaluate`.
    pub fn loss_operands(&self, plan: &StepPlan) -> Result<LossOperands, OperandError> {
        let reader = Reader::new(
            self,
            plan,
            matches!(
                self.kind,
                OperationKind::LossForward | OperationKind::LossEvaluate
            ),
            "a loss forward",
        )?;
        let mut reads = reader.reads();
        let output = reader.one(&mut reads, "model output", |role, _| is_tensor(role))?;
        let target = reader.one(&mut reads, "target", |role, _| {
            matches!(role, BufferRole::TargetSlot { .. })
        })?;
        reader.end(reads)?;
        let mut writes = reader.writes();
        let loss = reader.one(&mut writes, "loss value", |role, _| {
            role == BufferRole::LossValue
        })?;
        // Cross-entropy's; the plan does not say which loss it is.
        let has_probabilities = !writes.rest.is_empty();
        let probabilities = reader.optional(
            &mut writes,
            has_probabilities,
            "probabilities",
            |role, _| role == BufferRole::Probabilities,
        )?;
        reader.end(writes)?;
        reader.end(reader.scratch())?;
        Ok(LossOperands {
            output,
            target,
            loss,
            probabilities,
        })
    }

    /// The buffers of `LossBackward`.
    pub fn loss_gradient_operands(
        &self,
        plan: &StepPlan,
    ) -> Result<LossGradientOperands, OperandError> {
        let reader = Reader::new(
            self,
            plan,
            self.kind == OperationKind::LossBackward,
            "a loss backward",
        )?;
        let mut reads = reader.reads();
        let predictions = reader.one(&mut reads, "predictions", |role, _| {
            is_tensor(role) || role == BufferRole::Probabilities
        })?;
        let target = reader.one(&mut reads, "target", |role, _| {
            matches!(role, BufferRole::TargetSlot { .. })
        })?;
        reader.end(reads)?;
        let mut writes = reader.writes();
        let output_gradient = reader.one(&mut writes, "output gradient", |role, _| {
            role == BufferRole::OutputGradient
        })?;
        reader.end(writes)?;
        reader.end(reader.scratch())?;
        Ok(LossGradientOperands {
            predictions,
            target,
            output_gradient,
        })
    }

    /// The buffers of `AccumulateGradient` and `CopyGradient`.
    pub fn gradient_sum_operands(
        &self,
        plan: &StepPlan,
    ) -> Result<GradientSumOperands, OperandError> {
        let reader = Reader::new(
            self,
            plan,
            matches!(
                self.kind,
                OperationKind::AccumulateGradient { .. } | OperationKind::CopyGradient { .. }
            ),
            "a gradient sum or copy",
        )?;
        let (mut reads, mut writes) = (reader.reads(), reader.writes());
        let from = reader.one(&mut reads, "summand", |role, _| is_tensor_gradient(role))?;
        let into = reader.one(&mut writes, "sum", |role, _| is_tensor_gradient(role))?;
        reader.end(reads)?;
        reader.end(writes)?;
        reader.end(reader.scratch())?;
        Ok(GradientSumOperands { from, into })
    }

    /// The buffers of `CheckOverflow`.
    pub fn overflow_operands<'a>(
        &'a self,
        plan: &StepPlan,
    ) -> Result<OverflowOperands<'a>, OperandError> {
        let reader = Reader::new(
            self,
            plan,
            self.kind == OperationKind::CheckOverflow,
            "CheckOverflow",
        )?;
        let mut reads = reader.reads();
        let gradients = reader.many(&mut reads, self.reads.len(), "gradients", |_, role, _| {
            matches!(role, BufferRole::Gradient { .. })
        })?;
        let mut scratch = reader.scratch();
        let flag = reader.one(&mut scratch, "flag", |role, _| {
            role == BufferRole::OverflowFlag
        })?;
        reader.end(reader.writes())?;
        reader.end(scratch)?;
        Ok(OverflowOperands { gradients, flag })
    }

    /// The buffers of `OptimizerUpdate`.
    pub fn optimizer_operands(&self, plan: &StepPlan) -> Result<OptimizerOperands, OperandError> {
        let OperationKind::OptimizerUpdate { layer, parameter } = self.kind else {
            return Err(Reader {
                operation: self,
                plan,
            }
            .error("is not an optimizer update"));
        };
        let reader = Reader::new(self, plan, true, "an optimizer update")?;
        let owner = BufferOwner::Layer(layer);
        let mut reads = reader.reads();
        let gradient = reader.one(&mut reads, "gradient", |role, of| {
            role == BufferRole::Gradient { parameter } && of == owner
        })?;
        reader.end(reads)?;
        let mut writes = reader.writes();
        let weights = reader.one(&mut writes, "weights", |role, of| {
            role == BufferRole::Parameter { parameter } && of == owner
        })?;
        let master = reader.optional(
            &mut writes,
            plan.config.precision.is_mixed(),
            "master",
            |role, of| role == BufferRole::MasterParameter { parameter } && of == owner,
        )?;
        let slots = writes.rest.len();
        let states = reader.many(&mut writes, slots, "optimizer state", |slot, role, of| {
            role == BufferRole::OptimizerState { parameter, slot } && of == owner
        })?;
        reader.end(writes)?;
        reader.end(reader.scratch())?;
        Ok(OptimizerOperands {
            gradient,
            weights,
            master,
            state: OptimizerState::from_slots(states.iter().copied())
                .map_err(|error| reader.error(error))?,
        })
    }
}

impl StepPlan {
    /// Reads every operation of every phase through its accessor: `Ok` when each lists
    /// the buffers its kind and layer say, in the order this module gives them.
    pub fn check_operands(&self, graph: &ModelGraph) -> Result<(), OperandError> {
        let phases = [
            &self.setup,
            &self.micro_batch,
            &self.update,
            &self.evaluation,
        ];
        for step in phases.into_iter().flatten() {
            let PlanStep::Run(operation) = step else {
                continue;
            };
            let layer = |index: usize| {
                graph.layers.get(index).ok_or_else(|| {
                    OperandError::new(format!(
                        "{:?} names a layer the model does not have",
                        operation.kind
                    ))
                })
            };
            match operation.kind {
                OperationKind::InitializeParameters => {
                    operation.initialize_operands(self)?;
                }
                OperationKind::LayerForward { layer: index }
                | OperationKind::LayerRecompute { layer: index }
                | OperationKind::LayerInference { layer: index } => {
                    operation.layer_forward_operands(self, layer(index)?)?;
                }
                OperationKind::LayerBackward { layer: index } => {
                    operation.layer_backward_operands(self, layer(index)?)?;
                }
                OperationKind::LossForward | OperationKind::LossEvaluate => {
                    operation.loss_operands(self)?;
                }
                OperationKind::LossBackward => {
                    operation.loss_gradient_operands(self)?;
                }
                OperationKind::AccumulateGradient { .. } | OperationKind::CopyGradient { .. } => {
                    operation.gradient_sum_operands(self)?;
                }
                OperationKind::CheckOverflow => {
                    operation.overflow_operands(self)?;
                }
                OperationKind::OptimizerUpdate { .. } => {
                    operation.optimizer_operands(self)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
