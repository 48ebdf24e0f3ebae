//! The cuDNN calls of the backend: convolution forward, backward data, backward filter
//! and backward bias with workspace-aware algorithm queries, bias addition, pooling and
//! activation forward and backward. Tensors are NHWC and filters KRSC
//! (`CUDNN_TENSOR_NHWC`), the layouts the rest of the engine uses on the device.
//!
//! Descriptors are created per call and destroyed on drop (`Descriptors`); they are
//! host-side objects that cost microseconds. Algorithm choices are cached by the backend.

// The FFI boundary: every unsafe block below says why it is sound.
#![allow(unsafe_code)]

use carve_core::plan::ElementType;
use cudarc::cudnn::sys;
use cudarc::driver::sys as driver_sys;

use crate::cuda::algorithms::AlgorithmCandidate;
pub(super) use crate::cuda::cudnn_shapes::{
    ConvolutionAlgorithm, ConvolutionBuffers, ConvolutionDirection, ConvolutionShape,
    CudnnActivation, PoolingShape,
};
use crate::cuda::error::{CudaFailure, CudaLibrary};

mod algorithm_queries;

pub(super) fn check(status: sys::cudnnStatus_t, during: &str) -> Result<(), CudaFailure> {
    if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(
            CudaFailure::new(CudaLibrary::Cudnn, status as u32, format!("{status:?}"))
                .during(during),
        )
    }
}

pub(super) fn data_type(element_type: ElementType) -> Result<sys::cudnnDataType_t, CudaFailure> {
    match element_type {
        ElementType::F32 => Ok(sys::cudnnDataType_t::CUDNN_DATA_FLOAT),
        ElementType::F16 => Ok(sys::cudnnDataType_t::CUDNN_DATA_HALF),
        ElementType::Bf16 => Ok(sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16),
        other => Err(CudaFailure::new(
            CudaLibrary::Cudnn,
            2000,
            format!("no cudnn tensor of {other:?}"),
        )),
    }
}

/// The math type of a convolution descriptor. fp32 data: cuDNN's default math, which may
/// round inputs to TF32 on tensor cores as PyTorch lets it by default, or plain FMA math
/// when TF32 is not allowed, so the results stay within 1e-4 of the cpu backend, whatever
/// cuDNN reported. Half data: tensor cores with fp32 accumulation. An algorithm runs with
/// the math type cuDNN reported it for.
fn convolution_math(
    element_type: ElementType,
    allow_tf32: bool,
    found_math: Option<sys::cudnnMathType_t>,
) -> sys::cudnnMathType_t {
    match (element_type, allow_tf32, found_math) {
        (ElementType::F32, false, _) => sys::cudnnMathType_t::CUDNN_FMA_MATH,
        (_, _, Some(math)) => math,
        (ElementType::F32, true, None) => sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
        (_, _, None) => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
    }
}

fn int(value: usize, what: &str) -> Result<i32, CudaFailure> {
    i32::try_from(value).map_err(|_| {
        CudaFailure::new(
            CudaLibrary::Cudnn,
            2000,
            format!("{what} of {value} exceeds cudnn's 32-bit dimensions"),
        )
    })
}

/// The descriptors one call needs, destroyed when dropped.
#[derive(Default)]
struct Descriptors {
    tensors: Vec<sys::cudnnTensorDescriptor_t>,
    filters: Vec<sys::cudnnFilterDescriptor_t>,
    convolutions: Vec<sys::cudnnConvolutionDescriptor_t>,
    poolings: Vec<sys::cudnnPoolingDescriptor_t>,
    activations: Vec<sys::cudnnActivationDescriptor_t>,
}

impl Descriptors {
    /// An NHWC tensor of `[n, h, w, c]`.
    fn tensor(
        &mut self,
        element_type: ElementType,
        [n, h, w, c]: [usize; 4],
    ) -> Result<sys::cudnnTensorDescriptor_t, CudaFailure> {
        let mut descriptor: sys::cudnnTensorDescriptor_t = std::ptr::null_mut();
        check(
            // SAFETY: `descriptor` is a valid out-pointer.
            unsafe { sys::cudnnCreateTensorDescriptor(&mut descriptor) },
            "creating a tensor descriptor",
        )?;
        self.tensors.push(descriptor);
        check(
            // SAFETY: the descriptor was just created and is owned by `self`.
            unsafe {
                sys::cudnnSetTensor4dDescriptor(
                    descriptor,
                    sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
                    data_type(element_type)?,
                    int(n, "batch")?,
                    int(c, "channels")?,
                    int(h, "height")?,
                    int(w, "width")?,
                )
            },
            "describing a tensor",
        )?;
        Ok(descriptor)
    }

