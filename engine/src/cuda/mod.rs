//! The `cuda` backend: the same plans as the cpu backend, run on a GPU with cuDNN, cuBLAS
//! and NVRTC kernels, inside one reserved region of device memory.
//!
//! - The slice (`slice.rs`): at start the backend reserves the slice's bytes in ONE
//!   `cuMemAlloc` and checks with `cuMemGetInfo` that free memory fell by at least that
//!   much; every plan buffer — activations, weights, gradients, optimizer state, cuDNN
//!   workspaces — is then `base + offset` with the offset the executor's `SliceAllocator`
//!   chose. Outside the slice are only the context, the cuDNN/cuBLAS handles (and the
//!   workspace cuBLAS allocates for itself on first use), the compiled kernels, a
//!   40-byte result area, the batch norm's 2 MiB reduction scratch and the recorded CUDA
//!   graphs (`graphs.rs`): a fixed amount per process, inside the worker's context
//!   allowance (`--context-bytes`).
//! - Layouts (`slice.rs`): NHWC activations as on the cpu; conv kernels are KRSC on the
//!   device and permuted to the engine's HWIO when they cross to the host.
//! - Kernels: cuDNN convolutions (forward, backward data, backward filter, backward bias)
//!   with workspace-aware algorithms (`algorithms.rs`), cuDNN pooling and relu / sigmoid /
//!   tanh; cuBLAS GEMM for dense layers (fp32 accumulation); NVRTC kernels (`kernels.rs`)
//!   for the rest: casts, batch norm, dropout, leaky relu and gelu, losses, optimizers and
//!   the overflow check. Batch norm is NVRTC rather than cuDNN because the plan keeps
//!   gamma and beta in the compute precision, while cuDNN's batch norm wants fp32 scale
//!   and bias for half data (a converted copy would be memory the estimate does not
//!   count). cuDNN's descriptors take one padding per dimension, so a convolution whose
//!   padding is asymmetric (TF "same" with an odd total, e.g. every stride-2 3x3 on an
//!   even size) runs through cuDNN on a zero-padded copy of its input placed in its own
//!   workspace buffer, in chunks of samples, with cuDNN's workspace after the copy
//!   (`algorithms::plan_padded_convolution`); only when not one padded image fits there
//!   does it fall back to direct NVRTC kernels, which are correct but one to two orders
//!   of magnitude slower. Pooling with asymmetric padding and average-pool backward are
//!   NVRTC kernels, as the plan keeps neither the pool's input nor its output.
//! - The slice is allocated in whole 2 MiB driver pages: the driver serves smaller
//!   allocations from pools it already holds, where `cuMemGetInfo` cannot see them.
//! - Code: one file per layer family, as in `kernels/` (`conv.rs`, `dense.rs`, `pool.rs`,
//!   `activation.rs`, `batch_norm.rs`, `dropout.rs`, `loss.rs`, `optimizer.rs`), each
//!   implementing its family's trait of `dispatch`; this file holds the buffers and what
//!   runs around every layer operation (`LayerPasses`); `training.rs` prepares an attempt.
//! - Speed (`tuning.rs` has the switches that turn each change off for measuring): the
//!   micro-batch and update phases are recorded once as CUDA graphs and replayed
//!   (`graphs.rs`); only buffers that must start at zero are zeroed (debug builds fill the
//!   rest with NaN); `profile.rs` times every operation on the GPU and the host.
//! - Errors (`error.rs`): allocation failures of any CUDA library become the engine's
//!   `OutOfMemory` with the slice's numbers; everything else is a backend error.
//!
//! Nothing here calls into CUDA before `device::check_libraries` confirmed the libraries
//! load: cudarc panics without them.

mod activation;
mod algorithms;
mod batch_norm;
mod batch_norm_kernels;
mod conv;
mod conv_graph;
mod cudnn_graph;
mod cudnn_ops;
mod cudnn_shapes;
mod dense;
mod depthwise;
mod device;
mod dropout;
mod error;
mod graph_engines;
mod graphs;
mod kernels;
mod loss;
mod merge;
mod optimizer;
mod pool;
mod profile;
mod slice;
mod training;
mod tuning;

