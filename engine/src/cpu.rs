//! The `cpu` backend: real math over host buffers, with the slice's bookkeeping done by
//! the executor's allocator exactly as on a GPU.
//!
//! Half-precision buffers are stored as `f16`/`bf16`, so values really are rounded to half
//! precision between operations; kernels compute in f32 (as tensor cores accumulate in
//! f32). Converting a half buffer to f32 for a kernel uses a host temporary: that is the
//! cpu backend's stand-in for reading half values in registers, not device memory, so it
//! is outside the slice's bookkeeping.

use std::collections::HashMap;

use carve_core::model::{FeatureShape, LayerNode, LayerOp};
use carve_core::plan::{
    BufferId, BufferOwner, BufferRole, BufferSpec, ElementType, Operation, OperationKind,
};
use carve_core::spec::{LossKind, OptimizerSpec};
use half::{bf16, f16};

use crate::backend::{Backend, OperationContext, OperationResult};
use crate::error::EngineError;
use crate::kernels::activation::{activation_backward, activation_forward};
use crate::kernels::batch_norm::{
    BatchNormSettings, batch_norm_backward, batch_norm_forward_inference,
    batch_norm_forward_training,
};
use crate::kernels::conv::{conv2d_backward, conv2d_forward};
use crate::kernels::dense::{dense_backward, dense_forward};
use crate::kernels::dropout::{dropout_backward, dropout_forward};
use crate::kernels::loss::{
    count_correct, mse_backward, mse_forward, softmax_cross_entropy_backward,
    softmax_cross_entropy_forward,
};
use crate::kernels::optimizer::{adam_update, gradients_are_finite, sgd_update};
use crate::kernels::pool::{
    avg_pool_backward, avg_pool_forward, global_avg_pool_backward, global_avg_pool_forward,
    max_pool_backward, max_pool_forward,
};
use crate::kernels::{ImageShape, WindowedShapes};

#[derive(Debug)]
enum HostBuffer {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    I32(Vec<i32>),
    U8(Vec<u8>),
}

/// Host buffers indexed by plan buffer id.
#[derive(Debug, Default)]
pub struct CpuBackend {
    buffers: HashMap<BufferId, (ElementType, HostBuffer)>,
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend::default()
    }

    fn missing(id: BufferId) -> EngineError {
        EngineError::Backend(format!("buffer {} is not allocated", id.0))
    }

    /// Takes a buffer's values out as f32 (moving f32 storage, converting half).
    fn take_f32(&mut self, id: BufferId) -> Result<Vec<f32>, EngineError> {
        let (_, buffer) = self.buffers.get_mut(&id).ok_or_else(|| Self::missing(id))?;
        Ok(match buffer {
            HostBuffer::F32(values) => std::mem::take(values),
            HostBuffer::F16(values) => values.iter().map(|value| value.to_f32()).collect(),
            HostBuffer::Bf16(values) => values.iter().map(|value| value.to_f32()).collect(),
            HostBuffer::I32(values) => values.iter().map(|value| *value as f32).collect(),
            HostBuffer::U8(values) => values.iter().map(|value| f32::from(*value)).collect(),
        })
    }

    /// Puts f32 values back, rounding to the buffer's element type.
    fn put_f32(&mut self, id: BufferId, values: Vec<f32>) -> Result<(), EngineError> {
        let (_, buffer) = self.buffers.get_mut(&id).ok_or_else(|| Self::missing(id))?;
        match buffer {
            HostBuffer::F32(storage) => *storage = values,
            HostBuffer::F16(storage) => {
                for (slot, value) in storage.iter_mut().zip(values) {
                    *slot = f16::from_f32(value);
                }
            }
            HostBuffer::Bf16(storage) => {
                for (slot, value) in storage.iter_mut().zip(values) {
                    *slot = bf16::from_f32(value);
                }
            }
            HostBuffer::I32(_) | HostBuffer::U8(_) => {
                return Err(EngineError::Backend(format!(
                    "buffer {} is not a float buffer",
                    id.0
                )));
            }
        }
        Ok(())
    }

    fn labels(&self, id: BufferId) -> Result<&[i32], EngineError> {
        match self.buffers.get(&id) {
            Some((_, HostBuffer::I32(values))) => Ok(values),
            Some(_) => Err(EngineError::Backend(format!(
                "buffer {} does not hold labels",
                id.0
            ))),
            None => Err(Self::missing(id)),
        }
    }

    fn take_mask(&mut self, id: BufferId) -> Result<Vec<u8>, EngineError> {
        match self.buffers.get_mut(&id) {
            Some((_, HostBuffer::U8(values))) => Ok(std::mem::take(values)),
            Some(_) => Err(EngineError::Backend(format!(
                "buffer {} is not a mask",
                id.0
            ))),
            None => Err(Self::missing(id)),
        }
    }

    fn put_mask(&mut self, id: BufferId, mask: Vec<u8>) -> Result<(), EngineError> {
        match self.buffers.get_mut(&id) {
            Some((_, HostBuffer::U8(values))) => {
                *values = mask;
                Ok(())
            }
            _ => Err(Self::missing(id)),
        }
    }
}

