//! The operands of each operation kind by name: the structs the compiler builds an
//! operation from and the engine reads it back as.

use super::OperandError;
use super::parameters::*;
use crate::plan::{BufferId, Operation, OperationKind};

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
