//! Initialization, the one device, contexts and streams: `cuInit`, `cuDriverGetVersion`,
//! `cuDevice*`, `cuDevicePrimaryCtx*`, `cuCtx*` and `cuStream*`.
//!
//! Contexts and streams are bookkeeping only (every call runs synchronously); the current
//! context is per thread, as in the real driver. `cuStreamSynchronize` and
//! `cuCtxSynchronize` matter for memory: they trim the pools to their release thresholds.

#![allow(unsafe_code)]
// The exports' safety contract is the CUDA driver API's: valid or null pointers.
#![allow(clippy::missing_safety_doc)]

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::{
    CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NO_DEVICE, CUDA_SUCCESS, CUdevice, CUresult, DEVICE_NAME,
    DEVICE_UUID, DRIVER_VERSION, DriverState, Handle, answer_call, cuda_call, handle_pointer,
    handle_value, initialized_call, lock_state,
};

thread_local! {
    /// The calling thread's current context handle; 0 for none.
    static CURRENT_CONTEXT: Cell<u64> = const { Cell::new(0) };
}

/// `CU_STREAM_DEFAULT` and `CU_STREAM_NON_BLOCKING`.
const STREAM_FLAGS: [c_uint; 2] = [0x0, 0x1];

fn check_device(device: CUdevice) -> Result<(), CUresult> {
    if device == 0 {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_DEVICE)
    }
}

fn initialize(state: &mut DriverState, flags: c_uint) -> CUresult {
    if flags != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if let Err(problem) = &state.capacity {
        eprintln!("carve-fake-driver: {problem}");
        return CUDA_ERROR_INVALID_VALUE;
    }
    if !state.initialized {
        if let Err(problem) = state.connect_ledger() {
            eprintln!("carve-fake-driver: {problem}");
            return CUDA_ERROR_NO_DEVICE;
        }
        let default_pool = state.new_handle();
        state.pools.create_default(default_pool);
        state.primary_context = state.new_handle();
        state.contexts.insert(state.primary_context);
        state.initialized = true;
    }
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    cuda_call(|| initialize(&mut lock_state(), flags))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version_out: *mut c_int) -> CUresult {
    cuda_call(|| {
        // SAFETY: CUDA's contract: the out-pointer is null or valid for writes.
        let Some(version_out) = (unsafe { version_out.as_mut() }) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        *version_out = DRIVER_VERSION;
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device_out: *mut CUdevice, ordinal: c_int) -> CUresult {
    answer_call(device_out, |_| check_device(ordinal).map(|()| 0))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count_out: *mut c_int) -> CUresult {
    answer_call(count_out, |_| Ok(1))
}

/// `cuDeviceGetName`: the name, cut to `length - 1` bytes, NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(
    name_out: *mut c_char,
    length: c_int,
    device: CUdevice,
) -> CUresult {
    initialized_call(|_| {
        if name_out.is_null() || length <= 0 {
            return CUDA_ERROR_INVALID_VALUE;
        }
        if let Err(code) = check_device(device) {
            return code;
        }
        let copied = DEVICE_NAME.len().min(length as usize - 1);
        // SAFETY: CUDA's contract: `name_out` is valid for `length` bytes; we write
        // `copied + 1 <= length` of them.
        unsafe {
            std::ptr::copy_nonoverlapping(DEVICE_NAME.as_ptr().cast::<c_char>(), name_out, copied);
            name_out.add(copied).write(0);
        }
        CUDA_SUCCESS
    })
}

fn write_uuid(uuid_out: *mut [u8; 16], device: CUdevice) -> CUresult {
    answer_call(uuid_out, |_| check_device(device).map(|()| DEVICE_UUID))
}

exports_alike!(
    cuDeviceGetUuid, cuDeviceGetUuid_v2 =>
    (uuid_out: *mut [u8; 16], device: CUdevice) {
        write_uuid(uuid_out, device)
    }
);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    context_out: *mut Handle,
    device: CUdevice,
) -> CUresult {
    answer_call(context_out, |state| {
        check_device(device)?;
        state.primary_context_retains += 1;
        Ok(handle_pointer(state.primary_context))
    })
}

