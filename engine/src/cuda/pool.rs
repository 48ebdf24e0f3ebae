//! The cuda backend's pooling: cuDNN max and average pooling with symmetric padding, NVRTC
//! kernels for asymmetric padding, average-pool backward (the plan keeps neither the
//! pool's input nor its output) and global average pooling.

use carve_core::plan::ElementType;

use super::cudnn_ops::PoolingShape;
use super::device::{KernelArgument, KernelGeometry, LaunchShape};
use super::{
    CudaBackend, CudaBackward, CudaForward, count, geometry_dimensions, has_symmetric_padding,
    kernel_geometry, pointer, type_code,
};
use crate::dispatch::{LayerCall, PoolKernels, Pooling, image_shape};
use crate::error::EngineError;

fn pooling_shape(
    geometry: &KernelGeometry,
    is_max: bool,
    element_type: ElementType,
) -> PoolingShape {
    let (input, output) = geometry_dimensions(geometry);
    PoolingShape {
        input,
        output,
        window: [
            geometry.kernel_height as usize,
            geometry.kernel_width as usize,
        ],
        stride: [
            geometry.stride_height as usize,
            geometry.stride_width as usize,
        ],
        padding: [
            geometry.padding_top as usize,
            geometry.padding_left as usize,
        ],
        is_max,
        element_type,
    }
}

impl PoolKernels for CudaBackend {
    fn zero_padding_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CudaForward,
        top: usize,
        left: usize,
    ) -> Result<(), EngineError> {
        let CudaForward { input, output } = *forward;
        self.zero_padding(call, input, output, (top, left), false)
    }

    fn zero_padding_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CudaBackward,
        top: usize,
        left: usize,
    ) -> Result<(), EngineError> {
        let dx = backward.required_input_gradient(call)?;
        self.zero_padding(call, backward.gradient_in, dx, (top, left), true)
    }

    fn pool_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CudaForward,
        pooling: Pooling,
    ) -> Result<(), EngineError> {
        let LayerCall { layer, batch, .. } = *call;
        let CudaForward { input, output } = *forward;
        let element_type = output.element_type;
        let is_max = pooling == Pooling::Max;
        let geometry = kernel_geometry(layer, batch).expect("pool has a window");
        if has_symmetric_padding(layer) {
            let shape = pooling_shape(&geometry, is_max, element_type);
            self.cudnn
                .pooling_forward(&shape, input.address, output.address)
                .map_err(|failure| self.fail(failure))?;
        } else {
            self.launch(
                "pool_forward_direct",
                LaunchShape::Elements(call.output_elements() as u64),
                &[
                    pointer(input.address),
                    pointer(output.address),
                    type_code(element_type),
                    KernelArgument::I32(if is_max { 0 } else { 1 }),
                    KernelArgument::Geometry(geometry),
                ],
            )?;
        }
        Ok(())
    }

    fn pool_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CudaBackward,
        pooling: Pooling,
    ) -> Result<(), EngineError> {
        let LayerCall { layer, batch, .. } = *call;
        let gradient_in = backward.gradient_in;
        let element_type = gradient_in.element_type;
        let is_max = pooling == Pooling::Max;
        let geometry = kernel_geometry(layer, batch).expect("pool has a window");
        let dx = backward.required_input_gradient(call)?;
        if is_max && has_symmetric_padding(layer) {
            let shape = pooling_shape(&geometry, true, element_type);
            self.cudnn
                .pooling_backward(
                    &shape,
                    backward.saved_input(call)?.address,
                    backward.saved_output(call)?.address,
                    gradient_in.address,
                    dx.address,
                )
                .map_err(|failure| self.fail(failure))?;
        } else {
            let (saved_input, saved_output) = if is_max {
                (
                    backward.saved_input(call)?.address,
                    backward.saved_output(call)?.address,
                )
            } else {
                (0, 0)
            };
            self.launch(
                "pool_backward_direct",
                LaunchShape::Elements(call.input_elements() as u64),
                &[
                    pointer(saved_input),
                    pointer(saved_output),
                    pointer(gradient_in.address),
                    pointer(dx.address),
                    type_code(element_type),
                    KernelArgument::I32(if is_max { 0 } else { 1 }),
                    KernelArgument::Geometry(geometry),
                ],
            )?;
        }
        Ok(())
    }

    fn global_avg_pool_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CudaForward,
    ) -> Result<(), EngineError> {
        let LayerCall { layer, batch, .. } = *call;
        let CudaForward { input, output } = *forward;
        let shape = image_shape(layer.input_shape, batch);
        self.launch(
            "global_avg_pool_forward",
            LaunchShape::Elements((batch * shape.channels) as u64),
            &[
                pointer(input.address),
                pointer(output.address),
                type_code(output.element_type),
                count(batch),
                count(shape.height * shape.width),
                count(shape.channels),
            ],
        )?;
        Ok(())
    }

    fn global_avg_pool_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CudaBackward,
    ) -> Result<(), EngineError> {
        let LayerCall { layer, batch, .. } = *call;
        let gradient_in = backward.gradient_in;
        let shape = image_shape(layer.input_shape, batch);
        let dx = backward.required_input_gradient(call)?;
        self.launch(
            "global_avg_pool_backward",
            LaunchShape::Elements(call.input_elements() as u64),
            &[
                pointer(gradient_in.address),
                pointer(dx.address),
                type_code(gradient_in.element_type),
                count(batch),
                count(shape.height * shape.width),
                count(shape.channels),
            ],
        )?;
        Ok(())
    }
}
