//! How programs reach the guard: the hook table, `cuGetProcAddress(_v2)` and `dlsym`.
//!
//! A program finds driver functions three ways, and each must land on the guard's:
//! - linked against libcuda: the preloaded guard's exports of the same names win;
//! - `dlopen("libcuda.so.1")` then `dlsym`: the guard exports `dlsym` and answers a
//!   hooked name with its own function;
//! - `cuGetProcAddress(_v2)` (the CUDA runtime since 11.3, PyTorch, JAX): the guard asks
//!   the driver first, so status and errors are the driver's own, then, when the request
//!   (base name, CUDA version, per-thread-stream flag) is in the table, hands back its
//!   function instead. The table is explicit, never guessed from `_v2`/`_v3` suffixes:
//!   an entry point whose signature changed in a later version is only hooked for the
//!   versions whose signature the guard implements.
#![allow(unsafe_code)] // Exported C entry points, a naked dlsym trampoline, raw C strings.
#![allow(non_snake_case)] // The exported names are cuda.h's.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::null_mut;

use crate::driver_types::{
    CUDA_SUCCESS, CuResult, PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, PROC_ADDRESS_SYMBOL_FOUND,
};
use crate::real::{call_real, real_dlsym};
use crate::{arrays, hook, info, memory, pools};

/// One hooked entry point: the driver's export name, the base name `cuGetProcAddress` is
/// asked for, the CUDA versions (`min..max`, as `cuGetProcAddress` counts them: 12000 is
/// 12.0) for which the base name means this export, and whether it is the per-thread
/// default stream (`_ptsz`) variant.
#[derive(Debug)]
pub(crate) struct Hook {
    pub(crate) export: &'static CStr,
    pub(crate) base: &'static CStr,
    pub(crate) min_version: c_int,
    pub(crate) max_version: c_int,
    pub(crate) per_thread: bool,
    pub(crate) function: *const (),
}

// SAFETY: the table is immutable; `function` is the address of a guard function.
unsafe impl Sync for Hook {}

const ANY: c_int = c_int::MAX;

macro_rules! hooks {
    ($( $export:ident : $base:literal, $min:expr, $max:expr, $per_thread:expr => $function:path ; )*) => {
        [ $( Hook {
            export: match CStr::from_bytes_with_nul(concat!(stringify!($export), "\0").as_bytes()) {
                Ok(name) => name,
                Err(_) => panic!("names have no NUL"),
            },
            base: $base,
            min_version: $min,
            max_version: $max,
            per_thread: $per_thread,
            function: $function as *const (),
        }, )* ]
    };
}

