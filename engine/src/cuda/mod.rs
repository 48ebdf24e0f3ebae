//! The `cuda` backend: the same plans as the cpu backend, run on a GPU with cuDNN, cuBLAS
//! and NVRTC kernels, inside one reserved region of device memory.
//!
//! - The slice (`slice.rs`): at start the backend reserves the slice's bytes in ONE
//!   `cuMemAlloc` and checks with `cuMemGetInfo` that free memory fell by at least that
//!   much; every plan buffer — activations, weights, gradients, optimizer state, cuDNN
//!   workspaces — is then `base + offset` with the offset the executor's `SliceAllocator`
//!   chose. Outside the slice are only the context, the cuDNN/cuBLAS handles (and the
//!   workspace cuBLAS allocates for itself on first use), the compiled kernels and a
//!   40-byte result area, all of which the worker measures at start-up like the context.
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
//! - Errors (`error.rs`): allocation failures of any CUDA library become the engine's
//!   `OutOfMemory` with the slice's numbers; everything else is a backend error.
//!
//! Nothing here calls into CUDA before `device::check_libraries` confirmed the libraries
//! load: cudarc panics without them.

mod algorithms;
mod cudnn_ops;
mod device;
mod error;
mod kernels;
mod slice;

use std::collections::HashMap;

use carve_core::estimator::{MemoryEstimate, estimate_plan};
use carve_core::model::{ActivationKind, LayerNode, LayerOp, ModelGraph};
use carve_core::plan::{
    BufferId, BufferOwner, BufferRole, BufferSpec, ElementType, Operation, OperationKind, StepPlan,
    compile_step_plan,
};
use carve_core::spec::{LossKind, OptimizerSpec};
use carve_core::validate::ValidatedJob;
use half::{bf16, f16};

pub use algorithms::{
    AlgorithmCandidate, AlgorithmChoiceError, PaddedConvolutionPlan, choose_algorithm,
    plan_padded_convolution, workspace_budget,
};
pub use error::{CudaFailure, CudaLibrary, SliceNumbers, classify_failure, is_allocation_failure};
pub use slice::{
    KernelDimensions, LiveBuffers, SliceReservation, hwio_to_krsc, krsc_to_hwio, verify_reservation,
};

use crate::backend::{Backend, OperationContext, OperationResult};
use crate::cpu::{Roles, image_shape, sort_roles, windowed_shapes};
use crate::data::DataSets;
use crate::error::EngineError;
use crate::executor::Executor;
use crate::kernels::loss::LossError;
use crate::rng::Rng;
use crate::trainer::{Progress, TrainingOptions, TrainingReport, train_with};
use cudnn_ops::{
    ConvolutionAlgorithm, ConvolutionBuffers, ConvolutionDirection, ConvolutionShape, Cudnn,
    CudnnActivation, PoolingShape,
};
use device::{Device, GemmCall, KernelArgument, KernelGeometry, LaunchShape};
use kernels::{
    COLUMNS_PER_SUM_BLOCK, MAILBOX_BAD_LABEL_SAMPLE, MAILBOX_CORRECT, MAILBOX_LOSS_SUM,
    MAILBOX_OVERFLOW, element_type_code,
};

