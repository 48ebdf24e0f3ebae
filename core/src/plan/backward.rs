//! Backward in the step plan compiler: last layer first (a reverse topological order of
//! the graph), each tensor's gradient the sum of its readers' (summed in place), and the
//! recomputation of segments just before their backward.

use super::compile::{ForwardPass, PersistentBuffers, PlanBuilder, layer_forward};
use super::operands::{
    GradientSumOperands, LayerBackwardOperands, LayerParameters, ParameterGradients,
};
use super::*;
use crate::model::{LayerNode, LayerOp, TensorSource};

/// Which tensors need a gradient: a layer's output does when the layer or anything it
/// reads has trainable parameters. Layers whose output needs none run no backward, and a
/// layer writes an input gradient only for inputs that need one.
fn outputs_needing_gradient(graph: &ModelGraph) -> Vec<bool> {
    let mut needs = Vec::with_capacity(graph.layers.len());
    for layer in &graph.layers {
        let reads_one = layer.inputs.iter().any(|source| match source {
            TensorSource::ModelInput => false,
            TensorSource::Layer(index) => needs[*index],
        });
        needs.push(reads_one || layer.trainable_parameter_elements() > 0);
    }
    needs
}

/// The recomputation segments as `start..end` ranges covering the layers: each starts at a
/// cut point at least `segment` layers after the one before, so a segment holds whole
/// branches (a residual block is one segment, or part of a longer one).
fn recompute_segments(graph: &ModelGraph, segment: usize) -> Vec<std::ops::Range<usize>> {
    let mut starts = Vec::new();
    for cut in graph.cut_points() {
        if starts.last().is_none_or(|last| cut >= last + segment) {
            starts.push(cut);
        }
    }
    let mut ends: Vec<usize> = starts.iter().skip(1).copied().collect();
    ends.push(graph.layers.len());
    starts
        .into_iter()
        .zip(ends)
        .map(|(start, end)| start..end)
        .collect()
}

/// The gradients of the tensors during backward, one per layer output, each owned by that
/// tensor alone so it can be summed into in place.
struct GradientTable {
    gradients: Vec<Option<BufferId>>,
    needs: Vec<bool>,
}

impl GradientTable {
    fn needs(&self, source: TensorSource) -> bool {
        match source {
            TensorSource::ModelInput => false,
            TensorSource::Layer(index) => self.needs[index],
        }
    }

    /// Adds a reader's gradient for `source`: it becomes the gradient, or is summed into
    /// the one there (`layer` is the reader).
    fn contribute(
        &mut self,
        source: TensorSource,
        gradient: BufferId,
        layer: usize,
        operations: &mut Vec<Operation>,
    ) {
        let TensorSource::Layer(index) = source else {
            return;
        };
        if !self.needs[index] {
            return;
        }
        match self.gradients[index] {
            None => self.gradients[index] = Some(gradient),
            Some(existing) => operations.push(
                GradientSumOperands {
                    from: gradient,
                    into: existing,
                }
                .operation(OperationKind::AccumulateGradient { layer }),
            ),
        }
    }
}

/// Backward, last layer first (reverse topological order), summing the gradients of
/// tensors read by several layers.
pub(super) fn backward_pass(
    builder: &mut PlanBuilder<'_>,
    persistent: &PersistentBuffers,
    forward: &ForwardPass,
    output_gradient: BufferId,
    operations: &mut Vec<Operation>,
) -> Result<(), FieldError> {
    let graph = builder.graph;
    let layer_count = graph.layers.len();
    if graph.trainable_parameter_elements() == 0 {
        return Err(FieldError::new(
            "model.layers",
            "the model has no trainable parameters",
        ));
    }
    let segments = builder
        .config
        .recompute_segment_layers
        .map(|segment| recompute_segments(graph, segment as usize))
        .unwrap_or_default();
    let mut table = GradientTable {
        gradients: vec![None; layer_count],
        needs: outputs_needing_gradient(graph),
    };
    table.gradients[layer_count - 1] = Some(output_gradient);
    // With recomputation, the buffers backward reads for layers inside a segment come from
    // re-running the segment's forward just before its backward.
    let mut read = forward.clone();
    for index in (0..layer_count).rev() {
        let layer = &graph.layers[index];
        if let Some(segment) = segments.iter().find(|segment| segment.end == index + 1)
            && segment.start < index
        {
            recompute_segment(builder, persistent, segment.clone(), &mut read, operations)?;
        }
        if !table.needs[index] {
            continue;
        }
        let gradient = table.gradients[index].take().ok_or_else(|| {
            FieldError::new(
                "model.layers",
                format!("{} has no gradient to go back from", layer.label()),
            )
        })?;
        match layer.op {
            // The gradient of a reshape is the same buffer under the input's shape.
            LayerOp::Flatten => table.contribute(layer.inputs[0], gradient, index, operations),
            LayerOp::Add => add_backward(builder, layer, gradient, &mut table, operations)?,
            _ => layer_backward(
                builder, persistent, &read, layer, gradient, &mut table, operations,
            )?,
        }
    }
    Ok(())
}