/// Every hooked entry point. Versions: the `_v2` memory functions replaced the 32-bit
/// ones in CUDA 3.2 (3020); `cuGetProcAddress` means the 5-argument `_v2` from 12.0;
/// `cuCtxSynchronize` means a different `_v2` (taking a context) from 13.0, which the
/// guard leaves to the driver (it only credits pool memory earlier there).
pub(crate) static HOOKS: [Hook; 36] = hooks! {
    cuInit: c"cuInit", 0, ANY, false => memory::cuInit;
    cuGetProcAddress: c"cuGetProcAddress", 0, 12000, false => cuGetProcAddress;
    cuGetProcAddress_v2: c"cuGetProcAddress", 12000, ANY, false => cuGetProcAddress_v2;
    cuMemAlloc: c"cuMemAlloc", 0, 3020, false => memory::cuMemAlloc;
    cuMemAlloc_v2: c"cuMemAlloc", 3020, ANY, false => memory::cuMemAlloc_v2;
    cuMemAllocPitch: c"cuMemAllocPitch", 0, 3020, false => memory::cuMemAllocPitch;
    cuMemAllocPitch_v2: c"cuMemAllocPitch", 3020, ANY, false => memory::cuMemAllocPitch_v2;
    cuMemFree: c"cuMemFree", 0, 3020, false => memory::cuMemFree;
    cuMemFree_v2: c"cuMemFree", 3020, ANY, false => memory::cuMemFree_v2;
    cuMemAllocManaged: c"cuMemAllocManaged", 0, ANY, false => memory::cuMemAllocManaged;
    cuMemCreate: c"cuMemCreate", 0, ANY, false => memory::cuMemCreate;
    cuMemRelease: c"cuMemRelease", 0, ANY, false => memory::cuMemRelease;
    cuMemAllocAsync: c"cuMemAllocAsync", 0, ANY, false => pools::cuMemAllocAsync;
    cuMemAllocAsync_ptsz: c"cuMemAllocAsync", 0, ANY, true => pools::cuMemAllocAsync_ptsz;
    cuMemAllocFromPoolAsync: c"cuMemAllocFromPoolAsync", 0, ANY, false => pools::cuMemAllocFromPoolAsync;
    cuMemAllocFromPoolAsync_ptsz: c"cuMemAllocFromPoolAsync", 0, ANY, true => pools::cuMemAllocFromPoolAsync_ptsz;
    cuMemFreeAsync: c"cuMemFreeAsync", 0, ANY, false => pools::cuMemFreeAsync;
    cuMemFreeAsync_ptsz: c"cuMemFreeAsync", 0, ANY, true => pools::cuMemFreeAsync_ptsz;
    cuMemPoolTrimTo: c"cuMemPoolTrimTo", 0, ANY, false => pools::cuMemPoolTrimTo;
    cuMemPoolDestroy: c"cuMemPoolDestroy", 0, ANY, false => pools::cuMemPoolDestroy;
    cuStreamSynchronize: c"cuStreamSynchronize", 0, ANY, false => pools::cuStreamSynchronize;
    cuStreamSynchronize_ptsz: c"cuStreamSynchronize", 0, ANY, true => pools::cuStreamSynchronize_ptsz;
    cuCtxSynchronize: c"cuCtxSynchronize", 0, 13000, false => pools::cuCtxSynchronize;
    cuArrayCreate: c"cuArrayCreate", 0, 3020, false => memory::cuArrayCreate;
    cuArrayCreate_v2: c"cuArrayCreate", 3020, ANY, false => arrays::cuArrayCreate_v2;
    cuArray3DCreate: c"cuArray3DCreate", 0, 3020, false => memory::cuArray3DCreate;
    cuArray3DCreate_v2: c"cuArray3DCreate", 3020, ANY, false => arrays::cuArray3DCreate_v2;
    cuArrayDestroy: c"cuArrayDestroy", 0, ANY, false => arrays::cuArrayDestroy;
    cuMipmappedArrayCreate: c"cuMipmappedArrayCreate", 0, ANY, false => arrays::cuMipmappedArrayCreate;
    cuMipmappedArrayDestroy: c"cuMipmappedArrayDestroy", 0, ANY, false => arrays::cuMipmappedArrayDestroy;
    cuMemGetInfo_v2: c"cuMemGetInfo", 3020, ANY, false => info::cuMemGetInfo_v2;
    cuDeviceTotalMem_v2: c"cuDeviceTotalMem", 3020, ANY, false => info::cuDeviceTotalMem_v2;
    nvmlDeviceGetMemoryInfo: c"nvmlDeviceGetMemoryInfo", 0, ANY, false => info::nvmlDeviceGetMemoryInfo;
    nvmlDeviceGetMemoryInfo_v2: c"nvmlDeviceGetMemoryInfo_v2", 0, ANY, false => info::nvmlDeviceGetMemoryInfo_v2;
    dlsym: c"dlsym", 0, 0, false => dlsym;
    carve_guard_hook_entry: c"carve_guard_hook_entry", 0, 0, false => carve_guard_hook_entry;
};

/// The hook `cuGetProcAddress` should hand back for `base` at `cuda_version`: the
/// per-thread variant when asked for one and the table has one, else the plain entry.
fn hook_for_proc_address(base: &CStr, cuda_version: c_int, flags: u64) -> Option<&'static Hook> {
    let per_thread = flags & PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    let mut plain = None;
    for hook in &HOOKS {
        if hook.base != base || cuda_version < hook.min_version || cuda_version >= hook.max_version
        {
            continue;
        }
        if hook.per_thread == per_thread {
            return Some(hook);
        }
        if !hook.per_thread {
            plain = Some(hook);
        }
    }
    plain
}

/// The hook exported under `name`, if any (`dlsym` answers these with the guard's own).
fn hook_by_export(name: &CStr) -> Option<&'static Hook> {
    let bytes = name.to_bytes();
    if !bytes.starts_with(b"cu") && !bytes.starts_with(b"nvml") {
        return None;
    }
    HOOKS
        .iter()
        .find(|hook| hook.export == name && hook.max_version > 0)
}

/// After the driver answered `cuGetProcAddress`, swaps in the guard's function.
///
/// # Safety
/// `symbol` is null or NUL-terminated; `pfn` is null or writable.
unsafe fn substitute(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) {
    if symbol.is_null() || pfn.is_null() {
        return;
    }
    // SAFETY: the caller passed a NUL-terminated name (the driver just read it too).
    let base = unsafe { CStr::from_ptr(symbol) };
    if let Some(hook) = hook_for_proc_address(base, cuda_version, flags) {
        // SAFETY: `pfn` is the caller's out-pointer, which the driver just wrote.
        unsafe {
            if !(*pfn).is_null() {
                *pfn = hook.function as *mut c_void;
            }
        }
    }
}

/// `cuGetProcAddress` (CUDA 11.3 to 11.8, and 12.x programs built against the 4-argument form).
///
/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CuResult {
    hook("cuGetProcAddress", || {
        let result = call_real!(cuGetProcAddress(symbol, pfn, cuda_version, flags));
        if result == CUDA_SUCCESS {
            // SAFETY: the caller's arguments, which the driver accepted.
            unsafe { substitute(symbol, pfn, cuda_version, flags) };
        }
        result
    })
}

