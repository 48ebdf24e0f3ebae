//! Loads a private copy of the fake driver for one test and calls it through `dlsym`, as a
//! program that `dlopen`s libcuda does.
//!
//! Each test loads its own copy of `libcarve_fake_driver.so` (another file, so the dynamic
//! loader maps a second instance with its own state): the tests of a binary run in
//! parallel threads of one process and must not see each other's allocations.

#![allow(unsafe_code, dead_code)]

use std::ffi::{CString, c_char, c_int, c_uint, c_void};
use std::path::PathBuf;

pub type CUresult = u32;
pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

pub type Handle = *mut c_void;
pub type InitFn = unsafe extern "C" fn(c_uint) -> CUresult;
pub type AllocFn = unsafe extern "C" fn(*mut u64, usize) -> CUresult;
pub type FreeFn = unsafe extern "C" fn(u64) -> CUresult;
pub type GetInfoFn = unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult;
pub type AllocAsyncFn = unsafe extern "C" fn(*mut u64, usize, Handle) -> CUresult;
pub type FreeAsyncFn = unsafe extern "C" fn(u64, Handle) -> CUresult;
pub type GetProcAddressFn =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;
pub type GetProcAddressV2Fn =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;

/// `CarveFakeDriverStats`, as the library writes it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub bytes_in_use: u64,
    pub pool_reserved_bytes: u64,
    pub allocation_count: u64,
    pub capacity: u64,
}

/// One loaded copy of the fake driver.
#[derive(Debug)]
pub struct Driver {
    library: *mut c_void,
}

// SAFETY: the handle is only passed to dlsym, which is thread-safe; the driver itself is.
unsafe impl Send for Driver {}
// SAFETY: as above.
unsafe impl Sync for Driver {}

/// `target/<profile>/deps/libcarve_fake_driver.so`, next to this test binary.
pub fn library_path() -> PathBuf {
    let deps = std::env::current_exe()
        .expect("the test binary's path")
        .parent()
        .expect("the test binary lives in target/<profile>/deps")
        .to_path_buf();
    let library = deps.join("libcarve_fake_driver.so");
    assert!(
        library.exists(),
        "{} is missing: cargo writes it when it builds carve-fake-driver's lib (its own tests, or a crate that depends on it)",
        library.display()
    );
    library
}

impl Driver {
    /// A fresh copy of the driver, not initialized.
    pub fn load(test_name: &str) -> Driver {
        let directory =
            std::env::temp_dir().join(format!("carve-fake-driver-tests-{}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("create the copies' directory");
        let copy = directory.join(format!("{test_name}.so"));
        std::fs::copy(library_path(), &copy).expect("copy the fake driver");
        let path = CString::new(copy.to_str().expect("a UTF-8 temp path")).expect("no NUL");
        // SAFETY: dlopen of a shared library built from this workspace; its constructors
        // only set up Rust's runtime.
        let library = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!library.is_null(), "dlopen {}", copy.display());
        Driver { library }
    }

    /// A fresh copy with `cuInit(0)` done.
    pub fn initialized(test_name: &str) -> Driver {
        let driver = Driver::load(test_name);
        // SAFETY: cuInit's signature.
        let code = unsafe { driver.function::<InitFn>("cuInit")(0) };
        assert_eq!(code, CUDA_SUCCESS, "cuInit");
        driver
    }

    /// The raw address of an exported symbol; null when there is none.
    pub fn address(&self, name: &str) -> *mut c_void {
        let name = CString::new(name).expect("no NUL");
        // SAFETY: a handle from dlopen and a NUL-terminated name.
        unsafe { libc::dlsym(self.library, name.as_ptr()) }
    }

    /// An exported function as the type `F` (a function pointer type the caller picks to
    /// match the C signature).
    ///
    /// # Safety
    /// `F` must be the function's signature.
    pub unsafe fn function<F: Copy>(&self, name: &str) -> F {
        let address = self.address(name);
        assert!(!address.is_null(), "{name} is not exported");
        assert_eq!(size_of::<F>(), size_of::<*mut c_void>());
        // SAFETY: F is a function pointer type of the symbol's signature (the caller's promise).
        unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) }
    }

    pub fn stats(&self) -> Stats {
        let mut stats = Stats::default();
        // SAFETY: carveFakeDriverStats(CarveFakeDriverStats*).
        let code = unsafe {
            self.function::<unsafe extern "C" fn(*mut Stats) -> CUresult>("carveFakeDriverStats")(
                &mut stats,
            )
        };
        assert_eq!(code, CUDA_SUCCESS);
        stats
    }

    pub fn alloc(&self, bytes: u64) -> Result<u64, CUresult> {
        let mut pointer = 0;
        // SAFETY: cuMemAlloc_v2's signature.
        let code =
            unsafe { self.function::<AllocFn>("cuMemAlloc_v2")(&mut pointer, bytes as usize) };
        if code == CUDA_SUCCESS {
            Ok(pointer)
        } else {
            Err(code)
        }
    }

    pub fn free(&self, pointer: u64) -> CUresult {
        // SAFETY: cuMemFree_v2's signature.
        unsafe { self.function::<FreeFn>("cuMemFree_v2")(pointer) }
    }

    /// `cuMemGetInfo_v2`: (free, total).
    pub fn memory_info(&self) -> (u64, u64) {
        let (mut free, mut total) = (0, 0);
        // SAFETY: cuMemGetInfo_v2's signature.
        let code = unsafe { self.function::<GetInfoFn>("cuMemGetInfo_v2")(&mut free, &mut total) };
        assert_eq!(code, CUDA_SUCCESS);
        (free as u64, total as u64)
    }
}
