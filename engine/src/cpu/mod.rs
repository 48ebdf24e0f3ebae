//! The `cpu` backend: real math over host buffers, with the slice's bookkeeping done by
//! the executor's allocator exactly as on a GPU.
//!
//! Half-precision buffers are stored as `f16`/`bf16`, so values really are rounded to half
//! precision between operations; kernels compute in f32 (as tensor cores accumulate in
//! f32). Converting a half buffer to f32 for a kernel uses a host temporary: that is the
//! cpu backend's stand-in for reading half values in registers, not device memory, so it
//! is outside the slice's bookkeeping.

mod layers;
mod merge;

use std::collections::HashMap;

use carve_core::plan::{
    BufferId, BufferRole, BufferSpec, ElementType, LossGradientOperands, LossOperands, Operation,
    OptimizerState,
};
use carve_core::spec::{LossKind, OptimizerSpec};
use half::{bf16, f16};

use crate::backend::{Backend, OperationContext, OperationResult, padded_write};
use crate::dispatch::{LossKernels, OptimizerBuffers, OptimizerKernels, run_operation};
use crate::error::EngineError;
use crate::kernels::loss::{
    count_correct, mse_backward, mse_forward, softmax_cross_entropy_backward,
    softmax_cross_entropy_forward,
};
use crate::kernels::optimizer::{adam_update, sgd_update};

#[derive(Debug)]
enum HostBuffer {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    I32(Vec<i32>),
    U8(Vec<u8>),
    /// A convolution workspace of this many elements. Nothing in it outlives the operation
    /// it serves, so it is kept as its length and handed to the kernel as fresh f32 pages
    /// (zeroed lazily, so only the part the im2col uses is ever touched), whatever the
    /// plan's element type: converting a half workspace (sized with cuDNN's headroom) to
    /// f32 and back on every call would cost more than the im2col itself.
    Scratch(usize),
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
            HostBuffer::Scratch(elements) => vec![0.0; *elements],
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
            HostBuffer::Scratch(_) => {}
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
#[derive(Debug)]
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
            _ if buffer.role == BufferRole::Workspace => HostBuffer::Scratch(elements),
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
        let padded = padded_write(id, values, length)?;
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
            HostBuffer::Scratch(elements) => vec![0.0; *elements],
        })
    }

    fn run(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<OperationResult, EngineError> {
        run_operation(self, operation, context)
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

    /// Writes the batch's mean loss into `loss_value` and reports the sum.
    fn report_loss(
        &mut self,
        loss_value: BufferId,
        loss_sum: f64,
        batch: usize,
        correct: Option<usize>,
    ) -> Result<OperationResult, EngineError> {
        self.write_f32(loss_value, &[(loss_sum / batch.max(1) as f64) as f32])?;
        Ok(OperationResult {
            loss_sum: Some(loss_sum),
            correct,
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
}

impl LossKernels for CpuBackend {
    fn loss_forward(
        &mut self,
        operands: &LossOperands,
        context: &mut OperationContext<'_>,
    ) -> Result<OperationResult, EngineError> {
        let output_id = operands.output;
        let target_id = operands.target;
        let batch = context.samples;
        let output_elements = context.graph.output_shape().elements() as usize;
        let logits = self.read_f32(output_id)?;
        let logits = &logits[..batch * output_elements];
        match context.graph.loss {
            LossKind::SoftmaxCrossEntropy => {
                let probabilities_id = operands.probabilities.ok_or_else(|| {
                    EngineError::Backend("cross-entropy without its probabilities".into())
                })?;
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
                self.report_loss(operands.loss, loss_sum, batch, Some(correct))
            }
            LossKind::Mse => {
                let targets = self.read_f32(target_id)?;
                let loss_sum = mse_forward(
                    batch,
                    output_elements,
                    logits,
                    &targets[..batch * output_elements],
                );
                self.report_loss(operands.loss, loss_sum, batch, None)
            }
        }
    }

    fn loss_backward(
        &mut self,
        operands: &LossGradientOperands,
        context: &mut OperationContext<'_>,
    ) -> Result<(), EngineError> {
        let batch = context.samples;
        let output_elements = context.graph.output_shape().elements() as usize;
        let gradient_id = operands.output_gradient;
        let mut gradient = self.take_f32(gradient_id)?;
        let values = self.read_f32(operands.predictions)?;
        match context.graph.loss {
            LossKind::SoftmaxCrossEntropy => {
                let labels = &self.labels(operands.target)?[..batch];
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
                let targets = self.read_f32(operands.target)?;
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
}

impl OptimizerKernels for CpuBackend {
    fn optimizer_update(
        &mut self,
        buffers: &OptimizerBuffers,
        context: &mut OperationContext<'_>,
    ) -> Result<(), EngineError> {
        let gradient_id = buffers.gradient;
        let mut gradient = self.take_f32(gradient_id)?;
        if *context.apply_update {
            let weights_id = buffers.weights;
            let master_id = buffers.master;
            let target_id = buffers.updated();
            let mut parameters = self.take_f32(target_id)?;
            // The scale the gradients were computed with, not the one the overflow check may
            // just have doubled.
            let gradient_scale = context.loss_scaler.unscale_factor();
            let mut state = buffers.state.try_map(|id| self.take_f32(id))?;
            match (context.optimizer, state.as_mut()) {
                (OptimizerSpec::Sgd(settings), OptimizerState::None) => {
                    sgd_update(&mut parameters, &gradient, None, settings, gradient_scale)
                }
                (OptimizerSpec::Sgd(settings), OptimizerState::Velocity(velocity)) => sgd_update(
                    &mut parameters,
                    &gradient,
                    Some(velocity.as_mut_slice()),
                    settings,
                    gradient_scale,
                ),
                (
                    OptimizerSpec::Adam(settings) | OptimizerSpec::Adamw(settings),
                    OptimizerState::Moments { first, second },
                ) => adam_update(
                    &mut parameters,
                    &gradient,
                    first,
                    second,
                    context.optimizer_update_number,
                    settings,
                    matches!(context.optimizer, OptimizerSpec::Adamw(_)),
                    gradient_scale,
                ),
                (optimizer, _) => {
                    return Err(EngineError::Backend(format!(
                        "{} with {} optimizer state tensors",
                        optimizer.kind_name(),
                        buffers.state.list().len()
                    )));
                }
            }
            for (id, values) in buffers.state.list().into_iter().zip(state.list()) {
                self.put_f32(id, values)?;
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
