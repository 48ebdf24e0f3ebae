//! `cuGetProcAddress` and `cuGetProcAddress_v2` give the export the real driver would for
//! the caller's CUDA version and stream flags, as the CUDA runtime and PyTorch ask.

#![allow(unsafe_code)]

mod common;

use std::ffi::{CString, c_int, c_void};

use common::*;

const LEGACY_STREAM: u64 = 1;
const PER_THREAD_STREAM: u64 = 2;

/// (base name, version, flags, the export expected).
const EXPECTED: &[(&str, c_int, u64, &str)] = &[
    ("cuMemAlloc", 2000, 0, "cuMemAlloc"),
    ("cuMemAlloc", 11080, 0, "cuMemAlloc_v2"),
    ("cuMemAlloc", 12000, PER_THREAD_STREAM, "cuMemAlloc_v2"),
    ("cuMemAlloc", 13000, LEGACY_STREAM, "cuMemAlloc_v2"),
    ("cuMemFree", 12000, 0, "cuMemFree_v2"),
    ("cuMemGetInfo", 13000, 0, "cuMemGetInfo_v2"),
    ("cuMemGetInfo", 3000, 0, "cuMemGetInfo"),
    ("cuDeviceTotalMem", 11080, 0, "cuDeviceTotalMem_v2"),
    ("cuMemAllocPitch", 12000, 0, "cuMemAllocPitch_v2"),
    ("cuMemAllocManaged", 13000, 0, "cuMemAllocManaged"),
    ("cuMemAllocAsync", 11080, 0, "cuMemAllocAsync"),
    (
        "cuMemAllocAsync",
        11080,
        PER_THREAD_STREAM,
        "cuMemAllocAsync_ptsz",
    ),
    ("cuMemAllocAsync", 13000, LEGACY_STREAM, "cuMemAllocAsync"),
    (
        "cuMemAllocFromPoolAsync",
        12000,
        PER_THREAD_STREAM,
        "cuMemAllocFromPoolAsync_ptsz",
    ),
    (
        "cuMemFreeAsync",
        13000,
        PER_THREAD_STREAM,
        "cuMemFreeAsync_ptsz",
    ),
    ("cuMemFreeAsync", 12000, 0, "cuMemFreeAsync"),
    (
        "cuStreamSynchronize",
        12000,
        PER_THREAD_STREAM,
        "cuStreamSynchronize_ptsz",
    ),
    (
        "cuMemcpyHtoD",
        12000,
        PER_THREAD_STREAM,
        "cuMemcpyHtoD_v2_ptds",
    ),
    ("cuMemcpyDtoH", 11080, 0, "cuMemcpyDtoH_v2"),
    ("cuMemCreate", 11080, 0, "cuMemCreate"),
    ("cuMemCreate", 13000, PER_THREAD_STREAM, "cuMemCreate"),
    ("cuMemRelease", 12000, 0, "cuMemRelease"),
    ("cuMemMap", 12000, 0, "cuMemMap"),
    ("cuMemPoolCreate", 12000, 0, "cuMemPoolCreate"),
    ("cuMemPoolTrimTo", 13000, 0, "cuMemPoolTrimTo"),
    (
        "cuDeviceGetDefaultMemPool",
        11080,
        0,
        "cuDeviceGetDefaultMemPool",
    ),
    ("cuArrayCreate", 12000, 0, "cuArrayCreate_v2"),
    ("cuArray3DCreate", 13000, 0, "cuArray3DCreate_v2"),
    ("cuMipmappedArrayCreate", 11080, 0, "cuMipmappedArrayCreate"),
    ("cuCtxCreate", 11080, 0, "cuCtxCreate_v3"),
    ("cuCtxCreate", 13000, 0, "cuCtxCreate_v4"),
    ("cuCtxCreate", 4000, 0, "cuCtxCreate_v2"),
    ("cuCtxDestroy", 12000, 0, "cuCtxDestroy_v2"),
    (
        "cuDevicePrimaryCtxRelease",
        11080,
        0,
        "cuDevicePrimaryCtxRelease_v2",
    ),
    ("cuDeviceGetUuid", 11080, 0, "cuDeviceGetUuid_v2"),
    ("cuDeviceGetUuid", 10000, 0, "cuDeviceGetUuid"),
    ("cuGetProcAddress", 11080, 0, "cuGetProcAddress"),
    ("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2"),
    ("cuInit", 13000, 0, "cuInit"),
    (
        "cuArrayGetMemoryRequirements",
        12000,
        0,
        "cuArrayGetMemoryRequirements",
    ),
];

