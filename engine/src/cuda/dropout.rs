//! The cuda backend's dropout: NVRTC kernels drawing the same positional masks as the cpu
//! kernel, from (seed, step, micro-batch, layer).

use super::device::{KernelArgument, LaunchShape};
use super::{CudaBackend, CudaBackward, CudaForward, count, pointer, type_code};
use crate::dispatch::{DropoutKernels, LayerCall};
use crate::error::EngineError;
use crate::kernels::dropout::keep_scale;
use crate::rng::Rng;

impl DropoutKernels for CudaBackend {
    fn dropout_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CudaForward,
        rate: f64,
    ) -> Result<(), EngineError> {
        let CudaForward { input, output } = *forward;
        let output_elements = call.output_elements();
        match call.dropout_mask() {
            Some(mask_id) if !call.is_inference() => {
                let mask = self.buffer(mask_id)?;
                let rate = rate as f32;
                let identity = rate.is_nan() || rate <= 0.0;
                let state = Rng::for_stream(call.context.seed, &call.dropout_stream()).state();
                self.launch(
                    "dropout_forward",
                    LaunchShape::Elements(output_elements as u64),
                    &[
                        pointer(input.address),
                        pointer(output.address),
                        type_code(output.element_type),
                        pointer(mask.address),
                        count(output_elements),
                        KernelArgument::F32(rate),
                        KernelArgument::F32(keep_scale(rate)),
                        KernelArgument::U64(state),
                        KernelArgument::I32(i32::from(identity)),
                    ],
                )?;
            }
            _ => self.convert_elements(
                input.address,
                input.element_type,
                output.address,
                output.element_type,
                output_elements as u64,
            )?,
        }
        Ok(())
    }

    fn dropout_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CudaBackward,
        rate: f64,
    ) -> Result<(), EngineError> {
        let gradient_in = backward.gradient_in;
        let output_elements = call.output_elements();
        let dx = backward.required_input_gradient(call)?;
        let mask = self.buffer(call.dropout_mask().ok_or_else(|| call.missing("mask"))?)?;
        self.launch(
            "dropout_backward",
            LaunchShape::Elements(output_elements as u64),
            &[
                pointer(mask.address),
                pointer(gradient_in.address),
                pointer(dx.address),
                type_code(gradient_in.element_type),
                count(output_elements),
                KernelArgument::F32(keep_scale(rate as f32)),
            ],
        )?;
        Ok(())
    }
}
