//! carve-worker: GPU discovery (NVML, or simulated GPUs), slices, one child process per
//! attempt, heartbeats and reports to the scheduler.
//!
//! Empty until the worker issue lands.
