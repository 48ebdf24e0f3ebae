//! The step plan compiler: a validated job and a run configuration in, the three phases
//! of buffers and operations out (see the parent module for what a plan is), with every
//! phase-local buffer placed by liveness.

use super::backward::backward_pass;
use super::liveness::place_by_liveness;
use super::operands::{
    InitializeOperands, LayerForwardOperands, LayerParameters, LossGradientOperands, LossOperands,
    OptimizerOperands, OptimizerState, OverflowOperands,
};
use super::*;
use crate::model::{LayerNode, LayerOp, ParameterTensor, TensorSource};
use crate::spec::LossKind;
use crate::validate::ValidatedJob;

/// Builds plans, keeping the buffer table and the overflow checks in one place.
pub(super) struct PlanBuilder<'a> {
    pub(super) graph: &'a ModelGraph,
    pub(super) config: RunConfig,
    pub(super) buffers: Vec<BufferSpec>,
}

impl PlanBuilder<'_> {
    pub(super) fn add_buffer(
        &mut self,
        role: BufferRole,
        owner: BufferOwner,
        category: MemoryCategory,
        element_type: ElementType,
        elements: u64,
    ) -> Result<BufferId, FieldError> {
        let bytes = elements
            .checked_mul(element_type.bytes())
            .ok_or_else(|| self.too_large(owner))?;
        let id = BufferId(self.buffers.len());
        self.buffers.push(BufferSpec {
            id,
            role,
            owner,
            category,
            element_type,
            elements,
            bytes,
        });
        Ok(id)
    }

    pub(super) fn too_large(&self, owner: BufferOwner) -> FieldError {
        let what = match owner {
            BufferOwner::Layer(index) => self.graph.layers[index].label(),
            BufferOwner::Data => "the input".to_string(),
            BufferOwner::Loss => "the loss".to_string(),
        };
        FieldError::new(
            "training.batch_size",
            format!(
                "a micro-batch of {} makes {what} larger than 2^64 bytes",
                self.config.micro_batch_size
            ),
        )
    }

    pub(super) fn per_micro_batch(
        &self,
        per_sample_elements: u64,
        owner: BufferOwner,
    ) -> Result<u64, FieldError> {
        per_sample_elements
            .checked_mul(self.config.micro_batch_size)
            .ok_or_else(|| self.too_large(owner))
    }

    pub(super) fn activation_type(&self) -> ElementType {
        ElementType::for_compute(self.config.precision)
    }

    /// A layer's output for one micro-batch (views share their input's buffer).
    pub(super) fn layer_output(
        &mut self,
        layer: &LayerNode,
        inputs: &[BufferId],
    ) -> Result<BufferId, FieldError> {
        if layer.is_view() {
            return Ok(inputs[0]);
        }
        let owner = BufferOwner::Layer(layer.index);
        let elements = self.per_micro_batch(layer.output_shape.elements(), owner)?;
        self.add_buffer(
            BufferRole::LayerOutput,
            owner,
            MemoryCategory::Activations,
            self.activation_type(),
            elements,
        )
    }

    /// The convolution workspace of one pass ([`workspace_elements`]); none when that is 0.
    pub(super) fn workspace(&mut self, layer: &LayerNode) -> Result<Option<BufferId>, FieldError> {
        let owner = BufferOwner::Layer(layer.index);
        let elements =
            workspace_elements(layer, &self.config).ok_or_else(|| self.too_large(owner))?;
        if elements == 0 {
            return Ok(None);
        }
        self.add_buffer(
            BufferRole::Workspace,
            owner,
            MemoryCategory::Workspace,
            self.activation_type(),
            elements,
        )
        .map(Some)
    }
}

/// How many times its im2col a convolution's workspace is, up to `workspace_limit_bytes`.
/// cuDNN's fast filter-gradient algorithms want somewhat more than an im2col: on an H200,
/// ResNet-18's 1x1 stride-2 shortcut at batch 128 (im2col 2 MiB) fell to an algorithm 8x
/// slower than one needing 2.6 MB, and a stride-2 3x3 whose padded copy shares its
/// workspace could not measure the 7.9 MB one. Relative to the im2col, the headroom
/// shrinks with the precision and the micro-batch as the rest of the plan does, so the
/// shrink planner's steps still free memory on small models; the estimate counts it like
/// any workspace.
pub const CONVOLUTION_WORKSPACE_HEADROOM: u64 = 2;