    /// A KRSC filter of `filters x kh x kw x channels`.
    fn filter(
        &mut self,
        element_type: ElementType,
        [k, r, s, c]: [usize; 4],
    ) -> Result<sys::cudnnFilterDescriptor_t, CudaFailure> {
        let mut descriptor: sys::cudnnFilterDescriptor_t = std::ptr::null_mut();
        check(
            // SAFETY: `descriptor` is a valid out-pointer.
            unsafe { sys::cudnnCreateFilterDescriptor(&mut descriptor) },
            "creating a filter descriptor",
        )?;
        self.filters.push(descriptor);
        check(
            // SAFETY: the descriptor was just created and is owned by `self`.
            unsafe {
                sys::cudnnSetFilter4dDescriptor(
                    descriptor,
                    data_type(element_type)?,
                    sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
                    int(k, "filters")?,
                    int(c, "channels")?,
                    int(r, "kernel height")?,
                    int(s, "kernel width")?,
                )
            },
            "describing a filter",
        )?;
        Ok(descriptor)
    }

    /// `found_math` is the math type cuDNN reported with the algorithm about to run (none
    /// while algorithms are queried).
    fn convolution(
        &mut self,
        shape: &ConvolutionShape,
        allow_tf32: bool,
        found_math: Option<sys::cudnnMathType_t>,
    ) -> Result<sys::cudnnConvolutionDescriptor_t, CudaFailure> {
        let mut descriptor: sys::cudnnConvolutionDescriptor_t = std::ptr::null_mut();
        check(
            // SAFETY: `descriptor` is a valid out-pointer.
            unsafe { sys::cudnnCreateConvolutionDescriptor(&mut descriptor) },
            "creating a convolution descriptor",
        )?;
        self.convolutions.push(descriptor);
        let math = convolution_math(shape.element_type, allow_tf32, found_math);
        check(
            // SAFETY: the descriptor was just created and is owned by `self`.
            unsafe {
                sys::cudnnSetConvolution2dDescriptor(
                    descriptor,
                    int(shape.padding[0], "padding")?,
                    int(shape.padding[1], "padding")?,
                    int(shape.stride[0], "stride")?,
                    int(shape.stride[1], "stride")?,
                    1,
                    1,
                    sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                    sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
                )
            },
            "describing a convolution",
        )?;
        check(
            // SAFETY: as above.
            unsafe { sys::cudnnSetConvolutionMathType(descriptor, math) },
            "setting the convolution math type",
        )?;
        Ok(descriptor)
    }

    fn pooling(
        &mut self,
        shape: &PoolingShape,
    ) -> Result<sys::cudnnPoolingDescriptor_t, CudaFailure> {
        let mut descriptor: sys::cudnnPoolingDescriptor_t = std::ptr::null_mut();
        check(
            // SAFETY: `descriptor` is a valid out-pointer.
            unsafe { sys::cudnnCreatePoolingDescriptor(&mut descriptor) },
            "creating a pooling descriptor",
        )?;
        self.poolings.push(descriptor);
        let mode = if shape.is_max {
            sys::cudnnPoolingMode_t::CUDNN_POOLING_MAX
        } else {
            // Padding never counts, as in the cpu kernels and TF.
            sys::cudnnPoolingMode_t::CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING
        };
        check(
            // SAFETY: the descriptor was just created and is owned by `self`.
            unsafe {
                sys::cudnnSetPooling2dDescriptor(
                    descriptor,
                    mode,
                    sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
                    int(shape.window[0], "window")?,
                    int(shape.window[1], "window")?,
                    int(shape.padding[0], "padding")?,
                    int(shape.padding[1], "padding")?,
                    int(shape.stride[0], "stride")?,
                    int(shape.stride[1], "stride")?,
                )
            },
            "describing a pooling",
        )?;
        Ok(descriptor)
    }