/// `cuGetProcAddress_v2` (CUDA 12.0 on: `cudaGetDriverEntryPoint(ByVersion)`).
///
/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    symbol_status: *mut c_int,
) -> CuResult {
    hook("cuGetProcAddress_v2", || {
        let result = call_real!(cuGetProcAddress_v2(
            symbol,
            pfn,
            cuda_version,
            flags,
            symbol_status
        ));
        // SAFETY: `symbol_status` is null or the caller's out-pointer the driver just wrote.
        let found =
            symbol_status.is_null() || unsafe { *symbol_status } == PROC_ADDRESS_SYMBOL_FOUND;
        if result == CUDA_SUCCESS && found {
            // SAFETY: the caller's arguments, which the driver accepted.
            unsafe { substitute(symbol, pfn, cuda_version, flags) };
        }
        result
    })
}

/// What `dlsym` does with one request: hand back `hook`, or (when null) tail-call `real`.
#[repr(C)]
#[derive(Debug)]
struct DlsymRoute {
    hook: *mut c_void,
    real: *mut c_void,
}

/// Decides one `dlsym` request. A hooked name gets the guard's function when the lookup
/// would have found the driver's (so a handle without it still answers NULL); anything
/// else goes to the C library's `dlsym`. Never calls the exported `dlsym`.
extern "C" fn route_dlsym(handle: *mut c_void, symbol: *const c_char) -> DlsymRoute {
    let route = catch_unwind(AssertUnwindSafe(|| {
        let real = real_dlsym();
        let real_address = real.map_or(null_mut(), |function| function as *mut c_void);
        let mut hook = null_mut();
        if !symbol.is_null() {
            // SAFETY: dlsym's contract: `symbol` is a NUL-terminated name.
            let name = unsafe { CStr::from_ptr(symbol) };
            if let Some(found) = hook_by_export(name) {
                // SAFETY: the caller's own (handle, name) pair, given to the real dlsym.
                let exists = handle == libc::RTLD_NEXT
                    || real.is_some_and(|real| !unsafe { real(handle, symbol) }.is_null());
                if exists {
                    hook = found.function as *mut c_void;
                }
            }
        }
        DlsymRoute {
            hook,
            real: real_address,
        }
    }));
    route.unwrap_or(DlsymRoute {
        hook: null_mut(),
        real: null_mut(),
    })
}

/// `dlsym`: a trampoline so that a request passed through reaches the C library's dlsym
/// with the CALLER's return address (a tail jump), which `RTLD_NEXT` lookups depend on.
///
/// # Safety
/// dlsym's contract.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // Keep the arguments, ask route_dlsym (returns hook in rax, real in rdx); return the
    // hook, or restore the arguments and jump to the real dlsym (NULL if there is none).
    core::arch::naked_asm!(
        "endbr64", // a valid indirect-branch target where CET is enforced; a NOP elsewhere
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {route}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jnz 2f",
        "test rdx, rdx",
        "jz 2f",
        "jmp rdx",
        "2:",
        "ret",
        route = sym route_dlsym,
    )
}

/// `dlsym` elsewhere: forwards from the guard (an `RTLD_NEXT` lookup then starts after
/// the guard rather than after its caller).
///
/// # Safety
/// dlsym's contract.
#[cfg(not(target_arch = "x86_64"))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let route = route_dlsym(handle, symbol);
    if !route.hook.is_null() || route.real.is_null() {
        return route.hook;
    }
    // SAFETY: `route.real` is the C library's dlsym; the arguments are the caller's.
    unsafe {
        std::mem::transmute::<*mut c_void, crate::real::DlsymFunction>(route.real)(handle, symbol)
    }
}

/// One row of the hook table, for the tests that check the table against the exports.
#[repr(C)]
#[derive(Debug)]
pub struct HookEntryView {
    pub export: *const c_char,
    pub base: *const c_char,
    pub min_version: c_int,
    pub max_version: c_int,
    pub per_thread: c_int,
    pub function: *const c_void,
}

/// Writes row `index` of the hook table to `view`; 0 past the end.
///
/// # Safety
/// `view` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn carve_guard_hook_entry(index: usize, view: *mut HookEntryView) -> c_int {
    let (Some(hook), false) = (HOOKS.get(index), view.is_null()) else {
        return 0;
    };
    // SAFETY: `view` is non-null and writable by the contract.
    unsafe {
        view.write(HookEntryView {
            export: hook.export.as_ptr(),
            base: hook.base.as_ptr(),
            min_version: hook.min_version,
            max_version: hook.max_version,
            per_thread: c_int::from(hook.per_thread),
            function: hook.function.cast(),
        });
    }
    1
}
