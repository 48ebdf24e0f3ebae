//! What a cuDNN call is described by: the shapes, directions, algorithms and device
//! addresses of convolutions and poolings, as plain data. The calls themselves, and
//! every FFI block, are in `cudnn_ops.rs`.

use carve_core::plan::ElementType;
use cudarc::cudnn::sys;

/// A convolution with symmetric padding, NHWC, KRSC filters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvolutionShape {
    /// `[n, h, w, c]`
    pub input: [usize; 4],
    /// `[n, oh, ow, filters]`
    pub output: [usize; 4],
    /// `[kh, kw]`
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    /// Rows and columns of padding on each side.
    pub padding: [usize; 2],
    pub element_type: ElementType,
}

impl ConvolutionShape {
    /// `[filters, kh, kw, c]`: cuDNN's KRSC.
    pub(super) fn filter(&self) -> [usize; 4] {
        [
            self.output[3],
            self.kernel[0],
            self.kernel[1],
            self.input[3],
        ]
    }
}

/// Which of the three convolutions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConvolutionDirection {
    Forward,
    BackwardData,
    BackwardFilter,
}

/// The algorithm a direction runs, as cuDNN's own enum, with the math type cuDNN reported
/// it for: an algorithm found under one math type may be refused under another
/// (`CUDNN_STATUS_BAD_PARAM`, seen for fp16 filter gradients on an H200), so the
/// descriptor it runs with takes the reported one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvolutionAlgorithm {
    Forward(sys::cudnnConvolutionFwdAlgo_t, sys::cudnnMathType_t),
    BackwardData(sys::cudnnConvolutionBwdDataAlgo_t, sys::cudnnMathType_t),
    BackwardFilter(sys::cudnnConvolutionBwdFilterAlgo_t, sys::cudnnMathType_t),
}

impl ConvolutionAlgorithm {
    /// The math type cuDNN reported with the algorithm.
    pub fn math(&self) -> sys::cudnnMathType_t {
        match *self {
            ConvolutionAlgorithm::Forward(_, math)
            | ConvolutionAlgorithm::BackwardData(_, math)
            | ConvolutionAlgorithm::BackwardFilter(_, math) => math,
        }
    }
}

/// The device addresses of a convolution: `input` (x or dx), `filter` (w or dw),
/// `output` (y or dy).
#[derive(Debug, Clone, Copy)]
pub struct ConvolutionBuffers {
    pub input: u64,
    pub filter: u64,
    pub output: u64,
    pub workspace: u64,
    pub workspace_bytes: u64,
}

/// A pooling with symmetric padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolingShape {
    pub input: [usize; 4],
    pub output: [usize; 4],
    pub window: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub is_max: bool,
    pub element_type: ElementType,
}

/// The activations cuDNN runs (the others are NVRTC kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudnnActivation {
    Relu,
    Sigmoid,
    Tanh,
}