/// Elements of whole samples' im2col in a layer's workspace: as many samples as
/// `workspace_limit_bytes` allows, at most `micro_batch_size`; 0 for none (a layer without
/// im2col, or not even one sample fits). `None` on overflow.
pub fn im2col_workspace_elements(
    layer: &LayerNode,
    element_type: ElementType,
    micro_batch_size: u64,
    workspace_limit_bytes: u64,
) -> Option<u64> {
    let per_sample_elements = layer.workspace_elements_per_sample();
    let per_sample_bytes = per_sample_elements.checked_mul(element_type.bytes())?;
    if per_sample_bytes == 0 {
        return Some(0);
    }
    per_sample_elements
        .checked_mul((workspace_limit_bytes / per_sample_bytes).min(micro_batch_size))
}

/// Elements of a layer's workspace buffer under `config` (0 for none): its
/// [`im2col_workspace_elements`] times [`CONVOLUTION_WORKSPACE_HEADROOM`], never above
/// `workspace_limit_bytes` (which the im2col alone never passes). `None` on overflow. Two
/// configs that differ only in their workspace limit compile to the same plan exactly when
/// this agrees on every layer.
pub fn workspace_elements(layer: &LayerNode, config: &RunConfig) -> Option<u64> {
    let element_type = ElementType::for_compute(config.precision);
    let im2col_elements = im2col_workspace_elements(
        layer,
        element_type,
        config.micro_batch_size,
        config.workspace_limit_bytes(),
    )?;
    let limit_elements = config.workspace_limit_bytes() / element_type.bytes();
    Some(
        im2col_elements
            .checked_mul(CONVOLUTION_WORKSPACE_HEADROOM)?
            .min(limit_elements),
    )
}

/// The buffers setup allocates and nothing frees during training, indexed by layer and
/// then by parameter tensor.
pub(super) struct PersistentBuffers {
    /// Compute-precision weights (fp32 running statistics).
    pub(super) weights: Vec<Vec<BufferId>>,
    /// fp32 masters under mixed precision, `None` for non-trainable tensors; empty
    /// layers otherwise.
    pub(super) masters: Vec<Vec<Option<BufferId>>>,
    /// fp32 gradients, `None` for non-trainable tensors.
    pub(super) gradients: Vec<Vec<Option<BufferId>>>,
    pub(super) optimizer_state: Vec<Vec<Vec<BufferId>>>,
    /// Prefetch slot 0 of the inputs and the targets: the engine rotates the slots, and
    /// they are all the same size, so slot 0 stands for whichever is current.
    pub(super) input: BufferId,
    pub(super) target: BufferId,
    /// Every buffer id below this is persistent.
    pub(super) count: usize,
}

/// What a forward pass produced, by layer: what backward reads, and the model's output.
/// With recomputation, backward reads a copy where the in-segment outputs are replaced by
/// their recomputed buffers.
#[derive(Clone)]
pub(super) struct ForwardPass {
    pub(super) model_input: BufferId,
    pub(super) outputs: Vec<BufferId>,
    /// Dropout's mask or batch norm's statistics, by layer.
    pub(super) side_outputs: Vec<Option<BufferId>>,
}

impl ForwardPass {
    pub(super) fn source(&self, source: TensorSource) -> BufferId {
        match source {
            TensorSource::ModelInput => self.model_input,
            TensorSource::Layer(index) => self.outputs[index],
        }
    }

    pub(super) fn inputs_of(&self, layer: &LayerNode) -> Vec<BufferId> {
        layer
            .inputs
            .iter()
            .map(|source| self.source(*source))
            .collect()
    }

    pub(super) fn final_output(&self) -> BufferId {
        self.outputs.last().copied().unwrap_or(self.model_input)
    }
}

/// Compiles one training step of `job` run with `config`.
pub fn compile_step_plan(job: &ValidatedJob, config: &RunConfig) -> Result<StepPlan, FieldError> {
    config.check(&job.graph)?;
    let graph = &job.graph;
    let mut builder = PlanBuilder {
        graph,
        config: *config,
        buffers: Vec::new(),
    };
    let persistent = add_persistent_buffers(&mut builder, job)?;
    let setup = setup_steps(graph, config, &persistent);

    // Micro-batch: forward, loss, backward.
    let mut operations = Vec::new();
    let forward = forward_pass(
        &mut builder,
        &persistent,
        |layer| OperationKind::LayerForward { layer },
        &mut operations,
    )?;
    let output_gradient = loss_pass(
        &mut builder,
        forward.final_output(),
        persistent.target,
        &mut operations,
    )?;
    backward_pass(
        &mut builder,
        &persistent,
        &forward,
        output_gradient,
        &mut operations,
    )?;
    let micro_batch = place_by_liveness(operations, persistent.count);

    let update = place_by_liveness(
        update_operations(&mut builder, &persistent)?,
        persistent.count,
    );
    let evaluation = place_by_liveness(
        evaluation_operations(&mut builder, &persistent)?,
        persistent.count,
    );

    Ok(StepPlan {
        config: *config,
        buffers: builder.buffers,
        setup,
        micro_batch,
        update,
        evaluation,
        layer_labels: graph.layers.iter().map(LayerNode::named_label).collect(),
    })
}