fn release_primary_context(device: CUdevice) -> CUresult {
    initialized_call(|state| {
        if let Err(code) = check_device(device) {
            return code;
        }
        if state.primary_context_retains == 0 {
            return CUDA_ERROR_INVALID_CONTEXT;
        }
        state.primary_context_retains -= 1;
        CUDA_SUCCESS
    })
}

exports_alike!(
    cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2 =>
    (device: CUdevice) {
        release_primary_context(device)
    }
);

/// Every `cuCtxCreate` version: a new context, current on the calling thread. The extra
/// parameters of `_v3` (affinity) and `_v4` (create params) change nothing here.
fn create_context(context_out: *mut Handle, device: CUdevice) -> CUresult {
    answer_call(context_out, |state| {
        check_device(device)?;
        let handle = state.new_handle();
        state.contexts.insert(handle);
        CURRENT_CONTEXT.with(|current| current.set(handle));
        Ok(handle_pointer(handle))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    context_out: *mut Handle,
    _flags: c_uint,
    device: CUdevice,
) -> CUresult {
    create_context(context_out, device)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    context_out: *mut Handle,
    _affinity_params: *mut c_void,
    _affinity_param_count: c_int,
    _flags: c_uint,
    device: CUdevice,
) -> CUresult {
    create_context(context_out, device)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    context_out: *mut Handle,
    _create_params: *mut c_void,
    _flags: c_uint,
    device: CUdevice,
) -> CUresult {
    create_context(context_out, device)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(context: Handle) -> CUresult {
    initialized_call(|state| {
        let value = handle_value(context);
        if context.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        if value == state.primary_context || !state.contexts.remove(&value) {
            return CUDA_ERROR_INVALID_CONTEXT;
        }
        CURRENT_CONTEXT.with(|current| {
            if current.get() == value {
                current.set(0);
            }
        });
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetCurrent(context: Handle) -> CUresult {
    initialized_call(|state| {
        let value = handle_value(context);
        if value != 0 && !state.contexts.contains(&value) {
            return CUDA_ERROR_INVALID_CONTEXT;
        }
        CURRENT_CONTEXT.with(|current| current.set(value));
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(context_out: *mut Handle) -> CUresult {
    answer_call(context_out, |_| {
        Ok(handle_pointer(CURRENT_CONTEXT.with(Cell::get)))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(device_out: *mut CUdevice) -> CUresult {
    answer_call(device_out, |_| match CURRENT_CONTEXT.with(Cell::get) {
        0 => Err(CUDA_ERROR_INVALID_CONTEXT),
        _ => Ok(0),
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    initialized_call(|state| {
        state.pools.trim_all_to_thresholds();
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream_out: *mut Handle, flags: c_uint) -> CUresult {
    answer_call(stream_out, |state| {
        if !STREAM_FLAGS.contains(&flags) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = state.new_handle();
        state.streams.insert(handle);
        Ok(handle_pointer(handle))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: Handle) -> CUresult {
    initialized_call(|state| {
        if state.streams.remove(&handle_value(stream)) {
            CUDA_SUCCESS
        } else {
            CUDA_ERROR_INVALID_HANDLE
        }
    })
}

fn synchronize_stream(stream: Handle) -> CUresult {
    initialized_call(|state| {
        if !state.is_stream(stream) {
            return CUDA_ERROR_INVALID_HANDLE;
        }
        state.pools.trim_all_to_thresholds();
        CUDA_SUCCESS
    })
}

exports_alike!(
    cuStreamSynchronize, cuStreamSynchronize_ptsz =>
    (stream: Handle) {
        synchronize_stream(stream)
    }
);