/// Which GPU and how much of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    pub device_ordinal: usize,
    /// The slice, reserved in one allocation.
    pub slice_bytes: u64,
    /// The most one convolution may take as workspace (the run config's cap).
    pub workspace_limit_bytes: u64,
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
    // Declared first so it is dropped before the device (and its stream and context).
    cudnn: Cudnn,
    device: Device,
    reservation: SliceReservation,
    live: LiveBuffers,
    buffers: HashMap<BufferId, DeviceBuffer>,
    /// Conv kernel dimensions by layer index, for the layout of its parameter tensors.
    conv_kernels: HashMap<usize, KernelDimensions>,
    algorithms: HashMap<AlgorithmKey, (ConvolutionAlgorithm, u64)>,
    workspace_limit_bytes: u64,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("CudaBackend")
            .field("reservation", &self.reservation)
            .field("live_buffers", &self.buffers.len())
            .field("cached_algorithms", &self.algorithms.len())
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
        let cudnn =
            Cudnn::new(device.cu_stream()).map_err(|failure| classify_failure(&failure, empty))?;
        let reservation = device
            .reserve_slice(options.slice_bytes)
            .map_err(|failure| classify_failure(&failure, empty))?;
        verify_reservation(&reservation).map_err(EngineError::Backend)?;
        let conv_kernels = graph
            .layers
            .iter()
            .filter_map(|layer| match (layer.op, layer.parameters.first()) {
                (LayerOp::Conv2d { .. }, Some(kernel)) if kernel.shape.len() == 4 => Some((
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
            cudnn,
            device,
            reservation,
            live: LiveBuffers::new(options.slice_bytes),
            buffers: HashMap::new(),
            conv_kernels,
            algorithms: HashMap::new(),
            workspace_limit_bytes: options.workspace_limit_bytes,
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
    }
}

fn activation_code(kind: ActivationKind) -> (i32, f32) {
    match kind {
        ActivationKind::Relu => (0, 0.0),
        ActivationKind::LeakyRelu { alpha } => (1, alpha as f32),
        ActivationKind::Gelu => (2, 0.0),
        ActivationKind::Sigmoid => (3, 0.0),
        ActivationKind::Tanh => (4, 0.0),
    }
}

fn cudnn_activation(kind: ActivationKind) -> Option<CudnnActivation> {
    match kind {
        ActivationKind::Relu => Some(CudnnActivation::Relu),
        ActivationKind::Sigmoid => Some(CudnnActivation::Sigmoid),
        ActivationKind::Tanh => Some(CudnnActivation::Tanh),
        ActivationKind::LeakyRelu { .. } | ActivationKind::Gelu => None,
    }
}

/// The dropout keep scale, as the cpu kernel computes it.
fn dropout_keep_scale(rate: f32) -> f32 {
    if rate.is_nan() || rate <= 0.0 {
        1.0
    } else if rate >= 1.0 {
        0.0
    } else {
        1.0 / (1.0 - rate)
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
        // New buffers start at zero, as on the cpu backend: gradients and optimizer state
        // rely on it.
        self.device
            .zero(address, buffer.bytes)
            .map_err(|failure| self.fail(failure))
    }

    fn release_buffer(&mut self, id: BufferId) {
        self.buffers.remove(&id);
        self.live.remove(id);
    }

    fn write_f32(&mut self, id: BufferId, values: &[f32]) -> Result<(), EngineError> {
        let buffer = self.buffer(id)?;
        let elements = buffer.elements as usize;
        if values.len() > elements {
            return Err(EngineError::Backend(format!(
                "{} values do not fit buffer {} of {elements}",
                values.len(),
                id.0
            )));
        }
        let mut padded = values.to_vec();
        padded.resize(elements, 0.0);
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
        match operation.kind {
            OperationKind::InitializeParameters => {
                for (master, weights) in operation.reads.iter().zip(&operation.writes) {
                    self.convert(*master, *weights)?;
                }
                Ok(OperationResult::default())
            }
            OperationKind::LayerForward { layer }
            | OperationKind::LayerRecompute { layer }
            | OperationKind::LayerInference { layer } => {
                self.layer_forward(operation, context, layer)?;
                Ok(OperationResult::default())
            }
            OperationKind::LayerBackward { layer } => {
                self.layer_backward(operation, context, layer)?;
                Ok(OperationResult::default())
            }
            OperationKind::LossForward | OperationKind::LossEvaluate => {
                self.loss_forward(operation, context)
            }
            OperationKind::LossBackward => {
                self.loss_backward(operation, context)?;
                Ok(OperationResult::default())
            }
            OperationKind::CheckOverflow => {
                self.device
                    .clear_mailbox()
                    .map_err(|failure| self.fail(failure))?;
                for id in &operation.reads {
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
                let finite = mailbox[MAILBOX_OVERFLOW] == 0;
                *context.apply_update = context.loss_scaler.update(!finite);
                Ok(OperationResult::default())
            }
            OperationKind::OptimizerUpdate { .. } => {
                self.optimizer_update(operation, context)?;
                Ok(OperationResult::default())
            }
        }
    }
}

impl CudaBackend {
    /// `destination = source`, rounding to the destination's type.
    fn convert(&self, source: BufferId, destination: BufferId) -> Result<(), EngineError> {
        let from = self.buffer(source)?;
        let to = self.buffer(destination)?;
        let elements = from.elements.min(to.elements);
        self.convert_elements(
            from.address,
            from.element_type,
            to.address,
            to.element_type,
            elements,
        )
    }

    fn convert_elements(
        &self,
        source: u64,
        source_type: ElementType,
        destination: u64,
        destination_type: ElementType,
        elements: u64,
    ) -> Result<(), EngineError> {
        self.launch(
            "convert_elements",
            LaunchShape::Elements(elements),
            &[
                pointer(source),
                type_code(source_type),
                pointer(destination),
                type_code(destination_type),
                KernelArgument::I64(elements as i64),
            ],
        )
    }

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
        let candidates = self
            .cudnn
            .convolution_algorithms(shape, direction, buffers, may_overwrite_output)
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
                    let (chunk_beta, overwrite) = if first == 0 {
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

    fn workspace_of(&self, roles: &Roles) -> Result<(u64, u64), EngineError> {
        match roles.workspace {
            Some(id) => {
                let buffer = self.buffer(id)?;
                let bytes = self.live.get(id).map_or(0, |(_, bytes)| bytes);
                Ok((buffer.address, bytes.min(self.workspace_limit_bytes)))
            }
            None => Ok((0, 0)),
        }
    }

    fn layer_forward(
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
        if batch == 0 {
            return Ok(());
        }
        let input = self.buffer(input_id)?;
        let output = self.buffer(output_id)?;
        let element_type = output.element_type;
        let t = type_code(element_type);
        let output_elements = batch * layer.output_shape.elements() as usize;
        let input_elements = batch * layer.input_shape.elements() as usize;
        let is_inference = matches!(operation.kind, OperationKind::LayerInference { .. });
        let parameter = |index: usize| -> Result<DeviceBuffer, EngineError> {
            let id = roles.parameters.get(index).ok_or_else(|| {
                EngineError::Backend(format!("{} has no parameter {index}", layer.label()))
            })?;
            self.buffer(*id)
        };
        match layer.op {
            LayerOp::Conv2d { use_bias, .. } => {
                let geometry = kernel_geometry(layer, batch).expect("conv has a window");
                let kernel = parameter(0)?;
                let bias = if use_bias { Some(parameter(1)?) } else { None };
                let (workspace, workspace_bytes) = self.workspace_of(&roles)?;
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
                        LaunchShape::Elements(output_elements as u64),
                        &[
                            pointer(input.address),
                            pointer(kernel.address),
                            pointer(bias.map_or(0, |bias| bias.address)),
                            pointer(output.address),
                            t,
                            KernelArgument::Geometry(geometry),
                        ],
                    )?;
                }
            }
            LayerOp::MaxPool { .. } | LayerOp::AvgPool { .. } => {
                let is_max = matches!(layer.op, LayerOp::MaxPool { .. });
                let geometry = kernel_geometry(layer, batch).expect("pool has a window");
                if has_symmetric_padding(layer) {
                    let shape = pooling_shape(&geometry, is_max, element_type);
                    self.cudnn
                        .pooling_forward(&shape, input.address, output.address)
                        .map_err(|failure| self.fail(failure))?;
                } else {
                    self.launch(
                        "pool_forward_direct",
                        LaunchShape::Elements(output_elements as u64),
                        &[
                            pointer(input.address),
                            pointer(output.address),
                            t,
                            KernelArgument::I32(if is_max { 0 } else { 1 }),
                            KernelArgument::Geometry(geometry),
                        ],
                    )?;
                }
            }
            LayerOp::GlobalAvgPool => {
                let shape = image_shape(layer.input_shape, batch);
                self.launch(
                    "global_avg_pool_forward",
                    LaunchShape::Elements((batch * shape.channels) as u64),
                    &[
                        pointer(input.address),
                        pointer(output.address),
                        t,
                        count(batch),
                        count(shape.height * shape.width),
                        count(shape.channels),
                    ],
                )?;
            }
            LayerOp::Activation(kind) => match cudnn_activation(kind) {
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
                            t,
                            count(output_elements),
                        ],
                    )?;
                }
            },
            LayerOp::Dense { units, use_bias } => {
                let kernel = parameter(0)?;
                let in_features = layer.input_shape.elements() as usize;
                let units = units as usize;
                // Row-major Y[N, out] = X[N, in] W[in, out] is column-major
                // Y^T = W^T X^T: m = out, n = N, k = in.
                self.device
                    .gemm(&GemmCall {
                        transpose_a: false,
                        transpose_b: false,
                        m: units,
                        n: batch,
                        k: in_features,
                        a: kernel.address,
                        lda: units,
                        b: input.address,
                        ldb: in_features,
                        c: output.address,
                        ldc: units,
                        input_type: element_type,
                        output_type: element_type,
                        beta: 0.0,
                    })
                    .map_err(|failure| self.fail(failure.during(layer.label())))?;
                if use_bias {
                    let bias = parameter(1)?;
                    self.launch(
                        "add_bias_rows",
                        LaunchShape::Elements(output_elements as u64),
                        &[
                            pointer(output.address),
                            t,
                            pointer(bias.address),
                            type_code(bias.element_type),
                            count(batch),
                            count(units),
                        ],
                    )?;
                }
            }
            LayerOp::BatchNorm { momentum, epsilon } => {
                let channels = layer.parameters[0].elements as usize;
                let rows = input_elements / channels.max(1);
                let gamma = parameter(0)?;
                let beta = parameter(1)?;
                let running_mean = parameter(2)?;
                let running_variance = parameter(3)?;
                if gamma.element_type != beta.element_type
                    || running_mean.element_type != ElementType::F32
                    || running_variance.element_type != ElementType::F32
                {
                    return Err(EngineError::Backend(format!(
                        "{}: gamma and beta must share a type and running statistics be fp32",
                        layer.label()
                    )));
                }
                if is_inference {
                    self.launch(
                        "batch_norm_inference_forward",
                        LaunchShape::Elements(output_elements as u64),
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
                    let statistics_id = roles
                        .side
                        .filter(|id| context.plan.buffers[id.0].role == BufferRole::BatchStatistics)
                        .ok_or_else(|| {
                            EngineError::Backend(format!("{} without statistics", layer.label()))
                        })?;
                    let statistics = self.buffer(statistics_id)?;
                    // A recomputed forward must not count the batch twice in the running
                    // statistics.
                    let update_running =
                        matches!(operation.kind, OperationKind::LayerForward { .. });
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
            }
            LayerOp::Dropout { rate } => {
                let mask = roles
                    .side
                    .filter(|id| context.plan.buffers[id.0].role == BufferRole::DropoutMask);
                match mask {
                    Some(mask_id) if !is_inference => {
                        let mask = self.buffer(mask_id)?;
                        let rate = rate as f32;
                        let identity = rate.is_nan() || rate <= 0.0;
                        let state = Rng::for_stream(
                            context.seed,
                            &[context.step, context.micro_batch, layer_index as u64],
                        )
                        .state();
                        self.launch(
                            "dropout_forward",
                            LaunchShape::Elements(output_elements as u64),
                            &[
                                pointer(input.address),
                                pointer(output.address),
                                t,
                                pointer(mask.address),
                                count(output_elements),
                                KernelArgument::F32(rate),
                                KernelArgument::F32(dropout_keep_scale(rate)),
                                KernelArgument::U64(state),
                                KernelArgument::I32(i32::from(identity)),
                            ],
                        )?;
                    }
                    _ => self.convert_elements(
                        input.address,
                        input.element_type,
                        output.address,
                        element_type,
                        output_elements as u64,
                    )?,
                }
            }
            LayerOp::Flatten => {}
        }
        Ok(())
    }

    /// Where each trainable parameter's gradient goes, in the plan's order.
    fn gradient_targets(
        &self,
        layer: &LayerNode,
        roles: &Roles,
    ) -> Result<Vec<GradientTarget>, EngineError> {
        let trainable: Vec<u64> = layer
            .parameters
            .iter()
            .filter(|parameter| parameter.trainable)
            .map(|parameter| parameter.elements)
            .collect();
        match roles.half_gradients {
            Some(scratch_id) => {
                let scratch = self.buffer(scratch_id)?;
                let mut offset = 0u64;
                let mut targets = Vec::new();
                for elements in trainable {
                    targets.push(GradientTarget {
                        address: scratch.address + offset * scratch.element_type.bytes(),
                        element_type: scratch.element_type,
                        accumulate: false,
                    });
                    offset += elements;
                }
                if offset > scratch.elements {
                    return Err(EngineError::Backend(format!(
                        "{}: the half-gradient scratch is too small",
                        layer.label()
                    )));
                }
                Ok(targets)
            }
            None => roles
                .parameter_gradients
                .iter()
                .map(|id| {
                    let buffer = self.buffer(*id)?;
                    Ok(GradientTarget {
                        address: buffer.address,
                        element_type: buffer.element_type,
                        accumulate: true,
                    })
                })
                .collect(),
        }
    }

    fn layer_backward(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
        layer_index: usize,
    ) -> Result<(), EngineError> {
        let layer = &context.graph.layers[layer_index];
        let roles = sort_roles(operation, &context.plan.buffers, layer_index);
        let batch = context.samples;
        if batch == 0 || layer.is_view() {
            return Ok(());
        }
        let gradient_in = self.buffer(
            roles
                .gradient_in
                .ok_or_else(|| EngineError::Backend("backward without a gradient".into()))?,
        )?;
        let element_type = gradient_in.element_type;
        let t = type_code(element_type);
        let missing = |what: &str| {
            EngineError::Backend(format!("{} backward without its {what}", layer.label()))
        };
        let input = roles.input.map(|id| self.buffer(id)).transpose()?;
        let output = roles.output.map(|id| self.buffer(id)).transpose()?;
        let input_gradient = roles.input_gradient.map(|id| self.buffer(id)).transpose()?;
        let input_elements = batch * layer.input_shape.elements() as usize;
        let output_elements = batch * layer.output_shape.elements() as usize;
        let targets = self.gradient_targets(layer, &roles)?;
        let parameter = |index: usize| -> Result<DeviceBuffer, EngineError> {
            let id = roles
                .parameters
                .get(index)
                .ok_or_else(|| missing("parameters"))?;
            self.buffer(*id)
        };
        match layer.op {
            LayerOp::Conv2d { use_bias, .. } => {
                let geometry = kernel_geometry(layer, batch).expect("conv has a window");
                let input = input.ok_or_else(|| missing("input"))?;
                let kernel = parameter(0)?;
                let kernel_target = *targets.first().ok_or_else(|| missing("kernel gradient"))?;
                let bias_target = if use_bias {
                    targets.get(1).copied()
                } else {
                    None
                };
                let (workspace, workspace_bytes) = self.workspace_of(&roles)?;
                if let Some(route) = cudnn_route(layer, &geometry, element_type, workspace_bytes) {
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
                        && (!bias_target.address.is_multiple_of(16)
                            || element_type == ElementType::Bf16)
                    {
                        self.column_sums(
                            gradient_in,
                            (batch * (geometry.output_height * geometry.output_width) as usize)
                                as u64,
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
                } else {
                    if let Some(dx) = input_gradient {
                        self.launch(
                            "conv_backward_data_direct",
                            LaunchShape::Elements(input_elements as u64),
                            &[
                                pointer(gradient_in.address),
                                pointer(kernel.address),
                                pointer(dx.address),
                                t,
                                KernelArgument::Geometry(geometry),
                            ],
                        )?;
                    }
                    let kernel_elements = layer.parameters[0].elements;
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
                            (batch * (geometry.output_height * geometry.output_width) as usize)
                                as u64,
                            geometry.output_channels as u64,
                            bias_target,
                        )?;
                    }
                }
            }
            LayerOp::Dense { units, use_bias } => {
                let input = input.ok_or_else(|| missing("input"))?;
                let kernel = parameter(0)?;
                let in_features = layer.input_shape.elements() as usize;
                let units = units as usize;
                let kernel_target = *targets.first().ok_or_else(|| missing("kernel gradient"))?;
                // dW[in, out] (+)= X^T dY: column-major dW^T = dY^T X, m = out, n = in, k = N.
                self.device
                    .gemm(&GemmCall {
                        transpose_a: false,
                        transpose_b: true,
                        m: units,
                        n: in_features,
                        k: batch,
                        a: gradient_in.address,
                        lda: units,
                        b: input.address,
                        ldb: in_features,
                        c: kernel_target.address,
                        ldc: units,
                        input_type: element_type,
                        output_type: kernel_target.element_type,
                        beta: if kernel_target.accumulate { 1.0 } else { 0.0 },
                    })
                    .map_err(|failure| self.fail(failure.during(layer.label())))?;
                if let Some(dx) = input_gradient {
                    // dX[N, in] = dY W^T: column-major dX^T = W dY^T, m = in, n = N, k = out.
                    self.device
                        .gemm(&GemmCall {
                            transpose_a: true,
                            transpose_b: false,
                            m: in_features,
                            n: batch,
                            k: units,
                            a: kernel.address,
                            lda: units,
                            b: gradient_in.address,
                            ldb: units,
                            c: dx.address,
                            ldc: in_features,
                            input_type: element_type,
                            output_type: dx.element_type,
                            beta: 0.0,
                        })
                        .map_err(|failure| self.fail(failure.during(layer.label())))?;
                }
                if use_bias && let Some(bias_target) = targets.get(1).copied() {
                    self.column_sums(gradient_in, batch as u64, units as u64, bias_target)?;
                }
            }
            LayerOp::MaxPool { .. } | LayerOp::AvgPool { .. } => {
                let is_max = matches!(layer.op, LayerOp::MaxPool { .. });
                let geometry = kernel_geometry(layer, batch).expect("pool has a window");
                let dx = input_gradient.ok_or_else(|| missing("input gradient"))?;
                if is_max && has_symmetric_padding(layer) {
                    let shape = pooling_shape(&geometry, true, element_type);
                    self.cudnn
                        .pooling_backward(
                            &shape,
                            input.ok_or_else(|| missing("input"))?.address,
                            output.ok_or_else(|| missing("output"))?.address,
                            gradient_in.address,
                            dx.address,
                        )
                        .map_err(|failure| self.fail(failure))?;
                } else {
                    let (saved_input, saved_output) = if is_max {
                        (
                            input.ok_or_else(|| missing("input"))?.address,
                            output.ok_or_else(|| missing("output"))?.address,
                        )
                    } else {
                        (0, 0)
                    };
                    self.launch(
                        "pool_backward_direct",
                        LaunchShape::Elements(input_elements as u64),
                        &[
                            pointer(saved_input),
                            pointer(saved_output),
                            pointer(gradient_in.address),
                            pointer(dx.address),
                            t,
                            KernelArgument::I32(if is_max { 0 } else { 1 }),
                            KernelArgument::Geometry(geometry),
                        ],
                    )?;
                }
            }
            LayerOp::GlobalAvgPool => {
                let shape = image_shape(layer.input_shape, batch);
                let dx = input_gradient.ok_or_else(|| missing("input gradient"))?;
                self.launch(
                    "global_avg_pool_backward",
                    LaunchShape::Elements(input_elements as u64),
                    &[
                        pointer(gradient_in.address),
                        pointer(dx.address),
                        t,
                        count(batch),
                        count(shape.height * shape.width),
                        count(shape.channels),
                    ],
                )?;
            }
            LayerOp::Activation(kind) => {
                let dx = input_gradient.ok_or_else(|| missing("input gradient"))?;
                match cudnn_activation(kind) {
                    Some(activation) if output_elements <= i32::MAX as usize => self
                        .cudnn
                        .activation_backward(
                            activation,
                            output_elements,
                            element_type,
                            output.ok_or_else(|| missing("output"))?.address,
                            gradient_in.address,
                            dx.address,
                        )
                        .map_err(|failure| self.fail(failure))?,
                    _ => {
                        let (code, alpha) = activation_code(kind);
                        let saved = if cudnn_activation(kind).is_some() {
                            output.ok_or_else(|| missing("output"))?
                        } else {
                            input.ok_or_else(|| missing("input"))?
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
                                t,
                                count(output_elements),
                            ],
                        )?;
                    }
                }
            }
            LayerOp::BatchNorm { .. } => {
                let input = input.ok_or_else(|| missing("input"))?;
                let statistics = self.buffer(roles.side.ok_or_else(|| missing("statistics"))?)?;
                let gamma = parameter(0)?;
                let channels = layer.parameters[0].elements as usize;
                let rows = input_elements / channels.max(1);
                let gamma_target = *targets.first().ok_or_else(|| missing("gamma gradient"))?;
                let beta_target = *targets.get(1).ok_or_else(|| missing("beta gradient"))?;
                self.launch(
                    "batch_norm_backward",
                    LaunchShape::Blocks(channels as u64),
                    &[
                        pointer(input.address),
                        pointer(gradient_in.address),
                        pointer(input_gradient.map_or(0, |dx| dx.address)),
                        t,
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
            }
            LayerOp::Dropout { rate } => {
                let dx = input_gradient.ok_or_else(|| missing("input gradient"))?;
                let mask = self.buffer(
                    roles
                        .side
                        .filter(|id| context.plan.buffers[id.0].role == BufferRole::DropoutMask)
                        .ok_or_else(|| missing("mask"))?,
                )?;
                self.launch(
                    "dropout_backward",
                    LaunchShape::Elements(output_elements as u64),
                    &[
                        pointer(mask.address),
                        pointer(gradient_in.address),
                        pointer(dx.address),
                        t,
                        count(output_elements),
                        KernelArgument::F32(dropout_keep_scale(rate as f32)),
                    ],
                )?;
            }
            LayerOp::Flatten => {}
        }
        // Under mixed precision the gradients were written in half precision to the
        // scratch; they are added into the fp32 gradients here, as the cpu backend does.
        if roles.half_gradients.is_some() {
            let trainable = layer
                .parameters
                .iter()
                .filter(|parameter| parameter.trainable);
            for ((target, gradient_id), parameter) in targets
                .iter()
                .zip(&roles.parameter_gradients)
                .zip(trainable)
            {
                let gradient = self.buffer(*gradient_id)?;
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

    /// `target (+)= column sums of source[rows, columns]`.
    fn column_sums(
        &self,
        source: DeviceBuffer,
        rows: u64,
        columns: u64,
        target: GradientTarget,
    ) -> Result<(), EngineError> {
        self.launch(
            "column_sums",
            LaunchShape::Blocks(columns.div_ceil(COLUMNS_PER_SUM_BLOCK)),
            &[
                pointer(source.address),
                type_code(source.element_type),
                KernelArgument::I64(rows as i64),
                KernelArgument::I64(columns as i64),
                pointer(target.address),
                type_code(target.element_type),
                KernelArgument::I32(i32::from(target.accumulate)),
            ],
        )
    }

    fn loss_forward(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<OperationResult, EngineError> {
        let output = self.buffer(operation.reads[0])?;
        let target = self.buffer(operation.reads[1])?;
        let loss_value = self.buffer(operation.writes[0])?;
        let batch = context.samples;
        let per_sample = context.graph.output_shape().elements() as usize;
        self.device
            .clear_mailbox()
            .map_err(|failure| self.fail(failure))?;
        let mailbox_address = self.device.mailbox_address();
        match context.graph.loss {
            LossKind::SoftmaxCrossEntropy => {
                let probabilities = self.buffer(operation.writes[1])?;
                if probabilities.element_type != ElementType::F32
                    || target.element_type != ElementType::I32
                {
                    return Err(EngineError::Backend(
                        "cross-entropy needs fp32 probabilities and i32 labels".into(),
                    ));
                }
                self.launch(
                    "softmax_cross_entropy_forward",
                    LaunchShape::Blocks(1),
                    &[
                        pointer(output.address),
                        type_code(output.element_type),
                        pointer(target.address),
                        pointer(probabilities.address),
                        count(batch),
                        count(per_sample),
                        pointer(mailbox_address),
                        pointer(loss_value.address),
                        type_code(loss_value.element_type),
                    ],
                )?;
                let mailbox = self
                    .device
                    .read_mailbox()
                    .map_err(|failure| self.fail(failure))?;
                if mailbox[MAILBOX_BAD_LABEL_SAMPLE] != 0 {
                    let sample = !mailbox[MAILBOX_BAD_LABEL_SAMPLE] as usize;
                    let mut label = [0u8; 4];
                    self.device
                        .download(target.address + 4 * sample as u64, &mut label)
                        .map_err(|failure| self.fail(failure))?;
                    let error = LossError::LabelOutOfRange {
                        sample,
                        label: i32::from_le_bytes(label),
                        classes: per_sample,
                    };
                    return Err(EngineError::data("labels", error.to_string()));
                }
                Ok(OperationResult {
                    loss_sum: Some(f64::from_bits(mailbox[MAILBOX_LOSS_SUM])),
                    correct: Some(mailbox[MAILBOX_CORRECT] as usize),
                })
            }
            LossKind::Mse => {
                if target.element_type != ElementType::F32 {
                    return Err(EngineError::Backend("mse needs fp32 targets".into()));
                }
                self.launch(
                    "mse_forward",
                    LaunchShape::Blocks(1),
                    &[
                        pointer(output.address),
                        type_code(output.element_type),
                        pointer(target.address),
                        count(batch * per_sample),
                        count(per_sample),
                        count(batch),
                        pointer(mailbox_address),
                        pointer(loss_value.address),
                        type_code(loss_value.element_type),
                    ],
                )?;
                let mailbox = self
                    .device
                    .read_mailbox()
                    .map_err(|failure| self.fail(failure))?;
                Ok(OperationResult {
                    loss_sum: Some(f64::from_bits(mailbox[MAILBOX_LOSS_SUM])),
                    correct: None,
                })
            }
        }
    }

    fn loss_backward(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<(), EngineError> {
        let batch = context.samples;
        let per_sample = context.graph.output_shape().elements() as usize;
        let gradient = self.buffer(operation.writes[0])?;
        let values = self.buffer(operation.reads[0])?;
        let targets = self.buffer(operation.reads[1])?;
        let elements = batch * per_sample;
        match context.graph.loss {
            LossKind::SoftmaxCrossEntropy => self.launch(
                "softmax_cross_entropy_backward",
                LaunchShape::Elements(elements as u64),
                &[
                    pointer(values.address),
                    pointer(targets.address),
                    count(batch),
                    count(per_sample),
                    KernelArgument::F32(context.loss_gradient_scale),
                    pointer(gradient.address),
                    type_code(gradient.element_type),
                ],
            ),
            LossKind::Mse => {
                if per_sample == 0 {
                    return Ok(());
                }
                let factor = 2.0 * context.loss_gradient_scale / per_sample as f32;
                self.launch(
                    "mse_backward",
                    LaunchShape::Elements(elements as u64),
                    &[
                        pointer(values.address),
                        type_code(values.element_type),
                        pointer(targets.address),
                        count(elements),
                        KernelArgument::F32(factor),
                        pointer(gradient.address),
                        type_code(gradient.element_type),
                    ],
                )
            }
        }
    }

    fn optimizer_update(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<(), EngineError> {
        let gradient = self.buffer(operation.reads[0])?;
        if *context.apply_update {
            let buffers = &context.plan.buffers;
            let weights_id = operation.writes[0];
            let master_id = operation
                .writes
                .iter()
                .copied()
                .find(|id| matches!(buffers[id.0].role, BufferRole::MasterParameter { .. }));
            let states: Vec<DeviceBuffer> = operation
                .writes
                .iter()
                .filter(|id| matches!(buffers[id.0].role, BufferRole::OptimizerState { .. }))
                .map(|id| self.buffer(*id))
                .collect::<Result<_, _>>()?;
            let target = self.buffer(master_id.unwrap_or(weights_id))?;
            let all_fp32 = target.element_type == ElementType::F32
                && gradient.element_type == ElementType::F32
                && states
                    .iter()
                    .all(|state| state.element_type == ElementType::F32);
            if !all_fp32 {
                return Err(EngineError::Backend(
                    "optimizer updates run on fp32 parameters, gradients and state".into(),
                ));
            }
            let elements = target.elements.min(gradient.elements);
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
                        pointer(states.first().map_or(0, |velocity| velocity.address)),
                        KernelArgument::I64(elements as i64),
                        KernelArgument::F32(settings.learning_rate as f32),
                        KernelArgument::F32(settings.momentum as f32),
                        KernelArgument::F32(settings.weight_decay as f32),
                        KernelArgument::I32(i32::from(settings.nesterov)),
                        KernelArgument::F32(gradient_scale),
                    ],
                )?,
                OptimizerSpec::Adam(settings) | OptimizerSpec::Adamw(settings) => {
                    let (first, second) = match states.as_slice() {
                        [first, second, ..] => (*first, *second),
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
            if master_id.is_some() {
                self.convert(master_id.unwrap_or(weights_id), weights_id)?;
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

/// An attempt ready to train on a GPU: the plan compiled, the slice reserved and
/// verified. Preparing first lets the caller report the reservation before training.
#[derive(Debug)]
pub struct CudaTraining {
    plan: StepPlan,
    estimate: MemoryEstimate,
    executor: Executor<CudaBackend>,
    reservation: SliceReservation,
}

impl CudaTraining {
    /// Compiles the plan for `options.config` and reserves `options.slice_bytes` on GPU
    /// `device_ordinal`.
    pub fn prepare(
        job: &ValidatedJob,
        options: &TrainingOptions,
        device_ordinal: usize,
    ) -> Result<CudaTraining, EngineError> {
        let plan = compile_step_plan(job, &options.config)?;
        let estimate = estimate_plan(&plan);
        let backend = CudaBackend::new(
            CudaOptions {
                device_ordinal,
                slice_bytes: options.slice_bytes,
                workspace_limit_bytes: options.config.workspace_limit_bytes,
            },
            &job.graph,
        )?;
        let reservation = backend.reservation().clone();
        let executor = Executor::new(&plan, options.slice_bytes, backend);
        Ok(CudaTraining {
            plan,
            estimate,
            executor,
            reservation,
        })
    }

    /// What was reserved on the GPU.
    pub fn reservation(&self) -> &SliceReservation {
        &self.reservation
    }

    /// Trains as `trainer::train` does on the cpu backend; the slice is released after.
    pub fn train(
        self,
        job: &ValidatedJob,
        data: &DataSets,
        options: &TrainingOptions,
        on_progress: &mut dyn FnMut(&Progress),
    ) -> Result<TrainingReport, EngineError> {
        train_with(
            job,
            data,
            options,
            self.plan,
            self.estimate,
            self.executor,
            on_progress,
        )
    }
}

/// Trains `job` on GPU `device_ordinal` inside a slice of `options.slice_bytes`: the
/// `train` of the cpu backend, with the reservation report alongside.
pub fn train_on_cuda(
    job: &ValidatedJob,
    data: &DataSets,
    options: &TrainingOptions,
    device_ordinal: usize,
    on_progress: &mut dyn FnMut(&Progress),
) -> Result<(TrainingReport, SliceReservation), EngineError> {
    let prepared = CudaTraining::prepare(job, options, device_ordinal)?;
    let reservation = prepared.reservation().clone();
    let report = prepared.train(job, data, options, on_progress)?;
    Ok((report, reservation))
}