/// One value per parameter tensor of every layer, made in layer order.
fn per_parameter<T>(
    graph: &ModelGraph,
    mut make: impl FnMut(BufferOwner, usize, &ParameterTensor) -> Result<T, FieldError>,
) -> Result<Vec<Vec<T>>, FieldError> {
    graph
        .layers
        .iter()
        .map(|layer| {
            let owner = BufferOwner::Layer(layer.index);
            layer
                .parameters
                .iter()
                .enumerate()
                .map(|(parameter_index, parameter)| make(owner, parameter_index, parameter))
                .collect()
        })
        .collect()
}

/// An fp32 buffer per trainable parameter tensor (masters, gradients), `None` for the
/// running statistics, which are not trained.
fn fp32_per_trainable_parameter(
    builder: &mut PlanBuilder<'_>,
    role: fn(usize) -> BufferRole,
    category: MemoryCategory,
) -> Result<Vec<Vec<Option<BufferId>>>, FieldError> {
    per_parameter(builder.graph, |owner, parameter_index, parameter| {
        if !parameter.trainable {
            return Ok(None);
        }
        builder
            .add_buffer(
                role(parameter_index),
                owner,
                category,
                ElementType::F32,
                parameter.elements,
            )
            .map(Some)
    })
}

/// Setup's buffers, grouped by category so the breakdown reads naturally: weights,
/// masters, gradients, optimizer state, then the prefetched input batches.
fn add_persistent_buffers(
    builder: &mut PlanBuilder<'_>,
    job: &ValidatedJob,
) -> Result<PersistentBuffers, FieldError> {
    let graph = builder.graph;
    let config = builder.config;
    let weights = per_parameter(graph, |owner, parameter_index, parameter| {
        // Running statistics stay fp32 whatever the precision: they are averages that
        // half precision would round away.
        let element_type = if parameter.trainable {
            builder.activation_type()
        } else {
            ElementType::F32
        };
        builder.add_buffer(
            BufferRole::Parameter {
                parameter: parameter_index,
            },
            owner,
            MemoryCategory::Weights,
            element_type,
            parameter.elements,
        )
    })?;
    let masters = if config.precision.is_mixed() {
        fp32_per_trainable_parameter(
            builder,
            |parameter| BufferRole::MasterParameter { parameter },
            MemoryCategory::MasterWeights,
        )?
    } else {
        vec![Vec::new(); graph.layers.len()]
    };
    let gradients = fp32_per_trainable_parameter(
        builder,
        |parameter| BufferRole::Gradient { parameter },
        MemoryCategory::Gradients,
    )?;
    let optimizer_slots = job.spec.training.optimizer.state_tensors_per_parameter() as usize;
    let optimizer_state = per_parameter(graph, |owner, parameter_index, parameter| {
        let slots = if parameter.trainable {
            optimizer_slots
        } else {
            0
        };
        (0..slots)
            .map(|slot| {
                builder.add_buffer(
                    BufferRole::OptimizerState {
                        parameter: parameter_index,
                        slot,
                    },
                    owner,
                    MemoryCategory::OptimizerState,
                    ElementType::F32,
                    parameter.elements,
                )
            })
            .collect()
    })?;

    let input_elements =
        builder.per_micro_batch(graph.input_shape.elements(), BufferOwner::Data)?;
    let target_bytes =
        builder.per_micro_batch(graph.target_bytes_per_sample(), BufferOwner::Data)?;
    let target_type = match graph.loss {
        LossKind::SoftmaxCrossEntropy => ElementType::I32,
        LossKind::Mse => ElementType::F32,
    };
    let mut input_slots = Vec::new();
    let mut target_slots = Vec::new();
    for slot in 0..config.engine_settings()?.prefetch_batches as usize {
        input_slots.push(builder.add_buffer(
            BufferRole::InputSlot { slot },
            BufferOwner::Data,
            MemoryCategory::InputBatches,
            builder.activation_type(),
            input_elements,
        )?);
        target_slots.push(builder.add_buffer(
            BufferRole::TargetSlot { slot },
            BufferOwner::Data,
            MemoryCategory::InputBatches,
            target_type,
            target_bytes / target_type.bytes(),
        )?);
    }
    Ok(PersistentBuffers {
        weights,
        masters,
        gradients,
        optimizer_state,
        input: input_slots[0],
        target: target_slots[0],
        count: builder.buffers.len(),
    })
}

