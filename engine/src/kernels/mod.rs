//! The math of training, on plain f32 slices: every layer's forward and backward, the
//! losses and the optimizers. Kernels know nothing of allocators or precisions: the
//! executor hands them slices and rounds half-precision buffers around them.
//!
//! Conventions every kernel follows:
//! - images are NHWC (batch, height, width, channels), row-major; flat features are
//!   (batch, features);
//! - conv kernels are `[kernel_height, kernel_width, in_channels, filters]`, dense kernels
//!   `[in_features, out_features]`, both row-major;
//! - outputs and input gradients are overwritten; **parameter gradients are added to**
//!   (`+=`), so micro-batches accumulate and the trainer zeroes them after each update.

pub mod activation;
pub mod batch_norm;
pub mod conv;
pub mod dense;
pub mod depthwise;
pub mod dropout;
pub mod gemm;
pub mod loss;
pub mod merge;
pub mod optimizer;
pub mod pool;

use carve_core::model::WindowGeometry;

/// Dimensions of an NHWC batch of images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImageShape {
    pub batch: usize,
    pub height: usize,
    pub width: usize,
    pub channels: usize,
}

impl ImageShape {
    pub fn per_sample(&self) -> usize {
        self.height * self.width * self.channels
    }

    pub fn elements(&self) -> usize {
        self.batch * self.per_sample()
    }
}

/// A window (convolution or pooling) applied to `input`, producing `output`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WindowedShapes {
    pub input: ImageShape,
    pub output: ImageShape,
    pub window: WindowGeometry,
}