use std::collections::HashMap;

use carve_core::model::{LayerNode, LayerOp, ModelGraph};
use carve_core::plan::{
    BatchNormGradients, BufferId, BufferOwner, BufferRole, BufferSpec, ElementType,
    KernelParameters, LayerParameters, Operation, ParameterGradients, half_gradient_layout,
};
use half::{bf16, f16};

pub use algorithms::{
    AlgorithmCandidate, AlgorithmChoiceError, PaddedConvolutionPlan, choose_algorithm,
    plan_padded_convolution, workspace_budget,
};
pub use error::{CudaFailure, CudaLibrary, SliceNumbers, classify_failure, is_allocation_failure};
pub use graph_engines::{
    ConvolutionApi, EngineNotes, GraphEngineCandidate, choose_graph_engine, resolve_convolution_api,
};
pub use slice::{
    KernelDimensions, LiveBuffers, SliceReservation, hwio_to_krsc, krsc_to_hwio, verify_reservation,
};
pub use training::{CudaTraining, train_on_cuda, train_on_cuda_with};
pub use tuning::{ConvolutionApiChoice, CudaTuning, TUNING_VARIABLE};

use crate::backend::{
    Backend, OperationContext, OperationResult, PhaseEnd, PhaseKind, padded_write,
};
use crate::dispatch::{LayerCall, LayerPasses, Roles, run_operation, windowed_shapes};
use crate::error::EngineError;
use cudnn_ops::{ConvolutionAlgorithm, ConvolutionDirection, ConvolutionShape, Cudnn};
use device::{Device, KernelArgument, KernelGeometry, LaunchShape};
use graphs::PhaseGraphs;
use kernels::{MAILBOX_OVERFLOW, element_type_code};
use profile::OperationProfile;

/// Which GPU and how much of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    pub device_ordinal: usize,
    /// The slice, reserved in one allocation.
    pub slice_bytes: u64,
    /// The most one convolution may take as workspace (the run config's cap).
    pub workspace_limit_bytes: u64,
    /// Which speed changes are on.
    pub tuning: CudaTuning,
}

/// A plan buffer on the device.
#[derive(Debug, Clone, Copy)]
struct DeviceBuffer {
    address: u64,
    element_type: ElementType,
    elements: u64,
    /// Set for every tensor of a conv kernel (weights, master, gradient, optimizer
    /// state): stored KRSC on the device.
    kernel_layout: Option<KernelDimensions>,
}

/// Where a layer's parameter gradient goes: added into the fp32 gradient, or written to
/// the half scratch (mixed precision) and added from there.
#[derive(Debug, Clone, Copy)]
struct GradientTarget {
    address: u64,
    element_type: ElementType,
    accumulate: bool,
}

type AlgorithmKey = (ConvolutionShape, ConvolutionDirection, u64);

/// The CUDA backend of one attempt.
pub struct CudaBackend {
    // Declared first so they are dropped before the device (and its stream and context).
    graphs: PhaseGraphs,
    /// Graph API plans by what they were built for (`None`: the legacy API runs it);
    /// dropped before the cuDNN handle they were built with.
    graph_plans: HashMap<cudnn_graph::GraphKey, Option<cudnn_graph::GraphPlan>>,
    cudnn: Cudnn,
    device: Device,
    reservation: SliceReservation,
    live: LiveBuffers,
    buffers: HashMap<BufferId, DeviceBuffer>,
    /// Conv kernel dimensions by layer index, for the layout of its parameter tensors.
    conv_kernels: HashMap<usize, KernelDimensions>,
    algorithms: HashMap<AlgorithmKey, (ConvolutionAlgorithm, u64)>,
    workspace_limit_bytes: u64,
    tuning: CudaTuning,
    /// `cudnnGetVersion`, which says whether the graph API can run.
    cudnn_version: usize,
    /// Set with the `profile` tuning.
    profile: Option<OperationProfile>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("CudaBackend")
            .field("reservation", &self.reservation)
            .field("live_buffers", &self.buffers.len())
            .field("cached_algorithms", &self.algorithms.len())
            .field("graphs", &self.graphs)
            .finish()
    }
}

