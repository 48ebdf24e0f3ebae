//! `cuGetProcAddress` (4 arguments, CUDA 11.3+) and `cuGetProcAddress_v2` (5 arguments,
//! 12.0+): a base name, the CUDA version the caller was built for and the stream flags,
//! mapped to the export the real driver would give, as the CUDA runtime and PyTorch ask.
//!
//! [`ENTRY_POINTS`] lists, per base name, each versioned export with the CUDA version that
//! introduced it; the caller gets the newest one not newer than its version, and with
//! `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` the `_ptsz`/`_ptds` one where there is
//! one. A base name not in the table is `CUDA_ERROR_NOT_FOUND` with
//! `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`; one whose first version is newer than the
//! caller's, `CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT`. Both work before `cuInit`.

#![allow(unsafe_code)]
// The exports' safety contract is the CUDA driver API's: valid or null pointers.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{CStr, c_char, c_int, c_void};

use crate::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS, CUresult, arrays, context,
    cuda_call, errors, memory, pools, virtual_memory,
};

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
const PER_THREAD_DEFAULT_STREAM: u64 = 0x2;
/// `CUdriverProcAddressQueryResult` values.
const SYMBOL_FOUND: c_int = 0;
const SYMBOL_NOT_FOUND: c_int = 1;
const VERSION_NOT_SUFFICIENT: c_int = 2;

/// One versioned export of a base name.
#[derive(Debug, Clone, Copy)]
struct EntryPoint {
    base_name: &'static str,
    since_version: c_int,
    per_thread_stream: bool,
    export_name: &'static str,
}

const fn entry(
    base_name: &'static str,
    since_version: c_int,
    export_name: &'static str,
) -> EntryPoint {
    EntryPoint {
        base_name,
        since_version,
        per_thread_stream: false,
        export_name,
    }
}

const fn per_thread(
    base_name: &'static str,
    since_version: c_int,
    export_name: &'static str,
) -> EntryPoint {
    EntryPoint {
        base_name,
        since_version,
        per_thread_stream: true,
        export_name,
    }
}

