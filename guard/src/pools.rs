//! Stream-ordered allocation and memory pools (`cuMemAllocAsync`,
//! `cuMemAllocFromPoolAsync`, `cuMemFreeAsync`, with their `_ptsz` variants): the async
//! allocators of TensorFlow and PyTorch (`backend:cudaMallocAsync`).
//!
//! A pool holds device memory beyond what its allocations use: freed memory stays
//! RESERVED by the pool until a synchronisation or a trim gives it back. So a pool is
//! charged for its reserved bytes, read from the driver (`RESERVED_MEM_CURRENT`), not for
//! its allocations: an allocation the pool can serve from its free reserve costs nothing
//! more, and after a free the reserve is re-read ("reconciled") at the points where the
//! driver gives memory back (stream/context synchronisation, trim, destroy), so what a
//! pool returns is credited.
#![allow(unsafe_code)] // Exported C entry points reading the caller's out-pointers.
#![allow(non_snake_case)] // The exported names are cuda.h's.

use std::ffi::c_void;

use carve_guard_account::OverLimit;

use crate::driver_types::{
    CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CuResult, DevicePointer, Handle,
    MEMPOOL_ATTR_RESERVED_MEM_CURRENT, MEMPOOL_ATTR_USED_MEM_CURRENT,
};
use crate::hook;
use crate::real::call_real;
use crate::state::{self, Guard, Pooled, lock};

/// Pools grow in 2 MiB steps on current GPUs: the charge asked ahead of an allocation
/// is rounded up to it, and corrected to the pool's real growth afterwards.
const POOL_GROWTH_STEP: u64 = 2 << 20;

/// What the account holds for one pool.
#[derive(Debug, Default)]
pub(crate) struct PoolCharge {
    charged: u64,
    /// Destroyed with allocations outstanding: the driver keeps the pool until they are
    /// freed but no longer answers for it, so it is charged their bytes, each credited
    /// at its free.
    destroyed: bool,
}

/// One `cuuint64_t` attribute of a pool.
fn read_attribute(pool: Handle, attribute: u32) -> Result<u64, CuResult> {
    let mut value: u64 = 0;
    let out = (&raw mut value).cast::<c_void>();
    match call_real!(cuMemPoolGetAttribute(pool, attribute, out)) {
        CUDA_SUCCESS => Ok(value),
        driver_error => Err(driver_error),
    }
}

/// A pool's reserved and used bytes, as the driver says.
fn read_pool(pool: Handle) -> Result<(u64, u64), CuResult> {
    let reserved = read_attribute(pool, MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
    let used = read_attribute(pool, MEMPOOL_ATTR_USED_MEM_CURRENT)?;
    Ok((reserved, used))
}

/// Moves the account so that it holds `target` for the pool (it holds `charge.charged`
/// now). Growth the account refuses stays uncharged until the next reconcile.
fn settle(guard: Guard, charge: &mut PoolCharge, target: u64) {
    if target < charge.charged {
        guard.release(charge.charged - target);
        charge.charged = target;
    } else if target > charge.charged && guard.try_reserve(target - charge.charged).is_ok() {
        charge.charged = target;
    }
}

/// Re-reads `pool`'s reserved bytes and charges exactly those.
pub(crate) fn reconcile(guard: Guard, pool: usize) {
    let Some(charge) = guard.process.existing_pool(pool) else {
        return;
    };
    let mut charge = lock(&charge);
    if !charge.destroyed
        && let Ok((reserved, _)) = read_pool(pool as Handle)
    {
        settle(guard, &mut charge, reserved);
    }
}

/// Reconciles every pool this process has used that no other thread is working on
/// right now (that thread settles it itself).
pub(crate) fn reconcile_all(guard: Guard) {
    for (pool, charge) in guard.process.known_pools() {
        if let Ok(mut charge) = charge.try_lock()
            && !charge.destroyed
            && let Ok((reserved, _)) = read_pool(pool as Handle)
        {
            settle(guard, &mut charge, reserved);
        }
    }
}

/// Allocates `bytesize` from `pool` through `allocate`, charging only what the pool's
/// free reserve cannot serve, then settling on the pool's real reserved bytes. The pool
/// stays locked throughout so the before/after readings belong to this allocation.
fn allocate_in_pool(
    entry_point: &str,
    dptr: *mut DevicePointer,
    bytesize: usize,
    pool: Handle,
    stream: Handle,
    allocate: impl FnOnce() -> CuResult,
) -> CuResult {
    let guard = match state::guard() {
        Ok(guard) => guard,
        Err(refused) => return refused,
    };
    let charge = guard.process.pool(pool as usize);
    let mut charge = lock(&charge);
    let (reserved_before, used_before) = match read_pool(pool) {
        Ok(reading) => reading,
        Err(driver_error) => return driver_error,
    };
    let spare = reserved_before.saturating_sub(used_before);
    let ahead = (bytesize as u64)
        .saturating_sub(spare)
        .div_ceil(POOL_GROWTH_STEP)
        .saturating_mul(POOL_GROWTH_STEP);
    if let Err(refused) = guard.reserve_for(entry_point, ahead, bytesize as u64) {
        return refused;
    }
    charge.charged += ahead;
    let result = allocate();
    let reserved_after = read_pool(pool).map_or(charge.charged, |(reserved, _)| reserved);
    let charged_before = charge.charged;
    settle(guard, &mut charge, reserved_after);
    if result != CUDA_SUCCESS || dptr.is_null() {
        return result;
    }
    // SAFETY: non-null out-pointer the driver wrote on success.
    let pointer = unsafe { dptr.read() };
    if charge.charged < reserved_after {
        let grown = Growth {
            entry_point,
            pointer,
            pool,
            stream,
            reserved_before,
        };
        return undo_refused_growth(
            guard,
            &mut charge,
            grown,
            bytesize as u64,
            reserved_after - charged_before,
        );
    }
    let pooled = Pooled {
        pool: pool as usize,
        bytes: bytesize as u64,
    };
    guard.process.remember_pooled(pointer, pooled);
    result
}

/// An allocation whose pool grew past what the account would take.
struct Growth<'a> {
    entry_point: &'a str,
    pointer: DevicePointer,
    pool: Handle,
    stream: Handle,
    reserved_before: u64,
}

