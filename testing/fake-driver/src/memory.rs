//! Device memory by pointer: `cuMemAlloc_v2`, `cuMemAllocPitch_v2`, `cuMemAllocManaged`,
//! `cuMemFree_v2`, the memory-info calls, copies and memset, and the legacy 32-bit
//! `cuMemAlloc`/`cuMemFree`/`cuMemGetInfo`/`cuDeviceTotalMem` the real 64-bit driver still
//! exports (so the guard can be tested refusing them).
//!
//! The pool allocations (`pools.rs`) live in the same pointer table, so `cuMemFree_v2` and
//! the copies work on them too.

#![allow(unsafe_code)]
// The exports' safety contract is the CUDA driver API's: valid or null pointers.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_uint, c_void};

use crate::{
    Allocation, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_SUCCESS, CUdevice, CUdeviceptr, CUresult, DriverState, host_memory, initialized_call,
};

/// The row alignment `cuMemAllocPitch_v2` pads to (the real driver's is device specific;
/// 512 is what current GPUs answer).
pub const PITCH_ALIGNMENT: u64 = 512;

/// `CU_MEM_ATTACH_GLOBAL` and `CU_MEM_ATTACH_HOST`, the flags `cuMemAllocManaged` accepts.
const MANAGED_ATTACH_FLAGS: [c_uint; 2] = [0x1, 0x2];

/// Maps host memory for a device pointer and records it; the caller has checked the
/// capacity and counts the bytes (in `direct_bytes` or its pool).
pub(crate) fn map_device_memory(
    state: &mut DriverState,
    bytes: u64,
    pool: Option<u64>,
    below_4_gib: bool,
) -> Result<CUdeviceptr, CUresult> {
    let mapping_length = usize::try_from(bytes).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    let address = if below_4_gib {
        host_memory::map_below_4_gib(mapping_length)
    } else {
        host_memory::map(mapping_length)
    }
    .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    state.allocations.insert(
        address,
        Allocation {
            bytes,
            mapping_length,
            pool,
        },
    );
    Ok(address)
}

