//! The step plan compiler: a validated job and a run configuration in, the three phases
//! of buffers and operations out (see the parent module for what a plan is), with every
//! phase-local buffer placed by liveness.

use super::*;
use crate::model::{LayerNode, LayerOp};
use crate::spec::LossKind;
use crate::validate::ValidatedJob;

/// Builds plans, keeping the buffer table and the overflow checks in one place.
struct PlanBuilder<'a> {
    graph: &'a ModelGraph,
    config: RunConfig,
    buffers: Vec<BufferSpec>,
}

impl PlanBuilder<'_> {
    fn add_buffer(
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

    fn too_large(&self, owner: BufferOwner) -> FieldError {
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

    fn per_micro_batch(
        &self,
        per_sample_elements: u64,
        owner: BufferOwner,
    ) -> Result<u64, FieldError> {
        per_sample_elements
            .checked_mul(self.config.micro_batch_size)
            .ok_or_else(|| self.too_large(owner))
    }

    fn activation_type(&self) -> ElementType {
        ElementType::for_compute(self.config.precision)
    }

    /// A layer's output for one micro-batch (views share their input's buffer).
    fn layer_output(&mut self, layer: &LayerNode, input: BufferId) -> Result<BufferId, FieldError> {
        if layer.is_view() {
            return Ok(input);
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

    /// The convolution workspace of one pass: whole samples' im2col up to the cap; an
    /// algorithm without workspace when not even one sample fits.
    fn workspace(&mut self, layer: &LayerNode) -> Result<Option<BufferId>, FieldError> {
        let owner = BufferOwner::Layer(layer.index);
        let samples =
            workspace_samples(layer, &self.config).ok_or_else(|| self.too_large(owner))?;
        if samples == 0 {
            return Ok(None);
        }
        let elements = layer.workspace_elements_per_sample() * samples;
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

/// How many samples' im2col a layer's workspace holds under `config`: as many whole
/// samples as `workspace_limit_bytes` allows, at most a micro-batch; 0 for no workspace
/// (a layer that needs none, or not even one sample fits). `None` when one sample's
/// workspace overflows u64 bytes. Two configs that differ only in their workspace limit
/// compile to the same plan exactly when this agrees on every layer.
pub fn workspace_samples(layer: &LayerNode, config: &RunConfig) -> Option<u64> {
    let per_sample_bytes = layer
        .workspace_elements_per_sample()
        .checked_mul(ElementType::for_compute(config.precision).bytes())?;
    if per_sample_bytes == 0 {
        return Some(0);
    }
    Some((config.workspace_limit_bytes / per_sample_bytes).min(config.micro_batch_size))
}

/// The persistent buffers of each layer's parameters.
#[derive(Debug, Clone, Default)]
struct ParameterBuffers {
    /// Compute-precision weights, one per parameter tensor.
    weights: Vec<BufferId>,
    /// fp32 gradients, `None` for non-trainable tensors.
    gradients: Vec<Option<BufferId>>,
}

/// Compiles one training step of `job` run with `config`.
pub fn compile_step_plan(job: &ValidatedJob, config: &RunConfig) -> Result<StepPlan, FieldError> {
    config.check(&job.graph)?;
    let graph = &job.graph;
    let mixed = config.precision.is_mixed();
    let optimizer_slots = job.spec.training.optimizer.state_tensors_per_parameter();
    let mut builder = PlanBuilder {
        graph,
        config: *config,
        buffers: Vec::new(),
    };

    // Setup: persistent buffers, grouped by category so the breakdown reads naturally.
    let mut setup_operations = Vec::new();
    let mut parameters: Vec<ParameterBuffers> =
        vec![ParameterBuffers::default(); graph.layers.len()];
    let mut masters: Vec<Vec<Option<BufferId>>> = vec![Vec::new(); graph.layers.len()];
    let mut optimizer_state: Vec<Vec<Vec<BufferId>>> = vec![Vec::new(); graph.layers.len()];
    for layer in &graph.layers {
        let owner = BufferOwner::Layer(layer.index);
        for (parameter_index, parameter) in layer.parameters.iter().enumerate() {
            // Running statistics stay fp32 whatever the precision: they are averages that
            // half precision would round away.
            let element_type = if parameter.trainable {
                builder.activation_type()
            } else {
                ElementType::F32
            };
            let id = builder.add_buffer(
                BufferRole::Parameter {
                    parameter: parameter_index,
                },
                owner,
                MemoryCategory::Weights,
                element_type,
                parameter.elements,
            )?;
            parameters[layer.index].weights.push(id);
        }
    }
    if mixed {
        for layer in &graph.layers {
            let owner = BufferOwner::Layer(layer.index);
            for (parameter_index, parameter) in layer.parameters.iter().enumerate() {
                let master = if parameter.trainable {
                    Some(builder.add_buffer(
                        BufferRole::MasterParameter {
                            parameter: parameter_index,
                        },
                        owner,
                        MemoryCategory::MasterWeights,
                        ElementType::F32,
                        parameter.elements,
                    )?)
                } else {
                    None
                };
                masters[layer.index].push(master);
            }
        }
    }
    for layer in &graph.layers {
        let owner = BufferOwner::Layer(layer.index);
        for (parameter_index, parameter) in layer.parameters.iter().enumerate() {
            let gradient = if parameter.trainable {
                Some(builder.add_buffer(
                    BufferRole::Gradient {
                        parameter: parameter_index,
                    },
                    owner,
                    MemoryCategory::Gradients,
                    ElementType::F32,
                    parameter.elements,
                )?)
            } else {
                None
            };
            parameters[layer.index].gradients.push(gradient);
        }
    }
    for layer in &graph.layers {
        let owner = BufferOwner::Layer(layer.index);
        for (parameter_index, parameter) in layer.parameters.iter().enumerate() {
            let mut slots = Vec::new();
            if parameter.trainable {
                for slot in 0..optimizer_slots as usize {
                    slots.push(builder.add_buffer(
                        BufferRole::OptimizerState {
                            parameter: parameter_index,
                            slot,
                        },
                        owner,
                        MemoryCategory::OptimizerState,
                        ElementType::F32,
                        parameter.elements,
                    )?);
                }
            }
            optimizer_state[layer.index].push(slots);
        }
    }
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
    for slot in 0..config.prefetch_batches as usize {
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
    let persistent_count = builder.buffers.len();
    let mut setup: Vec<PlanStep> = (0..persistent_count)
        .map(|index| PlanStep::Allocate(BufferId(index)))
        .collect();
    if mixed {
        let mut reads = Vec::new();
        let mut writes = Vec::new();
        for layer in &graph.layers {
            for (parameter_index, master) in masters[layer.index].iter().enumerate() {
                if let Some(master) = master {
                    reads.push(*master);
                    writes.push(parameters[layer.index].weights[parameter_index]);
                }
            }
        }
        setup_operations.push(Operation {
            kind: OperationKind::InitializeParameters,
            reads,
            writes,
            scratch: Vec::new(),
        });
    }
    setup.extend(setup_operations.into_iter().map(PlanStep::Run));

    // Micro-batch: forward, loss, backward. The engine rotates the prefetch slots; they
    // are all the same size, so slot 0 stands for whichever is current.
    let input = input_slots[0];
    let target = target_slots[0];
    let mut operations = Vec::new();
    let layer_count = graph.layers.len();
    let segment = config
        .recompute_segment_layers
        .map(|segment| segment as usize);
    // What forward produced, by layer. With recomputation only the inputs of each
    // segment's first layer (and the last layer's output) outlive the forward pass.
    let mut layer_inputs = Vec::with_capacity(layer_count);
    let mut layer_outputs = Vec::with_capacity(layer_count);
    let mut forward_extras: Vec<Vec<BufferId>> = vec![Vec::new(); layer_count];
    let mut current = input;
    for layer in &graph.layers {
        let output = builder.layer_output(layer, current)?;
        let extras = layer_side_outputs(&mut builder, layer)?;
        let workspace = builder.workspace(layer)?;
        let mut writes = vec![output];
        writes.extend(&extras);
        if layer.is_view() {
            writes.clear();
        }
        let mut reads = vec![current];
        reads.extend(&parameters[layer.index].weights);
        operations.push(Operation {
            kind: OperationKind::LayerForward { layer: layer.index },
            reads,
            writes,
            scratch: workspace.into_iter().collect(),
        });
        forward_extras[layer.index] = extras;
        layer_inputs.push(current);
        layer_outputs.push(output);
        current = output;
    }
    let final_output = current;

    let mut loss_reads = vec![final_output, target];
    let loss_value = builder.add_buffer(
        BufferRole::LossValue,
        BufferOwner::Loss,
        MemoryCategory::Transients,
        ElementType::F32,
        1,
    )?;
    let mut loss_writes = vec![loss_value];
    let probabilities = if graph.loss == LossKind::SoftmaxCrossEntropy {
        let elements =
            builder.per_micro_batch(graph.output_shape().elements(), BufferOwner::Loss)?;
        let probabilities = builder.add_buffer(
            BufferRole::Probabilities,
            BufferOwner::Loss,
            MemoryCategory::Activations,
            ElementType::F32,
            elements,
        )?;
        loss_writes.push(probabilities);
        Some(probabilities)
    } else {
        None
    };
    operations.push(Operation {
        kind: OperationKind::LossForward,
        reads: loss_reads.clone(),
        writes: loss_writes,
        scratch: Vec::new(),
    });
    let output_gradient_elements =
        builder.per_micro_batch(graph.output_shape().elements(), BufferOwner::Loss)?;
    let output_gradient = builder.add_buffer(
        BufferRole::OutputGradient,
        BufferOwner::Loss,
        MemoryCategory::Transients,
        builder.activation_type(),
        output_gradient_elements,
    )?;
    if let Some(probabilities) = probabilities {
        // Cross-entropy's gradient is softmax minus one-hot: it needs the probabilities,
        // not the logits.
        loss_reads[0] = probabilities;
    }
    operations.push(Operation {
        kind: OperationKind::LossBackward,
        reads: loss_reads,
        writes: vec![output_gradient],
        scratch: Vec::new(),
    });

    // Backward, last layer first. Layers before the first trainable one need no backward
    // at all, and that layer needs no input gradient.
    let first_trainable = graph
        .layers
        .iter()
        .position(|layer| layer.trainable_parameter_elements() > 0)
        .ok_or_else(|| FieldError::new("model.layers", "the model has no trainable parameters"))?;
    let mut gradient = output_gradient;
    // With recomputation, the buffers backward reads for layers inside a segment come from
    // re-running the segment's forward just before its backward.
    let mut backward_inputs = layer_inputs.clone();
    let mut backward_outputs = layer_outputs.clone();
    let mut backward_extras = forward_extras.clone();
    let mut index = layer_count;
    while index > first_trainable {
        index -= 1;
        let layer = &graph.layers[index];
        if let Some(segment) = segment {
            let segment_start = index - index % segment;
            let segment_end = (segment_start + segment).min(layer_count);
            if index + 1 == segment_end && segment_start < segment_end - 1 {
                // Entering a segment from its end: rebuild its layers except the last, whose
                // output is the next boundary (or the model output) and was kept.
                let mut current = layer_inputs[segment_start];
                for recompute_index in segment_start..segment_end - 1 {
                    let recompute_layer = &graph.layers[recompute_index];
                    let output = builder.layer_output(recompute_layer, current)?;
                    let extras = layer_side_outputs(&mut builder, recompute_layer)?;
                    let workspace = builder.workspace(recompute_layer)?;
                    let mut writes = vec![output];
                    writes.extend(&extras);
                    if recompute_layer.is_view() {
                        writes.clear();
                    }
                    let mut reads = vec![current];
                    reads.extend(&parameters[recompute_index].weights);
                    operations.push(Operation {
                        kind: OperationKind::LayerRecompute {
                            layer: recompute_index,
                        },
                        reads,
                        writes,
                        scratch: workspace.into_iter().collect(),
                    });
                    backward_inputs[recompute_index] = current;
                    backward_outputs[recompute_index] = output;
                    backward_extras[recompute_index] = extras;
                    current = output;
                }
                backward_inputs[segment_end - 1] = current;
            }
        }
        if layer.is_view() {
            // The gradient of a reshape is the same buffer under the input's shape.
            continue;
        }
        let owner = BufferOwner::Layer(index);
        let mut reads = vec![gradient];
        if layer.backward_reads_input() {
            reads.push(backward_inputs[index]);
        }
        if layer.backward_reads_output() {
            reads.push(backward_outputs[index]);
        }
        reads.extend(&backward_extras[index]);
        reads.extend(&parameters[index].weights);
        let mut writes = Vec::new();
        // cuDNN's batch-norm backward always writes the input gradient, so it gets one
        // even as the first trainable layer.
        let needs_input_gradient =
            index > first_trainable || matches!(layer.op, LayerOp::BatchNorm { .. });
        let input_gradient = if needs_input_gradient {
            let elements = builder.per_micro_batch(layer.input_shape.elements(), owner)?;
            let input_gradient = builder.add_buffer(
                BufferRole::InputGradient,
                owner,
                MemoryCategory::Transients,
                builder.activation_type(),
                elements,
            )?;
            writes.push(input_gradient);
            Some(input_gradient)
        } else {
            None
        };
        writes.extend(parameters[index].gradients.iter().flatten());
        let mut scratch: Vec<BufferId> = builder.workspace(layer)?.into_iter().collect();
        let trainable_elements = layer.trainable_parameter_elements();
        if mixed && trainable_elements > 0 {
            // Half-precision kernels produce half gradients; they are added into the fp32
            // gradients so accumulation does not lose precision.
            scratch.push(builder.add_buffer(
                BufferRole::HalfGradients,
                owner,
                MemoryCategory::Transients,
                builder.activation_type(),
                trainable_elements,
            )?);
        }
        operations.push(Operation {
            kind: OperationKind::LayerBackward { layer: index },
            reads,
            writes,
            scratch,
        });
        if let Some(input_gradient) = input_gradient {
            gradient = input_gradient;
        }
    }
    let micro_batch = place_by_liveness(operations, persistent_count);

    // Update: loss-scale overflow check (fp16), then the optimizer per parameter tensor.
    let mut update_operations = Vec::new();
    if config.precision == Precision::Fp16 {
        let flag = builder.add_buffer(
            BufferRole::OverflowFlag,
            BufferOwner::Loss,
            MemoryCategory::Transients,
            ElementType::I32,
            1,
        )?;
        update_operations.push(Operation {
            kind: OperationKind::CheckOverflow,
            reads: parameters
                .iter()
                .flat_map(|layer| layer.gradients.iter().flatten().copied())
                .collect(),
            writes: Vec::new(),
            scratch: vec![flag],
        });
    }
    for layer in &graph.layers {
        for (parameter_index, gradient) in parameters[layer.index].gradients.iter().enumerate() {
            let Some(gradient) = gradient else { continue };
            let weights = parameters[layer.index].weights[parameter_index];
            let mut writes = vec![weights];
            if let Some(Some(master)) = masters[layer.index].get(parameter_index) {
                writes.push(*master);
            }
            writes.extend(&optimizer_state[layer.index][parameter_index]);
            update_operations.push(Operation {
                kind: OperationKind::OptimizerUpdate {
                    layer: layer.index,
                    parameter: parameter_index,
                },
                reads: vec![*gradient],
                writes,
                scratch: Vec::new(),
            });
        }
    }
    let update = place_by_liveness(update_operations, persistent_count);

    // Evaluation: each layer's output lives only until the next layer has read it.
    let mut evaluation_operations = Vec::new();
    let mut current = input;
    for layer in &graph.layers {
        let output = builder.layer_output(layer, current)?;
        let workspace = builder.workspace(layer)?;
        let mut reads = vec![current];
        reads.extend(&parameters[layer.index].weights);
        evaluation_operations.push(Operation {
            kind: OperationKind::LayerInference { layer: layer.index },
            reads,
            writes: if layer.is_view() {
                Vec::new()
            } else {
                vec![output]
            },
            scratch: workspace.into_iter().collect(),
        });
        current = output;
    }
    let evaluation_loss = builder.add_buffer(
        BufferRole::LossValue,
        BufferOwner::Loss,
        MemoryCategory::Transients,
        ElementType::F32,
        1,
    )?;
    let mut evaluation_writes = vec![evaluation_loss];
    if graph.loss == LossKind::SoftmaxCrossEntropy {
        let elements =
            builder.per_micro_batch(graph.output_shape().elements(), BufferOwner::Loss)?;
        evaluation_writes.push(builder.add_buffer(
            BufferRole::Probabilities,
            BufferOwner::Loss,
            MemoryCategory::Activations,
            ElementType::F32,
            elements,
        )?);
    }
    evaluation_operations.push(Operation {
        kind: OperationKind::LossEvaluate,
        reads: vec![current, target],
        writes: evaluation_writes,
        scratch: Vec::new(),
    });
    let evaluation = place_by_liveness(evaluation_operations, persistent_count);

    Ok(StepPlan {
        config: *config,
        buffers: builder.buffers,
        setup,
        micro_batch,
        update,
        evaluation,
        layer_labels: graph.layers.iter().map(LayerNode::label).collect(),
    })
}

/// Buffers a layer's forward writes besides its output, all kept for backward: the
/// dropout mask, batch norm's per-channel statistics.
fn layer_side_outputs(
    builder: &mut PlanBuilder<'_>,
    layer: &LayerNode,
) -> Result<Vec<BufferId>, FieldError> {
    let owner = BufferOwner::Layer(layer.index);
    match layer.op {
        LayerOp::Dropout { .. } => {
            let elements = builder.per_micro_batch(layer.output_shape.elements(), owner)?;
            Ok(vec![builder.add_buffer(
                BufferRole::DropoutMask,
                owner,
                MemoryCategory::Activations,
                ElementType::U8,
                elements,
            )?])
        }
        LayerOp::BatchNorm { .. } => {
            let channels = layer.parameters[0].elements;
            Ok(vec![builder.add_buffer(
                BufferRole::BatchStatistics,
                owner,
                MemoryCategory::Activations,
                ElementType::F32,
                2 * channels,
            )?])
        }
        _ => Ok(Vec::new()),
    }
}

/// Turns a list of operations into plan steps: each phase-local buffer is allocated just
/// before the first operation that touches it and freed just after the last. Buffers
/// with ids below `persistent_count` belong to setup and are never freed here.
///
/// Linear in the operations' buffer references: buffer ids are dense indices into the
/// plan's buffer table, so the first and last uses live in vectors indexed by id.
fn place_by_liveness(operations: Vec<Operation>, persistent_count: usize) -> Vec<PlanStep> {
    let buffer_count = operations
        .iter()
        .flat_map(|operation| {
            operation
                .reads
                .iter()
                .chain(&operation.writes)
                .chain(&operation.scratch)
        })
        .map(|id| id.0 + 1)
        .max()
        .unwrap_or(0);
    let mut last_use: Vec<Option<usize>> = vec![None; buffer_count];
    for (position, operation) in operations.iter().enumerate() {
        for id in operation
            .reads
            .iter()
            .chain(&operation.writes)
            .chain(&operation.scratch)
        {
            if id.0 >= persistent_count {
                last_use[id.0] = Some(position);
            }
        }
    }
    let mut allocated = vec![false; buffer_count];
    // A buffer listed twice in its last operation is freed once.
    let mut freed = vec![false; buffer_count];
    let mut steps = Vec::with_capacity(operations.len() * 3);
    for (position, operation) in operations.into_iter().enumerate() {
        // Outputs before scratch: the workspace goes on top, where freeing it right after
        // leaves one hole that the next buffer of similar size fills.
        for id in operation
            .reads
            .iter()
            .chain(&operation.writes)
            .chain(&operation.scratch)
        {
            if id.0 >= persistent_count && !allocated[id.0] {
                allocated[id.0] = true;
                steps.push(PlanStep::Allocate(*id));
            }
        }
        let mut frees = Vec::new();
        for id in operation
            .scratch
            .iter()
            .chain(&operation.reads)
            .chain(&operation.writes)
        {
            if id.0 >= persistent_count && last_use[id.0] == Some(position) && !freed[id.0] {
                freed[id.0] = true;
                frees.push(PlanStep::Free(*id));
            }
        }
        steps.push(PlanStep::Run(operation));
        steps.extend(frees);
    }
    steps
}