/// The pool grew more than was charged ahead and the account refused the rest: the
/// allocation is freed, its stream waited on and the pool trimmed back, then refused
/// like any allocation past the limit. (What a trim cannot give back stays uncharged
/// until the next reconcile.)
fn undo_refused_growth(
    guard: Guard,
    charge: &mut PoolCharge,
    grown: Growth,
    requested_bytes: u64,
    refused_bytes: u64,
) -> CuResult {
    let Growth {
        entry_point,
        pointer,
        pool,
        stream,
        reserved_before,
    } = grown;
    // Stream 0 means a different stream to the `_ptsz` variants: free and wait on the one
    // the program meant.
    if entry_point.ends_with("_ptsz") {
        call_real!(cuMemFreeAsync_ptsz(pointer, stream));
        call_real!(cuStreamSynchronize_ptsz(stream));
    } else {
        call_real!(cuMemFreeAsync(pointer, stream));
        call_real!(cuStreamSynchronize(stream));
    }
    call_real!(cuMemPoolTrimTo(pool, reserved_before as usize));
    if let Ok((reserved, _)) = read_pool(pool) {
        settle(guard, charge, reserved);
    }
    let usage = guard.config.account.usage();
    let over = OverLimit {
        requested_bytes: refused_bytes,
        in_use_bytes: usage.in_use_bytes,
        limit_bytes: usage.limit_bytes,
        peak_bytes: usage.peak_bytes,
    };
    guard.record_out_of_memory(entry_point, requested_bytes, over);
    CUDA_ERROR_OUT_OF_MEMORY
}

/// After a stream-ordered pointer was freed (or not): credit what its pool gave back,
/// or restore the pointer.
pub(crate) fn after_pooled_free(guard: Guard, pointer: u64, pooled: Pooled, result: CuResult) {
    if result != CUDA_SUCCESS {
        guard.process.remember_pooled(pointer, pooled);
        return;
    }
    let Some(charge) = guard.process.existing_pool(pooled.pool) else {
        return;
    };
    let mut charge = lock(&charge);
    if !charge.destroyed {
        if let Ok((reserved, _)) = read_pool(pooled.pool as Handle) {
            settle(guard, &mut charge, reserved);
        }
        return;
    }
    let outstanding = guard.process.outstanding_in(pooled.pool);
    settle(guard, &mut charge, outstanding);
    if outstanding == 0 {
        guard.process.drop_pool(pooled.pool);
    }
}