/// A synchronous allocation of `bytes`, counted in `direct_bytes`.
pub(crate) fn allocate_direct(
    state: &mut DriverState,
    bytes: u64,
    below_4_gib: bool,
) -> Result<CUdeviceptr, CUresult> {
    if bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if !state.fits(bytes) {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let address = map_device_memory(state, bytes, None, below_4_gib)?;
    state.direct_bytes += bytes;
    Ok(address)
}

/// Forgets a device pointer and unmaps its memory; a direct allocation's bytes are given
/// back here, a pool allocation's are the caller's to return to its pool.
pub(crate) fn take_allocation(state: &mut DriverState, pointer: CUdeviceptr) -> Option<Allocation> {
    let allocation = state.allocations.remove(&pointer)?;
    host_memory::unmap(pointer, allocation.mapping_length);
    if allocation.pool.is_none() {
        state.direct_bytes -= allocation.bytes;
    }
    Some(allocation)
}

/// `cuMemFree_v2` and the legacy `cuMemFree`: a pool's pointer goes back to its pool, which
/// is then trimmed as if synchronized (the real driver synchronizes there too).
fn free_now(state: &mut DriverState, pointer: CUdeviceptr) -> CUresult {
    let Some(allocation) = take_allocation(state, pointer) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    if let Some(pool) = allocation.pool {
        state.pools.return_used(pool, allocation.bytes);
        state.pools.trim_all_to_thresholds();
    }
    CUDA_SUCCESS
}

/// Whether `[pointer, pointer + length)` is device memory the program may touch: inside one
/// allocation, or inside mapped virtual memory.
fn device_range_is_valid(state: &DriverState, pointer: CUdeviceptr, length: u64) -> bool {
    let Some(end) = pointer.checked_add(length) else {
        return false;
    };
    let inside_allocation = state
        .allocations
        .range(..=pointer)
        .next_back()
        .is_some_and(|(start, allocation)| end <= start + allocation.bytes);
    inside_allocation || state.virtual_memory.range_is_mapped(pointer, length)
}

fn device_total(state: &DriverState, device: CUdevice) -> Result<u64, CUresult> {
    if device != 0 {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    Ok(state.capacity_bytes())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(pointer_out: *mut CUdeviceptr, bytes: usize) -> CUresult {
    initialized_call(|state| {
        // SAFETY: CUDA's contract: the out-pointer is null or valid for writes.
        let Some(pointer_out) = (unsafe { pointer_out.as_mut() }) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        match allocate_direct(state, bytes as u64, false) {
            Ok(address) => {
                *pointer_out = address;
                CUDA_SUCCESS
            }
            Err(code) => code,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    pointer_out: *mut CUdeviceptr,
    pitch_out: *mut usize,
    width_bytes: usize,
    height: usize,
    element_size_bytes: c_uint,
) -> CUresult {
    initialized_call(|state| {
        // SAFETY: CUDA's contract: out-pointers are null or valid for writes.
        let (Some(pointer_out), Some(pitch_out)) = (unsafe { pointer_out.as_mut() }, unsafe {
            pitch_out.as_mut()
        }) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        if width_bytes == 0 || height == 0 || ![4, 8, 16].contains(&element_size_bytes) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let pitch = (width_bytes as u64).div_ceil(PITCH_ALIGNMENT) * PITCH_ALIGNMENT;
        let Some(bytes) = pitch.checked_mul(height as u64) else {
            return CUDA_ERROR_OUT_OF_MEMORY;
        };
        match allocate_direct(state, bytes, false) {
            Ok(address) => {
                *pointer_out = address;
                *pitch_out = pitch as usize;
                CUDA_SUCCESS
            }
            Err(code) => code,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    pointer_out: *mut CUdeviceptr,
    bytes: usize,
    flags: c_uint,
) -> CUresult {
    initialized_call(|state| {
        // SAFETY: CUDA's contract: the out-pointer is null or valid for writes.
        let Some(pointer_out) = (unsafe { pointer_out.as_mut() }) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        if !MANAGED_ATTACH_FLAGS.contains(&flags) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        match allocate_direct(state, bytes as u64, false) {
            Ok(address) => {
                *pointer_out = address;
                CUDA_SUCCESS
            }
            Err(code) => code,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(pointer: CUdeviceptr) -> CUresult {
    initialized_call(|state| free_now(state, pointer))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free_out: *mut usize, total_out: *mut usize) -> CUresult {
    initialized_call(|state| {
        // SAFETY: CUDA's contract: out-pointers are null or valid for writes.
        let (Some(free_out), Some(total_out)) =
            (unsafe { free_out.as_mut() }, unsafe { total_out.as_mut() })
        else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        *free_out = state.free_bytes() as usize;
        *total_out = state.capacity_bytes() as usize;
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes_out: *mut usize, device: CUdevice) -> CUresult {
    initialized_call(|state| {
        // SAFETY: CUDA's contract: the out-pointer is null or valid for writes.
        let Some(bytes_out) = (unsafe { bytes_out.as_mut() }) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        match device_total(state, device) {
            Ok(total) => {
                *bytes_out = total as usize;
                CUDA_SUCCESS
            }
            Err(code) => code,
        }
    })
}

/// The legacy `cuMemAlloc` (CUDA before 3.2): a 32-bit device pointer and size.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc(pointer_out: *mut u32, bytes: c_uint) -> CUresult {
    initialized_call(|state| {
        // SAFETY: CUDA's contract: the out-pointer is null or valid for writes.
        let Some(pointer_out) = (unsafe { pointer_out.as_mut() }) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        match allocate_direct(state, u64::from(bytes), true) {
            Ok(address) => {
                // map_below_4_gib only answers addresses that fit.
                *pointer_out = address as u32;
                CUDA_SUCCESS
            }
            Err(code) => code,
        }
    })
}

/// The legacy `cuMemFree`: a 32-bit device pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree(pointer: u32) -> CUresult {
    initialized_call(|state| free_now(state, u64::from(pointer)))
}

/// The legacy `cuMemGetInfo`: 32-bit numbers, saturated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo(free_out: *mut c_uint, total_out: *mut c_uint) -> CUresult {
    initialized_call(|state| {
        // SAFETY: CUDA's contract: out-pointers are null or valid for writes.
        let (Some(free_out), Some(total_out)) =
            (unsafe { free_out.as_mut() }, unsafe { total_out.as_mut() })
        else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        *free_out = u32::try_from(state.free_bytes()).unwrap_or(u32::MAX);
        *total_out = u32::try_from(state.capacity_bytes()).unwrap_or(u32::MAX);
        CUDA_SUCCESS
    })
}

/// The legacy `cuDeviceTotalMem`: a 32-bit size, saturated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem(bytes_out: *mut c_uint, device: CUdevice) -> CUresult {
    initialized_call(|state| {
        // SAFETY: CUDA's contract: the out-pointer is null or valid for writes.
        let Some(bytes_out) = (unsafe { bytes_out.as_mut() }) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        match device_total(state, device) {
            Ok(total) => {
                *bytes_out = u32::try_from(total).unwrap_or(u32::MAX);
                CUDA_SUCCESS
            }
            Err(code) => code,
        }
    })
}

fn copy_host_to_device(destination: CUdeviceptr, source: *const c_void, length: usize) -> CUresult {
    initialized_call(|state| {
        if length == 0 {
            return CUDA_SUCCESS;
        }
        if source.is_null() || !device_range_is_valid(state, destination, length as u64) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        // SAFETY: the destination range is host memory this driver mapped and still holds
        // (checked above, under the lock); the source is the caller's readable buffer of
        // `length` bytes (CUDA's contract); the two cannot overlap unless the caller passes
        // device memory as host memory, which ptr::copy tolerates.
        unsafe { std::ptr::copy(source.cast::<u8>(), destination as usize as *mut u8, length) };
        CUDA_SUCCESS
    })
}

fn copy_device_to_host(destination: *mut c_void, source: CUdeviceptr, length: usize) -> CUresult {
    initialized_call(|state| {
        if length == 0 {
            return CUDA_SUCCESS;
        }
        if destination.is_null() || !device_range_is_valid(state, source, length as u64) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        // SAFETY: as in copy_host_to_device, with the roles swapped.
        unsafe {
            std::ptr::copy(
                source as usize as *const u8,
                destination.cast::<u8>(),
                length,
            )
        };
        CUDA_SUCCESS
    })
}

fn set_device_bytes(destination: CUdeviceptr, value: u8, length: usize) -> CUresult {
    initialized_call(|state| {
        if length == 0 {
            return CUDA_SUCCESS;
        }
        if !device_range_is_valid(state, destination, length as u64) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        // SAFETY: the range is host memory this driver mapped and still holds (checked above,
        // under the lock).
        unsafe { std::ptr::write_bytes(destination as usize as *mut u8, value, length) };
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    destination: CUdeviceptr,
    source: *const c_void,
    length: usize,
) -> CUresult {
    copy_host_to_device(destination, source, length)
}

/// The per-thread-default-stream variant; copies are synchronous here, so the same.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2_ptds(
    destination: CUdeviceptr,
    source: *const c_void,
    length: usize,
) -> CUresult {
    copy_host_to_device(destination, source, length)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    destination: *mut c_void,
    source: CUdeviceptr,
    length: usize,
) -> CUresult {
    copy_device_to_host(destination, source, length)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2_ptds(
    destination: *mut c_void,
    source: CUdeviceptr,
    length: usize,
) -> CUresult {
    copy_device_to_host(destination, source, length)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8_v2(
    destination: CUdeviceptr,
    value: u8,
    length: usize,
) -> CUresult {
    set_device_bytes(destination, value, length)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8_v2_ptds(
    destination: CUdeviceptr,
    value: u8,
    length: usize,
) -> CUresult {
    set_device_bytes(destination, value, length)
}
