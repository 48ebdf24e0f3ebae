//! Stream-ordered memory pools: `cuMemAllocAsync`, `cuMemAllocFromPoolAsync`,
//! `cuMemFreeAsync` (and their `_ptsz` variants), `cuMemPool*` and the device's default and
//! current pool.
//!
//! As in the real driver, a pool RESERVES memory from the device and hands USED parts of it
//! out. The capacity counts what pools reserve, not what they hand out: `cuMemFreeAsync`
//! makes memory unused but it stays reserved until a synchronization
//! (`cuStreamSynchronize`, `cuCtxSynchronize`, a `cuMemFree_v2` of a pool pointer) trims
//! every pool to its release threshold (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`, default 0),
//! or `cuMemPoolTrimTo` trims one. The fake's pool grows by exactly what it lacks: an
//! allocation that fits in the unused reserve takes no new memory, one that does not
//! reserves the difference.

#![allow(unsafe_code)]
// The exports' safety contract is the CUDA driver API's: valid or null pointers.
#![allow(clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::ffi::{c_int, c_void};

use crate::{
    CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CUdevice, CUdeviceptr, CUresult, DriverState, Handle,
    answer_call, handle_pointer, handle_value, initialized_call, memory,
};

// CUmemPool_attribute values.
const ATTRIBUTE_REUSE_FOLLOW_EVENT_DEPENDENCIES: c_int = 1;
const ATTRIBUTE_REUSE_ALLOW_INTERNAL_DEPENDENCIES: c_int = 3;
const ATTRIBUTE_RELEASE_THRESHOLD: c_int = 4;
const ATTRIBUTE_RESERVED_MEM_CURRENT: c_int = 5;
const ATTRIBUTE_RESERVED_MEM_HIGH: c_int = 6;
const ATTRIBUTE_USED_MEM_CURRENT: c_int = 7;
const ATTRIBUTE_USED_MEM_HIGH: c_int = 8;

#[derive(Debug, Default)]
struct Pool {
    reserved: u64,
    reserved_high: u64,
    used: u64,
    used_high: u64,
    release_threshold: u64,
    /// The three reuse policy flags (attributes 1..=3), kept only to answer them back.
    reuse_flags: [c_int; 3],
    /// `cuMemPoolDestroy` was called while pointers were outstanding: the pool goes away
    /// when the last one is freed.
    destroyed: bool,
}

impl Pool {
    fn trim_to(&mut self, bytes_to_keep: u64) {
        self.reserved = self.used.max(self.reserved.min(bytes_to_keep));
    }
}

/// Every pool, the default pool and the one `cuMemAllocAsync` takes from.
#[derive(Debug, Default)]
pub(crate) struct PoolTable {
    pools: HashMap<u64, Pool>,
    default_pool: u64,
    current_pool: u64,
}

impl PoolTable {
    /// Makes the device's default pool (at `cuInit`).
    pub fn create_default(&mut self, handle: u64) {
        self.pools.insert(handle, Pool::default());
        self.default_pool = handle;
        self.current_pool = handle;
    }

    /// The reserved bytes of all pools together.
    pub fn reserved_bytes(&self) -> u64 {
        self.pools.values().map(|pool| pool.reserved).sum()
    }

    /// Gives a freed pool pointer's bytes back to its pool (they stay reserved).
    pub fn return_used(&mut self, handle: u64, bytes: u64) {
        let Some(pool) = self.pools.get_mut(&handle) else {
            return;
        };
        pool.used -= bytes;
        if pool.destroyed {
            pool.trim_to(0);
            if pool.used == 0 {
                self.pools.remove(&handle);
            }
        }
    }

    /// What a synchronization does: every pool keeps at most its release threshold unused.
    pub fn trim_all_to_thresholds(&mut self) {
        for pool in self.pools.values_mut() {
            let threshold = pool.release_threshold;
            pool.trim_to(threshold);
        }
    }

    fn live(&mut self, handle: Handle) -> Option<(u64, &mut Pool)> {
        let value = handle_value(handle);
        self.pools
            .get_mut(&value)
            .filter(|pool| !pool.destroyed)
            .map(|pool| (value, pool))
    }
}