impl CudaBackend {
    /// Whether this machine can run the backend: the CUDA libraries load and there is at
    /// least one GPU. The error says what is missing.
    pub fn available() -> Result<(), String> {
        device::check_libraries()?;
        let count = device::device_count()?;
        if count == 0 {
            return Err("no CUDA device found".into());
        }
        Ok(())
    }

    /// Opens the GPU, compiles the kernels, reserves the slice and verifies the
    /// reservation. `graph` tells which buffers are conv kernels (stored KRSC).
    pub fn new(options: CudaOptions, graph: &ModelGraph) -> Result<CudaBackend, EngineError> {
        Self::available()
            .map_err(|reason| EngineError::Backend(format!("CUDA not available: {reason}")))?;
        let empty = SliceNumbers {
            limit: options.slice_bytes,
            ..SliceNumbers::default()
        };
        let mut device = Device::open(options.device_ordinal)
            .map_err(|failure| classify_failure(&failure, empty))?;
        let cudnn = Cudnn::new(device.cu_stream(), options.tuning.allow_tf32)
            .map_err(|failure| classify_failure(&failure, empty))?;
        let cudnn_version = cudnn_graph::cudnn_version();
        resolve_convolution_api(
            options.tuning.convolution_api,
            ElementType::F32,
            options.tuning.allow_tf32,
            cudnn_version,
        )
        .map_err(|reason| EngineError::Backend(format!("cuda: {reason}")))?;
        let reservation = device
            .reserve_slice(options.slice_bytes)
            .map_err(|failure| classify_failure(&failure, empty))?;
        verify_reservation(&reservation).map_err(EngineError::Backend)?;
        let conv_kernels = graph
            .layers
            .iter()
            .filter_map(|layer| {
                let kernel = match LayerParameters::of_layer(layer) {
                    Ok(LayerParameters::Kernel(tensors)) => Some(tensors.kernel),
                    _ => None,
                };
                Some((layer, kernel?))
            })
            .filter_map(|(layer, kernel)| match layer.op {
                LayerOp::Conv2d { .. } if kernel.shape.len() == 4 => Some((
                    layer.index,
                    KernelDimensions {
                        height: kernel.shape[0] as usize,
                        width: kernel.shape[1] as usize,
                        input_channels: kernel.shape[2] as usize,
                        filters: kernel.shape[3] as usize,
                    },
                )),
                _ => None,
            })
            .collect();
        Ok(CudaBackend {
            graphs: PhaseGraphs::default(),
            graph_plans: HashMap::new(),
            cudnn,
            device,
            reservation,
            live: LiveBuffers::new(options.slice_bytes),
            buffers: HashMap::new(),
            conv_kernels,
            algorithms: HashMap::new(),
            workspace_limit_bytes: options.workspace_limit_bytes,
            tuning: options.tuning,
            cudnn_version,
            profile: options.tuning.profile.then(OperationProfile::default),
        })
    }

    /// What the attempt reserved on the GPU.
    pub fn reservation(&self) -> &SliceReservation {
        &self.reservation
    }

    fn fail(&self, failure: CudaFailure) -> EngineError {
        classify_failure(&failure, self.live.numbers())
    }

    fn buffer(&self, id: BufferId) -> Result<DeviceBuffer, EngineError> {
        self.buffers
            .get(&id)
            .copied()
            .ok_or_else(|| EngineError::Backend(format!("buffer {} is not allocated", id.0)))
    }

