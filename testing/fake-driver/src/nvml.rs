//! The fake NVML (`libnvidia-ml.so.1` is a link to the same file): init and shutdown, the
//! one device, and its memory info from the driver's state (used = everything the driver
//! holds), which is what the guard rewrites into the slice.
//!
//! With the worker's ledger (`device_ledger.rs`) the memory info is the device's as the
//! ledger keeps it: what every process holds, not only this one.
//!
//! NVML keeps its own init count, apart from `cuInit`: calls before `nvmlInit` are
//! `NVML_ERROR_UNINITIALIZED`.

#![allow(unsafe_code)]
// The exports' safety contract is NVML's: valid or null pointers.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{CStr, c_char, c_uint, c_void};

use crate::{DriverState, ffi_boundary, handle_pointer, handle_value, lock_state};

/// `nvmlReturn_t`.
pub type NvmlReturn = c_uint;
pub const NVML_SUCCESS: NvmlReturn = 0;
pub const NVML_ERROR_UNINITIALIZED: NvmlReturn = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: NvmlReturn = 25;
pub const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

/// The value the one device's `nvmlDevice_t` carries.
const DEVICE_HANDLE: u64 = 0xca4e_0000;

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmlMemory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmlMemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2`: the struct's size with version 2 in the top byte, as NVML's header
/// builds it.
pub const NVML_MEMORY_V2_VERSION: c_uint = size_of::<NvmlMemoryV2>() as c_uint | (2 << 24);

/// Runs an NVML export's body; a panic becomes `NVML_ERROR_UNKNOWN`.
fn nvml_call(body: impl FnOnce() -> NvmlReturn) -> NvmlReturn {
    ffi_boundary(NVML_ERROR_UNKNOWN, body)
}

/// Runs an NVML export's body with the state locked, after `nvmlInit`, for the one device.
fn device_call(
    device: *mut c_void,
    body: impl FnOnce(&mut DriverState) -> NvmlReturn,
) -> NvmlReturn {
    nvml_call(|| {
        let mut state = lock_state();
        if state.nvml_init_count == 0 {
            return NVML_ERROR_UNINITIALIZED;
        }
        if handle_value(device) != DEVICE_HANDLE {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        body(&mut state)
    })
}

fn initialize() -> NvmlReturn {
    nvml_call(|| {
        let mut state = lock_state();
        if let Err(problem) = &state.capacity {
            eprintln!("carve-fake-driver: {problem}");
            return NVML_ERROR_UNKNOWN;
        }
        if let Err(problem) = state.connect_ledger() {
            eprintln!("carve-fake-driver: {problem}");
            return NVML_ERROR_UNKNOWN;
        }
        state.nvml_init_count += 1;
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit_v2() -> NvmlReturn {
    initialize()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit() -> NvmlReturn {
    initialize()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlShutdown() -> NvmlReturn {
    nvml_call(|| {
        let mut state = lock_state();
        if state.nvml_init_count == 0 {
            return NVML_ERROR_UNINITIALIZED;
        }
        state.nvml_init_count -= 1;
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count_out: *mut c_uint) -> NvmlReturn {
    nvml_call(|| {
        if lock_state().nvml_init_count == 0 {
            return NVML_ERROR_UNINITIALIZED;
        }
        // SAFETY: NVML's contract: the out-pointer is null or valid for writes.
        let Some(count_out) = (unsafe { count_out.as_mut() }) else {
            return NVML_ERROR_INVALID_ARGUMENT;
        };
        *count_out = 1;
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device_out: *mut *mut c_void,
) -> NvmlReturn {
    nvml_call(|| {
        if lock_state().nvml_init_count == 0 {
            return NVML_ERROR_UNINITIALIZED;
        }
        // SAFETY: NVML's contract: the out-pointer is null or valid for writes.
        let Some(device_out) = (unsafe { device_out.as_mut() }) else {
            return NVML_ERROR_INVALID_ARGUMENT;
        };
        if index != 0 {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        *device_out = handle_pointer(DEVICE_HANDLE);
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: *mut c_void,
    memory_out: *mut NvmlMemory,
) -> NvmlReturn {
    device_call(device, |state| {
        // SAFETY: NVML's contract: the out-pointer is null or valid for writes.
        let Some(memory_out) = (unsafe { memory_out.as_mut() }) else {
            return NVML_ERROR_INVALID_ARGUMENT;
        };
        let total = state.capacity_bytes();
        let free = state.free_bytes().min(total);
        *memory_out = NvmlMemory {
            total,
            free,
            used: total - free,
        };
        NVML_SUCCESS
    })
}

/// `nvmlDeviceGetMemoryInfo_v2`: the caller sets `version` to [`NVML_MEMORY_V2_VERSION`];
/// the fake reserves nothing for the system.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: *mut c_void,
    memory_out: *mut NvmlMemoryV2,
) -> NvmlReturn {
    device_call(device, |state| {
        // SAFETY: NVML's contract: the out-pointer is null or valid for reads and writes.
        let Some(memory_out) = (unsafe { memory_out.as_mut() }) else {
            return NVML_ERROR_INVALID_ARGUMENT;
        };
        if memory_out.version != NVML_MEMORY_V2_VERSION {
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        }
        let total = state.capacity_bytes();
        let free = state.free_bytes().min(total);
        *memory_out = NvmlMemoryV2 {
            version: NVML_MEMORY_V2_VERSION,
            total,
            reserved: 0,
            free,
            used: total - free,
        };
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlErrorString(result: NvmlReturn) -> *const c_char {
    let text: &CStr = match result {
        NVML_SUCCESS => c"Success",
        NVML_ERROR_UNINITIALIZED => c"Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH => c"Argument version mismatch",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}