/// An `add` passes its output gradient to every input unchanged: one input takes the
/// buffer itself, inputs that already have a gradient get it summed in, the rest a copy.
fn add_backward(
    builder: &mut PlanBuilder<'_>,
    layer: &LayerNode,
    gradient: BufferId,
    table: &mut GradientTable,
    operations: &mut Vec<Operation>,
) -> Result<(), FieldError> {
    let needed: Vec<TensorSource> = layer
        .inputs
        .iter()
        .copied()
        .filter(|source| table.needs(*source))
        .collect();
    let taker = needed.iter().position(|source| match source {
        TensorSource::Layer(index) => table.gradients[*index].is_none(),
        TensorSource::ModelInput => false,
    });
    for (position, source) in needed.iter().enumerate() {
        let TensorSource::Layer(producer) = *source else {
            continue;
        };
        if Some(position) == taker {
            continue;
        }
        if table.gradients[producer].is_some() {
            table.contribute(*source, gradient, layer.index, operations);
            continue;
        }
        let copy = input_gradient_buffer(builder, layer.index, *source)?;
        operations.push(
            GradientSumOperands {
                from: gradient,
                into: copy,
            }
            .operation(OperationKind::CopyGradient { layer: layer.index }),
        );
        table.gradients[producer] = Some(copy);
    }
    // Last, so the buffer is not summed into while the others still read it.
    if let Some(taker) = taker {
        table.contribute(needed[taker], gradient, layer.index, operations);
    }
    Ok(())
}

/// A gradient for tensor `source` written by layer `layer`'s backward, for one micro-batch.
fn input_gradient_buffer(
    builder: &mut PlanBuilder<'_>,
    layer: usize,
    source: TensorSource,
) -> Result<BufferId, FieldError> {
    let owner = BufferOwner::Layer(layer);
    let shape = builder.graph.source_shape(source);
    let elements = builder.per_micro_batch(shape.elements(), owner)?;
    builder.add_buffer(
        BufferRole::InputGradient,
        owner,
        MemoryCategory::Transients,
        builder.activation_type(),
        elements,
    )
}

/// The backward of one computing layer (and `concat`, which writes one gradient per
/// input), its input gradients then handed to what it read.
fn layer_backward(
    builder: &mut PlanBuilder<'_>,
    persistent: &PersistentBuffers,
    read: &ForwardPass,
    layer: &LayerNode,
    gradient: BufferId,
    table: &mut GradientTable,
    operations: &mut Vec<Operation>,
) -> Result<(), FieldError> {
    let index = layer.index;
    let owner = BufferOwner::Layer(index);
    let inputs = if layer.backward_reads_input() {
        read.inputs_of(layer)
    } else {
        Vec::new()
    };
    let mut input_gradients = Vec::new();
    let mut handed = Vec::new();
    for source in &layer.inputs {
        // cuDNN's batch-norm backward always writes the input gradient, and a concat
        // writes every input's slice, so they get one whether it is needed or not.
        let always = matches!(layer.op, LayerOp::BatchNorm { .. } | LayerOp::Concat);
        if !(table.needs(*source) || always) {
            continue;
        }
        let input_gradient = input_gradient_buffer(builder, index, *source)?;
        input_gradients.push(input_gradient);
        handed.push((*source, input_gradient));
    }
    let workspace = builder.workspace(layer)?;
    let trainable_elements = layer.trainable_parameter_elements();
    let half_gradients = if builder.config.precision.is_mixed() && trainable_elements > 0 {
        // Half-precision kernels produce half gradients; they are added into the fp32
        // gradients so accumulation does not lose precision.
        Some(builder.add_buffer(
            BufferRole::HalfGradients,
            owner,
            MemoryCategory::Transients,
            builder.activation_type(),
            trainable_elements,
        )?)
    } else {
        None
    };
    let operands = LayerBackwardOperands {
        output_gradient: gradient,
        inputs: &inputs,
        output: layer.backward_reads_output().then(|| read.outputs[index]),
        side_output: read.side_outputs[index],
        parameters: LayerParameters::name(layer, persistent.weights[index].iter().copied())?,
        input_gradients: &input_gradients,
        parameter_gradients: ParameterGradients::name(
            layer,
            persistent.gradients[index].iter().flatten().copied(),
        )?,
        workspace,
        half_gradients,
    };
    operations.push(operands.operation(index));
    for (source, input_gradient) in handed {
        table.contribute(source, input_gradient, index, operations);
    }
    Ok(())
}

/// Entering a segment from its end: rebuild its layers except the last, whose output is
/// the next boundary (or the model output) and was kept. What backward reads for those
/// layers (`read`) becomes the recomputed buffers; the segment's first layer reads the
/// tensor kept at the cut.
fn recompute_segment(
    builder: &mut PlanBuilder<'_>,
    persistent: &PersistentBuffers,
    segment: std::ops::Range<usize>,
    read: &mut ForwardPass,
    operations: &mut Vec<Operation>,
) -> Result<(), FieldError> {
    let graph = builder.graph;
    for recompute_index in segment.start..segment.end - 1 {
        let layer = &graph.layers[recompute_index];
        let step = layer_forward(
            builder,
            layer,
            read.inputs_of(layer),
            &persistent.weights[recompute_index],
            OperationKind::LayerRecompute {
                layer: recompute_index,
            },
        )?;
        operations.push(step.operation);
        read.outputs[recompute_index] = step.output;
        read.side_outputs[recompute_index] = step.side_output;
    }
    Ok(())
}
