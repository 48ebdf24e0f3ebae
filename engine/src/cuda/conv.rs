//! The cuda backend's convolutions: cuDNN forward, backward data and backward filter with
//! workspace-aware algorithms chosen once per shape (`algorithms.rs`), asymmetric padding
//! on padded copies inside the conv's workspace, and direct NVRTC kernels when not one
//! padded image fits there. Where `graph_engines::resolve_convolution_api` says so (strict
//! fp32 by default), each cuDNN call goes through the graph API instead (`conv_graph.rs`),
//! within the same workspace, on the same routes.

use carve_core::model::LayerNode;
use carve_core::plan::{ElementType, im2col_workspace_elements};

use super::algorithms::{
    AlgorithmCandidate, PaddedConvolutionPlan, choose_algorithm, filter_measurement_split,
    plan_padded_convolution, workspace_budget,
};
use super::cudnn_ops::{
    ConvolutionAlgorithm, ConvolutionBuffers, ConvolutionDirection, ConvolutionShape,
};
use super::device::{KernelArgument, KernelGeometry, LaunchShape};
use super::graph_engines::{ConvolutionApi, usable_workspace_bytes};
use super::{
    CudaBackend, CudaBackward, CudaForward, DeviceBuffer, GradientTarget, geometry_dimensions,
    has_symmetric_padding, kernel_geometry, pointer, type_code,
};
use crate::dispatch::{ConvKernels, LayerCall};
use crate::error::EngineError;

/// How a convolution runs through cuDNN, when it does.
#[derive(Debug, Clone, Copy)]
enum CudnnRoute {
    /// Symmetric padding: cuDNN's descriptors say it as written.
    AsWritten,
    /// Asymmetric padding, on padded copies in the workspace.
    Padded(PaddedConvolutionPlan),
}

/// cuDNN's route for this convolution: always with symmetric padding, and with asymmetric
/// padding when a padded image fits its workspace; `None` for the direct kernels.
fn cudnn_route(
    layer: &LayerNode,
    geometry: &KernelGeometry,
    element_type: ElementType,
    workspace_bytes: u64,
) -> Option<CudnnRoute> {
    if has_symmetric_padding(layer) {
        return Some(CudnnRoute::AsWritten);
    }
    padded_convolution_plan(geometry, element_type, workspace_bytes).map(CudnnRoute::Padded)
}

/// How a convolution with asymmetric padding fits cuDNN in this workspace, if it does.
fn padded_convolution_plan(
    geometry: &KernelGeometry,
    element_type: ElementType,
    workspace_bytes: u64,
) -> Option<PaddedConvolutionPlan> {
    plan_padded_convolution(
        geometry.batch as usize,
        [
            geometry.output_height as usize,
            geometry.output_width as usize,
        ],
        [
            geometry.kernel_height as usize,
            geometry.kernel_width as usize,
        ],
        [
            geometry.stride_height as usize,
            geometry.stride_width as usize,
        ],
        geometry.input_channels as usize,
        element_type.bytes(),
        workspace_bytes,
    )
}