    fn launch(
        &self,
        name: &str,
        shape: LaunchShape,
        arguments: &[KernelArgument],
    ) -> Result<(), EngineError> {
        self.device
            .launch(name, shape, arguments)
            .map_err(|failure| self.fail(failure))
    }

    fn download_f32(&self, id: BufferId) -> Result<Vec<f32>, EngineError> {
        let buffer = self.buffer(id)?;
        let elements = buffer.elements as usize;
        let mut bytes = vec![0u8; elements * buffer.element_type.bytes() as usize];
        self.device
            .download(buffer.address, &mut bytes)
            .map_err(|failure| self.fail(failure))?;
        let values: Vec<f32> = match buffer.element_type {
            ElementType::F32 => bytes
                .chunks_exact(4)
                .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
                .collect(),
            ElementType::F16 => bytes
                .chunks_exact(2)
                .map(|chunk| f16::from_le_bytes([chunk[0], chunk[1]]).to_f32())
                .collect(),
            ElementType::Bf16 => bytes
                .chunks_exact(2)
                .map(|chunk| bf16::from_le_bytes([chunk[0], chunk[1]]).to_f32())
                .collect(),
            ElementType::I32 => bytes
                .chunks_exact(4)
                .map(|chunk| i32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]) as f32)
                .collect(),
            ElementType::U8 => bytes.iter().map(|value| f32::from(*value)).collect(),
        };
        Ok(match buffer.kernel_layout {
            Some(dimensions) if dimensions.elements() == values.len() => {
                krsc_to_hwio(&values, dimensions)
            }
            _ => values,
        })
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Everything queued must finish before the handles and the slice go.
        let _ = self.device.synchronize();
        if let Some(profile) = &self.profile {
            eprint!("{}", profile.table());
        }
    }
}

/// The geometry of a windowed layer (conv or pool) at `batch` samples.
fn kernel_geometry(layer: &LayerNode, batch: usize) -> Option<KernelGeometry> {
    let shapes = windowed_shapes(layer, batch)?;
    let window = shapes.window;
    Some(KernelGeometry {
        batch: batch as i64,
        input_height: shapes.input.height as i64,
        input_width: shapes.input.width as i64,
        input_channels: shapes.input.channels as i64,
        output_height: shapes.output.height as i64,
        output_width: shapes.output.width as i64,
        output_channels: shapes.output.channels as i64,
        kernel_height: window.kernel_height as i64,
        kernel_width: window.kernel_width as i64,
        stride_height: window.stride_height as i64,
        stride_width: window.stride_width as i64,
        padding_top: window.padding_top as i64,
        padding_left: window.padding_left as i64,
    })
}

/// Whether cuDNN's one-padding-per-dimension descriptors express this window.
fn has_symmetric_padding(layer: &LayerNode) -> bool {
    match layer.op {
        LayerOp::Conv2d { window, .. }
        | LayerOp::MaxPool { window }
        | LayerOp::AvgPool { window } => {
            window.padding_top == window.padding_bottom
                && window.padding_left == window.padding_right
        }
        _ => false,
    }
}

fn geometry_dimensions(geometry: &KernelGeometry) -> ([usize; 4], [usize; 4]) {
    (
        [
            geometry.batch as usize,
            geometry.input_height as usize,
            geometry.input_width as usize,
            geometry.input_channels as usize,
        ],
        [
            geometry.batch as usize,
            geometry.output_height as usize,
            geometry.output_width as usize,
            geometry.output_channels as usize,
        ],
    )
}

fn pointer(address: u64) -> KernelArgument {
    KernelArgument::Pointer(address)
}

fn type_code(element_type: ElementType) -> KernelArgument {
    KernelArgument::I32(element_type_code(element_type))
}