/// The versions are those of the real driver's table (`cuda.h`'s `#define`s and
/// `cudaTypedefs.h`'s `PFN_*_v<version>` names).
const ENTRY_POINTS: &[EntryPoint] = &[
    entry("cuInit", 2000, "cuInit"),
    entry("cuDriverGetVersion", 2020, "cuDriverGetVersion"),
    entry("cuDeviceGet", 2000, "cuDeviceGet"),
    entry("cuDeviceGetCount", 2000, "cuDeviceGetCount"),
    entry("cuDeviceGetName", 2000, "cuDeviceGetName"),
    entry("cuDeviceGetUuid", 9020, "cuDeviceGetUuid"),
    entry("cuDeviceGetUuid", 11040, "cuDeviceGetUuid_v2"),
    entry("cuDeviceTotalMem", 2000, "cuDeviceTotalMem"),
    entry("cuDeviceTotalMem", 3020, "cuDeviceTotalMem_v2"),
    entry("cuDevicePrimaryCtxRetain", 7000, "cuDevicePrimaryCtxRetain"),
    entry(
        "cuDevicePrimaryCtxRelease",
        7000,
        "cuDevicePrimaryCtxRelease",
    ),
    entry(
        "cuDevicePrimaryCtxRelease",
        11000,
        "cuDevicePrimaryCtxRelease_v2",
    ),
    entry("cuCtxCreate", 3020, "cuCtxCreate_v2"),
    entry("cuCtxCreate", 11040, "cuCtxCreate_v3"),
    entry("cuCtxCreate", 12050, "cuCtxCreate_v4"),
    entry("cuCtxDestroy", 4000, "cuCtxDestroy_v2"),
    entry("cuCtxSetCurrent", 4000, "cuCtxSetCurrent"),
    entry("cuCtxGetCurrent", 4000, "cuCtxGetCurrent"),
    entry("cuCtxGetDevice", 2000, "cuCtxGetDevice"),
    entry("cuCtxSynchronize", 2000, "cuCtxSynchronize"),
    entry("cuStreamCreate", 2000, "cuStreamCreate"),
    entry("cuStreamDestroy", 4000, "cuStreamDestroy_v2"),
    entry("cuStreamSynchronize", 2000, "cuStreamSynchronize"),
    per_thread("cuStreamSynchronize", 7000, "cuStreamSynchronize_ptsz"),
    entry("cuGetErrorName", 6000, "cuGetErrorName"),
    entry("cuGetErrorString", 6000, "cuGetErrorString"),
    entry("cuGetProcAddress", 11030, "cuGetProcAddress"),
    entry("cuGetProcAddress", 12000, "cuGetProcAddress_v2"),
    entry("cuMemGetInfo", 2000, "cuMemGetInfo"),
    entry("cuMemGetInfo", 3020, "cuMemGetInfo_v2"),
    entry("cuMemAlloc", 2000, "cuMemAlloc"),
    entry("cuMemAlloc", 3020, "cuMemAlloc_v2"),
    entry("cuMemFree", 2000, "cuMemFree"),
    entry("cuMemFree", 3020, "cuMemFree_v2"),
    entry("cuMemAllocPitch", 3020, "cuMemAllocPitch_v2"),
    entry("cuMemAllocManaged", 6000, "cuMemAllocManaged"),
    entry("cuMemcpyHtoD", 3020, "cuMemcpyHtoD_v2"),
    per_thread("cuMemcpyHtoD", 7000, "cuMemcpyHtoD_v2_ptds"),
    entry("cuMemcpyDtoH", 3020, "cuMemcpyDtoH_v2"),
    per_thread("cuMemcpyDtoH", 7000, "cuMemcpyDtoH_v2_ptds"),
    entry("cuMemsetD8", 3020, "cuMemsetD8_v2"),
    per_thread("cuMemsetD8", 7000, "cuMemsetD8_v2_ptds"),
    entry("cuMemCreate", 10020, "cuMemCreate"),
    entry("cuMemRelease", 10020, "cuMemRelease"),
    entry("cuMemAddressReserve", 10020, "cuMemAddressReserve"),
    entry("cuMemAddressFree", 10020, "cuMemAddressFree"),
    entry("cuMemMap", 10020, "cuMemMap"),
    entry("cuMemUnmap", 10020, "cuMemUnmap"),
    entry("cuMemSetAccess", 10020, "cuMemSetAccess"),
    entry(
        "cuMemGetAllocationGranularity",
        10020,
        "cuMemGetAllocationGranularity",
    ),
    entry("cuMemAllocAsync", 11020, "cuMemAllocAsync"),
    per_thread("cuMemAllocAsync", 11020, "cuMemAllocAsync_ptsz"),
    entry("cuMemAllocFromPoolAsync", 11020, "cuMemAllocFromPoolAsync"),
    per_thread(
        "cuMemAllocFromPoolAsync",
        11020,
        "cuMemAllocFromPoolAsync_ptsz",
    ),
    entry("cuMemFreeAsync", 11020, "cuMemFreeAsync"),
    per_thread("cuMemFreeAsync", 11020, "cuMemFreeAsync_ptsz"),
    entry("cuMemPoolCreate", 11020, "cuMemPoolCreate"),
    entry("cuMemPoolDestroy", 11020, "cuMemPoolDestroy"),
    entry("cuMemPoolTrimTo", 11020, "cuMemPoolTrimTo"),
    entry("cuMemPoolGetAttribute", 11020, "cuMemPoolGetAttribute"),
    entry("cuMemPoolSetAttribute", 11020, "cuMemPoolSetAttribute"),
    entry(
        "cuDeviceGetDefaultMemPool",
        11020,
        "cuDeviceGetDefaultMemPool",
    ),
    entry("cuDeviceGetMemPool", 11020, "cuDeviceGetMemPool"),
    entry("cuDeviceSetMemPool", 11020, "cuDeviceSetMemPool"),
    entry("cuArrayCreate", 3020, "cuArrayCreate_v2"),
    entry("cuArray3DCreate", 3020, "cuArray3DCreate_v2"),
    entry("cuArrayDestroy", 2000, "cuArrayDestroy"),
    entry("cuMipmappedArrayCreate", 5000, "cuMipmappedArrayCreate"),
    entry("cuMipmappedArrayDestroy", 5000, "cuMipmappedArrayDestroy"),
    entry(
        "cuArrayGetMemoryRequirements",
        11060,
        "cuArrayGetMemoryRequirements",
    ),
    entry(
        "cuMipmappedArrayGetMemoryRequirements",
        11060,
        "cuMipmappedArrayGetMemoryRequirements",
    ),
];

/// `export_address(name)`: this library's function for an export name of
/// [`ENTRY_POINTS`], the name written once (as the function's path).
macro_rules! export_addresses {
    ($($module:ident :: $function:ident),* $(,)?) => {
        fn export_address(export_name: &str) -> Option<*mut c_void> {
            match export_name {
                $(stringify!($function) => Some($module::$function as *mut c_void),)*
                _ => None,
            }
        }
    };
}

