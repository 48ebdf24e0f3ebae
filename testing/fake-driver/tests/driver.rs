//! The fake driver's device memory by pointer, its device and context calls, its errors
//! and its NVML, called through `dlsym` on a private copy of the library.

#![allow(unsafe_code)]

mod common;

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

use common::*;

#[test]
fn every_call_but_the_documented_ones_needs_cu_init() {
    let driver = Driver::load("before_init");
    let mut pointer = 0;
    // SAFETY: the signatures of the called functions.
    unsafe {
        assert_eq!(
            driver.function::<AllocFn>("cuMemAlloc_v2")(&mut pointer, 1024),
            CUDA_ERROR_NOT_INITIALIZED
        );
        assert_eq!(
            driver.function::<FreeFn>("cuMemFree_v2")(1),
            CUDA_ERROR_NOT_INITIALIZED
        );
        let (mut free, mut total) = (0, 0);
        assert_eq!(
            driver.function::<GetInfoFn>("cuMemGetInfo_v2")(&mut free, &mut total),
            CUDA_ERROR_NOT_INITIALIZED
        );
        let mut count: c_int = 0;
        let get_count =
            driver.function::<unsafe extern "C" fn(*mut c_int) -> CUresult>("cuDeviceGetCount");
        assert_eq!(get_count(&mut count), CUDA_ERROR_NOT_INITIALIZED);
        let mut version: c_int = 0;
        let get_version =
            driver.function::<unsafe extern "C" fn(*mut c_int) -> CUresult>("cuDriverGetVersion");
        assert_eq!(get_version(&mut version), CUDA_SUCCESS);
        assert_eq!(version, 13000);
        assert_eq!(
            driver.function::<InitFn>("cuInit")(1),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(driver.function::<InitFn>("cuInit")(0), CUDA_SUCCESS);
        assert_eq!(get_count(&mut count), CUDA_SUCCESS);
        assert_eq!(count, 1);
    }
    assert_eq!(driver.stats().allocation_count, 0);
}

#[test]
fn allocations_and_frees_move_the_numbers_everywhere() {
    let driver = Driver::initialized("numbers");
    let (free, total) = driver.memory_info();
    assert_eq!((free, total), (16 * GIB, 16 * GIB));
    let first = driver.alloc(3 * MIB).expect("3 MiB");
    let second = driver.alloc(5 * MIB + 1).expect("5 MiB + 1");
    assert_ne!(first, second);
    assert_eq!(driver.memory_info(), (16 * GIB - 8 * MIB - 1, 16 * GIB));
    assert_eq!(
        driver.stats(),
        Stats {
            bytes_in_use: 8 * MIB + 1,
            pool_reserved_bytes: 0,
            allocation_count: 2,
            capacity: 16 * GIB
        }
    );
    let mut total_memory: usize = 0;
    // SAFETY: cuDeviceTotalMem_v2(size_t*, CUdevice).
    let code =
        unsafe {
            driver.function::<unsafe extern "C" fn(*mut usize, c_int) -> CUresult>(
                "cuDeviceTotalMem_v2",
            )(&mut total_memory, 0)
        };
    assert_eq!((code, total_memory as u64), (CUDA_SUCCESS, 16 * GIB));
    assert_eq!(driver.free(first), CUDA_SUCCESS);
    assert_eq!(
        driver.free(first),
        CUDA_ERROR_INVALID_VALUE,
        "a double free is refused"
    );
    assert_eq!(
        driver.free(0xdead_0000),
        CUDA_ERROR_INVALID_VALUE,
        "an unknown pointer"
    );
    assert_eq!(driver.free(second), CUDA_SUCCESS);
    assert_eq!(driver.stats().bytes_in_use, 0);
    assert_eq!(driver.stats().allocation_count, 0);
    assert_eq!(driver.alloc(0), Err(CUDA_ERROR_INVALID_VALUE));
}

#[test]
fn past_the_capacity_is_out_of_memory() {
    let driver = Driver::initialized("capacity");
    assert_eq!(driver.alloc(16 * GIB + 1), Err(CUDA_ERROR_OUT_OF_MEMORY));
    let most = driver
        .alloc(16 * GIB - MIB)
        .expect("all but 1 MiB (untouched pages cost nothing)");
    assert_eq!(driver.alloc(MIB + 1), Err(CUDA_ERROR_OUT_OF_MEMORY));
    let last = driver.alloc(MIB).expect("exactly the rest");
    assert_eq!(driver.memory_info().0, 0);
    assert_eq!(driver.alloc(1), Err(CUDA_ERROR_OUT_OF_MEMORY));
    assert_eq!(driver.free(most), CUDA_SUCCESS);
    assert_eq!(driver.free(last), CUDA_SUCCESS);
    assert_eq!(driver.memory_info().0, 16 * GIB);
}

#[test]
fn null_out_pointers_are_invalid_values() {
    let driver = Driver::initialized("null_pointers");
    // SAFETY: the signatures of the called functions; null is what is being tested.
    unsafe {
        assert_eq!(
            driver.function::<AllocFn>("cuMemAlloc_v2")(std::ptr::null_mut(), 64),
            CUDA_ERROR_INVALID_VALUE
        );
        let mut free = 0;
        assert_eq!(
            driver.function::<GetInfoFn>("cuMemGetInfo_v2")(&mut free, std::ptr::null_mut()),
            CUDA_ERROR_INVALID_VALUE
        );
        let stats =
            driver.function::<unsafe extern "C" fn(*mut Stats) -> CUresult>("carveFakeDriverStats");
        assert_eq!(stats(std::ptr::null_mut()), CUDA_ERROR_INVALID_VALUE);
    }
    assert_eq!(driver.stats().allocation_count, 0);
}

#[test]
fn device_memory_is_host_memory_for_copies_and_memset() {
    let driver = Driver::initialized("copies");
    let pointer = driver.alloc(4096).expect("4 KiB");
    type SetFn = unsafe extern "C" fn(u64, u8, usize) -> CUresult;
    type ToDeviceFn = unsafe extern "C" fn(u64, *const c_void, usize) -> CUresult;
    type ToHostFn = unsafe extern "C" fn(*mut c_void, u64, usize) -> CUresult;
    let source: Vec<u8> = (0..=255).collect();
    let mut back = vec![0u8; 4096];
    // SAFETY: the signatures of the called functions; buffers of the given lengths.
    unsafe {
        assert_eq!(
            driver.function::<SetFn>("cuMemsetD8_v2")(pointer, 7, 4096),
            CUDA_SUCCESS
        );
        assert_eq!(
            driver.function::<ToDeviceFn>("cuMemcpyHtoD_v2")(
                pointer + 100,
                source.as_ptr().cast(),
                256
            ),
            CUDA_SUCCESS
        );
        assert_eq!(
            driver.function::<ToHostFn>("cuMemcpyDtoH_v2_ptds")(
                back.as_mut_ptr().cast(),
                pointer,
                4096
            ),
            CUDA_SUCCESS
        );
        assert_eq!(
            driver.function::<ToHostFn>("cuMemcpyDtoH_v2")(
                back.as_mut_ptr().cast(),
                pointer + 4000,
                97
            ),
            CUDA_ERROR_INVALID_VALUE,
            "past the allocation's end"
        );
    }
    assert_eq!(back[99], 7);
    assert_eq!(&back[100..356], &source[..]);
    assert_eq!(back[356], 7);
    assert_eq!(driver.free(pointer), CUDA_SUCCESS);
}

#[test]
fn pitched_and_managed_allocations_count_what_they_take() {
    let driver = Driver::initialized("pitch_managed");
    let (mut pointer, mut pitch) = (0u64, 0usize);
    type PitchFn = unsafe extern "C" fn(*mut u64, *mut usize, usize, usize, c_uint) -> CUresult;
    type ManagedFn = unsafe extern "C" fn(*mut u64, usize, c_uint) -> CUresult;
    let mut managed = 0u64;
    // SAFETY: the signatures of the called functions.
    unsafe {
        let alloc_pitch = driver.function::<PitchFn>("cuMemAllocPitch_v2");
        assert_eq!(
            alloc_pitch(&mut pointer, &mut pitch, 1000, 10, 4),
            CUDA_SUCCESS
        );
        assert_eq!(
            alloc_pitch(&mut pointer, &mut pitch, 1000, 10, 3),
            CUDA_ERROR_INVALID_VALUE
        );
        let alloc_managed = driver.function::<ManagedFn>("cuMemAllocManaged");
        assert_eq!(
            alloc_managed(&mut managed, 4096, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(alloc_managed(&mut managed, 4096, 1), CUDA_SUCCESS);
    }
    assert_eq!(pitch, 1024);
    assert_eq!(driver.stats().bytes_in_use, 1024 * 10 + 4096);
    assert_eq!(driver.free(pointer), CUDA_SUCCESS);
    assert_eq!(driver.free(managed), CUDA_SUCCESS);
    assert_eq!(driver.stats().bytes_in_use, 0);
}

#[test]
fn the_legacy_32_bit_entry_points_still_work() {
    let driver = Driver::initialized("legacy");
    let (mut pointer, mut free, mut total) = (0u32, 0u32, 0u32);
    // SAFETY: the legacy signatures: cuMemAlloc(unsigned int*, unsigned int),
    // cuMemFree(unsigned int), cuMemGetInfo(unsigned int*, unsigned int*).
    unsafe {
        let get_info =
            driver.function::<unsafe extern "C" fn(*mut u32, *mut u32) -> CUresult>("cuMemGetInfo");
        assert_eq!(get_info(&mut free, &mut total), CUDA_SUCCESS);
        assert_eq!(
            (free, total),
            (u32::MAX, u32::MAX),
            "16 GiB saturates 32 bits"
        );
        let alloc =
            driver.function::<unsafe extern "C" fn(*mut u32, u32) -> CUresult>("cuMemAlloc");
        assert_eq!(alloc(&mut pointer, 1 << 20), CUDA_SUCCESS);
        assert_ne!(pointer, 0);
        assert_eq!(driver.stats().bytes_in_use, MIB);
        let free_legacy = driver.function::<unsafe extern "C" fn(u32) -> CUresult>("cuMemFree");
        assert_eq!(free_legacy(pointer), CUDA_SUCCESS);
    }
    assert_eq!(driver.stats().bytes_in_use, 0);
}

#[test]
fn device_contexts_and_streams() {
    let driver = Driver::initialized("device");
    let mut name = [0 as c_char; 64];
    let mut short = [0 as c_char; 6];
    let mut uuid = [0u8; 16];
    let (mut context, mut current, mut stream): (Handle, Handle, Handle) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    let mut device: c_int = -1;
    type NameFn = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> CUresult;
    type UuidFn = unsafe extern "C" fn(*mut [u8; 16], c_int) -> CUresult;
    type HandleOutFn = unsafe extern "C" fn(*mut Handle, c_int) -> CUresult;
    type HandleFn = unsafe extern "C" fn(Handle) -> CUresult;
    // SAFETY: the signatures of the called functions.
    unsafe {
        let get_name = driver.function::<NameFn>("cuDeviceGetName");
        assert_eq!(get_name(name.as_mut_ptr(), 64, 0), CUDA_SUCCESS);
        assert_eq!(CStr::from_ptr(name.as_ptr()).to_str(), Ok("Carve Fake GPU"));
        assert_eq!(get_name(short.as_mut_ptr(), 6, 0), CUDA_SUCCESS);
        assert_eq!(CStr::from_ptr(short.as_ptr()).to_str(), Ok("Carve"));
        assert_eq!(
            get_name(name.as_mut_ptr(), 64, 1),
            101,
            "CUDA_ERROR_INVALID_DEVICE"
        );
        assert_eq!(
            driver.function::<UuidFn>("cuDeviceGetUuid_v2")(&mut uuid, 0),
            CUDA_SUCCESS
        );
        assert_eq!(uuid[..4], [0xca, 0x4f, 0xc0, 0xde]);
        assert_eq!(
            driver.function::<HandleOutFn>("cuDevicePrimaryCtxRetain")(&mut context, 0),
            CUDA_SUCCESS
        );
        let get_device =
            driver.function::<unsafe extern "C" fn(*mut c_int) -> CUresult>("cuCtxGetDevice");
        assert_eq!(get_device(&mut device), 201, "no current context yet");
        assert_eq!(
            driver.function::<HandleFn>("cuCtxSetCurrent")(context),
            CUDA_SUCCESS
        );
        let get_current =
            driver.function::<unsafe extern "C" fn(*mut Handle) -> CUresult>("cuCtxGetCurrent");
        assert_eq!(get_current(&mut current), CUDA_SUCCESS);
        assert_eq!(current, context);
        assert_eq!(get_device(&mut device), CUDA_SUCCESS);
        assert_eq!(device, 0);
        let create_stream = driver
            .function::<unsafe extern "C" fn(*mut Handle, c_uint) -> CUresult>("cuStreamCreate");
        assert_eq!(create_stream(&mut stream, 0), CUDA_SUCCESS);
        assert_eq!(
            driver.function::<HandleFn>("cuStreamSynchronize")(stream),
            CUDA_SUCCESS
        );
        assert_eq!(
            driver.function::<HandleFn>("cuStreamDestroy_v2")(stream),
            CUDA_SUCCESS
        );
        assert_eq!(
            driver.function::<HandleFn>("cuStreamSynchronize")(stream),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(
            driver.function::<HandleFn>("cuStreamSynchronize_ptsz")(std::ptr::null_mut()),
            CUDA_SUCCESS
        );
        let create_context = driver
            .function::<unsafe extern "C" fn(*mut Handle, c_uint, c_int) -> CUresult>(
                "cuCtxCreate_v2",
            );
        let mut own = std::ptr::null_mut();
        assert_eq!(create_context(&mut own, 0, 0), CUDA_SUCCESS);
        assert_eq!(get_current(&mut current), CUDA_SUCCESS);
        assert_eq!(current, own, "a created context is current");
        assert_eq!(
            driver.function::<HandleFn>("cuCtxDestroy_v2")(own),
            CUDA_SUCCESS
        );
        assert_eq!(
            driver.function::<unsafe extern "C" fn(c_int) -> CUresult>(
                "cuDevicePrimaryCtxRelease_v2"
            )(0),
            CUDA_SUCCESS
        );
        assert_eq!(
            driver.function::<unsafe extern "C" fn() -> CUresult>("cuCtxSynchronize")(),
            CUDA_SUCCESS
        );
    }
}

#[test]
fn error_names_and_strings() {
    let driver = Driver::load("errors");
    type DescribeFn = unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult;
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: the signatures of the called functions; the strings are static C strings.
    unsafe {
        assert_eq!(
            driver.function::<DescribeFn>("cuGetErrorName")(2, &mut text),
            CUDA_SUCCESS
        );
        assert_eq!(
            CStr::from_ptr(text).to_str(),
            Ok("CUDA_ERROR_OUT_OF_MEMORY")
        );
        assert_eq!(
            driver.function::<DescribeFn>("cuGetErrorString")(2, &mut text),
            CUDA_SUCCESS
        );
        assert_eq!(CStr::from_ptr(text).to_str(), Ok("out of memory"));
        assert_eq!(
            driver.function::<DescribeFn>("cuGetErrorName")(12345, &mut text),
            CUDA_ERROR_INVALID_VALUE
        );
        assert!(text.is_null());
    }
}

/// Threads allocating and freeing at once: the numbers come out exact.
#[test]
fn many_threads_at_once_keep_the_numbers_exact() {
    let driver = Driver::initialized("threads");
    std::thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(|| {
                let kept: Vec<u64> = (0..200)
                    .map(|round| {
                        let pointer = driver.alloc(4096).expect("4 KiB");
                        if round % 2 == 0 {
                            assert_eq!(driver.free(pointer), CUDA_SUCCESS);
                            0
                        } else {
                            pointer
                        }
                    })
                    .filter(|pointer| *pointer != 0)
                    .collect();
                assert_eq!(kept.len(), 100);
            });
        }
    });
    let stats = driver.stats();
    assert_eq!(stats.allocation_count, 800);
    assert_eq!(stats.bytes_in_use, 800 * 4096);
}

/// `CARVE_FAKE_CUDA_TOTAL_BYTES` is read from the environment of the process, so this test
/// runs itself again as a child with the variable set.
#[test]
fn the_capacity_comes_from_the_environment() {
    const CHILD_MARK: &str = "CARVE_FAKE_DRIVER_TEST_CHILD";
    match std::env::var(CHILD_MARK).as_deref() {
        Ok("sized") => {
            let driver = Driver::initialized("environment_sized");
            assert_eq!(driver.memory_info(), (64 * MIB, 64 * MIB));
            assert_eq!(driver.alloc(64 * MIB + 1), Err(CUDA_ERROR_OUT_OF_MEMORY));
            assert_eq!(driver.stats().capacity, 64 * MIB);
        }
        Ok("garbled") => {
            let driver = Driver::load("environment_garbled");
            // SAFETY: cuInit's signature.
            let code = unsafe { driver.function::<InitFn>("cuInit")(0) };
            assert_eq!(
                code, CUDA_ERROR_INVALID_VALUE,
                "an unreadable capacity fails cuInit"
            );
        }
        _ => {
            for (mark, capacity) in [("sized", "67108864"), ("garbled", "64M")] {
                let status = std::process::Command::new(std::env::current_exe().expect("own path"))
                    .args([
                        "--exact",
                        "the_capacity_comes_from_the_environment",
                        "--nocapture",
                    ])
                    .env(CHILD_MARK, mark)
                    .env("CARVE_FAKE_CUDA_TOTAL_BYTES", capacity)
                    .status()
                    .expect("run the test binary again");
                assert!(status.success(), "the {mark} child failed");
            }
        }
    }
}

#[test]
fn nvml_reports_the_drivers_memory() {
    #[repr(C)]
    #[derive(Default)]
    struct MemoryV1 {
        total: u64,
        free: u64,
        used: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct MemoryV2 {
        version: c_uint,
        total: u64,
        reserved: u64,
        free: u64,
        used: u64,
    }
    let driver = Driver::initialized("nvml");
    let pointer = driver.alloc(10 * MIB).expect("10 MiB");
    let mut device: Handle = std::ptr::null_mut();
    let (mut v1, mut v2, mut count) = (MemoryV1::default(), MemoryV2::default(), 0u32);
    type NoArgumentFn = unsafe extern "C" fn() -> u32;
    // SAFETY: NVML's signatures of the called functions.
    unsafe {
        let count_fn =
            driver.function::<unsafe extern "C" fn(*mut c_uint) -> u32>("nvmlDeviceGetCount_v2");
        assert_eq!(
            count_fn(&mut count),
            1,
            "NVML_ERROR_UNINITIALIZED before nvmlInit"
        );
        assert_eq!(driver.function::<NoArgumentFn>("nvmlInit_v2")(), 0);
        assert_eq!(count_fn(&mut count), 0);
        assert_eq!(count, 1);
        let by_index = driver.function::<unsafe extern "C" fn(c_uint, *mut Handle) -> u32>(
            "nvmlDeviceGetHandleByIndex_v2",
        );
        assert_eq!(by_index(0, &mut device), 0);
        let info = driver.function::<unsafe extern "C" fn(Handle, *mut MemoryV1) -> u32>(
            "nvmlDeviceGetMemoryInfo",
        );
        assert_eq!(info(device, &mut v1), 0);
        let info_v2 = driver.function::<unsafe extern "C" fn(Handle, *mut MemoryV2) -> u32>(
            "nvmlDeviceGetMemoryInfo_v2",
        );
        assert_eq!(
            info_v2(device, &mut v2),
            25,
            "NVML_ERROR_ARGUMENT_VERSION_MISMATCH without the version"
        );
        v2.version = size_of::<MemoryV2>() as u32 | (2 << 24);
        assert_eq!(info_v2(device, &mut v2), 0);
        let error_string =
            driver.function::<unsafe extern "C" fn(u32) -> *const c_char>("nvmlErrorString");
        assert_eq!(
            CStr::from_ptr(error_string(1)).to_str(),
            Ok("Uninitialized")
        );
        assert_eq!(driver.function::<NoArgumentFn>("nvmlShutdown")(), 0);
        assert_eq!(count_fn(&mut count), 1);
    }
    assert_eq!(
        (v1.total, v1.used, v1.free),
        (16 * GIB, 10 * MIB, 16 * GIB - 10 * MIB)
    );
    assert_eq!(
        (v2.total, v2.used, v2.free, v2.reserved),
        (16 * GIB, 10 * MIB, 16 * GIB - 10 * MIB, 0)
    );
    assert_eq!(driver.free(pointer), CUDA_SUCCESS);
}

/// Programs load the driver as `libcuda.so.1` and NVML as `libnvidia-ml.so.1`, links to one
/// file: the loader maps it once, so NVML reports what the CUDA side allocated.
#[test]
fn cuda_and_nvml_links_to_one_file_share_one_driver() {
    let directory = std::env::temp_dir().join(format!(
        "carve-fake-driver-tests-{}/links",
        std::process::id()
    ));
    std::fs::create_dir_all(&directory).expect("links directory");
    let copy = directory.join("libcarve_fake_driver.so");
    std::fs::copy(library_path(), &copy).expect("a private copy");
    let open = |name: &str| {
        let link = directory.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&copy, &link).expect("symlink");
        let path = std::ffi::CString::new(link.to_str().expect("UTF-8")).expect("no NUL");
        // SAFETY: dlopen of the fake driver through a link to it.
        unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) }
    };
    let cuda = open("libcuda.so.1");
    let nvml = open("libnvidia-ml.so.1");
    assert!(!cuda.is_null() && !nvml.is_null());
    assert_eq!(cuda, nvml, "one file, one mapping");
    let symbol = |handle: *mut c_void, name: &std::ffi::CStr| {
        // SAFETY: dlsym on a live handle with a NUL-terminated name.
        let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
        assert!(!address.is_null(), "{name:?}");
        address
    };
    let mut pointer = 0u64;
    let mut device: Handle = std::ptr::null_mut();
    let mut memory = [0u64; 3];
    // SAFETY: the signatures of cuInit, cuMemAlloc_v2, nvmlInit_v2,
    // nvmlDeviceGetHandleByIndex_v2 and nvmlDeviceGetMemoryInfo (nvmlMemory_t: three u64).
    unsafe {
        let init: InitFn = std::mem::transmute(symbol(cuda, c"cuInit"));
        assert_eq!(init(0), CUDA_SUCCESS);
        let alloc: AllocFn = std::mem::transmute(symbol(cuda, c"cuMemAlloc_v2"));
        assert_eq!(alloc(&mut pointer, (3 * MIB) as usize), CUDA_SUCCESS);
        let nvml_init: unsafe extern "C" fn() -> u32 =
            std::mem::transmute(symbol(nvml, c"nvmlInit_v2"));
        assert_eq!(nvml_init(), 0);
        let by_index: unsafe extern "C" fn(c_uint, *mut Handle) -> u32 =
            std::mem::transmute(symbol(nvml, c"nvmlDeviceGetHandleByIndex_v2"));
        assert_eq!(by_index(0, &mut device), 0);
        let info: unsafe extern "C" fn(Handle, *mut [u64; 3]) -> u32 =
            std::mem::transmute(symbol(nvml, c"nvmlDeviceGetMemoryInfo"));
        assert_eq!(info(device, &mut memory), 0);
    }
    assert_eq!(
        memory,
        [16 * GIB, 16 * GIB - 3 * MIB, 3 * MIB],
        "total, free, used"
    );
}