/// Takes `bytes` from a pool, reserving what its unused reserve lacks.
fn allocate_from_pool(
    state: &mut DriverState,
    pool_handle: Handle,
    bytes: u64,
    stream: Handle,
) -> Result<CUdeviceptr, CUresult> {
    if bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if !state.is_stream(stream) {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    let (pool_id, pool) = state
        .pools
        .live(pool_handle)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let unused = pool.reserved - pool.used;
    let growth = bytes.saturating_sub(unused);
    if growth > 0 && !state.fits(growth) {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let address = memory::map_device_memory(state, bytes, Some(pool_id), false)?;
    let (_, pool) = state
        .pools
        .live(pool_handle)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    pool.reserved += growth;
    pool.used += bytes;
    pool.reserved_high = pool.reserved_high.max(pool.reserved);
    pool.used_high = pool.used_high.max(pool.used);
    Ok(address)
}

fn allocate_async(
    pointer_out: *mut CUdeviceptr,
    bytes: usize,
    pool: Option<Handle>,
    stream: Handle,
) -> CUresult {
    answer_call(pointer_out, |state| {
        let pool = pool.unwrap_or_else(|| handle_pointer(state.pools.current_pool));
        allocate_from_pool(state, pool, bytes as u64, stream)
    })
}

/// `cuMemFreeAsync`: a pool pointer's memory goes back to its pool, still reserved; a
/// pointer from `cuMemAlloc*` is freed at once.
fn free_async(pointer: CUdeviceptr, stream: Handle) -> CUresult {
    initialized_call(|state| {
        if !state.is_stream(stream) {
            return CUDA_ERROR_INVALID_HANDLE;
        }
        let Some(allocation) = memory::take_allocation(state, pointer) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        if let Some(pool) = allocation.pool {
            state.pools.return_used(pool, allocation.bytes);
        }
        CUDA_SUCCESS
    })
}

exports_alike!(
    cuMemAllocAsync, cuMemAllocAsync_ptsz =>
    (pointer_out: *mut CUdeviceptr, bytes: usize, stream: Handle) {
        allocate_async(pointer_out, bytes, None, stream)
    }
);

exports_alike!(
    cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz =>
    (pointer_out: *mut CUdeviceptr, bytes: usize, pool: Handle, stream: Handle) {
        allocate_async(pointer_out, bytes, Some(pool), stream)
    }
);

exports_alike!(
    cuMemFreeAsync, cuMemFreeAsync_ptsz =>
    (pointer: CUdeviceptr, stream: Handle) {
        free_async(pointer, stream)
    }
);

/// `cuMemPoolCreate`: the properties must be there; the fake has one device and one kind of
/// memory, so their contents are not checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool_out: *mut Handle,
    properties: *const c_void,
) -> CUresult {
    answer_call(pool_out, |state| {
        if properties.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = state.new_handle();
        state.pools.pools.insert(handle, Pool::default());
        Ok(handle_pointer(handle))
    })
}

/// `cuMemPoolDestroy`: unused reserve goes back at once; with pointers outstanding the pool
/// lingers until they are freed, as the real driver documents. The default pool cannot be
/// destroyed; a destroyed current pool makes the default one current again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: Handle) -> CUresult {
    initialized_call(|state| {
        let table = &mut state.pools;
        let value = handle_value(pool);
        if value == table.default_pool {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let Some((_, entry)) = table.live(pool) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        entry.destroyed = true;
        entry.trim_to(0);
        if entry.used == 0 {
            table.pools.remove(&value);
        }
        if table.current_pool == value {
            table.current_pool = table.default_pool;
        }
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: Handle, bytes_to_keep: usize) -> CUresult {
    initialized_call(|state| match state.pools.live(pool) {
        Some((_, entry)) => {
            entry.trim_to(bytes_to_keep as u64);
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_VALUE,
    })
}

/// The get and set attribute calls: a live pool and a non-null value pointer.
fn on_pool_attribute(
    pool: Handle,
    value: *mut c_void,
    body: impl FnOnce(&mut Pool) -> CUresult,
) -> CUresult {
    initialized_call(|state| match state.pools.live(pool) {
        Some((_, entry)) if !value.is_null() => body(entry),
        _ => CUDA_ERROR_INVALID_VALUE,
    })
}

/// `cuMemPoolGetAttribute`: the reuse flags are `int`, the byte counts `cuuint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolGetAttribute(
    pool: Handle,
    attribute: c_int,
    value: *mut c_void,
) -> CUresult {
    on_pool_attribute(pool, value, |entry| {
        let bytes = match attribute {
            ATTRIBUTE_REUSE_FOLLOW_EVENT_DEPENDENCIES
                ..=ATTRIBUTE_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                let flag = entry.reuse_flags[(attribute - 1) as usize];
                // SAFETY: non-null (checked); CUDA's contract for these attributes is an int.
                unsafe { value.cast::<c_int>().write_unaligned(flag) };
                return CUDA_SUCCESS;
            }
            ATTRIBUTE_RELEASE_THRESHOLD => entry.release_threshold,
            ATTRIBUTE_RESERVED_MEM_CURRENT => entry.reserved,
            ATTRIBUTE_RESERVED_MEM_HIGH => entry.reserved_high,
            ATTRIBUTE_USED_MEM_CURRENT => entry.used,
            ATTRIBUTE_USED_MEM_HIGH => entry.used_high,
            _ => return CUDA_ERROR_INVALID_VALUE,
        };
        // SAFETY: non-null (checked); CUDA's contract for these attributes is a cuuint64_t.
        unsafe { value.cast::<u64>().write_unaligned(bytes) };
        CUDA_SUCCESS
    })
}

/// `cuMemPoolSetAttribute`: the reuse flags and the release threshold are set; the high
/// watermarks can only be reset (to the current value, with 0 as the argument).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    pool: Handle,
    attribute: c_int,
    value: *mut c_void,
) -> CUresult {
    on_pool_attribute(pool, value, |entry| {
        if (ATTRIBUTE_REUSE_FOLLOW_EVENT_DEPENDENCIES..=ATTRIBUTE_REUSE_ALLOW_INTERNAL_DEPENDENCIES)
            .contains(&attribute)
        {
            // SAFETY: non-null (checked); CUDA's contract for these attributes is an int.
            let flag = unsafe { value.cast::<c_int>().read_unaligned() };
            entry.reuse_flags[(attribute - 1) as usize] = flag;
            return CUDA_SUCCESS;
        }
        // SAFETY: non-null (checked); CUDA's contract for the others is a cuuint64_t.
        let bytes = unsafe { value.cast::<u64>().read_unaligned() };
        match attribute {
            ATTRIBUTE_RELEASE_THRESHOLD => entry.release_threshold = bytes,
            ATTRIBUTE_RESERVED_MEM_HIGH if bytes == 0 => entry.reserved_high = entry.reserved,
            ATTRIBUTE_USED_MEM_HIGH if bytes == 0 => entry.used_high = entry.used,
            _ => return CUDA_ERROR_INVALID_VALUE,
        }
        CUDA_SUCCESS
    })
}

fn answer_pool(pool_out: *mut Handle, device: CUdevice, pick: fn(&PoolTable) -> u64) -> CUresult {
    answer_call(pool_out, |state| {
        if device != 0 {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        Ok(handle_pointer(pick(&state.pools)))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(
    pool_out: *mut Handle,
    device: CUdevice,
) -> CUresult {
    answer_pool(pool_out, device, |table| table.default_pool)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool_out: *mut Handle, device: CUdevice) -> CUresult {
    answer_pool(pool_out, device, |table| table.current_pool)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceSetMemPool(device: CUdevice, pool: Handle) -> CUresult {
    initialized_call(|state| {
        if device != 0 {
            return CUDA_ERROR_INVALID_DEVICE;
        }
        match state.pools.live(pool) {
            Some((value, _)) => {
                state.pools.current_pool = value;
                CUDA_SUCCESS
            }
            None => CUDA_ERROR_INVALID_VALUE,
        }
    })
}
