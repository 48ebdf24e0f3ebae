//! The cuda backend's optimizers: SGD and Adam(W) as NVRTC kernels on the fp32 masters (or
//! weights), with the same per-step constants as the cpu kernels.

use carve_core::plan::{ElementType, OptimizerState};
use carve_core::spec::OptimizerSpec;

use super::device::{KernelArgument, LaunchShape};
use super::{CudaBackend, pointer, type_code};
use crate::backend::OperationContext;
use crate::dispatch::{OptimizerBuffers, OptimizerKernels};
use crate::error::EngineError;

impl OptimizerKernels for CudaBackend {
    fn optimizer_update(
        &mut self,
        buffers: &OptimizerBuffers,
        context: &mut OperationContext<'_>,
    ) -> Result<(), EngineError> {
        let gradient = self.buffer(buffers.gradient)?;
        if *context.apply_update {
            let weights_id = buffers.weights;
            let master_id = buffers.master;
            let state = buffers.state.try_map(|id| self.buffer(id))?;
            let target = self.buffer(buffers.updated())?;
            let all_fp32 = target.element_type == ElementType::F32
                && gradient.element_type == ElementType::F32
                && state
                    .list()
                    .iter()
                    .all(|state| state.element_type == ElementType::F32);
            if !all_fp32 {
                return Err(EngineError::Backend(
                    "optimizer updates run on fp32 parameters, gradients and state".into(),
                ));
            }
            let elements = target.elements.min(gradient.elements);
            // Under mixed precision the kernel also writes the compute-precision weights.
            let weights = match master_id {
                Some(_) => Some(self.buffer(weights_id)?),
                None => None,
            };
            let weights_address = weights.map_or(0, |weights| weights.address);
            let weights_type =
                type_code(weights.map_or(ElementType::F32, |weights| weights.element_type));
            // The scale the gradients were computed with, not the one the overflow check
            // may just have doubled.
            let gradient_scale = context.loss_scaler.unscale_factor();
            match context.optimizer {
                OptimizerSpec::Sgd(settings) => self.launch(
                    "sgd_update",
                    LaunchShape::Elements(elements),
                    &[
                        pointer(target.address),
                        pointer(gradient.address),
                        pointer(match state {
                            OptimizerState::Velocity(velocity) => velocity.address,
                            _ => 0,
                        }),
                        pointer(weights_address),
                        weights_type,
                        KernelArgument::I64(elements as i64),
                        KernelArgument::F32(settings.learning_rate as f32),
                        KernelArgument::F32(settings.momentum as f32),
                        KernelArgument::F32(settings.weight_decay as f32),
                        KernelArgument::I32(i32::from(settings.nesterov)),
                        KernelArgument::F32(gradient_scale),
                    ],
                )?,
                OptimizerSpec::Adam(settings) | OptimizerSpec::Adamw(settings) => {
                    let (first, second) = match state {
                        OptimizerState::Moments { first, second } => (first, second),
                        _ => {
                            return Err(EngineError::Backend(
                                "adam needs two optimizer state tensors".into(),
                            ));
                        }
                    };
                    // The same per-step constants as the cpu kernel, computed the same way.
                    let step = context.optimizer_update_number.max(1) as f64;
                    let bias_correction1 = 1.0 - settings.beta1.powf(step);
                    let bias_correction2 = 1.0 - settings.beta2.powf(step);
                    let step_size = (settings.learning_rate / bias_correction1) as f32;
                    let bias_correction2_sqrt = bias_correction2.sqrt() as f32;
                    let decoupled = matches!(context.optimizer, OptimizerSpec::Adamw(_));
                    let (l2_decay, decoupled_decay_factor) = if decoupled {
                        (
                            0.0,
                            1.0 - (settings.learning_rate * settings.weight_decay) as f32,
                        )
                    } else {
                        (settings.weight_decay as f32, 1.0)
                    };
                    self.launch(
                        "adam_update",
                        LaunchShape::Elements(elements),
                        &[
                            pointer(target.address),
                            pointer(gradient.address),
                            pointer(first.address),
                            pointer(second.address),
                            pointer(weights_address),
                            weights_type,
                            KernelArgument::I64(elements as i64),
                            KernelArgument::F32(settings.beta1 as f32),
                            KernelArgument::F32(settings.beta2 as f32),
                            KernelArgument::F32((1.0 - settings.beta1) as f32),
                            KernelArgument::F32((1.0 - settings.beta2) as f32),
                            KernelArgument::F32(settings.epsilon as f32),
                            KernelArgument::F32(step_size),
                            KernelArgument::F32(bias_correction2_sqrt),
                            KernelArgument::F32(l2_decay),
                            KernelArgument::F32(decoupled_decay_factor),
                            KernelArgument::F32(gradient_scale),
                        ],
                    )?
                }
            }
            // The kernel zeroed the gradient's first `elements`; the rest, if any, here.
            if elements == gradient.elements {
                return Ok(());
            }
        }
        self.device
            .zero(
                gradient.address,
                gradient.elements * gradient.element_type.bytes(),
            )
            .map_err(|failure| self.fail(failure))
    }
}
