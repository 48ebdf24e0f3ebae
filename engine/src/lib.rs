//! carve-engine: training execution inside a slice.
//!
//! This crate will execute `carve_core::plan::StepPlan`s on a backend (`cpu` with real
//! math over host buffers, `cuda` with cuDNN/cuBLAS through cudarc), with every buffer
//! placed by `carve_core::allocator::SliceAllocator`. It is empty until the engine issue
//! lands; the dependency on carve-core is what it will build on.
