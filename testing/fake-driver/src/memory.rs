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
    CUDA_SUCCESS, CUdevice, CUdeviceptr, CUresult, DriverState, answer_call, host_memory,
    initialized_call,
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
    answer_call(pointer_out, |state| {
        allocate_direct(state, bytes as u64, false)
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
    answer_call(pointer_out, |state| {
        if pitch_out.is_null()
            || width_bytes == 0
            || height == 0
            || ![4, 8, 16].contains(&element_size_bytes)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let pitch = (width_bytes as u64).div_ceil(PITCH_ALIGNMENT) * PITCH_ALIGNMENT;
        let bytes = pitch
            .checked_mul(height as u64)
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let address = allocate_direct(state, bytes, false)?;
        // SAFETY: checked non-null above; CUDA's contract: valid for writes.
        unsafe { pitch_out.write(pitch as usize) };
        Ok(address)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    pointer_out: *mut CUdeviceptr,
    bytes: usize,
    flags: c_uint,
) -> CUresult {
    answer_call(pointer_out, |state| {
        if !MANAGED_ATTACH_FLAGS.contains(&flags) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        allocate_direct(state, bytes as u64, false)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(pointer: CUdeviceptr) -> CUresult {
    initialized_call(|state| free_now(state, pointer))
}

/// Both `cuMemGetInfo` versions: (free, total) converted by `convert`.
fn memory_info<T>(free_out: *mut T, total_out: *mut T, convert: fn(u64) -> T) -> CUresult {
    answer_call(free_out, |state| {
        if total_out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: checked non-null above; CUDA's contract: valid for writes.
        unsafe { total_out.write(convert(state.capacity_bytes())) };
        Ok(convert(state.free_bytes()))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free_out: *mut usize, total_out: *mut usize) -> CUresult {
    memory_info(free_out, total_out, |bytes| bytes as usize)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes_out: *mut usize, device: CUdevice) -> CUresult {
    answer_call(bytes_out, |state| Ok(device_total(state, device)? as usize))
}

/// The legacy `cuMemAlloc` (CUDA before 3.2): a 32-bit device pointer and size.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc(pointer_out: *mut u32, bytes: c_uint) -> CUresult {
    // map_below_4_gib only answers addresses that fit in 32 bits.
    answer_call(pointer_out, |state| {
        Ok(allocate_direct(state, u64::from(bytes), true)? as u32)
    })
}

/// The legacy `cuMemFree`: a 32-bit device pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree(pointer: u32) -> CUresult {
    initialized_call(|state| free_now(state, u64::from(pointer)))
}

fn saturate_to_32_bits(bytes: u64) -> c_uint {
    c_uint::try_from(bytes).unwrap_or(c_uint::MAX)
}

/// The legacy `cuMemGetInfo`: 32-bit numbers, saturated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo(free_out: *mut c_uint, total_out: *mut c_uint) -> CUresult {
    memory_info(free_out, total_out, saturate_to_32_bits)
}

/// The legacy `cuDeviceTotalMem`: a 32-bit size, saturated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem(bytes_out: *mut c_uint, device: CUdevice) -> CUresult {
    answer_call(bytes_out, |state| {
        Ok(saturate_to_32_bits(device_total(state, device)?))
    })
}

/// Runs a copy or memset on `[device_pointer, device_pointer + length)` once it is known to
/// be device memory the driver holds (checked under the lock, which stays held while
/// `body` runs, so the memory cannot be freed meanwhile); `host` must be non-null.
fn on_device_range(
    device_pointer: CUdeviceptr,
    length: usize,
    host: *const c_void,
    body: impl FnOnce(*mut u8),
) -> CUresult {
    initialized_call(|state| {
        if length == 0 {
            return CUDA_SUCCESS;
        }
        if host.is_null() || !device_range_is_valid(state, device_pointer, length as u64) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        body(device_pointer as usize as *mut u8);
        CUDA_SUCCESS
    })
}

fn copy_host_to_device(destination: CUdeviceptr, source: *const c_void, length: usize) -> CUresult {
    on_device_range(destination, length, source, |device| {
        // SAFETY: the device range is host memory this driver mapped and holds
        // (on_device_range); the source is the caller's readable buffer of `length` bytes
        // (CUDA's contract). ptr::copy tolerates a caller passing overlapping ranges.
        unsafe { std::ptr::copy(source.cast::<u8>(), device, length) }
    })
}

fn copy_device_to_host(destination: *mut c_void, source: CUdeviceptr, length: usize) -> CUresult {
    on_device_range(source, length, destination, |device| {
        // SAFETY: as in copy_host_to_device, with the roles swapped.
        unsafe { std::ptr::copy(device, destination.cast::<u8>(), length) }
    })
}

fn set_device_bytes(destination: CUdeviceptr, value: u8, length: usize) -> CUresult {
    // Any non-null host pointer: a memset has no host side.
    on_device_range(destination, length, std::ptr::dangling(), |device| {
        // SAFETY: the range is host memory this driver mapped and holds (on_device_range).
        unsafe { std::ptr::write_bytes(device, value, length) }
    })
}

exports_alike!(
    cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds =>
    (destination: CUdeviceptr, source: *const c_void, length: usize) {
        copy_host_to_device(destination, source, length)
    }
);

exports_alike!(
    cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds =>
    (destination: *mut c_void, source: CUdeviceptr, length: usize) {
        copy_device_to_host(destination, source, length)
    }
);

exports_alike!(
    cuMemsetD8_v2, cuMemsetD8_v2_ptds =>
    (destination: CUdeviceptr, value: u8, length: usize) {
        set_device_bytes(destination, value, length)
    }
);