    fn activation(
        &mut self,
        kind: CudnnActivation,
    ) -> Result<sys::cudnnActivationDescriptor_t, CudaFailure> {
        let mut descriptor: sys::cudnnActivationDescriptor_t = std::ptr::null_mut();
        check(
            // SAFETY: `descriptor` is a valid out-pointer.
            unsafe { sys::cudnnCreateActivationDescriptor(&mut descriptor) },
            "creating an activation descriptor",
        )?;
        self.activations.push(descriptor);
        let mode = match kind {
            CudnnActivation::Relu => sys::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU,
            CudnnActivation::Sigmoid => sys::cudnnActivationMode_t::CUDNN_ACTIVATION_SIGMOID,
            CudnnActivation::Tanh => sys::cudnnActivationMode_t::CUDNN_ACTIVATION_TANH,
        };
        check(
            // SAFETY: the descriptor was just created and is owned by `self`.
            unsafe {
                sys::cudnnSetActivationDescriptor(
                    descriptor,
                    mode,
                    // relu(NaN) stays NaN, as on the cpu backend.
                    sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
                    0.0,
                )
            },
            "describing an activation",
        )?;
        Ok(descriptor)
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: every descriptor was created by this struct, is destroyed once, and no
        // call that uses it is pending on the host (cuDNN reads descriptors when a call
        // is enqueued, not when it runs).
        unsafe {
            for descriptor in self.tensors.drain(..) {
                sys::cudnnDestroyTensorDescriptor(descriptor);
            }
            for descriptor in self.filters.drain(..) {
                sys::cudnnDestroyFilterDescriptor(descriptor);
            }
            for descriptor in self.convolutions.drain(..) {
                sys::cudnnDestroyConvolutionDescriptor(descriptor);
            }
            for descriptor in self.poolings.drain(..) {
                sys::cudnnDestroyPoolingDescriptor(descriptor);
            }
            for descriptor in self.activations.drain(..) {
                sys::cudnnDestroyActivationDescriptor(descriptor);
            }
        }
    }
}

fn pointer(address: u64) -> *const std::ffi::c_void {
    address as *const std::ffi::c_void
}

fn pointer_mut(address: u64) -> *mut std::ffi::c_void {
    address as *mut std::ffi::c_void
}

const ONE: f32 = 1.0;
const ZERO: f32 = 0.0;

fn scale(value: &f32) -> *const std::ffi::c_void {
    (value as *const f32).cast()
}

/// A cuDNN handle bound to the backend's stream.
pub struct Cudnn {
    handle: sys::cudnnHandle_t,
    /// fp32 convolutions may use TF32 (the `strict` tuning turns it off).
    allow_tf32: bool,
}

impl std::fmt::Debug for Cudnn {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Cudnn").finish_non_exhaustive()
    }
}

impl Drop for Cudnn {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; the backend synchronizes its stream
        // before dropping.
        let _ = unsafe { sys::cudnnDestroy(self.handle) };
    }
}

impl Cudnn {
    /// Creates a handle on `stream` (the context must be current).
    pub fn new(stream: driver_sys::CUstream, allow_tf32: bool) -> Result<Cudnn, CudaFailure> {
        let mut handle: sys::cudnnHandle_t = std::ptr::null_mut();
        check(
            // SAFETY: `handle` is a valid out-pointer; the caller made the context current.
            unsafe { sys::cudnnCreate(&mut handle) },
            "creating the cudnn handle",
        )?;
        let cudnn = Cudnn { handle, allow_tf32 };
        check(
            // SAFETY: the handle is live; the stream belongs to the current context and
            // outlives the handle (the backend drops the handle first).
            unsafe { sys::cudnnSetStream(cudnn.handle, stream as sys::cudaStream_t) },
            "binding cudnn to the stream",
        )?;
        Ok(cudnn)
    }

    /// The handle, for the graph API's descriptors and executions (`cudnn_graph.rs`),
    /// which live no longer than this `Cudnn` (the backend drops them first).
    pub(super) fn raw_handle(&self) -> sys::cudnnHandle_t {
        self.handle
    }