/// The buffers of one operation, taken out of the backend as f32 and put back after.
struct Workbench {
    values: HashMap<BufferId, Vec<f32>>,
    written: Vec<BufferId>,
}

impl Workbench {
    fn get(&self, id: BufferId) -> &[f32] {
        &self.values[&id]
    }

    /// Takes a buffer out for writing; `give` puts it back.
    fn take(&mut self, id: BufferId) -> Vec<f32> {
        self.values.remove(&id).unwrap_or_default()
    }

    fn give(&mut self, id: BufferId, values: Vec<f32>) {
        self.values.insert(id, values);
        if !self.written.contains(&id) {
            self.written.push(id);
        }
    }
}

pub(crate) fn image_shape(shape: FeatureShape, batch: usize) -> ImageShape {
    match shape {
        FeatureShape::Image {
            height,
            width,
            channels,
        } => ImageShape {
            batch,
            height: height as usize,
            width: width as usize,
            channels: channels as usize,
        },
        FeatureShape::Flat { features } => ImageShape {
            batch,
            height: 1,
            width: 1,
            channels: features as usize,
        },
    }
}

pub(crate) fn windowed_shapes(layer: &LayerNode, batch: usize) -> Option<WindowedShapes> {
    let window = match layer.op {
        LayerOp::Conv2d { window, .. }
        | LayerOp::MaxPool { window }
        | LayerOp::AvgPool { window } => window,
        _ => return None,
    };
    Some(WindowedShapes {
        input: image_shape(layer.input_shape, batch),
        output: image_shape(layer.output_shape, batch),
        window,
    })
}

/// The ids an operation touches, sorted out by what they are for (shared with the cuda
/// backend, which reads operations the same way).
#[derive(Debug, Default)]
pub(crate) struct Roles {
    pub(crate) input: Option<BufferId>,
    pub(crate) output: Option<BufferId>,
    pub(crate) parameters: Vec<BufferId>,
    pub(crate) side: Option<BufferId>,
    pub(crate) gradient_in: Option<BufferId>,
    pub(crate) input_gradient: Option<BufferId>,
    pub(crate) parameter_gradients: Vec<BufferId>,
    pub(crate) workspace: Option<BufferId>,
    pub(crate) half_gradients: Option<BufferId>,
}

