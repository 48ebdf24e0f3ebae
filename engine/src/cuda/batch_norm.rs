//! The cuda backend's batch norm: NVRTC kernels rather than cuDNN, because the plan keeps
//! gamma and beta in the compute precision while cuDNN wants fp32 scale and bias for half
//! data (a converted copy would be memory the estimate does not count).
//!
//! Training runs the coalesced kernels of `batch_norm_kernels.rs` (sums per chunk of rows
//! and group of 32 channels, then an elementwise pass); the first wave's one block per
//! channel runs where their scratch cannot hold the channels, for a backward without an
//! input gradient, and with the `legacy-batch-norm` tuning.

use carve_core::plan::{BatchNormGradients, ElementType};

use super::batch_norm_kernels::{
    CHANNELS_PER_GROUP, SCRATCH_MEANS_OFFSET, SCRATCH_PARTIALS_OFFSET, coalesced_chunks,
};
use super::device::{KernelArgument, LaunchShape};
use super::{CudaBackend, CudaBackward, CudaForward, count, pointer, type_code};
use crate::dispatch::{BatchNormKernels, LayerCall};
use crate::error::EngineError;

impl BatchNormKernels for CudaBackend {
    fn batch_norm_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CudaForward,
        momentum: f64,
        epsilon: f64,
    ) -> Result<(), EngineError> {
        let layer = call.layer;
        let CudaForward { input, output } = *forward;
        let t = type_code(output.element_type);
        let channels = batch_norm_channels(call)?;
        let rows = call.input_elements() / channels.max(1);
        let parameters = call.batch_norm_parameters()?;
        let gamma = self.buffer(parameters.gamma)?;
        let beta = self.buffer(parameters.beta)?;
        let running_mean = self.buffer(parameters.running_mean)?;
        let running_variance = self.buffer(parameters.running_variance)?;
        if gamma.element_type != beta.element_type
            || running_mean.element_type != ElementType::F32
            || running_variance.element_type != ElementType::F32
        {
            return Err(EngineError::Backend(format!(
                "{}: gamma and beta must share a type and running statistics be fp32",
                layer.label()
            )));
        }
        if call.is_inference() {
            self.launch(
                "batch_norm_inference_forward",
                LaunchShape::Elements(call.output_elements() as u64),
                &[
                    pointer(input.address),
                    pointer(output.address),
                    t,
                    count(rows),
                    count(channels),
                    pointer(gamma.address),
                    pointer(beta.address),
                    type_code(gamma.element_type),
                    pointer(running_mean.address),
                    pointer(running_variance.address),
                    KernelArgument::F64(f64::from(epsilon as f32)),
                ],
            )?;
        } else {
            let statistics_id = call.batch_statistics().ok_or_else(|| {
                EngineError::Backend(format!("{} without statistics", layer.label()))
            })?;
            let statistics = self.buffer(statistics_id)?;
            // A recomputed forward must not count the batch twice in the running
            // statistics.
            let update_running = call.updates_running_statistics();
            if let Some(chunks) = self.coalesced_batch_norm_chunks(rows, channels) {
                let (scratch, _) = self.device.scratch();
                self.launch(
                    "batch_norm_forward_sums",
                    LaunchShape::Blocks(chunks * (channels as u64).div_ceil(CHANNELS_PER_GROUP)),
                    &[
                        pointer(input.address),
                        t,
                        count(rows),
                        count(channels),
                        KernelArgument::I64(chunks as i64),
                        pointer(scratch + SCRATCH_PARTIALS_OFFSET),
                        pointer(scratch),
                        pointer(statistics.address),
                        pointer(running_mean.address),
                        pointer(running_variance.address),
                        KernelArgument::I32(i32::from(update_running)),
                        KernelArgument::F64(f64::from(momentum as f32)),
                        KernelArgument::F64(f64::from(epsilon as f32)),
                    ],
                )?;
                return self.launch(
                    "batch_norm_forward_apply",
                    LaunchShape::Elements((rows * channels) as u64),
                    &[
                        pointer(input.address),
                        pointer(output.address),
                        t,
                        count(rows * channels),
                        count(channels),
                        pointer(gamma.address),
                        pointer(beta.address),
                        type_code(gamma.element_type),
                        pointer(statistics.address),
                    ],
                );
            }
            self.launch(
                "batch_norm_training_forward",
                LaunchShape::Blocks(channels as u64),
                &[
                    pointer(input.address),
                    pointer(output.address),
                    t,
                    count(rows),
                    count(channels),
                    pointer(gamma.address),
                    pointer(beta.address),
                    type_code(gamma.element_type),
                    pointer(statistics.address),
                    pointer(running_mean.address),
                    pointer(running_variance.address),
                    KernelArgument::I32(i32::from(update_running)),
                    // The cpu kernel widens the f32 settings to f64.
                    KernelArgument::F64(f64::from(momentum as f32)),
                    KernelArgument::F64(f64::from(epsilon as f32)),
                ],
            )?;
        }
        Ok(())
    }

    fn batch_norm_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CudaBackward,
        _momentum: f64,
        _epsilon: f64,
    ) -> Result<(), EngineError> {
        let gradient_in = backward.gradient_in;
        let input = backward.saved_input(call)?;
        let statistics = self.buffer(call.roles.side.ok_or_else(|| call.missing("statistics"))?)?;
        let gamma = self.buffer(call.batch_norm_parameters()?.gamma)?;
        let channels = batch_norm_channels(call)?;
        let rows = call.input_elements() / channels.max(1);
        let BatchNormGradients {
            gamma: gamma_target,
            beta: beta_target,
        } = backward.batch_norm_targets(call)?;
        let coalesced = self.coalesced_batch_norm_chunks(rows, channels);
        if let (Some(chunks), Some(input_gradient)) = (coalesced, backward.input_gradient) {
            let (scratch, _) = self.device.scratch();
            let means = scratch + SCRATCH_MEANS_OFFSET;
            self.launch(
                "batch_norm_backward_sums",
                LaunchShape::Blocks(chunks * (channels as u64).div_ceil(CHANNELS_PER_GROUP)),
                &[
                    pointer(input.address),
                    pointer(gradient_in.address),
                    type_code(gradient_in.element_type),
                    count(rows),
                    count(channels),
                    KernelArgument::I64(chunks as i64),
                    pointer(statistics.address),
                    pointer(scratch + SCRATCH_PARTIALS_OFFSET),
                    pointer(scratch),
                    pointer(means),
                    pointer(gamma_target.address),
                    pointer(beta_target.address),
                    type_code(gamma_target.element_type),
                    KernelArgument::I32(i32::from(gamma_target.accumulate)),
                ],
            )?;
            return self.launch(
                "batch_norm_backward_apply",
                LaunchShape::Elements((rows * channels) as u64),
                &[
                    pointer(input.address),
                    pointer(gradient_in.address),
                    pointer(input_gradient.address),
                    type_code(gradient_in.element_type),
                    count(rows * channels),
                    count(channels),
                    pointer(gamma.address),
                    type_code(gamma.element_type),
                    pointer(statistics.address),
                    pointer(means),
                ],
            );
        }
        self.launch(
            "batch_norm_backward",
            LaunchShape::Blocks(channels as u64),
            &[
                pointer(input.address),
                pointer(gradient_in.address),
                pointer(backward.input_gradient.map_or(0, |dx| dx.address)),
                type_code(gradient_in.element_type),
                count(rows),
                count(channels),
                pointer(gamma.address),
                type_code(gamma.element_type),
                pointer(statistics.address),
                pointer(gamma_target.address),
                pointer(beta_target.address),
                type_code(gamma_target.element_type),
                KernelArgument::I32(i32::from(gamma_target.accumulate)),
            ],
        )?;
        Ok(())
    }
}

/// Batch norm's channels: the elements of its gamma.
fn batch_norm_channels(call: &LayerCall<'_>) -> Result<usize, EngineError> {
    let tensors = call
        .parameter_tensors()?
        .batch_norm()
        .ok_or_else(|| call.missing("gamma"))?;
    Ok(tensors.gamma.elements as usize)
}

impl CudaBackend {
    /// The chunks of rows the coalesced kernels split `rows x channels` into, or `None`
    /// when the per-channel kernels run.
    fn coalesced_batch_norm_chunks(&self, rows: usize, channels: usize) -> Option<u64> {
        if !self.tuning.coalesced_batch_norm {
            return None;
        }
        let (_, scratch_bytes) = self.device.scratch();
        coalesced_chunks(rows as u64, channels as u64, scratch_bytes)
    }
}