/// Setup: allocate every persistent buffer, then (mixed precision) cast the fp32 masters
/// into the compute-precision weights.
fn setup_steps(
    graph: &ModelGraph,
    config: &RunConfig,
    persistent: &PersistentBuffers,
) -> Vec<PlanStep> {
    let mut setup: Vec<PlanStep> = (0..persistent.count)
        .map(|index| PlanStep::Allocate(BufferId(index)))
        .collect();
    if config.precision.is_mixed() {
        let mut reads = Vec::new();
        let mut writes = Vec::new();
        for layer in &graph.layers {
            for (parameter_index, master) in persistent.masters[layer.index].iter().enumerate() {
                if let Some(master) = master {
                    reads.push(*master);
                    writes.push(persistent.weights[layer.index][parameter_index]);
                }
            }
        }
        setup.push(PlanStep::Run(
            InitializeOperands {
                masters: &reads,
                weights: &writes,
            }
            .operation(),
        ));
    }
    setup
}

/// The operation that runs one layer forward as `kind` says (forward, recompute,
/// inference) on `input`, with the buffers it writes.
pub(super) struct LayerForward {
    pub(super) operation: Operation,
    pub(super) output: BufferId,
    pub(super) side_output: Option<BufferId>,
}

pub(super) fn layer_forward(
    builder: &mut PlanBuilder<'_>,
    layer: &LayerNode,
    inputs: Vec<BufferId>,
    weights: &[BufferId],
    kind: OperationKind,
) -> Result<LayerForward, FieldError> {
    let output = builder.layer_output(layer, &inputs)?;
    // Inference keeps nothing for a backward pass.
    let side_output = if matches!(kind, OperationKind::LayerInference { .. }) {
        None
    } else {
        layer_side_output(builder, layer)?
    };
    let workspace = builder.workspace(layer)?;
    let operands = LayerForwardOperands {
        inputs: &inputs,
        parameters: LayerParameters::name(layer, weights.iter().copied())?,
        // A view writes nothing: its output is its input's buffer.
        output: (!layer.is_view()).then_some(output),
        side_output,
        workspace,
    };
    Ok(LayerForward {
        operation: operands.operation(kind),
        output,
        side_output,
    })
}

/// The buffer a layer's forward writes besides its output, kept for backward: the
/// dropout mask, batch norm's per-channel statistics.
fn layer_side_output(
    builder: &mut PlanBuilder<'_>,
    layer: &LayerNode,
) -> Result<Option<BufferId>, FieldError> {
    let owner = BufferOwner::Layer(layer.index);
    match layer.op {
        LayerOp::Dropout { .. } => {
            let elements = builder.per_micro_batch(layer.output_shape.elements(), owner)?;
            Ok(Some(builder.add_buffer(
                BufferRole::DropoutMask,
                owner,
                MemoryCategory::Activations,
                ElementType::U8,
                elements,
            )?))
        }
        LayerOp::BatchNorm { .. } => {
            let channels = LayerParameters::of_layer(layer)?
                .batch_norm()
                .map_or(0, |parameters| parameters.gamma.elements);
            Ok(Some(builder.add_buffer(
                BufferRole::BatchStatistics,
                owner,
                MemoryCategory::Activations,
                ElementType::F32,
                2 * channels,
            )?))
        }
        _ => Ok(None),
    }
}

/// Forward through every layer as `kind` runs it (training or inference), keeping what
/// each produced for backward.
fn forward_pass(
    builder: &mut PlanBuilder<'_>,
    persistent: &PersistentBuffers,
    kind: fn(usize) -> OperationKind,
    operations: &mut Vec<Operation>,
) -> Result<ForwardPass, FieldError> {
    let graph = builder.graph;
    let layer_count = graph.layers.len();
    let mut forward = ForwardPass {
        model_input: persistent.input,
        outputs: Vec::with_capacity(layer_count),
        side_outputs: Vec::with_capacity(layer_count),
    };
    for layer in &graph.layers {
        let step = layer_forward(
            builder,
            layer,
            forward.inputs_of(layer),
            &persistent.weights[layer.index],
            kind(layer.index),
        )?;
        operations.push(step.operation);
        forward.outputs.push(step.output);
        forward.side_outputs.push(step.side_output);
    }
    Ok(forward)
}