fn count(value: usize) -> KernelArgument {
    KernelArgument::I64(value as i64)
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn create_buffer(&mut self, buffer: &BufferSpec, offset: u64) -> Result<(), EngineError> {
        self.live
            .insert(buffer.id, offset, buffer.bytes)
            .map_err(EngineError::Backend)?;
        let address = match self.device.slice_address(offset) {
            Ok(address) => address,
            Err(failure) => {
                self.live.remove(buffer.id);
                return Err(self.fail(failure));
            }
        };
        let is_kernel_tensor = matches!(
            buffer.role,
            BufferRole::Parameter { parameter: 0 }
                | BufferRole::MasterParameter { parameter: 0 }
                | BufferRole::Gradient { parameter: 0 }
                | BufferRole::OptimizerState { parameter: 0, .. }
        );
        let kernel_layout = match buffer.owner {
            BufferOwner::Layer(layer) if is_kernel_tensor => self.conv_kernels.get(&layer).copied(),
            _ => None,
        };
        self.buffers.insert(
            buffer.id,
            DeviceBuffer {
                address,
                element_type: buffer.element_type,
                elements: buffer.elements,
                kernel_layout,
            },
        );
        // Only what is accumulated into or lives for the whole attempt must start at zero;
        // zeroing every activation and workspace cost up to 2 GB of memset per step.
        // Debug builds (the tests) fill the rest with NaN (all bytes 0xff), so an operation
        // that read a buffer before writing it would show in the results.
        let fill = if buffer.role.must_start_at_zero() || self.tuning.zero_every_buffer {
            Some(0)
        } else if cfg!(debug_assertions) {
            Some(0xff)
        } else {
            None
        };
        match fill {
            Some(value) => self
                .device
                .fill_bytes(address, buffer.bytes, value)
                .map_err(|failure| self.fail(failure)),
            None => Ok(()),
        }
    }

    fn release_buffer(&mut self, id: BufferId) {
        self.buffers.remove(&id);
        self.live.remove(id);
    }

    fn write_f32(&mut self, id: BufferId, values: &[f32]) -> Result<(), EngineError> {
        let buffer = self.buffer(id)?;
        let elements = buffer.elements as usize;
        let mut padded = padded_write(id, values, elements)?;
        if let Some(dimensions) = buffer.kernel_layout
            && dimensions.elements() == elements
        {
            padded = hwio_to_krsc(&padded, dimensions);
        }
        let bytes: Vec<u8> = match buffer.element_type {
            ElementType::F32 => padded
                .iter()
                .flat_map(|value| value.to_le_bytes())
                .collect(),
            ElementType::F16 => padded
                .iter()
                .flat_map(|value| f16::from_f32(*value).to_le_bytes())
                .collect(),
            ElementType::Bf16 => padded
                .iter()
                .flat_map(|value| bf16::from_f32(*value).to_le_bytes())
                .collect(),
            ElementType::I32 | ElementType::U8 => {
                return Err(EngineError::Backend(format!(
                    "buffer {} is not a float buffer",
                    id.0
                )));
            }
        };
        self.device
            .upload(buffer.address, &bytes)
            .map_err(|failure| self.fail(failure))
    }

    fn write_i32(&mut self, id: BufferId, values: &[i32]) -> Result<(), EngineError> {
        let buffer = self.buffer(id)?;
        if buffer.element_type != ElementType::I32 || values.len() as u64 > buffer.elements {
            return Err(EngineError::Backend(format!(
                "buffer {} cannot hold {} labels",
                id.0,
                values.len()
            )));
        }
        let mut padded = values.to_vec();
        padded.resize(buffer.elements as usize, 0);
        let bytes: Vec<u8> = padded
            .iter()
            .flat_map(|value| value.to_le_bytes())
            .collect();
        self.device
            .upload(buffer.address, &bytes)
            .map_err(|failure| self.fail(failure))
    }

    fn read_f32(&self, id: BufferId) -> Result<Vec<f32>, EngineError> {
        self.download_f32(id)
    }

    fn run(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<OperationResult, EngineError> {
        if self.graphs.capture.is_some() {
            return Ok(self.run_while_recording(operation, context));
        }
        if self.profile.is_some() {
            return self.run_timed(operation, context);
        }
        run_operation(self, operation, context)
    }

    fn replay_phase(
        &mut self,
        kind: PhaseKind,
        context: &OperationContext<'_>,
    ) -> Result<Option<OperationResult>, EngineError> {
        self.replay_recorded_phase(kind, context)
    }

    fn begin_phase(
        &mut self,
        kind: PhaseKind,
        context: &OperationContext<'_>,
    ) -> Result<(), EngineError> {
        self.begin_recording(kind, context)
    }

    fn end_phase(&mut self, kind: PhaseKind, completed: bool) -> Result<PhaseEnd, EngineError> {
        self.end_recording(kind, completed)
    }
}

/// A forward's device buffers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CudaForward {
    input: DeviceBuffer,
    output: DeviceBuffer,
}