pub(crate) fn sort_roles(
    operation: &Operation,
    buffers: &[BufferSpec],
    layer_index: usize,
) -> Roles {
    let mut roles = Roles::default();
    let is_backward = matches!(operation.kind, OperationKind::LayerBackward { .. });
    for (position, id) in operation.reads.iter().enumerate() {
        let spec = &buffers[id.0];
        if is_backward && position == 0 {
            roles.gradient_in = Some(*id);
            continue;
        }
        match spec.role {
            BufferRole::Parameter { .. } => roles.parameters.push(*id),
            BufferRole::DropoutMask | BufferRole::BatchStatistics => roles.side = Some(*id),
            BufferRole::LayerOutput if spec.owner == BufferOwner::Layer(layer_index) => {
                roles.output = Some(*id)
            }
            _ => roles.input = Some(*id),
        }
    }
    for id in &operation.writes {
        match buffers[id.0].role {
            BufferRole::LayerOutput => roles.output = Some(*id),
            BufferRole::DropoutMask | BufferRole::BatchStatistics => roles.side = Some(*id),
            BufferRole::InputGradient => roles.input_gradient = Some(*id),
            BufferRole::Gradient { .. } => roles.parameter_gradients.push(*id),
            _ => {}
        }
    }
    for id in &operation.scratch {
        match buffers[id.0].role {
            BufferRole::Workspace => roles.workspace = Some(*id),
            BufferRole::HalfGradients => roles.half_gradients = Some(*id),
            _ => {}
        }
    }
    roles
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn create_buffer(&mut self, buffer: &BufferSpec, _offset: u64) -> Result<(), EngineError> {
        let elements = usize::try_from(buffer.elements).map_err(|_| {
            EngineError::Backend(format!(
                "buffer of {} elements is too large",
                buffer.elements
            ))
        })?;
        let storage = match buffer.element_type {
            ElementType::F32 => HostBuffer::F32(vec![0.0; elements]),
            ElementType::F16 => HostBuffer::F16(vec![f16::ZERO; elements]),
            ElementType::Bf16 => HostBuffer::Bf16(vec![bf16::ZERO; elements]),
            ElementType::I32 => HostBuffer::I32(vec![0; elements]),
            ElementType::U8 => HostBuffer::U8(vec![0; elements]),
        };
        self.buffers
            .insert(buffer.id, (buffer.element_type, storage));
        Ok(())
    }

    fn release_buffer(&mut self, id: BufferId) {
        self.buffers.remove(&id);
    }

    fn write_f32(&mut self, id: BufferId, values: &[f32]) -> Result<(), EngineError> {
        let length = self.take_f32(id)?.len();
        if values.len() > length {
            return Err(EngineError::Backend(format!(
                "{} values do not fit buffer {} of {length}",
                values.len(),
                id.0
            )));
        }
        let mut padded = values.to_vec();
        padded.resize(length, 0.0);
        self.put_f32(id, padded)
    }

    fn write_i32(&mut self, id: BufferId, values: &[i32]) -> Result<(), EngineError> {
        match self.buffers.get_mut(&id) {
            Some((_, HostBuffer::I32(storage))) if values.len() <= storage.len() => {
                storage[..values.len()].copy_from_slice(values);
                storage[values.len()..].fill(0);
                Ok(())
            }
            Some(_) => Err(EngineError::Backend(format!(
                "buffer {} cannot hold {} labels",
                id.0,
                values.len()
            ))),
            None => Err(Self::missing(id)),
        }
    }

    fn read_f32(&self, id: BufferId) -> Result<Vec<f32>, EngineError> {
        let (_, buffer) = self.buffers.get(&id).ok_or_else(|| Self::missing(id))?;
        Ok(match buffer {
            HostBuffer::F32(values) => values.clone(),
            HostBuffer::F16(values) => values.iter().map(|value| value.to_f32()).collect(),
            HostBuffer::Bf16(values) => values.iter().map(|value| value.to_f32()).collect(),
            HostBuffer::I32(values) => values.iter().map(|value| *value as f32).collect(),
            HostBuffer::U8(values) => values.iter().map(|value| f32::from(*value)).collect(),
        })
    }

    fn run(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<OperationResult, EngineError> {
        match operation.kind {
            OperationKind::InitializeParameters => {
                for (master, weights) in operation.reads.iter().zip(&operation.writes) {
                    let values = self.read_f32(*master)?;
                    self.put_f32(*weights, values)?;
                }
                Ok(OperationResult::default())
            }
            OperationKind::LayerForward { layer }
            | OperationKind::LayerRecompute { layer }
            | OperationKind::LayerInference { layer } => {
                self.run_layer_forward(operation, context, layer)?;
                Ok(OperationResult::default())
            }
            OperationKind::LayerBackward { layer } => {
                self.run_layer_backward(operation, context, layer)?;
                Ok(OperationResult::default())
            }
            OperationKind::LossForward | OperationKind::LossEvaluate => {
                self.run_loss_forward(operation, context)
            }
            OperationKind::LossBackward => {
                self.run_loss_backward(operation, context)?;
                Ok(OperationResult::default())
            }
            OperationKind::CheckOverflow => {
                let mut finite = true;
                for id in &operation.reads {
                    let values = self.take_f32(*id)?;
                    finite &= gradients_are_finite(&values);
                    self.put_f32(*id, values)?;
                }
                *context.apply_update = context.loss_scaler.update(!finite);
                Ok(OperationResult::default())
            }
            OperationKind::OptimizerUpdate { .. } => {
                self.run_optimizer_update(operation, context)?;
                Ok(OperationResult::default())
            }
        }
    }
}

impl CpuBackend {
    fn bench(&mut self, ids: impl IntoIterator<Item = BufferId>) -> Result<Workbench, EngineError> {
        let mut values = HashMap::new();
        for id in ids {
            if let std::collections::hash_map::Entry::Vacant(entry) = values.entry(id) {
                entry.insert(self.take_f32(id)?);
            }
        }
        Ok(Workbench {
            values,
            written: Vec::new(),
        })
    }

    /// Puts every f32 buffer back; half buffers only when written, so reads never round.
    fn return_bench(&mut self, bench: Workbench) -> Result<(), EngineError> {
        let Workbench { values, written } = bench;
        for (id, buffer_values) in values {
            let is_f32 = matches!(self.buffers.get(&id), Some((ElementType::F32, _)));
            if is_f32 || written.contains(&id) {
                self.put_f32(id, buffer_values)?;
            }
        }
        Ok(())
    }

    fn run_layer_forward(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
        layer_index: usize,
    ) -> Result<(), EngineError> {
        let layer = &context.graph.layers[layer_index];
        if layer.is_view() {
            return Ok(());
        }
        let roles = sort_roles(operation, &context.plan.buffers, layer_index);
        let input_id = roles
            .input
            .ok_or_else(|| EngineError::Backend("forward without an input".into()))?;
        let output_id = roles
            .output
            .ok_or_else(|| EngineError::Backend("forward without an output".into()))?;
        let batch = context.samples;
        let mask_id = roles
            .side
            .filter(|id| context.plan.buffers[id.0].role == BufferRole::DropoutMask);
        let statistics_id = roles
            .side
            .filter(|id| context.plan.buffers[id.0].role == BufferRole::BatchStatistics);
        let mut ids = vec![input_id, output_id];
        ids.extend(&roles.parameters);
        ids.extend(statistics_id);
        ids.extend(roles.workspace);
        let mut bench = self.bench(ids)?;
        let is_inference = matches!(operation.kind, OperationKind::LayerInference { .. });
        // Everything written is taken out of the bench first, so the reads can borrow it.
        let mut output = bench.take(output_id);
        let mut workspace = roles.workspace.map(|id| bench.take(id)).unwrap_or_default();
        let mut statistics = statistics_id.map(|id| bench.take(id)).unwrap_or_default();
        let is_batch_norm_training = matches!(layer.op, LayerOp::BatchNorm { .. }) && !is_inference;
        let (mut running_mean, mut running_variance) = if is_batch_norm_training {
            (
                bench.take(roles.parameters[2]),
                bench.take(roles.parameters[3]),
            )
        } else {
            (Vec::new(), Vec::new())
        };
        let input = bench.get(input_id);
        let parameter = |index: usize| bench.get(roles.parameters[index]);
        let rows = batch * layer.output_shape.elements() as usize;
        let output_slice = &mut output[..rows];
        let input_slice = &input[..batch * layer.input_shape.elements() as usize];
        match layer.op {
            LayerOp::Conv2d { use_bias, .. } => {
                let shapes = windowed_shapes(layer, batch).expect("conv has a window");
                let bias = use_bias.then(|| parameter(1));
                conv2d_forward(
                    &shapes,
                    input_slice,
                    parameter(0),
                    bias,
                    output_slice,
                    &mut workspace,
                );
            }
            LayerOp::MaxPool { .. } => {
                let shapes = windowed_shapes(layer, batch).expect("pool has a window");
                max_pool_forward(&shapes, input_slice, output_slice);
            }
            LayerOp::AvgPool { .. } => {
                let shapes = windowed_shapes(layer, batch).expect("pool has a window");
                avg_pool_forward(&shapes, input_slice, output_slice);
            }
            LayerOp::GlobalAvgPool => {
                global_avg_pool_forward(
                    image_shape(layer.input_shape, batch),
                    input_slice,
                    output_slice,
                );
            }
            LayerOp::Activation(kind) => activation_forward(kind, input_slice, output_slice),
            LayerOp::Dense { units, use_bias } => {
                let bias = use_bias.then(|| parameter(1));
                dense_forward(
                    batch,
                    layer.input_shape.elements() as usize,
                    units as usize,
                    input_slice,
                    parameter(0),
                    bias,
                    output_slice,
                );
            }
            LayerOp::BatchNorm { momentum, epsilon } => {
                let settings = batch_norm_settings(layer, momentum, epsilon);
                if is_inference {
                    batch_norm_forward_inference(
                        &settings,
                        input_slice,
                        parameter(0),
                        parameter(1),
                        parameter(2),
                        parameter(3),
                        output_slice,
                    );
                } else {
                    // A recomputed forward must not count the batch twice in the running
                    // statistics.
                    let running = matches!(operation.kind, OperationKind::LayerForward { .. })
                        .then_some((&mut running_mean[..], &mut running_variance[..]));
                    batch_norm_forward_training(
                        &settings,
                        input_slice,
                        parameter(0),
                        parameter(1),
                        output_slice,
                        &mut statistics,
                        running,
                    );
                }
            }
            LayerOp::Dropout { rate } => match mask_id {
                Some(mask_id) if !is_inference => {
                    let mut mask = self.take_mask(mask_id)?;
                    dropout_forward(
                        rate as f32,
                        context.seed,
                        &[context.step, context.micro_batch, layer_index as u64],
                        input_slice,
                        output_slice,
                        &mut mask[..rows],
                    );
                    self.put_mask(mask_id, mask)?;
                }
                _ => output_slice.copy_from_slice(input_slice),
            },
            LayerOp::Flatten => {}
        }
        if let Some(id) = roles.workspace {
            bench.give(id, workspace);
        }
        if let Some(id) = statistics_id {
            bench.give(id, statistics);
        }
        if is_batch_norm_training {
            bench.give(roles.parameters[2], running_mean);
            bench.give(roles.parameters[3], running_variance);
        }
        bench.give(output_id, output);
        self.return_bench(bench)
    }

    fn run_layer_backward(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
        layer_index: usize,
    ) -> Result<(), EngineError> {
        let layer = &context.graph.layers[layer_index];
        let roles = sort_roles(operation, &context.plan.buffers, layer_index);
        let batch = context.samples;
        let gradient_in_id = roles
            .gradient_in
            .ok_or_else(|| EngineError::Backend("backward without a gradient".into()))?;
        let mask_id = roles
            .side
            .filter(|id| context.plan.buffers[id.0].role == BufferRole::DropoutMask);
        let mut ids = vec![gradient_in_id];
        ids.extend(roles.input);
        ids.extend(roles.output);
        ids.extend(roles.parameters.iter().copied());
        ids.extend(roles.side.filter(|id| Some(*id) != mask_id));
        ids.extend(roles.input_gradient);
        ids.extend(roles.workspace);
        let mut bench = self.bench(ids)?;
        let mut input_gradient = roles.input_gradient.map(|id| bench.take(id));
        let mut workspace = roles.workspace.map(|id| bench.take(id)).unwrap_or_default();
        let input_elements = batch * layer.input_shape.elements() as usize;
        let output_elements = batch * layer.output_shape.elements() as usize;
        let dy = &bench.get(gradient_in_id)[..output_elements];
        let input = roles.input.map(|id| &bench.get(id)[..input_elements]);
        let output = roles.output.map(|id| &bench.get(id)[..output_elements]);
        let dx = input_gradient
            .as_mut()
            .map(|values| &mut values[..input_elements]);
        // Parameter gradients are computed into zeroed f32 temporaries and then added to
        // the accumulated gradients: directly in fp32, through the half scratch buffer
        // under mixed precision (the rounding a half-precision kernel would do).
        let mut parameter_gradients: Vec<Vec<f32>> = layer
            .parameters
            .iter()
            .filter(|parameter| parameter.trainable)
            .map(|parameter| vec![0.0; parameter.elements as usize])
            .collect();
        let missing = |what: &str| {
            EngineError::Backend(format!("{} backward without its {what}", layer.label()))
        };
        match layer.op {
            LayerOp::Conv2d { .. } => {
                let shapes = windowed_shapes(layer, batch).expect("conv has a window");
                let (kernel_gradient, rest) = parameter_gradients.split_at_mut(1);
                conv2d_backward(
                    &shapes,
                    input.ok_or_else(|| missing("input"))?,
                    bench.get(roles.parameters[0]),
                    dy,
                    dx,
                    &mut kernel_gradient[0],
                    // Only trainable tensors have gradients here: the bias, when there is one.
                    rest.first_mut().map(Vec::as_mut_slice),
                    &mut workspace,
                );
            }
            LayerOp::Dense { units, .. } => {
                let (kernel_gradient, rest) = parameter_gradients.split_at_mut(1);
                dense_backward(
                    batch,
                    layer.input_shape.elements() as usize,
                    units as usize,
                    input.ok_or_else(|| missing("input"))?,
                    bench.get(roles.parameters[0]),
                    dy,
                    dx,
                    &mut kernel_gradient[0],
                    // Only trainable tensors have gradients here: the bias, when there is one.
                    rest.first_mut().map(Vec::as_mut_slice),
                );
            }
            LayerOp::MaxPool { .. } => {
                let shapes = windowed_shapes(layer, batch).expect("pool has a window");
                max_pool_backward(
                    &shapes,
                    input.ok_or_else(|| missing("input"))?,
                    output.ok_or_else(|| missing("output"))?,
                    dy,
                    dx.ok_or_else(|| missing("input gradient"))?,
                );
            }
            LayerOp::AvgPool { .. } => {
                let shapes = windowed_shapes(layer, batch).expect("pool has a window");
                avg_pool_backward(&shapes, dy, dx.ok_or_else(|| missing("input gradient"))?);
            }
            LayerOp::GlobalAvgPool => {
                global_avg_pool_backward(
                    image_shape(layer.input_shape, batch),
                    dy,
                    dx.ok_or_else(|| missing("input gradient"))?,
                );
            }
            LayerOp::Activation(kind) => {
                activation_backward(
                    kind,
                    input,
                    output,
                    dy,
                    dx.ok_or_else(|| missing("input gradient"))?,
                );
            }
            LayerOp::BatchNorm { momentum, epsilon } => {
                let settings = batch_norm_settings(layer, momentum, epsilon);
                let statistics = roles.side.ok_or_else(|| missing("statistics"))?;
                let (gamma_gradient, beta_gradient) = parameter_gradients.split_at_mut(1);
                batch_norm_backward(
                    &settings,
                    input.ok_or_else(|| missing("input"))?,
                    bench.get(roles.parameters[0]),
                    bench.get(statistics),
                    dy,
                    dx.ok_or_else(|| missing("input gradient"))?,
                    &mut gamma_gradient[0],
                    &mut beta_gradient[0],
                );
            }
            LayerOp::Dropout { rate } => {
                let mask_id = mask_id.ok_or_else(|| missing("mask"))?;
                let mask = self.take_mask(mask_id)?;
                dropout_backward(
                    rate as f32,
                    &mask[..output_elements],
                    dy,
                    dx.ok_or_else(|| missing("input gradient"))?,
                );
                self.put_mask(mask_id, mask)?;
            }
            LayerOp::Flatten => {}
        }
        if let (Some(id), Some(values)) = (roles.input_gradient, input_gradient) {
            bench.give(id, values);
        }
        if let Some(id) = roles.workspace {
            bench.give(id, workspace);
        }
        self.return_bench(bench)?;
        if let Some(half_id) = roles.half_gradients {
            let flat: Vec<f32> = parameter_gradients.iter().flatten().copied().collect();
            self.write_f32(half_id, &flat)?;
            let rounded = self.read_f32(half_id)?;
            let mut offset = 0;
            for values in &mut parameter_gradients {
                let length = values.len();
                values.copy_from_slice(&rounded[offset..offset + length]);
                offset += length;
            }
        }
        for (gradient_id, computed) in roles.parameter_gradients.iter().zip(parameter_gradients) {
            let mut accumulated = self.take_f32(*gradient_id)?;
            for (sum, value) in accumulated.iter_mut().zip(computed) {
                *sum += value;
            }
            self.put_f32(*gradient_id, accumulated)?;
        }
        Ok(())
    }

    fn run_loss_forward(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<OperationResult, EngineError> {
        let output_id = operation.reads[0];
        let target_id = operation.reads[1];
        let batch = context.samples;
        let output_elements = context.graph.output_shape().elements() as usize;
        let logits = self.read_f32(output_id)?;
        let logits = &logits[..batch * output_elements];
        match context.graph.loss {
            LossKind::SoftmaxCrossEntropy => {
                let probabilities_id = operation.writes[1];
                let mut probabilities = self.take_f32(probabilities_id)?;
                let labels = &self.labels(target_id)?[..batch];
                let loss_sum = softmax_cross_entropy_forward(
                    batch,
                    output_elements,
                    logits,
                    labels,
                    &mut probabilities[..batch * output_elements],
                )
                .map_err(|error| EngineError::data("labels", error.to_string()))?;
                let correct = count_correct(
                    batch,
                    output_elements,
                    &probabilities[..batch * output_elements],
                    labels,
                );
                self.put_f32(probabilities_id, probabilities)?;
                self.write_f32(
                    operation.writes[0],
                    &[(loss_sum / batch.max(1) as f64) as f32],
                )?;
                Ok(OperationResult {
                    loss_sum: Some(loss_sum),
                    correct: Some(correct),
                })
            }
            LossKind::Mse => {
                let targets = self.read_f32(target_id)?;
                let loss_sum = mse_forward(
                    batch,
                    output_elements,
                    logits,
                    &targets[..batch * output_elements],
                );
                self.write_f32(
                    operation.writes[0],
                    &[(loss_sum / batch.max(1) as f64) as f32],
                )?;
                Ok(OperationResult {
                    loss_sum: Some(loss_sum),
                    correct: None,
                })
            }
        }
    }

    fn run_loss_backward(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<(), EngineError> {
        let batch = context.samples;
        let output_elements = context.graph.output_shape().elements() as usize;
        let gradient_id = operation.writes[0];
        let mut gradient = self.take_f32(gradient_id)?;
        let values = self.read_f32(operation.reads[0])?;
        match context.graph.loss {
            LossKind::SoftmaxCrossEntropy => {
                let labels = &self.labels(operation.reads[1])?[..batch];
                softmax_cross_entropy_backward(
                    batch,
                    output_elements,
                    &values[..batch * output_elements],
                    labels,
                    context.loss_gradient_scale,
                    &mut gradient[..batch * output_elements],
                );
            }
            LossKind::Mse => {
                let targets = self.read_f32(operation.reads[1])?;
                mse_backward(
                    batch,
                    output_elements,
                    &values[..batch * output_elements],
                    &targets[..batch * output_elements],
                    context.loss_gradient_scale,
                    &mut gradient[..batch * output_elements],
                );
            }
        }
        self.put_f32(gradient_id, gradient)
    }

    fn run_optimizer_update(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<(), EngineError> {
        let gradient_id = operation.reads[0];
        let mut gradient = self.take_f32(gradient_id)?;
        if *context.apply_update {
            let buffers = &context.plan.buffers;
            let weights_id = operation.writes[0];
            let master_id = operation
                .writes
                .iter()
                .copied()
                .find(|id| matches!(buffers[id.0].role, BufferRole::MasterParameter { .. }));
            let state_ids: Vec<BufferId> = operation
                .writes
                .iter()
                .copied()
                .filter(|id| matches!(buffers[id.0].role, BufferRole::OptimizerState { .. }))
                .collect();
            // Under mixed precision the update happens on the fp32 masters, then the
            // compute copy is rounded from them.
            let target_id = master_id.unwrap_or(weights_id);
            let mut parameters = self.take_f32(target_id)?;
            // The scale the gradients were computed with, not the one the overflow check may
            // just have doubled.
            let gradient_scale = context.loss_scaler.unscale_factor();
            let mut states: Vec<Vec<f32>> = state_ids
                .iter()
                .map(|id| self.take_f32(*id))
                .collect::<Result<_, _>>()?;
            match context.optimizer {
                OptimizerSpec::Sgd(settings) => {
                    sgd_update(
                        &mut parameters,
                        &gradient,
                        states.first_mut().map(|values| &mut values[..]),
                        settings,
                        gradient_scale,
                    );
                }
                OptimizerSpec::Adam(settings) | OptimizerSpec::Adamw(settings) => {
                    let (first, second) = states.split_at_mut(1);
                    adam_update(
                        &mut parameters,
                        &gradient,
                        &mut first[0],
                        &mut second[0],
                        context.optimizer_update_number,
                        settings,
                        matches!(context.optimizer, OptimizerSpec::Adamw(_)),
                        gradient_scale,
                    );
                }
            }
            for (id, values) in state_ids.iter().zip(states) {
                self.put_f32(*id, values)?;
            }
            if master_id.is_some() {
                self.put_f32(weights_id, parameters.clone())?;
            }
            self.put_f32(target_id, parameters)?;
        }
        gradient.fill(0.0);
        self.put_f32(gradient_id, gradient)
    }
}

fn batch_norm_settings(layer: &LayerNode, momentum: f64, epsilon: f64) -> BatchNormSettings {
    BatchNormSettings {
        channels: layer.parameters[0].elements as usize,
        epsilon: epsilon as f32,
        momentum: momentum as f32,
    }
}
