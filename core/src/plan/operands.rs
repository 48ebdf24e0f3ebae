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

use super::{BufferOwner, BufferRole, Operation, OperationKind, PlanStep, StepPlan};
use crate::error::FieldError;
use crate::model::{LayerNode, ModelGraph};

mod operations;
mod parameters;
mod reader;

pub use operations::*;
pub use parameters::*;
use reader::*;

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
