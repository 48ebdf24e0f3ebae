//! What the program sees: `cuMemGetInfo_v2`, `cuDeviceTotalMem_v2` and NVML's
//! `nvmlDeviceGetMemoryInfo(_v2)` report the slice, so frameworks that size themselves
//! from free memory size themselves to it. The driver is always asked first and its
//! errors returned unchanged; the guard only narrows numbers, never adds an error.
#![allow(unsafe_code)] // Exported C entry points writing the caller's out-pointers.
#![allow(non_snake_case)] // The exported names are cuda.h's and nvml.h's.

use crate::driver_types::{
    CUDA_SUCCESS, CuResult, Device, NVML_ERROR_UNKNOWN, NVML_SUCCESS, NvmlDevice, NvmlMemory,
    NvmlMemoryV2, NvmlReturn,
};
use crate::real::call_real;
use crate::state::{self, Guard};
use crate::{hook, hook_or, pools, real};

/// `NVML_ERROR_FUNCTION_NOT_FOUND`: NVML lacks the function the guard forwards to.
const NVML_ERROR_FUNCTION_NOT_FOUND: NvmlReturn = 13;

/// The slice as (total, used, free) given the driver's total and free, pools reconciled
/// first so memory they gave back shows as free.
fn slice_view(guard: Guard, real_total: u64, real_free: u64) -> (u64, u64, u64) {
    pools::reconcile_all(guard);
    let total = guard.config.account.limit_bytes().min(real_total);
    let used = guard.in_use_bytes();
    let free = total.saturating_sub(used).min(real_free);
    (total, used, free)
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    hook("cuMemGetInfo_v2", || {
        let result = call_real!(cuMemGetInfo_v2(free, total));
        if result != CUDA_SUCCESS || free.is_null() || total.is_null() {
            return result;
        }
        if let Ok(guard) = state::guard() {
            // SAFETY: both out-pointers are non-null and the driver just wrote them.
            unsafe {
                let (slice_total, _, slice_free) = slice_view(guard, *total as u64, *free as u64);
                *total = slice_total as usize;
                *free = slice_free as usize;
            }
        }
        result
    })
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: Device) -> CuResult {
    hook("cuDeviceTotalMem_v2", || {
        let result = call_real!(cuDeviceTotalMem_v2(bytes, device));
        if result == CUDA_SUCCESS
            && !bytes.is_null()
            && let Ok(guard) = state::guard()
        {
            // SAFETY: non-null out-pointer the driver just wrote.
            unsafe { *bytes = (*bytes as u64).min(guard.config.account.limit_bytes()) as usize };
        }
        result
    })
}

/// Asks NVML through `call` (None: NVML lacks the function), then narrows what it wrote
/// to `memory` with `narrow` when the guard is configured.
fn narrow_nvml<M>(
    entry_point: &str,
    memory: *mut M,
    call: impl FnOnce() -> Option<NvmlReturn>,
    narrow: impl FnOnce(&mut M, Guard),
) -> NvmlReturn {
    hook_or(entry_point, NVML_ERROR_UNKNOWN, || {
        let Some(result) = call() else {
            return NVML_ERROR_FUNCTION_NOT_FOUND;
        };
        if result == NVML_SUCCESS
            && let Ok(guard) = state::guard()
            // SAFETY: null or the caller's out-pointer, which NVML just wrote.
            && let Some(memory) = unsafe { memory.as_mut() }
        {
            narrow(memory, guard);
        }
        result
    })
}

/// NVML sees every GPU, not only the attempt's; each is reported as the slice (an
/// attempt only has one). Without a valid configuration NVML answers unchanged: it
/// takes no memory, and CUDA itself is refused.
///
/// # Safety
/// The caller's contract is NVML's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: NvmlDevice,
    memory: *mut NvmlMemory,
) -> NvmlReturn {
    let call = || {
        // SAFETY: the caller's arguments, unchanged, to NVML's function of this signature.
        real::nvmlDeviceGetMemoryInfo().map(|function| unsafe { function(device, memory) })
    };
    narrow_nvml("nvmlDeviceGetMemoryInfo", memory, call, |memory, guard| {
        (memory.total, memory.used, memory.free) = slice_view(guard, memory.total, memory.free);
    })
}

/// # Safety
/// The caller's contract is NVML's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: NvmlDevice,
    memory: *mut NvmlMemoryV2,
) -> NvmlReturn {
    let call = || {
        // SAFETY: the caller's arguments, unchanged, to NVML's function of this signature.
        real::nvmlDeviceGetMemoryInfo_v2().map(|function| unsafe { function(device, memory) })
    };
    narrow_nvml(
        "nvmlDeviceGetMemoryInfo_v2",
        memory,
        call,
        |memory, guard| {
            (memory.total, memory.used, memory.free) = slice_view(guard, memory.total, memory.free);
            memory.reserved = 0;
        },
    )
}
