//! The cuda backend's activations: cuDNN relu, sigmoid and tanh, NVRTC kernels for leaky
//! relu, relu6 and gelu (and for tensors too large for cuDNN's element count).

use carve_core::model::ActivationKind;

use super::cudnn_ops::CudnnActivation;
use super::device::{KernelArgument, LaunchShape};
use super::{CudaBackend, CudaBackward, CudaForward, count, pointer, type_code};
use crate::dispatch::{ActivationKernels, LayerCall};
use crate::error::EngineError;

fn activation_code(kind: ActivationKind) -> (i32, f32) {
    match kind {
        ActivationKind::Relu => (0, 0.0),
        ActivationKind::LeakyRelu { alpha } => (1, alpha as f32),
        ActivationKind::Gelu => (2, 0.0),
        ActivationKind::Sigmoid => (3, 0.0),
        ActivationKind::Tanh => (4, 0.0),
        ActivationKind::Relu6 => (5, 0.0),
    }
}

fn cudnn_activation(kind: ActivationKind) -> Option<CudnnActivation> {
    match kind {
        ActivationKind::Relu => Some(CudnnActivation::Relu),
        ActivationKind::Sigmoid => Some(CudnnActivation::Sigmoid),
        ActivationKind::Tanh => Some(CudnnActivation::Tanh),
        ActivationKind::LeakyRelu { .. } | ActivationKind::Gelu | ActivationKind::Relu6 => None,
    }
}

impl ActivationKernels for CudaBackend {
    fn activation_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CudaForward,
        kind: ActivationKind,
    ) -> Result<(), EngineError> {
        let CudaForward { input, output } = *forward;
        let element_type = output.element_type;
        let output_elements = call.output_elements();
        match cudnn_activation(kind) {
            Some(activation) if output_elements <= i32::MAX as usize => self
                .cudnn
                .activation_forward(
                    activation,
                    output_elements,
                    element_type,
                    input.address,
                    output.address,
                )
                .map_err(|failure| self.fail(failure))?,
            _ => {
                let (code, alpha) = activation_code(kind);
                self.launch(
                    "activation_forward",
                    LaunchShape::Elements(output_elements as u64),
                    &[
                        KernelArgument::I32(code),
                        KernelArgument::F32(alpha),
                        pointer(input.address),
                        pointer(output.address),
                        type_code(element_type),
                        count(output_elements),
                    ],
                )?;
            }
        }
        Ok(())
    }

    fn activation_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CudaBackward,
        kind: ActivationKind,
    ) -> Result<(), EngineError> {
        let gradient_in = backward.gradient_in;
        let element_type = gradient_in.element_type;
        let output_elements = call.output_elements();
        let dx = backward.required_input_gradient(call)?;
        match cudnn_activation(kind) {
            Some(activation) if output_elements <= i32::MAX as usize => self
                .cudnn
                .activation_backward(
                    activation,
                    output_elements,
                    element_type,
                    backward.saved_output(call)?.address,
                    gradient_in.address,
                    dx.address,
                )
                .map_err(|failure| self.fail(failure))?,
            _ => {
                let (code, alpha) = activation_code(kind);
                let saved = if crate::kernels::activation::backward_reads_output(kind) {
                    backward.saved_output(call)?
                } else {
                    backward.saved_input(call)?
                };
                self.launch(
                    "activation_backward",
                    LaunchShape::Elements(output_elements as u64),
                    &[
                        KernelArgument::I32(code),
                        KernelArgument::F32(alpha),
                        pointer(saved.address),
                        pointer(gradient_in.address),
                        pointer(dx.address),
                        type_code(element_type),
                        count(output_elements),
                    ],
                )?;
            }
        }
        Ok(())
    }
}