/// A backward's device buffers and where its parameter gradients go.
#[derive(Debug)]
pub(crate) struct CudaBackward {
    gradient_in: DeviceBuffer,
    input: Option<DeviceBuffer>,
    output: Option<DeviceBuffer>,
    input_gradient: Option<DeviceBuffer>,
    /// Where each trained parameter's gradient goes.
    targets: ParameterGradients<GradientTarget>,
}

/// What a backward needs but the plan did not give is an error naming the layer and the
/// buffer, never a launch on address 0.
impl CudaBackward {
    fn saved_input(&self, call: &LayerCall<'_>) -> Result<DeviceBuffer, EngineError> {
        self.input.ok_or_else(|| call.missing("input"))
    }

    fn saved_output(&self, call: &LayerCall<'_>) -> Result<DeviceBuffer, EngineError> {
        self.output.ok_or_else(|| call.missing("output"))
    }

    fn required_input_gradient(&self, call: &LayerCall<'_>) -> Result<DeviceBuffer, EngineError> {
        self.input_gradient
            .ok_or_else(|| call.missing("input gradient"))
    }

    /// Where a kernel layer's kernel and bias gradients go.
    fn kernel_targets(
        &self,
        call: &LayerCall<'_>,
    ) -> Result<KernelParameters<GradientTarget>, EngineError> {
        self.targets
            .kernel()
            .ok_or_else(|| call.missing("kernel gradient"))
    }

    /// Where batch norm's gamma and beta gradients go.
    fn batch_norm_targets(
        &self,
        call: &LayerCall<'_>,
    ) -> Result<BatchNormGradients<GradientTarget>, EngineError> {
        self.targets
            .batch_norm()
            .ok_or_else(|| call.missing("gamma and beta gradients"))
    }
}

impl LayerPasses for CudaBackend {
    type Forward = CudaForward;
    type Backward = CudaBackward;

    fn initialize_parameters(
        &mut self,
        master: BufferId,
        weights: BufferId,
    ) -> Result<(), EngineError> {
        self.convert(master, weights)
    }

    fn gradients_are_finite(&mut self, gradients: &[BufferId]) -> Result<bool, EngineError> {
        self.device
            .clear_mailbox()
            .map_err(|failure| self.fail(failure))?;
        for id in gradients {
            let buffer = self.buffer(*id)?;
            self.launch(
                "check_finite",
                LaunchShape::Elements(buffer.elements),
                &[
                    pointer(buffer.address),
                    type_code(buffer.element_type),
                    KernelArgument::I64(buffer.elements as i64),
                    pointer(self.device.mailbox_address()),
                ],
            )?;
        }
        let mailbox = self
            .device
            .read_mailbox()
            .map_err(|failure| self.fail(failure))?;
        Ok(mailbox[MAILBOX_OVERFLOW] == 0)
    }

    fn begin_forward(&mut self, call: &LayerCall<'_>) -> Result<Option<CudaForward>, EngineError> {
        let (input_id, output_id) = call.forward_buffers()?;
        if call.batch == 0 {
            return Ok(None);
        }
        Ok(Some(CudaForward {
            input: self.buffer(input_id)?,
            output: self.buffer(output_id)?,
        }))
    }

