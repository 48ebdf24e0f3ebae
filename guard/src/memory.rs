//! Linear and virtual device memory: `cuMemAlloc_v2`, `cuMemAllocPitch_v2`,
//! `cuMemAllocManaged`, `cuMemFree_v2`, `cuMemCreate`/`cuMemRelease`, `cuInit` (the fail
//! closed gate), and the 32-bit-era entry points the guard refuses because it cannot
//! count them.
#![allow(unsafe_code)] // Exported C entry points reading the caller's out-pointers.
#![allow(non_snake_case)] // The exported names are cuda.h's.

use std::ffi::c_void;

use crate::driver_types::{
    CUDA_ERROR_NOT_SUPPORTED, CUDA_SUCCESS, CuResult, DevicePointer, GenericAllocationHandle,
    Handle, MEM_LOCATION_TYPE_DEVICE, MemAllocationPropHead,
};
use crate::real::call_real;
use crate::state::{self, Guard, Kind};
use crate::{hook, pools};

/// `cuInit`: the driver is only initialised when the guard can enforce the limit.
///
/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: u32) -> CuResult {
    hook("cuInit", || match state::guard() {
        Ok(_) => call_real!(cuInit(flags)),
        Err(refused) => refused,
    })
}

/// Charges `bytes`, asks the driver through `allocate`, and remembers what it handed
/// back in `*out` as `kind`; the charge is given back if the driver fails.
pub(crate) fn charge_around(
    entry_point: &str,
    kind: Kind,
    bytes: u64,
    out: *const u64,
    allocate: impl FnOnce() -> CuResult,
) -> CuResult {
    let guard = match state::guard() {
        Ok(guard) => guard,
        Err(refused) => return refused,
    };
    if let Err(refused) = guard.reserve(entry_point, bytes) {
        return refused;
    }
    let result = allocate();
    if result != CUDA_SUCCESS || out.is_null() {
        guard.release(bytes);
        return result;
    }
    // SAFETY: `out` is the caller's out-pointer, non-null, written by the driver on success.
    let key = unsafe { out.read() };
    guard.process.remember(kind, key, bytes);
    result
}

/// Forgets `key` before the driver frees it (so an address the driver hands out again
/// meanwhile is not confused with it), then credits it on success or restores it.
pub(crate) fn credit_around(kind: Kind, key: u64, free: impl FnOnce() -> CuResult) -> CuResult {
    match state::guard() {
        Ok(guard) => credit_with(guard, kind, key, free),
        Err(_) => free(),
    }
}

/// `credit_around` for a caller that already has the guard.
fn credit_with(guard: Guard, kind: Kind, key: u64, free: impl FnOnce() -> CuResult) -> CuResult {
    let charged = guard.process.forget(kind, key);
    let result = free();
    match (charged, result == CUDA_SUCCESS) {
        (Some(bytes), true) => guard.release(bytes),
        (Some(bytes), false) => guard.process.remember(kind, key, bytes),
        (None, _) => {}
    }
    result
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevicePointer, bytesize: usize) -> CuResult {
    hook("cuMemAlloc_v2", || {
        charge_around("cuMemAlloc_v2", Kind::Linear, bytesize as u64, dptr, || {
            call_real!(cuMemAlloc_v2(dptr, bytesize))
        })
    })
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut DevicePointer,
    bytesize: usize,
    flags: u32,
) -> CuResult {
    hook("cuMemAllocManaged", || {
        charge_around(
            "cuMemAllocManaged",
            Kind::Linear,
            bytesize as u64,
            dptr,
            || call_real!(cuMemAllocManaged(dptr, bytesize, flags)),
        )
    })
}

/// The pitch is the driver's choice, so `width * height` is charged first and the
/// padding (`pitch * height` minus that) once the driver has said it.
///
/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut DevicePointer,
    pitch: *mut usize,
    width_in_bytes: usize,
    height: usize,
    element_size_bytes: u32,
) -> CuResult {
    const NAME: &str = "cuMemAllocPitch_v2";
    hook(NAME, || {
        let asked = (width_in_bytes as u64).saturating_mul(height as u64);
        let mut padding = 0;
        let result = charge_around(NAME, Kind::Linear, asked, dptr, || {
            let result = call_real!(cuMemAllocPitch_v2(
                dptr,
                pitch,
                width_in_bytes,
                height,
                element_size_bytes
            ));
            if result != CUDA_SUCCESS || pitch.is_null() || dptr.is_null() {
                return result;
            }
            // SAFETY: both out-pointers are non-null and were written by the driver.
            let (pointer, pitch) = unsafe { (dptr.read(), pitch.read()) };
            let actual = (pitch as u64).saturating_mul(height as u64);
            padding = actual.saturating_sub(asked);
            let Ok(guard) = state::guard() else {
                return result;
            };
            if let Err(refused) = guard.reserve_for(NAME, padding, actual) {
                padding = 0;
                call_real!(cuMemFree_v2(pointer));
                return refused;
            }
            result
        });
        if result == CUDA_SUCCESS && padding > 0 {
            grow_charge(Kind::Linear, dptr, padding);
        }
        result
    })
}