    /// Whether fp32 convolutions may use TF32.
    pub(super) fn allow_tf32(&self) -> bool {
        self.allow_tf32
    }

    /// Runs one convolution direction with `algorithm`: `output = conv(x, w)`,
    /// `dx = conv_backward_data(w, dy)` or `dw = beta * dw + conv_backward_filter(x, dy)`.
    pub fn convolution(
        &self,
        shape: &ConvolutionShape,
        algorithm: ConvolutionAlgorithm,
        buffers: &ConvolutionBuffers,
        beta: f32,
    ) -> Result<(), CudaFailure> {
        let mut descriptors = Descriptors::default();
        let x = descriptors.tensor(shape.element_type, shape.input)?;
        let y = descriptors.tensor(shape.element_type, shape.output)?;
        let w = descriptors.filter(shape.element_type, shape.filter())?;
        let convolution =
            descriptors.convolution(shape, self.allow_tf32, Some(algorithm.math()))?;
        let workspace = pointer_mut(buffers.workspace);
        let workspace_bytes = buffers.workspace_bytes as usize;
        // SAFETY: descriptors are live and match the buffers, which are live slice
        // buffers; the algorithm was chosen for this shape with a workspace need no
        // larger than `workspace_bytes`, the size of the buffer at `workspace`; alpha
        // and beta are host f32 as cuDNN requires for float/half data.
        let (status, during) = unsafe {
            match algorithm {
                ConvolutionAlgorithm::Forward(algorithm, _) => (
                    sys::cudnnConvolutionForward(
                        self.handle,
                        scale(&ONE),
                        x,
                        pointer(buffers.input),
                        w,
                        pointer(buffers.filter),
                        convolution,
                        algorithm,
                        workspace,
                        workspace_bytes,
                        scale(&beta),
                        y,
                        pointer_mut(buffers.output),
                    ),
                    "cudnnConvolutionForward",
                ),
                ConvolutionAlgorithm::BackwardData(algorithm, _) => (
                    sys::cudnnConvolutionBackwardData(
                        self.handle,
                        scale(&ONE),
                        w,
                        pointer(buffers.filter),
                        y,
                        pointer(buffers.output),
                        convolution,
                        algorithm,
                        workspace,
                        workspace_bytes,
                        scale(&beta),
                        x,
                        pointer_mut(buffers.input),
                    ),
                    "cudnnConvolutionBackwardData",
                ),
                ConvolutionAlgorithm::BackwardFilter(algorithm, _) => (
                    sys::cudnnConvolutionBackwardFilter(
                        self.handle,
                        scale(&ONE),
                        x,
                        pointer(buffers.input),
                        y,
                        pointer(buffers.output),
                        convolution,
                        algorithm,
                        workspace,
                        workspace_bytes,
                        scale(&beta),
                        w,
                        pointer_mut(buffers.filter),
                    ),
                    "cudnnConvolutionBackwardFilter",
                ),
            }
        };
        check(status, during)
    }

    /// `bias_gradient = beta * bias_gradient + sum of dy over n, h, w`.
    pub fn convolution_backward_bias(
        &self,
        output_shape: [usize; 4],
        element_type: ElementType,
        output_gradient: u64,
        bias_gradient: u64,
        bias_type: ElementType,
        beta: f32,
    ) -> Result<(), CudaFailure> {
        let mut descriptors = Descriptors::default();
        let dy = descriptors.tensor(element_type, output_shape)?;
        let db = descriptors.tensor(bias_type, [1, 1, 1, output_shape[3]])?;
        // SAFETY: live descriptors matching live slice buffers; host f32 scales.
        let status = unsafe {
            sys::cudnnConvolutionBackwardBias(
                self.handle,
                scale(&ONE),
                dy,
                pointer(output_gradient),
                scale(&beta),
                db,
                pointer_mut(bias_gradient),
            )
        };
        check(status, "cudnnConvolutionBackwardBias")
    }

