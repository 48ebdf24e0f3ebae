//! The CUDA backend's depthwise convolution and zero padding: direct NVRTC kernels
//! (`depthwise_*_direct`, the same loops as `kernels::depthwise`) and the padded-copy
//! kernels the convolutions already use (`pad_images`, `crop_images`). Depthwise kernels
//! stay HWIO on the device (only conv2d kernels are stored KRSC for cuDNN).

use carve_core::plan::KernelParameters;

use super::device::{KernelArgument, LaunchShape};
use super::{CudaBackend, CudaBackward, CudaForward, count, kernel_geometry, pointer, type_code};
use crate::dispatch::{LayerCall, image_shape};
use crate::error::EngineError;

impl CudaBackend {
    pub(super) fn depthwise_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &CudaForward,
        use_bias: bool,
    ) -> Result<(), EngineError> {
        let CudaForward { input, output } = *forward;
        let geometry = kernel_geometry(call.layer, call.batch).expect("depthwise has a window");
        let parameters = call.kernel_parameters()?;
        let kernel = self.buffer(parameters.kernel)?;
        let bias = self.parameter_buffer(parameters.bias.filter(|_| use_bias))?;
        self.launch(
            "depthwise_forward_direct",
            LaunchShape::Elements(call.output_elements() as u64),
            &[
                pointer(input.address),
                pointer(kernel.address),
                pointer(bias.map_or(0, |bias| bias.address)),
                pointer(output.address),
                type_code(output.element_type),
                KernelArgument::Geometry(geometry),
            ],
        )
    }

    pub(super) fn depthwise_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &CudaBackward,
        use_bias: bool,
    ) -> Result<(), EngineError> {
        let geometry = kernel_geometry(call.layer, call.batch).expect("depthwise has a window");
        let gradient_in = backward.gradient_in;
        let t = type_code(gradient_in.element_type);
        let input = backward.saved_input(call)?;
        let kernel = self.buffer(call.kernel_parameters()?.kernel)?;
        let KernelParameters {
            kernel: kernel_target,
            bias: bias_target,
        } = backward.kernel_targets(call)?;
        if let Some(dx) = backward.input_gradient {
            self.launch(
                "depthwise_backward_data_direct",
                LaunchShape::Elements(call.input_elements() as u64),
                &[
                    pointer(gradient_in.address),
                    pointer(kernel.address),
                    pointer(dx.address),
                    t,
                    KernelArgument::Geometry(geometry),
                ],
            )?;
        }
        let kernel_elements = call
            .parameter_tensors()?
            .kernel()
            .ok_or_else(|| call.missing("kernel"))?
            .kernel
            .elements;
        self.launch(
            "depthwise_backward_filter_direct",
            LaunchShape::Elements(kernel_elements),
            &[
                pointer(input.address),
                pointer(gradient_in.address),
                t,
                pointer(kernel_target.address),
                type_code(kernel_target.element_type),
                KernelArgument::I32(i32::from(kernel_target.accumulate)),
                KernelArgument::Geometry(geometry),
            ],
        )?;
        if use_bias {
            let bias_target = bias_target.ok_or_else(|| call.missing("bias gradient"))?;
            self.column_sums(
                gradient_in,
                (call.batch as i64 * geometry.output_height * geometry.output_width) as u64,
                geometry.output_channels as u64,
                bias_target,
            )?;
        }
        Ok(())
    }

    /// `pad_images` forward, `crop_images` backward: `top` rows and `left` columns of
    /// zeros before the image, the rest of the output's size after.
    pub(super) fn zero_padding(
        &mut self,
        call: &LayerCall<'_>,
        source: super::DeviceBuffer,
        destination: super::DeviceBuffer,
        (top, left): (usize, usize),
        crop: bool,
    ) -> Result<(), EngineError> {
        let input = image_shape(call.layer.input_shape, call.batch);
        let output = image_shape(call.layer.output_shape, call.batch);
        let (kernel, elements) = if crop {
            ("crop_images", call.input_elements())
        } else {
            ("pad_images", call.output_elements())
        };
        self.launch(
            kernel,
            LaunchShape::Elements(elements as u64),
            &[
                pointer(source.address),
                pointer(destination.address),
                type_code(destination.element_type),
                count(input.batch),
                count(input.height),
                count(input.width),
                count(input.channels),
                count(output.height),
                count(output.width),
                count(top),
                count(left),
            ],
        )
    }
}
