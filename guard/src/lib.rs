//! libcarve_guard.so: the CUDA driver interposer the worker preloads (`LD_PRELOAD`) into
//! an attempt's processes to enforce its memory slice around any program (PyTorch,
//! TensorFlow, JAX, plain CUDA).
//!
//! Every driver call that takes device memory is checked against the attempt's shared
//! account BEFORE the driver is asked (so concurrent threads and processes never exceed
//! the limit together); over the limit it answers `CUDA_ERROR_OUT_OF_MEMORY` (a real code,
//! so frameworks raise their normal OOM) and appends a line to the attempt's OOM record.
//! Memory-info calls (`cuMemGetInfo_v2`, `cuDeviceTotalMem_v2`, NVML) report the slice.
//! Without a valid configuration the guard fails closed (see `state`).
//!
//! Map: `symbols` (how programs reach the hooks: table, `cuGetProcAddress`, `dlsym`),
//! `real` (finding the driver's own functions), `state` (configuration, account, tables),
//! `memory` (linear and virtual memory), `pools` (stream-ordered allocation and pools),
//! `arrays` (CUDA arrays), `info` (what the program sees), `driver_types` (the ABI).
//!
//! The crate is a `cdylib`; its rlib form exists only so dependents' tests get the `.so`
//! built. Never link it into anything: it exports `dlsym`.

mod arrays;
mod driver_types;
mod info;
mod memory;
mod pools;
mod real;
mod state;
mod symbols;

pub use symbols::HookEntryView;

use std::panic::{AssertUnwindSafe, catch_unwind};

use driver_types::{CUDA_ERROR_UNKNOWN, CuResult};

/// Runs a hook's body so that nothing unwinds into C: a panic (a bug in the guard)
/// becomes `CUDA_ERROR_UNKNOWN` and a line on stderr.
pub(crate) fn hook(entry_point: &str, body: impl FnOnce() -> CuResult) -> CuResult {
    hook_or(entry_point, CUDA_ERROR_UNKNOWN, body)
}

/// As `hook`, with the answer to give on a panic (NVML's codes differ from CUDA's).
pub(crate) fn hook_or<T>(entry_point: &str, on_panic: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        state::say(&format!("internal error in {entry_point}"));
        on_panic
    })
}