/// The pool `cuMemAllocAsync` takes from: the current pool of the current context's
/// device (the attempt sees one GPU). A driver error here is the one the allocation
/// itself would give (no context).
fn current_pool() -> Result<Handle, CuResult> {
    let mut device = 0;
    let result = call_real!(cuCtxGetDevice(&raw mut device));
    if result != CUDA_SUCCESS {
        return Err(result);
    }
    let mut pool: Handle = std::ptr::null_mut();
    let result = call_real!(cuDeviceGetMemPool(&raw mut pool, device));
    if result != CUDA_SUCCESS {
        return Err(result);
    }
    Ok(pool)
}

macro_rules! alloc_async_hook {
    ($name:ident) => {
        /// # Safety
        /// The caller's contract is the driver's.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut DevicePointer,
            bytesize: usize,
            stream: Handle,
        ) -> CuResult {
            hook(stringify!($name), || match current_pool() {
                Ok(pool) => {
                    allocate_in_pool(stringify!($name), dptr, bytesize, pool, stream, || {
                        call_real!($name(dptr, bytesize, stream))
                    })
                }
                Err(driver_error) => driver_error,
            })
        }
    };
}
alloc_async_hook!(cuMemAllocAsync);
alloc_async_hook!(cuMemAllocAsync_ptsz);

macro_rules! alloc_from_pool_hook {
    ($name:ident) => {
        /// # Safety
        /// The caller's contract is the driver's.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut DevicePointer,
            bytesize: usize,
            pool: Handle,
            stream: Handle,
        ) -> CuResult {
            hook(stringify!($name), || {
                allocate_in_pool(stringify!($name), dptr, bytesize, pool, stream, || {
                    call_real!($name(dptr, bytesize, pool, stream))
                })
            })
        }
    };
}
alloc_from_pool_hook!(cuMemAllocFromPoolAsync);
alloc_from_pool_hook!(cuMemAllocFromPoolAsync_ptsz);

macro_rules! free_async_hook {
    ($name:ident) => {
        /// The memory goes back to its pool, which keeps it reserved until a sync: the
        /// pool is reconciled now and again at the next sync or trim.
        ///
        /// # Safety
        /// The caller's contract is the driver's.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(dptr: DevicePointer, stream: Handle) -> CuResult {
            hook(stringify!($name), || {
                let guard = state::guard().ok();
                let pooled = guard.and_then(|guard| guard.process.forget_pooled(dptr));
                let result = call_real!($name(dptr, stream));
                if let (Some(guard), Some(pooled)) = (guard, pooled) {
                    after_pooled_free(guard, dptr, pooled, result);
                }
                result
            })
        }
    };
}
free_async_hook!(cuMemFreeAsync);
free_async_hook!(cuMemFreeAsync_ptsz);

/// Reconciles every pool this process has used, waiting for each.
pub(crate) fn reconcile_every_pool(guard: Guard) {
    for (pool, _) in guard.process.known_pools() {
        reconcile(guard, pool);
    }
}

/// Runs a synchronising call, then credits what the pools gave back.
fn synchronise_then_reconcile(result: CuResult) -> CuResult {
    if let Ok(guard) = state::guard() {
        reconcile_every_pool(guard);
    }
    result
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(stream: Handle) -> CuResult {
    hook("cuStreamSynchronize", || {
        synchronise_then_reconcile(call_real!(cuStreamSynchronize(stream)))
    })
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize_ptsz(stream: Handle) -> CuResult {
    hook("cuStreamSynchronize_ptsz", || {
        synchronise_then_reconcile(call_real!(cuStreamSynchronize_ptsz(stream)))
    })
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> CuResult {
    hook("cuCtxSynchronize", || {
        synchronise_then_reconcile(call_real!(cuCtxSynchronize()))
    })
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: Handle, min_bytes_to_keep: usize) -> CuResult {
    hook("cuMemPoolTrimTo", || {
        let result = call_real!(cuMemPoolTrimTo(pool, min_bytes_to_keep));
        if let Ok(guard) = state::guard() {
            reconcile(guard, pool as usize);
        }
        result
    })
}

/// A destroyed pool gives its free reserve back at once and the rest as its outstanding
/// allocations are freed.
///
/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: Handle) -> CuResult {
    hook("cuMemPoolDestroy", || {
        let result = call_real!(cuMemPoolDestroy(pool));
        if result == CUDA_SUCCESS
            && let Ok(guard) = state::guard()
            && let Some(charge) = guard.process.existing_pool(pool as usize)
        {
            let mut charge = lock(&charge);
            let outstanding = guard.process.outstanding_in(pool as usize);
            settle(guard, &mut charge, outstanding);
            charge.destroyed = true;
            if outstanding == 0 {
                guard.process.drop_pool(pool as usize);
            }
        }
        result
    })
}