fn query(
    driver: &Driver,
    name: &str,
    version: c_int,
    flags: u64,
) -> (CUresult, *mut c_void, c_int) {
    let name = CString::new(name).expect("no NUL");
    let mut function = std::ptr::dangling_mut::<c_void>();
    let mut status: c_int = -1;
    // SAFETY: cuGetProcAddress_v2's signature.
    let code = unsafe {
        driver.function::<GetProcAddressV2Fn>("cuGetProcAddress_v2")(
            name.as_ptr(),
            &mut function,
            version,
            flags,
            &mut status,
        )
    };
    (code, function, status)
}

#[test]
fn each_base_name_maps_to_the_versioned_export() {
    // Before cuInit, as the CUDA runtime asks.
    let driver = Driver::load("mapping");
    for (name, version, flags, export) in EXPECTED {
        let (code, function, status) = query(&driver, name, *version, *flags);
        assert_eq!(
            (code, status),
            (CUDA_SUCCESS, 0),
            "{name} at {version}, flags {flags}"
        );
        assert_eq!(
            function,
            driver.address(export),
            "{name} at {version}, flags {flags} -> {export}"
        );
    }
}

#[test]
fn unknown_names_and_too_old_versions_are_not_found() {
    let driver = Driver::load("not_found");
    // (name, version, flags, expected code, expected CUdriverProcAddressQueryResult, why)
    let cases: &[(&str, c_int, u64, CUresult, c_int, &str)] = &[
        (
            "cuNoSuchFunction",
            13000,
            0,
            CUDA_ERROR_NOT_FOUND,
            1,
            "unknown",
        ),
        (
            "cuMemAlloc_v2",
            13000,
            0,
            CUDA_ERROR_NOT_FOUND,
            1,
            "exports are not base names",
        ),
        (
            "cuMemAllocAsync",
            11000,
            0,
            CUDA_ERROR_NOT_FOUND,
            2,
            "VERSION_NOT_SUFFICIENT",
        ),
    ];
    for (name, version, flags, code, status, why) in cases {
        let answer = query(&driver, name, *version, *flags);
        assert_eq!(answer, (*code, std::ptr::null_mut(), *status), "{why}");
    }
    let (code, _, _) = query(&driver, "cuMemAlloc", 13000, 4);
    assert_eq!(code, CUDA_ERROR_INVALID_VALUE, "unknown flags");
}

#[test]
fn the_four_argument_version_and_a_call_through_the_pointer() {
    let driver = Driver::initialized("four_arguments");
    let name = CString::new("cuMemAlloc").expect("no NUL");
    let mut function: *mut c_void = std::ptr::null_mut();
    // SAFETY: cuGetProcAddress's signature, then cuMemAlloc_v2's through the pointer it gave.
    unsafe {
        let get = driver.function::<GetProcAddressFn>("cuGetProcAddress");
        assert_eq!(get(name.as_ptr(), &mut function, 12000, 0), CUDA_SUCCESS);
        assert_eq!(
            get(name.as_ptr(), std::ptr::null_mut(), 12000, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            get(std::ptr::null(), &mut function, 12000, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        let alloc = std::mem::transmute::<*mut c_void, AllocFn>(function);
        let mut pointer = 0;
        assert_eq!(alloc(&mut pointer, 1 << 20), CUDA_SUCCESS);
    }
    assert_eq!(driver.stats().bytes_in_use, MIB);
}