/// Adds `extra` to what the table says `*out` charged.
fn grow_charge(kind: Kind, out: *const u64, extra: u64) {
    let Ok(guard) = state::guard() else {
        return;
    };
    // SAFETY: only called after a successful allocation wrote `*out`.
    let key = unsafe { out.read() };
    let bytes = guard.process.forget(kind, key).unwrap_or(0);
    guard.process.remember(kind, key, bytes + extra);
}

/// Frees linear memory, and stream-ordered memory freed the synchronous way (which
/// synchronises, so every pool is reconciled afterwards). An unknown pointer goes to the
/// driver as it is.
///
/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: DevicePointer) -> CuResult {
    hook("cuMemFree_v2", || {
        let Ok(guard) = state::guard() else {
            return call_real!(cuMemFree_v2(dptr));
        };
        let pooled = guard.process.forget_pooled(dptr);
        let result = credit_with(guard, Kind::Linear, dptr, || call_real!(cuMemFree_v2(dptr)));
        if let Some(pooled) = pooled {
            pools::after_pooled_free(guard, dptr, pooled, result);
            if result == CUDA_SUCCESS {
                pools::reconcile_every_pool(guard);
            }
        }
        result
    })
}

/// Virtual memory (PyTorch's expandable segments): physical memory is taken here, so a
/// device-located handle is charged; host-located ones are not device memory.
///
/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut GenericAllocationHandle,
    size: usize,
    prop: *const c_void,
    flags: u64,
) -> CuResult {
    hook("cuMemCreate", || {
        // SAFETY: a non-null `prop` points at the caller's CUmemAllocationProp, whose
        // head MemAllocationPropHead is.
        let on_device = !prop.is_null()
            && unsafe { prop.cast::<MemAllocationPropHead>().read() }
                .location
                .location_type
                == MEM_LOCATION_TYPE_DEVICE;
        if !on_device {
            return call_real!(cuMemCreate(handle, size, prop, flags));
        }
        charge_around("cuMemCreate", Kind::Physical, size as u64, handle, || {
            call_real!(cuMemCreate(handle, size, prop, flags))
        })
    })
}

/// Credits a handle when it is released (the driver frees it once it is also unmapped).
///
/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: GenericAllocationHandle) -> CuResult {
    hook("cuMemRelease", || {
        credit_around(Kind::Physical, handle, || call_real!(cuMemRelease(handle)))
    })
}

/// The 32-bit-era entry points (CUDA before 3.2): refused, since they would be an
/// uncounted way to take memory and no current toolkit emits calls to them.
fn refuse_legacy(name: &str) -> CuResult {
    state::say(&format!(
        "{name} is a 32-bit-era CUDA entry point the guard does not count; refused with CUDA_ERROR_NOT_SUPPORTED"
    ));
    CUDA_ERROR_NOT_SUPPORTED
}

/// # Safety
/// None: the arguments are not read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc(_dptr: *mut u32, _bytesize: u32) -> CuResult {
    hook("cuMemAlloc", || refuse_legacy("cuMemAlloc"))
}

/// # Safety
/// None: the arguments are not read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch(
    _dptr: *mut u32,
    _pitch: *mut u32,
    _width_in_bytes: u32,
    _height: u32,
    _element_size_bytes: u32,
) -> CuResult {
    hook("cuMemAllocPitch", || refuse_legacy("cuMemAllocPitch"))
}

/// # Safety
/// None: the argument is not read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree(_dptr: u32) -> CuResult {
    hook("cuMemFree", || refuse_legacy("cuMemFree"))
}

/// # Safety
/// None: the arguments are not read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate(
    _handle: *mut Handle,
    _descriptor: *const c_void,
) -> CuResult {
    hook("cuArrayCreate", || refuse_legacy("cuArrayCreate"))
}

/// # Safety
/// None: the arguments are not read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate(
    _handle: *mut Handle,
    _descriptor: *const c_void,
) -> CuResult {
    hook("cuArray3DCreate", || refuse_legacy("cuArray3DCreate"))
}
