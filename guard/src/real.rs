//! Finding the real driver and NVML functions the guard's hooks forward to.
//!
//! The guard exports `dlsym` itself, so it reaches the C library's through `dlvsym`
//! (which it does not hook) and never through its own. Real driver functions are looked
//! up by their versioned export name (`cuMemAlloc_v2`, `cuMemAllocAsync_ptsz`) on a handle
//! of `libcuda.so.1`: a lookup on a handle searches that library and its dependencies,
//! never the preloaded guard, so it cannot come back to a hook. Lookups are lazy and
//! cached in atomics; libcuda is only opened when a hook runs, and a hook only runs in a
//! program that already loaded the driver, so a program that never touches CUDA never
//! loads it because of the guard.
#![allow(unsafe_code)] // dlvsym/dlopen/dlsym and calling through the pointers they give.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::driver_types::{
    Array3dDescriptor, ArrayDescriptor, CuResult, Device, DevicePointer, GenericAllocationHandle,
    Handle, NvmlDevice, NvmlMemory, NvmlMemoryV2, NvmlReturn,
};

/// The C library's `dlsym`.
pub(crate) type DlsymFunction = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

/// The C library's own `dlsym`, found with `dlvsym(RTLD_NEXT, ..)` under the symbol
/// versions glibc has used for it (2.34 moved it into libc; 2.2.5 and 2.17 are the
/// x86_64 and aarch64 base versions).
pub(crate) fn real_dlsym() -> Option<DlsymFunction> {
    let mut found = REAL_DLSYM.load(Ordering::Acquire);
    if found.is_null() {
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
            // SAFETY: both strings are NUL-terminated literals; dlvsym does not call dlsym.
            found = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !found.is_null() {
                break;
            }
        }
        if found.is_null() {
            return None;
        }
        REAL_DLSYM.store(found, Ordering::Release);
    }
    // SAFETY: `found` is the address of glibc's dlsym, whose C signature this type is.
    Some(unsafe { std::mem::transmute::<*mut c_void, DlsymFunction>(found) })
}

/// A library the guard forwards to.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Library {
    Cuda,
    Nvml,
}

static CUDA_HANDLE: AtomicPtr<c_void> = AtomicPtr::new(null_mut());
static NVML_HANDLE: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

impl Library {
    fn file_name(self) -> &'static CStr {
        match self {
            Library::Cuda => c"libcuda.so.1",
            Library::Nvml => c"libnvidia-ml.so.1",
        }
    }

    /// The library's handle: the already loaded copy when there is one (the program's),
    /// else a fresh load (a program linked against it reaches a hook before any dlopen).
    fn handle(self) -> *mut c_void {
        let cache = match self {
            Library::Cuda => &CUDA_HANDLE,
            Library::Nvml => &NVML_HANDLE,
        };
        let cached = cache.load(Ordering::Acquire);
        if !cached.is_null() {
            return cached;
        }
        let name = self.file_name().as_ptr();
        // SAFETY: `name` is a NUL-terminated literal; RTLD_NOLOAD only returns a handle
        // of a library that is already loaded.
        let mut handle = unsafe { libc::dlopen(name, libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if handle.is_null() {
            // SAFETY: as above; this loads the library the program is about to use anyway.
            handle = unsafe { libc::dlopen(name, libc::RTLD_LAZY) };
        }
        if !handle.is_null() {
            cache.store(handle, Ordering::Release);
        }
        handle
    }
}

/// Looks `name` up in `library` once and caches the address in `slot`.
fn lookup(slot: &AtomicPtr<c_void>, library: Library, name: &CStr) -> *mut c_void {
    let cached = slot.load(Ordering::Acquire);
    if !cached.is_null() {
        return cached;
    }
    let Some(dlsym) = real_dlsym() else {
        return null_mut();
    };
    let handle = library.handle();
    if handle.is_null() {
        return null_mut();
    }
    // SAFETY: `handle` came from dlopen and `name` is NUL-terminated.
    let found = unsafe { dlsym(handle, name.as_ptr()) };
    if !found.is_null() {
        slot.store(found, Ordering::Release);
    }
    found
}

/// Declares one accessor per real function: `real::cuMemAlloc_v2()` is the driver's
/// `cuMemAlloc_v2`, typed with its cuda.h signature, or `None` when the driver lacks it.
macro_rules! real_functions {
    ($library:ident { $( $name:ident ( $( $argument:ty ),* ) -> $result:ty ; )* }) => {
        $(
            #[allow(non_snake_case)]
            pub(crate) fn $name() -> Option<unsafe extern "C" fn($($argument),*) -> $result> {
                static SLOT: AtomicPtr<c_void> = AtomicPtr::new(null_mut());
                let name = const {
                    match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                        Ok(name) => name,
                        Err(_) => panic!("function names have no NUL"),
                    }
                };
                let found = lookup(&SLOT, Library::$library, name);
                if found.is_null() {
                    return None;
                }
                // SAFETY: the library's export of this name has exactly this signature
                // (cuda.h / nvml.h); the pointer is a function address from dlsym.
                Some(unsafe {
                    std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($argument),*) -> $result>(found)
                })
            }
        )*
    };
}