    fn end_forward(
        &mut self,
        _call: &LayerCall<'_>,
        _forward: CudaForward,
    ) -> Result<(), EngineError> {
        Ok(())
    }

    fn begin_backward(
        &mut self,
        call: &LayerCall<'_>,
    ) -> Result<Option<CudaBackward>, EngineError> {
        let roles = &call.roles;
        if call.batch == 0 || call.layer.is_view() {
            return Ok(None);
        }
        let gradient_in = self.buffer(
            roles
                .gradient_in
                .ok_or_else(|| EngineError::Backend("backward without a gradient".into()))?,
        )?;
        Ok(Some(CudaBackward {
            gradient_in,
            input: roles.input.map(|id| self.buffer(id)).transpose()?,
            output: roles.output.map(|id| self.buffer(id)).transpose()?,
            input_gradient: roles.input_gradient.map(|id| self.buffer(id)).transpose()?,
            targets: self.gradient_targets(call.layer, roles)?,
        }))
    }

    fn end_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: CudaBackward,
    ) -> Result<(), EngineError> {
        let layer = call.layer;
        let roles = &call.roles;
        let targets = backward.targets;
        // Under mixed precision the gradients were written in half precision to the
        // scratch; they are added into the fp32 gradients here, as the cpu backend does.
        if roles.half_gradients.is_some() {
            let trained = ParameterGradients::of_layer(layer)?.list();
            for ((target, gradient_id), parameter) in targets
                .list()
                .into_iter()
                .zip(roles.parameter_gradients.list())
                .zip(trained)
            {
                let gradient = self.buffer(gradient_id)?;
                if gradient.element_type != ElementType::F32 {
                    return Err(EngineError::Backend(format!(
                        "{}: gradients must be fp32",
                        layer.label()
                    )));
                }
                self.launch(
                    "add_into_f32",
                    LaunchShape::Elements(parameter.elements),
                    &[
                        pointer(gradient.address),
                        pointer(target.address),
                        type_code(target.element_type),
                        KernelArgument::I64(parameter.elements as i64),
                    ],
                )?;
            }
        }
        Ok(())
    }
}

impl CudaBackend {
    /// A parameter's device buffer, if the layer has it.
    fn parameter_buffer(&self, id: Option<BufferId>) -> Result<Option<DeviceBuffer>, EngineError> {
        id.map(|id| self.buffer(id)).transpose()
    }

    /// Where each trained parameter's gradient goes: its place in the half scratch under
    /// mixed precision (core's `half_gradient_layout`), else its fp32 gradient.
    fn gradient_targets(
        &self,
        layer: &LayerNode,
        roles: &Roles<'_>,
    ) -> Result<ParameterGradients<GradientTarget>, EngineError> {
        match roles.half_gradients {
            Some(scratch_id) => {
                let scratch = self.buffer(scratch_id)?;
                let layout = half_gradient_layout(layer)?;
                if layout
                    .clone()
                    .list()
                    .iter()
                    .any(|range| range.end > scratch.elements)
                {
                    return Err(EngineError::Backend(format!(
                        "{}: the half-gradient scratch is too small",
                        layer.label()
                    )));
                }
                Ok(layout.map(|range| GradientTarget {
                    address: scratch.address + range.start * scratch.element_type.bytes(),
                    element_type: scratch.element_type,
                    accumulate: false,
                }))
            }
            None => {
                let targets = roles
                    .parameter_gradients
                    .list()
                    .into_iter()
                    .map(|id| {
                        let buffer = self.buffer(id)?;
                        Ok(GradientTarget {
                            address: buffer.address,
                            element_type: buffer.element_type,
                            accumulate: true,
                        })
                    })
                    .collect::<Result<Vec<_>, EngineError>>()?;
                Ok(ParameterGradients::name(layer, targets)?)
            }
        }
    }
}