fn convolution_shape(geometry: &KernelGeometry, element_type: ElementType) -> ConvolutionShape {
    let (input, output) = geometry_dimensions(geometry);
    ConvolutionShape {
        input,
        output,
        kernel: [
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
        element_type,
    }
}

impl CudaBackend {
    /// Chooses (once per shape, direction and budget) the convolution algorithm.
    fn convolution_algorithm(
        &mut self,
        shape: &ConvolutionShape,
        direction: ConvolutionDirection,
        buffers: &ConvolutionBuffers,
        may_overwrite_output: bool,
        label: &str,
    ) -> Result<ConvolutionAlgorithm, EngineError> {
        let budget = workspace_budget(Some(buffers.workspace_bytes), self.workspace_limit_bytes);
        let key = (*shape, direction, budget);
        if let Some((algorithm, _)) = self.algorithms.get(&key) {
            return Ok(*algorithm);
        }
        // A filter gradient added into fp32 cannot be written by cuDNN's measuring runs;
        // it is measured on a scratch copy at the start of the workspace instead.
        let filter_bytes =
            shape.filter().iter().product::<usize>() as u64 * shape.element_type.bytes();
        let scratch_split = (direction == ConvolutionDirection::BackwardFilter
            && !may_overwrite_output
            && self.tuning.measure_accumulated_filter_gradients)
            .then(|| filter_measurement_split(buffers.workspace_bytes, filter_bytes))
            .flatten();
        let (measured_buffers, measure) = match scratch_split {
            Some((offset, bytes)) => (
                ConvolutionBuffers {
                    filter: buffers.workspace,
                    workspace: buffers.workspace + offset,
                    workspace_bytes: bytes,
                    ..*buffers
                },
                true,
            ),
            None => (*buffers, may_overwrite_output),
        };
        let candidates = self
            .cudnn
            .convolution_algorithms(shape, direction, &measured_buffers, measure)
            .map_err(|failure| {
                self.fail(failure.during(format!("{label}: choosing an algorithm")))
            })?;
        let plain: Vec<AlgorithmCandidate> =
            candidates.iter().map(|(candidate, _)| *candidate).collect();
        let chosen = choose_algorithm(&plain, budget).map_err(|error| {
            EngineError::Backend(format!("cuda: {label} {direction:?}: {error}"))
        })?;
        let algorithm = candidates
            .iter()
            .find(|(candidate, _)| candidate.algorithm == chosen.algorithm)
            .map(|(_, algorithm)| *algorithm)
            .ok_or_else(|| EngineError::Backend("cuda: chosen algorithm vanished".into()))?;
        if let Some(profile) = self.profile.as_mut() {
            let listed: Vec<String> = plain
                .iter()
                .map(|candidate| {
                    format!(
                        "{}:{}{}{}",
                        candidate.algorithm,
                        candidate
                            .time_milliseconds
                            .map_or_else(|| "-".into(), |time| format!("{time:.3}ms")),
                        if candidate.usable { "" } else { "(unusable)" },
                        format_args!("/{}", candidate.workspace_bytes)
                    )
                })
                .collect();
            profile.note(format!(
                "algorithm {label} {direction:?} {:?} {:?}->{:?} budget {budget}{}: chose {:?} \
                 ({} bytes); candidates {}",
                shape.element_type,
                shape.input,
                shape.output,
                if measure { ", measured" } else { "" },
                algorithm,
                chosen.workspace_bytes,
                listed.join(" ")
            ));
        }
        self.algorithms
            .insert(key, (algorithm, chosen.workspace_bytes));
        Ok(algorithm)
    }

    /// One direction of a convolution along its cuDNN `route`.
    #[allow(clippy::too_many_arguments)]
    fn convolve(
        &mut self,
        route: CudnnRoute,
        layer: &LayerNode,
        geometry: &KernelGeometry,
        element_type: ElementType,
        direction: ConvolutionDirection,
        buffers: &ConvolutionBuffers,
        may_overwrite_output: bool,
        beta: f32,
    ) -> Result<(), EngineError> {
        let label = layer.label();
        match route {
            CudnnRoute::AsWritten => self.run_convolution(
                &convolution_shape(geometry, element_type),
                direction,
                buffers,
                may_overwrite_output,
                beta,
                &label,
            ),
            CudnnRoute::Padded(plan) => self.run_padded_convolution(
                geometry,
                &plan,
                element_type,
                direction,
                buffers,
                may_overwrite_output,
                beta,
                &label,
            ),
        }
    }

    /// Chooses the algorithm for `shape` and `direction` (once) and runs it.
    fn run_convolution(
        &mut self,
        shape: &ConvolutionShape,
        direction: ConvolutionDirection,
        buffers: &ConvolutionBuffers,
        may_overwrite_output: bool,
        beta: f32,
        label: &str,
    ) -> Result<(), EngineError> {
        if self.convolution_api(shape.element_type) == ConvolutionApi::Graph
            && self.run_graph_convolution(
                shape,
                direction,
                buffers,
                may_overwrite_output,
                beta,
                label,
            )?
        {
            return Ok(());
        }
        let algorithm =
            self.convolution_algorithm(shape, direction, buffers, may_overwrite_output, label)?;
        self.cudnn
            .convolution(shape, algorithm, buffers, beta)
            .map_err(|failure| self.fail(failure))
    }

    /// One direction of a convolution with asymmetric padding through cuDNN, on padded
    /// copies in the workspace (`PaddedConvolutionPlan`), a chunk of samples at a time.
    /// `buffers` are the whole batch's; for the filter gradient `beta` applies to the
    /// first chunk and later chunks add to it.
    #[allow(clippy::too_many_arguments)]
    fn run_padded_convolution(
        &mut self,
        geometry: &KernelGeometry,
        plan: &PaddedConvolutionPlan,
        element_type: ElementType,
        direction: ConvolutionDirection,
        buffers: &ConvolutionBuffers,
        may_overwrite_output: bool,
        beta: f32,
        label: &str,
    ) -> Result<(), EngineError> {
        let element_bytes = element_type.bytes();
        let input_sample_bytes =
            (geometry.input_height * geometry.input_width * geometry.input_channels) as u64
                * element_bytes;
        let output_sample_bytes =
            (geometry.output_height * geometry.output_width * geometry.output_channels) as u64
                * element_bytes;
        let padded = buffers.workspace;
        let batch = geometry.batch as usize;
        let mut first = 0;
        while first < batch {
            let samples = plan.samples_per_chunk.min(batch - first);
            let chunk_geometry = KernelGeometry {
                batch: samples as i64,
                input_height: plan.padded_height as i64,
                input_width: plan.padded_width as i64,
                padding_top: 0,
                padding_left: 0,
                ..*geometry
            };
            let shape = convolution_shape(&chunk_geometry, element_type);
            let input = buffers.input + first as u64 * input_sample_bytes;
            let chunk_buffers = ConvolutionBuffers {
                input: padded,
                filter: buffers.filter,
                output: buffers.output + first as u64 * output_sample_bytes,
                workspace: padded + plan.padded_chunk_bytes,
                workspace_bytes: buffers.workspace_bytes - plan.padded_chunk_bytes,
            };
            let pad_arguments = |source: u64, destination: u64| {
                [
                    pointer(source),
                    pointer(destination),
                    type_code(element_type),
                    KernelArgument::I64(samples as i64),
                    KernelArgument::I64(geometry.input_height),
                    KernelArgument::I64(geometry.input_width),
                    KernelArgument::I64(geometry.input_channels),
                    KernelArgument::I64(plan.padded_height as i64),
                    KernelArgument::I64(plan.padded_width as i64),
                    KernelArgument::I64(geometry.padding_top),
                    KernelArgument::I64(geometry.padding_left),
                ]
            };
            let padded_elements = (samples * plan.padded_height * plan.padded_width) as u64
                * geometry.input_channels as u64;
            match direction {
                ConvolutionDirection::Forward | ConvolutionDirection::BackwardFilter => {
                    self.launch(
                        "pad_images",
                        LaunchShape::Elements(padded_elements),
                        &pad_arguments(input, padded),
                    )?;
                    // Each chunk writes its own part of a forward's output, but every
                    // chunk adds into the same filter gradient: after the first, with
                    // beta 1 and never a measuring run on it.
                    let (chunk_beta, overwrite) =
                        if first == 0 || direction == ConvolutionDirection::Forward {
                            (beta, may_overwrite_output)
                        } else {
                            (1.0, false)
                        };
                    self.run_convolution(
                        &shape,
                        direction,
                        &chunk_buffers,
                        overwrite,
                        chunk_beta,
                        label,
                    )?;
                }
                ConvolutionDirection::BackwardData => {
                    self.run_convolution(&shape, direction, &chunk_buffers, true, 0.0, label)?;
                    self.launch(
                        "crop_images",
                        LaunchShape::Elements(
                            (samples as u64) * input_sample_bytes / element_bytes,
                        ),
                        &pad_arguments(padded, input),
                    )?;
                }
            }
            first += samples;
        }
        Ok(())
    }

    fn workspace_of(&self, call: &LayerCall<'_>) -> Result<(u64, u64), EngineError> {
        match call.roles.workspace {
            Some(id) => {
                let buffer = self.buffer(id)?;
                let bytes = self.live.get(id).map_or(0, |(_, bytes)| bytes);
                let im2col_bytes = im2col_workspace_elements(
                    call.layer,
                    buffer.element_type,
                    call.batch as u64,
                    self.workspace_limit_bytes,
                )
                .map_or(0, |elements| elements * buffer.element_type.bytes());
                let usable = usable_workspace_bytes(
                    bytes,
                    self.workspace_limit_bytes,
                    self.tuning.workspace_headroom,
                    im2col_bytes,
                );
                Ok((buffer.address, usable))
            }
            None => Ok((0, 0)),
        }
    }
}

impl ConvKernels for CudaBackend {
    fn depthwise_conv2d_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CudaForward,
        _multiplier: usize,
        use_bias: bool,
    ) -> Result<(), EngineError> {
        self.depthwise_forward(call, forward, use_bias)
    }

    fn depthwise_conv2d_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CudaBackward,
        _multiplier: usize,
        use_bias: bool,
    ) -> Result<(), EngineError> {
        self.depthwise_backward(call, backward, use_bias)
    }

    fn conv2d_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CudaForward,
        use_bias: bool,
    ) -> Result<(), EngineError> {
        let LayerCall { layer, batch, .. } = *call;
        let CudaForward { input, output } = *forward;
        let element_type = output.element_type;
        let geometry = kernel_geometry(layer, batch).expect("conv has a window");
        let parameters = call.kernel_parameters()?;
        let kernel = self.buffer(parameters.kernel)?;
        let bias = self.parameter_buffer(parameters.bias.filter(|_| use_bias))?;
        let (workspace, workspace_bytes) = self.workspace_of(call)?;
        if let Some(route) = cudnn_route(layer, &geometry, element_type, workspace_bytes) {
            let buffers = ConvolutionBuffers {
                input: input.address,
                filter: kernel.address,
                output: output.address,
                workspace,
                workspace_bytes,
            };
            self.convolve(
                route,
                layer,
                &geometry,
                element_type,
                ConvolutionDirection::Forward,
                &buffers,
                true,
                0.0,
            )?;
            if let Some(bias) = bias {
                let shape = convolution_shape(&geometry, element_type);
                self.cudnn
                    .add_bias(shape.output, element_type, bias.address, output.address)
                    .map_err(|failure| self.fail(failure))?;
            }
        } else {
            self.launch(
                "conv_forward_direct",
                LaunchShape::Elements(call.output_elements() as u64),
                &[
                    pointer(input.address),
                    pointer(kernel.address),
                    pointer(bias.map_or(0, |bias| bias.address)),
                    pointer(output.address),
                    type_code(element_type),
                    KernelArgument::Geometry(geometry),
                ],
            )?;
        }
        Ok(())
    }

    fn conv2d_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CudaBackward,
        use_bias: bool,
    ) -> Result<(), EngineError> {
        let LayerCall { layer, batch, .. } = *call;
        let element_type = backward.gradient_in.element_type;
        let geometry = kernel_geometry(layer, batch).expect("conv has a window");
        let input = backward.saved_input(call)?;
        let kernel = self.buffer(call.kernel_parameters()?.kernel)?;
        let targets = backward.kernel_targets(call)?;
        let kernel_target = targets.kernel;
        let bias_target = targets.bias.filter(|_| use_bias);
        let (workspace, workspace_bytes) = self.workspace_of(call)?;
        let buffers = ConvBackwardBuffers {
            geometry,
            input,
            kernel,
            kernel_target,
            bias_target,
        };
        match cudnn_route(layer, &geometry, element_type, workspace_bytes) {
            Some(route) => self.conv2d_backward_cudnn(
                call,
                backward,
                &buffers,
                route,
                (workspace, workspace_bytes),
            ),
            None => self.conv2d_backward_direct(call, backward, &buffers),
        }
    }
}