/// The loss value and, for cross-entropy, the probabilities: what a loss forward or an
/// evaluation's loss writes.
fn loss_outputs(builder: &mut PlanBuilder<'_>) -> Result<(BufferId, Option<BufferId>), FieldError> {
    let graph = builder.graph;
    let loss_value = builder.add_buffer(
        BufferRole::LossValue,
        BufferOwner::Loss,
        MemoryCategory::Transients,
        ElementType::F32,
        1,
    )?;
    let probabilities = if graph.loss == LossKind::SoftmaxCrossEntropy {
        let elements =
            builder.per_micro_batch(graph.output_shape().elements(), BufferOwner::Loss)?;
        Some(builder.add_buffer(
            BufferRole::Probabilities,
            BufferOwner::Loss,
            MemoryCategory::Activations,
            ElementType::F32,
            elements,
        )?)
    } else {
        None
    };
    Ok((loss_value, probabilities))
}

/// The loss forward and backward; returns the gradient of the model's output.
fn loss_pass(
    builder: &mut PlanBuilder<'_>,
    final_output: BufferId,
    target: BufferId,
    operations: &mut Vec<Operation>,
) -> Result<BufferId, FieldError> {
    let (loss, probabilities) = loss_outputs(builder)?;
    operations.push(
        LossOperands {
            output: final_output,
            target,
            loss,
            probabilities,
        }
        .operation(OperationKind::LossForward),
    );
    let output_gradient_elements =
        builder.per_micro_batch(builder.graph.output_shape().elements(), BufferOwner::Loss)?;
    let output_gradient = builder.add_buffer(
        BufferRole::OutputGradient,
        BufferOwner::Loss,
        MemoryCategory::Transients,
        builder.activation_type(),
        output_gradient_elements,
    )?;
    operations.push(
        LossGradientOperands {
            // Cross-entropy's gradient is softmax minus one-hot: it needs the
            // probabilities, not the logits.
            predictions: probabilities.unwrap_or(final_output),
            target,
            output_gradient,
        }
        .operation(),
    );
    Ok(output_gradient)
}

/// Update: loss-scale overflow check (fp16), then the optimizer per parameter tensor.
fn update_operations(
    builder: &mut PlanBuilder<'_>,
    persistent: &PersistentBuffers,
) -> Result<Vec<Operation>, FieldError> {
    let mut operations = Vec::new();
    if builder.config.precision == Precision::Fp16 {
        let flag = builder.add_buffer(
            BufferRole::OverflowFlag,
            BufferOwner::Loss,
            MemoryCategory::Transients,
            ElementType::I32,
            1,
        )?;
        let gradients: Vec<BufferId> = persistent
            .gradients
            .iter()
            .flat_map(|layer| layer.iter().flatten().copied())
            .collect();
        operations.push(
            OverflowOperands {
                gradients: &gradients,
                flag,
            }
            .operation(),
        );
    }
    for layer in &builder.graph.layers {
        for (parameter_index, gradient) in persistent.gradients[layer.index].iter().enumerate() {
            let Some(gradient) = gradient else { continue };
            let operands = OptimizerOperands {
                gradient: *gradient,
                weights: persistent.weights[layer.index][parameter_index],
                master: persistent.masters[layer.index]
                    .get(parameter_index)
                    .copied()
                    .flatten(),
                state: OptimizerState::from_slots(
                    persistent.optimizer_state[layer.index][parameter_index]
                        .iter()
                        .copied(),
                )?,
            };
            operations.push(operands.operation(layer.index, parameter_index));
        }
    }
    Ok(operations)
}

/// Evaluation: inference through every layer, each output living only until the next
/// layer has read it, then the loss.
fn evaluation_operations(
    builder: &mut PlanBuilder<'_>,
    persistent: &PersistentBuffers,
) -> Result<Vec<Operation>, FieldError> {
    let mut operations = Vec::new();
    let forward = forward_pass(
        builder,
        persistent,
        |layer| OperationKind::LayerInference { layer },
        &mut operations,
    )?;
    let (loss, probabilities) = loss_outputs(builder)?;
    operations.push(
        LossOperands {
            output: forward.final_output(),
            target: persistent.target,
            loss,
            probabilities,
        }
        .operation(OperationKind::LossEvaluate),
    );
    Ok(operations)
}
