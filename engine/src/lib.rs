//! carve-engine: training execution inside a memory-limited slice.
//!
//! The engine never decides allocation order itself: it executes the step plans that
//! `carve_core::plan` compiles, placing every buffer through
//! `carve_core::allocator::SliceAllocator`, so the memory it uses is exactly what the
//! estimator predicted. Pieces:
//! - `kernels`: the math of every layer, loss and optimizer, on f32 slices (NHWC images);
//! - `data`: data sets (synthetic, IDX, CIFAR-10, NPY) streamed in batches;
//! - `backend` / `executor`: device buffers and the plan interpreter; `cpu` and `cuda` are
//!   the backends, `dispatch` the one reading of an operation they share;
//! - `trainer` and `checkpoint`: the training loop, accumulation, loss scaling, resume.

pub mod backend;
pub mod checkpoint;
pub mod cpu;
pub mod cuda;
pub mod data;
mod dispatch;
pub mod error;
pub mod executor;
pub mod kernels;
pub mod rng;
pub mod trainer;

pub use error::EngineError;