real_functions!(Cuda {
    cuInit(u32) -> CuResult;
    cuGetProcAddress(*const c_char, *mut *mut c_void, c_int, u64) -> CuResult;
    cuGetProcAddress_v2(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CuResult;
    cuMemAlloc_v2(*mut DevicePointer, usize) -> CuResult;
    cuMemAllocPitch_v2(*mut DevicePointer, *mut usize, usize, usize, u32) -> CuResult;
    cuMemAllocManaged(*mut DevicePointer, usize, u32) -> CuResult;
    cuMemFree_v2(DevicePointer) -> CuResult;
    cuMemCreate(*mut GenericAllocationHandle, usize, *const c_void, u64) -> CuResult;
    cuMemRelease(GenericAllocationHandle) -> CuResult;
    cuMemAllocAsync(*mut DevicePointer, usize, Handle) -> CuResult;
    cuMemAllocAsync_ptsz(*mut DevicePointer, usize, Handle) -> CuResult;
    cuMemAllocFromPoolAsync(*mut DevicePointer, usize, Handle, Handle) -> CuResult;
    cuMemAllocFromPoolAsync_ptsz(*mut DevicePointer, usize, Handle, Handle) -> CuResult;
    cuMemFreeAsync(DevicePointer, Handle) -> CuResult;
    cuMemFreeAsync_ptsz(DevicePointer, Handle) -> CuResult;
    cuMemPoolGetAttribute(Handle, u32, *mut c_void) -> CuResult;
    cuMemPoolTrimTo(Handle, usize) -> CuResult;
    cuMemPoolDestroy(Handle) -> CuResult;
    cuStreamSynchronize(Handle) -> CuResult;
    cuStreamSynchronize_ptsz(Handle) -> CuResult;
    cuCtxSynchronize() -> CuResult;
    cuCtxGetDevice(*mut Device) -> CuResult;
    cuDeviceGetMemPool(*mut Handle, Device) -> CuResult;
    cuArrayCreate_v2(*mut Handle, *const ArrayDescriptor) -> CuResult;
    cuArray3DCreate_v2(*mut Handle, *const Array3dDescriptor) -> CuResult;
    cuArrayDestroy(Handle) -> CuResult;
    cuMipmappedArrayCreate(*mut Handle, *const Array3dDescriptor, u32) -> CuResult;
    cuMipmappedArrayDestroy(Handle) -> CuResult;
    cuMemGetInfo_v2(*mut usize, *mut usize) -> CuResult;
    cuDeviceTotalMem_v2(*mut usize, Device) -> CuResult;
});

real_functions!(Nvml {
    nvmlDeviceGetMemoryInfo(NvmlDevice, *mut NvmlMemory) -> NvmlReturn;
    nvmlDeviceGetMemoryInfo_v2(NvmlDevice, *mut NvmlMemoryV2) -> NvmlReturn;
});

/// Calls the real driver function of the same name with the hook's arguments, or says
/// once on stderr that the driver lacks it and answers `CUDA_ERROR_NOT_FOUND` (a program
/// only reaches a hook through the driver it loaded, so this means a broken install).
macro_rules! call_real {
    ($name:ident ( $( $argument:expr ),* $(,)? )) => {
        match $crate::real::$name() {
            // SAFETY: the arguments are the caller's, passed unchanged (or the guard's own
            // valid out-pointers) to the driver function with the signature the caller used.
            Some(function) => unsafe { function($($argument),*) },
            None => $crate::real::driver_lacks(stringify!($name)),
        }
    };
}
pub(crate) use call_real;

/// The answer when the driver lacks a function the guard must forward to.
pub(crate) fn driver_lacks(name: &str) -> CuResult {
    crate::state::say(&format!("the CUDA driver has no {name}; refusing the call"));
    crate::driver_types::CUDA_ERROR_NOT_FOUND
}