/// What a convolution's backward reads and writes, on either route.
#[derive(Debug, Clone, Copy)]
struct ConvBackwardBuffers {
    geometry: KernelGeometry,
    input: DeviceBuffer,
    kernel: DeviceBuffer,
    kernel_target: GradientTarget,
    bias_target: Option<GradientTarget>,
}

impl CudaBackend {
    /// A convolution's backward through cuDNN: data, filter, then bias gradients.
    fn conv2d_backward_cudnn(
        &mut self,
        call: &LayerCall<'_>,
        backward: &CudaBackward,
        buffers: &ConvBackwardBuffers,
        route: CudnnRoute,
        (workspace, workspace_bytes): (u64, u64),
    ) -> Result<(), EngineError> {
        let LayerCall { layer, batch, .. } = *call;
        let CudaBackward {
            gradient_in,
            input_gradient,
            ..
        } = *backward;
        let element_type = gradient_in.element_type;
        let ConvBackwardBuffers {
            geometry,
            input,
            kernel,
            kernel_target,
            bias_target,
        } = *buffers;
        let shape = convolution_shape(&geometry, element_type);
        if let Some(dx) = input_gradient {
            let buffers = ConvolutionBuffers {
                input: dx.address,
                filter: kernel.address,
                output: gradient_in.address,
                workspace,
                workspace_bytes,
            };
            self.convolve(
                route,
                layer,
                &geometry,
                element_type,
                ConvolutionDirection::BackwardData,
                &buffers,
                true,
                0.0,
            )?;
        }
        if kernel_target.element_type != element_type {
            return Err(EngineError::Backend(format!(
                "{}: kernel gradient of {:?} for {:?} data",
                layer.label(),
                kernel_target.element_type,
                element_type
            )));
        }
        let buffers = ConvolutionBuffers {
            input: input.address,
            filter: kernel_target.address,
            output: gradient_in.address,
            workspace,
            workspace_bytes,
        };
        // Measuring writes the filter gradient: only when it is the scratch,
        // never the accumulated fp32 gradient.
        self.convolve(
            route,
            layer,
            &geometry,
            element_type,
            ConvolutionDirection::BackwardFilter,
            &buffers,
            !kernel_target.accumulate,
            if kernel_target.accumulate { 1.0 } else { 0.0 },
        )?;
        // In the half scratch the bias gradient follows the kernel's and may
        // sit at any 2-byte offset; cuDNN is given only 16-byte aligned ones.
        // cuDNN 9 has no bf16 backward bias (CUDNN_STATUS_NOT_SUPPORTED on an
        // H200), so bf16 sums its columns too.
        if let Some(bias_target) = bias_target
            && (!bias_target.address.is_multiple_of(16) || element_type == ElementType::Bf16)
        {
            self.column_sums(
                gradient_in,
                (batch * (geometry.output_height * geometry.output_width) as usize) as u64,
                geometry.output_channels as u64,
                bias_target,
            )?;
        } else if let Some(bias_target) = bias_target {
            self.cudnn
                .convolution_backward_bias(
                    shape.output,
                    element_type,
                    gradient_in.address,
                    bias_target.address,
                    bias_target.element_type,
                    if bias_target.accumulate { 1.0 } else { 0.0 },
                )
                .map_err(|failure| self.fail(failure))?;
        }
        Ok(())
    }

    /// A convolution's backward through the direct NVRTC kernels.
    fn conv2d_backward_direct(
        &mut self,
        call: &LayerCall<'_>,
        backward: &CudaBackward,
        buffers: &ConvBackwardBuffers,
    ) -> Result<(), EngineError> {
        let LayerCall { batch, .. } = *call;
        let CudaBackward {
            gradient_in,
            input_gradient,
            ..
        } = *backward;
        let t = type_code(gradient_in.element_type);
        let ConvBackwardBuffers {
            geometry,
            input,
            kernel,
            kernel_target,
            bias_target,
        } = *buffers;
        if let Some(dx) = input_gradient {
            self.launch(
                "conv_backward_data_direct",
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
            "conv_backward_filter_direct",
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
        if let Some(bias_target) = bias_target {
            self.column_sums(
                gradient_in,
                (batch * (geometry.output_height * geometry.output_width) as usize) as u64,
                geometry.output_channels as u64,
                bias_target,
            )?;
        }
        Ok(())
    }
}
