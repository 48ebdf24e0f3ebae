//! The fake CUDA driver and NVML (work in progress).