    /// `output += bias`, broadcast over n, h, w.
    pub fn add_bias(
        &self,
        output_shape: [usize; 4],
        element_type: ElementType,
        bias: u64,
        output: u64,
    ) -> Result<(), CudaFailure> {
        let mut descriptors = Descriptors::default();
        let y = descriptors.tensor(element_type, output_shape)?;
        let b = descriptors.tensor(element_type, [1, 1, 1, output_shape[3]])?;
        // SAFETY: live descriptors matching live slice buffers; host f32 scales.
        let status = unsafe {
            sys::cudnnAddTensor(
                self.handle,
                scale(&ONE),
                b,
                pointer(bias),
                scale(&ONE),
                y,
                pointer_mut(output),
            )
        };
        check(status, "cudnnAddTensor")
    }

    pub fn pooling_forward(
        &self,
        shape: &PoolingShape,
        input: u64,
        output: u64,
    ) -> Result<(), CudaFailure> {
        let mut descriptors = Descriptors::default();
        let x = descriptors.tensor(shape.element_type, shape.input)?;
        let y = descriptors.tensor(shape.element_type, shape.output)?;
        let pooling = descriptors.pooling(shape)?;
        // SAFETY: live descriptors matching live slice buffers; host f32 scales.
        let status = unsafe {
            sys::cudnnPoolingForward(
                self.handle,
                pooling,
                scale(&ONE),
                x,
                pointer(input),
                scale(&ZERO),
                y,
                pointer_mut(output),
            )
        };
        check(status, "cudnnPoolingForward")
    }

    /// `dx = pooling_backward(y, dy, x)` (overwritten).
    pub fn pooling_backward(
        &self,
        shape: &PoolingShape,
        input: u64,
        output: u64,
        output_gradient: u64,
        input_gradient: u64,
    ) -> Result<(), CudaFailure> {
        let mut descriptors = Descriptors::default();
        let x = descriptors.tensor(shape.element_type, shape.input)?;
        let y = descriptors.tensor(shape.element_type, shape.output)?;
        let pooling = descriptors.pooling(shape)?;
        // SAFETY: live descriptors matching live slice buffers; for average pooling x and
        // y are the saved tensors too when the plan kept them, otherwise the gradients'
        // own buffers stand in (cuDNN reads only the shapes then); host f32 scales.
        let status = unsafe {
            sys::cudnnPoolingBackward(
                self.handle,
                pooling,
                scale(&ONE),
                y,
                pointer(output),
                y,
                pointer(output_gradient),
                x,
                pointer(input),
                scale(&ZERO),
                x,
                pointer_mut(input_gradient),
            )
        };
        check(status, "cudnnPoolingBackward")
    }

    /// `output = activation(input)` over `elements` values.
    pub fn activation_forward(
        &self,
        kind: CudnnActivation,
        elements: usize,
        element_type: ElementType,
        input: u64,
        output: u64,
    ) -> Result<(), CudaFailure> {
        let mut descriptors = Descriptors::default();
        let tensor = descriptors.tensor(element_type, [1, 1, 1, elements])?;
        let activation = descriptors.activation(kind)?;
        // SAFETY: live descriptors matching live slice buffers of `elements` values.
        let status = unsafe {
            sys::cudnnActivationForward(
                self.handle,
                activation,
                scale(&ONE),
                tensor,
                pointer(input),
                scale(&ZERO),
                tensor,
                pointer_mut(output),
            )
        };
        check(status, "cudnnActivationForward")
    }

    /// `dx = dy * activation'(...)`, from the saved output (relu, sigmoid and tanh need
    /// only it; it is passed as the input too, which relu's backward may read and which
    /// has the same sign).
    pub fn activation_backward(
        &self,
        kind: CudnnActivation,
        elements: usize,
        element_type: ElementType,
        output: u64,
        output_gradient: u64,
        input_gradient: u64,
    ) -> Result<(), CudaFailure> {
        let mut descriptors = Descriptors::default();
        let tensor = descriptors.tensor(element_type, [1, 1, 1, elements])?;
        let activation = descriptors.activation(kind)?;
        // SAFETY: live descriptors matching live slice buffers of `elements` values.
        let status = unsafe {
            sys::cudnnActivationBackward(
                self.handle,
                activation,
                scale(&ONE),
                tensor,
                pointer(output),
                tensor,
                pointer(output_gradient),
                tensor,
                pointer(output),
                scale(&ZERO),
                tensor,
                pointer_mut(input_gradient),
            )
        };
        check(status, "cudnnActivationBackward")
    }
}