export_addresses!(
    context::cuInit,
    context::cuDriverGetVersion,
    context::cuDeviceGet,
    context::cuDeviceGetCount,
    context::cuDeviceGetName,
    context::cuDeviceGetUuid,
    context::cuDeviceGetUuid_v2,
    memory::cuDeviceTotalMem,
    memory::cuDeviceTotalMem_v2,
    context::cuDevicePrimaryCtxRetain,
    context::cuDevicePrimaryCtxRelease,
    context::cuDevicePrimaryCtxRelease_v2,
    context::cuCtxCreate_v2,
    context::cuCtxCreate_v3,
    context::cuCtxCreate_v4,
    context::cuCtxDestroy_v2,
    context::cuCtxSetCurrent,
    context::cuCtxGetCurrent,
    context::cuCtxGetDevice,
    context::cuCtxSynchronize,
    context::cuStreamCreate,
    context::cuStreamDestroy_v2,
    context::cuStreamSynchronize,
    context::cuStreamSynchronize_ptsz,
    errors::cuGetErrorName,
    errors::cuGetErrorString,
    self::cuGetProcAddress,
    self::cuGetProcAddress_v2,
    memory::cuMemGetInfo,
    memory::cuMemGetInfo_v2,
    memory::cuMemAlloc,
    memory::cuMemAlloc_v2,
    memory::cuMemFree,
    memory::cuMemFree_v2,
    memory::cuMemAllocPitch_v2,
    memory::cuMemAllocManaged,
    memory::cuMemcpyHtoD_v2,
    memory::cuMemcpyHtoD_v2_ptds,
    memory::cuMemcpyDtoH_v2,
    memory::cuMemcpyDtoH_v2_ptds,
    memory::cuMemsetD8_v2,
    memory::cuMemsetD8_v2_ptds,
    virtual_memory::cuMemCreate,
    virtual_memory::cuMemRelease,
    virtual_memory::cuMemAddressReserve,
    virtual_memory::cuMemAddressFree,
    virtual_memory::cuMemMap,
    virtual_memory::cuMemUnmap,
    virtual_memory::cuMemSetAccess,
    pools::cuMemAllocAsync,
    pools::cuMemAllocAsync_ptsz,
    pools::cuMemAllocFromPoolAsync,
    pools::cuMemAllocFromPoolAsync_ptsz,
    pools::cuMemFreeAsync,
    pools::cuMemFreeAsync_ptsz,
    pools::cuMemPoolCreate,
    pools::cuMemPoolDestroy,
    pools::cuMemPoolTrimTo,
    pools::cuMemPoolGetAttribute,
    pools::cuMemPoolSetAttribute,
    pools::cuDeviceGetDefaultMemPool,
    pools::cuDeviceGetMemPool,
    pools::cuDeviceSetMemPool,
    arrays::cuArrayCreate_v2,
    arrays::cuArray3DCreate_v2,
    arrays::cuArrayDestroy,
    arrays::cuMipmappedArrayCreate,
    arrays::cuMipmappedArrayDestroy,
    arrays::cuArrayGetMemoryRequirements,
    arrays::cuMipmappedArrayGetMemoryRequirements,
);

/// The export for `base_name` at `version`, or the query result saying why there is none.
fn resolve(base_name: &str, version: c_int, per_thread_stream: bool) -> Result<*mut c_void, c_int> {
    let candidates: Vec<&EntryPoint> = ENTRY_POINTS
        .iter()
        .filter(|entry| entry.base_name == base_name)
        .collect();
    if candidates.is_empty() {
        return Err(SYMBOL_NOT_FOUND);
    }
    // A per-thread caller gets the per-thread export where the name has one; calls without
    // stream semantics have only the one kind.
    let has_per_thread = candidates.iter().any(|entry| entry.per_thread_stream);
    let wanted_kind = per_thread_stream && has_per_thread;
    candidates
        .into_iter()
        .filter(|entry| entry.per_thread_stream == wanted_kind && entry.since_version <= version)
        .max_by_key(|entry| entry.since_version)
        .and_then(|entry| export_address(entry.export_name))
        .ok_or(VERSION_NOT_SUFFICIENT)
}

fn get_proc_address(
    symbol: *const c_char,
    function_out: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status_out: *mut c_int,
) -> CUresult {
    cuda_call(|| {
        // SAFETY: CUDA's contract: the out-pointers are null or valid for writes.
        let Some(function_out) = (unsafe { function_out.as_mut() }) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        // SAFETY: as above.
        let status_out = unsafe { status_out.as_mut() };
        if symbol.is_null() || flags > PER_THREAD_DEFAULT_STREAM {
            return CUDA_ERROR_INVALID_VALUE;
        }
        // SAFETY: CUDA's contract: a non-null symbol is a NUL-terminated string.
        let name = unsafe { CStr::from_ptr(symbol) }.to_str().unwrap_or("");
        let per_thread_stream = flags == PER_THREAD_DEFAULT_STREAM;
        let (address, status, code) = match resolve(name, version, per_thread_stream) {
            Ok(address) => (address, SYMBOL_FOUND, CUDA_SUCCESS),
            Err(status) => (std::ptr::null_mut(), status, CUDA_ERROR_NOT_FOUND),
        };
        *function_out = address;
        if let Some(status_out) = status_out {
            *status_out = status;
        }
        code
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    function_out: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CUresult {
    get_proc_address(symbol, function_out, version, flags, std::ptr::null_mut())
}

/// `cuGetProcAddress_v2`: the same, with the query result written where asked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    function_out: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status_out: *mut c_int,
) -> CUresult {
    get_proc_address(symbol, function_out, version, flags, status_out)
}
