//! The other ways the fake driver gives out memory: stream-ordered pools (reserved until a
//! synchronization), virtual memory (physical handles and mappings) and arrays (sized from
//! their descriptors), each checked against `carveFakeDriverStats`.

#![allow(unsafe_code)]

mod common;

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};

use common::*;

const RELEASE_THRESHOLD: c_int = 4;
const RESERVED_MEM_CURRENT: c_int = 5;
const RESERVED_MEM_HIGH: c_int = 6;
const USED_MEM_CURRENT: c_int = 7;

type PoolOutFn = unsafe extern "C" fn(*mut Handle, c_int) -> CUresult;
type PoolAttributeFn = unsafe extern "C" fn(Handle, c_int, *mut c_void) -> CUresult;
type HandleFn = unsafe extern "C" fn(Handle) -> CUresult;

fn pool_attribute(driver: &Driver, pool: Handle, attribute: c_int) -> u64 {
    let mut value = 0u64;
    // SAFETY: cuMemPoolGetAttribute's signature; the byte attributes are cuuint64_t.
    let code = unsafe {
        driver.function::<PoolAttributeFn>("cuMemPoolGetAttribute")(
            pool,
            attribute,
            (&raw mut value).cast(),
        )
    };
    assert_eq!(code, CUDA_SUCCESS);
    value
}

fn alloc_async(driver: &Driver, export: &str, bytes: u64) -> Result<u64, CUresult> {
    let mut pointer = 0;
    // SAFETY: cuMemAllocAsync(_ptsz)'s signature.
    let code = unsafe {
        driver.function::<AllocAsyncFn>(export)(&mut pointer, bytes as usize, std::ptr::null_mut())
    };
    if code == CUDA_SUCCESS {
        Ok(pointer)
    } else {
        Err(code)
    }
}

#[test]
fn async_frees_stay_reserved_until_a_synchronization() {
    let driver = Driver::initialized("pools_reserved");
    let mut pool: Handle = std::ptr::null_mut();
    // SAFETY: cuDeviceGetMemPool's signature.
    let code = unsafe { driver.function::<PoolOutFn>("cuDeviceGetMemPool")(&mut pool, 0) };
    assert_eq!(code, CUDA_SUCCESS);
    let first = alloc_async(&driver, "cuMemAllocAsync", 8 * MIB).expect("8 MiB");
    let second = alloc_async(&driver, "cuMemAllocAsync_ptsz", 4 * MIB).expect("4 MiB");
    assert_eq!(
        pool_attribute(&driver, pool, RESERVED_MEM_CURRENT),
        12 * MIB
    );
    assert_eq!(pool_attribute(&driver, pool, USED_MEM_CURRENT), 12 * MIB);
    // SAFETY: cuMemFreeAsync's signature.
    let code =
        unsafe { driver.function::<FreeAsyncFn>("cuMemFreeAsync")(first, std::ptr::null_mut()) };
    assert_eq!(code, CUDA_SUCCESS);
    assert_eq!(pool_attribute(&driver, pool, USED_MEM_CURRENT), 4 * MIB);
    assert_eq!(
        pool_attribute(&driver, pool, RESERVED_MEM_CURRENT),
        12 * MIB,
        "still reserved"
    );
    assert_eq!(
        driver.stats(),
        Stats {
            bytes_in_use: 12 * MIB,
            pool_reserved_bytes: 12 * MIB,
            allocation_count: 1,
            capacity: 16 * GIB
        }
    );
    // The unused reserve is reused without growing the pool.
    let third = alloc_async(&driver, "cuMemAllocAsync", 6 * MIB).expect("6 MiB from the reserve");
    assert_eq!(
        pool_attribute(&driver, pool, RESERVED_MEM_CURRENT),
        12 * MIB
    );
    let fourth = alloc_async(&driver, "cuMemAllocAsync", 4 * MIB).expect("4 MiB, 2 of them new");
    assert_eq!(
        pool_attribute(&driver, pool, RESERVED_MEM_CURRENT),
        14 * MIB
    );
    // SAFETY: cuMemFreeAsync_ptsz's and cuStreamSynchronize's signatures.
    unsafe {
        let free_async = driver.function::<FreeAsyncFn>("cuMemFreeAsync_ptsz");
        for pointer in [second, third, fourth] {
            assert_eq!(free_async(pointer, std::ptr::null_mut()), CUDA_SUCCESS);
        }
        assert_eq!(
            free_async(pointer_never_given(), std::ptr::null_mut()),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            driver.stats().bytes_in_use,
            14 * MIB,
            "all unused, all reserved"
        );
        assert_eq!(
            driver.function::<HandleFn>("cuStreamSynchronize")(std::ptr::null_mut()),
            CUDA_SUCCESS
        );
    }
    assert_eq!(
        pool_attribute(&driver, pool, RESERVED_MEM_CURRENT),
        0,
        "threshold 0: all released"
    );
    assert_eq!(pool_attribute(&driver, pool, RESERVED_MEM_HIGH), 14 * MIB);
    assert_eq!(
        driver.stats(),
        Stats {
            capacity: 16 * GIB,
            ..Stats::default()
        }
    );
}

fn pointer_never_given() -> u64 {
    0x7777_0000
}

#[test]
fn the_release_threshold_and_trim_decide_what_stays_reserved() {
    let driver = Driver::initialized("pools_threshold");
    let mut pool: Handle = std::ptr::null_mut();
    let mut threshold = 6 * MIB;
    // SAFETY: the signatures of the called functions.
    unsafe {
        assert_eq!(
            driver.function::<PoolOutFn>("cuDeviceGetDefaultMemPool")(&mut pool, 0),
            CUDA_SUCCESS
        );
        let set = driver.function::<PoolAttributeFn>("cuMemPoolSetAttribute");
        assert_eq!(
            set(pool, RELEASE_THRESHOLD, (&raw mut threshold).cast()),
            CUDA_SUCCESS
        );
        assert_eq!(
            set(pool, RESERVED_MEM_CURRENT, (&raw mut threshold).cast()),
            CUDA_ERROR_INVALID_VALUE
        );
    }
    assert_eq!(pool_attribute(&driver, pool, RELEASE_THRESHOLD), 6 * MIB);
    let pointer = alloc_async(&driver, "cuMemAllocAsync", 10 * MIB).expect("10 MiB");
    // SAFETY: the signatures of the called functions.
    unsafe {
        assert_eq!(
            driver.function::<FreeAsyncFn>("cuMemFreeAsync")(pointer, std::ptr::null_mut()),
            CUDA_SUCCESS
        );
        assert_eq!(
            driver.function::<unsafe extern "C" fn() -> CUresult>("cuCtxSynchronize")(),
            CUDA_SUCCESS
        );
        assert_eq!(
            pool_attribute(&driver, pool, RESERVED_MEM_CURRENT),
            6 * MIB,
            "kept up to the threshold"
        );
        let trim =
            driver.function::<unsafe extern "C" fn(Handle, usize) -> CUresult>("cuMemPoolTrimTo");
        assert_eq!(trim(pool, (2 * MIB) as usize), CUDA_SUCCESS);
        assert_eq!(pool_attribute(&driver, pool, RESERVED_MEM_CURRENT), 2 * MIB);
        assert_eq!(trim(pool, 0), CUDA_SUCCESS);
    }
    assert_eq!(driver.stats().bytes_in_use, 0);
}

#[test]
fn own_pools_count_their_reserve_and_outlive_destroy_until_freed() {
    let driver = Driver::initialized("pools_own");
    // CUmemPoolProps: the fake only needs it to be there.
    let properties = [0u8; 88];
    let mut pool: Handle = std::ptr::null_mut();
    let mut pointer = 0u64;
    type CreateFn = unsafe extern "C" fn(*mut Handle, *const c_void) -> CUresult;
    type FromPoolFn = unsafe extern "C" fn(*mut u64, usize, Handle, Handle) -> CUresult;
    // SAFETY: the signatures of the called functions.
    unsafe {
        let create = driver.function::<CreateFn>("cuMemPoolCreate");
        assert_eq!(
            create(&mut pool, std::ptr::null()),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(create(&mut pool, properties.as_ptr().cast()), CUDA_SUCCESS);
        let from_pool = driver.function::<FromPoolFn>("cuMemAllocFromPoolAsync_ptsz");
        assert_eq!(
            from_pool(&mut pointer, (3 * MIB) as usize, pool, std::ptr::null_mut()),
            CUDA_SUCCESS
        );
        assert_eq!(
            from_pool(
                &mut pointer,
                (16 * GIB) as usize,
                pool,
                std::ptr::null_mut()
            ),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(driver.stats().pool_reserved_bytes, 3 * MIB);
        let set_current = driver
            .function::<unsafe extern "C" fn(c_int, Handle) -> CUresult>("cuDeviceSetMemPool");
        assert_eq!(set_current(0, pool), CUDA_SUCCESS);
        let on_current =
            alloc_async(&driver, "cuMemAllocAsync", MIB).expect("from the current pool");
        assert_eq!(pool_attribute(&driver, pool, USED_MEM_CURRENT), 4 * MIB);
        assert_eq!(
            driver.free(on_current),
            CUDA_SUCCESS,
            "cuMemFree_v2 takes pool pointers too"
        );
        assert_eq!(
            driver.function::<HandleFn>("cuMemPoolDestroy")(pool),
            CUDA_SUCCESS
        );
        assert_eq!(
            driver.stats().pool_reserved_bytes,
            3 * MIB,
            "the outstanding pointer keeps it"
        );
        assert_eq!(
            driver.function::<FreeAsyncFn>("cuMemFreeAsync")(pointer, std::ptr::null_mut()),
            CUDA_SUCCESS
        );
        let mut default_pool: Handle = std::ptr::null_mut();
        assert_eq!(
            driver.function::<PoolOutFn>("cuDeviceGetMemPool")(&mut default_pool, 0),
            CUDA_SUCCESS
        );
        assert_ne!(default_pool, pool, "the default pool is current again");
        assert_eq!(
            driver.function::<HandleFn>("cuMemPoolDestroy")(default_pool),
            CUDA_ERROR_INVALID_VALUE
        );
    }
    assert_eq!(
        driver.stats(),
        Stats {
            capacity: 16 * GIB,
            ..Stats::default()
        }
    );
}

type CreateFn = unsafe extern "C" fn(*mut u64, usize, *const c_void, c_ulonglong) -> CUresult;
type ReserveFn = unsafe extern "C" fn(*mut u64, usize, usize, u64, c_ulonglong) -> CUresult;
type MapFn = unsafe extern "C" fn(u64, usize, usize, u64, c_ulonglong) -> CUresult;
type RangeFn = unsafe extern "C" fn(u64, usize) -> CUresult;

#[test]
fn virtual_memory_counts_physical_handles_until_released_and_unmapped() {
    let driver = Driver::initialized("virtual_memory");
    let properties = [0u8; 32];
    let (mut granularity, mut handle, mut start) = (0usize, 0u64, 0u64);
    let two = (2 * MIB) as usize;
    // SAFETY: the signatures of the called functions.
    unsafe {
        let granularity_fn =
            driver.function::<unsafe extern "C" fn(*mut usize, *const c_void, c_int) -> CUresult>(
                "cuMemGetAllocationGranularity",
            );
        assert_eq!(
            granularity_fn(&mut granularity, properties.as_ptr().cast(), 0),
            CUDA_SUCCESS
        );
        assert_eq!(granularity, two);
        let create = driver.function::<CreateFn>("cuMemCreate");
        assert_eq!(
            create(&mut handle, two + 1, properties.as_ptr().cast(), 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            create(&mut handle, 2 * two, properties.as_ptr().cast(), 0),
            CUDA_SUCCESS
        );
        assert_eq!(driver.stats().bytes_in_use, 4 * MIB);
        assert_eq!(driver.stats().allocation_count, 1);
        let reserve = driver.function::<ReserveFn>("cuMemAddressReserve");
        assert_eq!(reserve(&mut start, 8 * two, 0, 0, 0), CUDA_SUCCESS);
        assert_eq!(start % (2 * MIB), 0);
        assert_eq!(
            driver.stats().bytes_in_use,
            4 * MIB,
            "address space costs nothing"
        );
        let map = driver.function::<MapFn>("cuMemMap");
        assert_eq!(map(start, 2 * two, 0, handle, 0), CUDA_SUCCESS);
        assert_eq!(
            map(start, two, 0, handle, 0),
            CUDA_ERROR_INVALID_VALUE,
            "already mapped there"
        );
        assert_eq!(
            map(start + 2 * two as u64, two, 0, handle, 0),
            CUDA_SUCCESS,
            "a second view"
        );
        let set_access = driver
            .function::<unsafe extern "C" fn(u64, usize, *const c_void, usize) -> CUresult>(
                "cuMemSetAccess",
            );
        assert_eq!(
            set_access(start, 3 * two, properties.as_ptr().cast(), 1),
            CUDA_SUCCESS
        );
        assert_eq!(
            set_access(start, 4 * two, properties.as_ptr().cast(), 1),
            CUDA_ERROR_INVALID_VALUE
        );
        type SetFn = unsafe extern "C" fn(u64, u8, usize) -> CUresult;
        assert_eq!(
            driver.function::<SetFn>("cuMemsetD8_v2")(start + 5, 1, 3 * two - 5),
            CUDA_SUCCESS
        );
        let release = driver.function::<unsafe extern "C" fn(u64) -> CUresult>("cuMemRelease");
        assert_eq!(release(handle), CUDA_SUCCESS);
        assert_eq!(release(handle), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            driver.stats().bytes_in_use,
            4 * MIB,
            "mapped memory stays until unmapped"
        );
        assert_eq!(driver.stats().allocation_count, 0);
        let unmap = driver.function::<RangeFn>("cuMemUnmap");
        assert_eq!(
            unmap(start, two),
            CUDA_ERROR_INVALID_VALUE,
            "half a mapping"
        );
        assert_eq!(unmap(start, 2 * two), CUDA_SUCCESS);
        assert_eq!(
            driver.stats().bytes_in_use,
            4 * MIB,
            "the second view still maps it"
        );
        let address_free = driver.function::<RangeFn>("cuMemAddressFree");
        assert_eq!(
            address_free(start, 8 * two),
            CUDA_ERROR_INVALID_VALUE,
            "still mapped"
        );
        assert_eq!(unmap(start + 2 * two as u64, two), CUDA_SUCCESS);
        assert_eq!(driver.stats().bytes_in_use, 0);
        assert_eq!(address_free(start, 8 * two), CUDA_SUCCESS);
        assert_eq!(
            create(
                &mut handle,
                (16 * GIB) as usize + two,
                properties.as_ptr().cast(),
                0
            ),
            CUDA_ERROR_OUT_OF_MEMORY
        );
    }
}

#[repr(C)]
struct ArrayDescriptor {
    width: usize,
    height: usize,
    format: c_uint,
    channel_count: c_uint,
}

#[repr(C)]
struct Array3dDescriptor {
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channel_count: c_uint,
    flags: c_uint,
}

const FORMAT_FLOAT: c_uint = 0x20;
const FORMAT_HALF: c_uint = 0x10;
const FORMAT_BC1: c_uint = 0x91;

#[test]
fn arrays_are_sized_from_their_descriptors() {
    let driver = Driver::initialized("arrays");
    let (mut flat, mut cube, mut mipmapped): (Handle, Handle, Handle) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    // SAFETY: the signatures of the called functions.
    unsafe {
        let create = driver
            .function::<unsafe extern "C" fn(*mut Handle, *const ArrayDescriptor) -> CUresult>(
                "cuArrayCreate_v2",
            );
        let descriptor = ArrayDescriptor {
            width: 1000,
            height: 10,
            format: FORMAT_FLOAT,
            channel_count: 4,
        };
        assert_eq!(create(&mut flat, &descriptor), CUDA_SUCCESS);
        assert_eq!(driver.stats().bytes_in_use, 1000 * 10 * 4 * 4);
        let compressed = ArrayDescriptor {
            width: 64,
            height: 64,
            format: FORMAT_BC1,
            channel_count: 1,
        };
        assert_eq!(
            create(&mut flat, &compressed),
            CUDA_ERROR_INVALID_VALUE,
            "the fake does not size these"
        );
        assert_eq!(
            create(&mut flat, std::ptr::null()),
            CUDA_ERROR_INVALID_VALUE
        );
        let create_3d = driver
            .function::<unsafe extern "C" fn(*mut Handle, *const Array3dDescriptor) -> CUresult>(
                "cuArray3DCreate_v2",
            );
        let cubemap = Array3dDescriptor {
            width: 64,
            height: 64,
            depth: 6,
            format: FORMAT_HALF,
            channel_count: 2,
            flags: 0x4,
        };
        assert_eq!(create_3d(&mut cube, &cubemap), CUDA_SUCCESS);
        assert_eq!(driver.stats().bytes_in_use, 160_000 + 64 * 64 * 6 * 2 * 2);
        let create_mipmapped = driver.function::<unsafe extern "C" fn(
            *mut Handle,
            *const Array3dDescriptor,
            c_uint,
        ) -> CUresult>("cuMipmappedArrayCreate");
        let square = Array3dDescriptor {
            width: 8,
            height: 8,
            depth: 0,
            format: FORMAT_FLOAT,
            channel_count: 1,
            flags: 0,
        };
        assert_eq!(create_mipmapped(&mut mipmapped, &square, 4), CUDA_SUCCESS);
        assert_eq!(
            driver.stats().bytes_in_use,
            160_000 + 98_304 + (64 + 16 + 4 + 1) * 4
        );
        assert_eq!(driver.stats().allocation_count, 3);
        type RequirementsFn = unsafe extern "C" fn(*mut [usize; 4], Handle, c_int) -> CUresult;
        let mut requirements = [0usize; 4];
        let array_requirements = driver.function::<RequirementsFn>("cuArrayGetMemoryRequirements");
        assert_eq!(array_requirements(&mut requirements, cube, 0), CUDA_SUCCESS);
        assert_eq!(requirements[0], 98_304, "the size counted");
        assert_eq!(
            array_requirements(&mut requirements, mipmapped, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        let mipmapped_requirements =
            driver.function::<RequirementsFn>("cuMipmappedArrayGetMemoryRequirements");
        assert_eq!(
            mipmapped_requirements(&mut requirements, mipmapped, 0),
            CUDA_SUCCESS
        );
        assert_eq!(requirements[0], (64 + 16 + 4 + 1) * 4);
        let destroy = driver.function::<HandleFn>("cuArrayDestroy");
        assert_eq!(destroy(flat), CUDA_SUCCESS);
        assert_eq!(destroy(flat), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(destroy(mipmapped), CUDA_ERROR_INVALID_VALUE, "not an array");
        assert_eq!(destroy(cube), CUDA_SUCCESS);
        assert_eq!(
            driver.function::<HandleFn>("cuMipmappedArrayDestroy")(mipmapped),
            CUDA_SUCCESS
        );
        let huge = Array3dDescriptor {
            width: 1 << 20,
            height: 1 << 20,
            depth: 1 << 20,
            format: FORMAT_FLOAT,
            channel_count: 4,
            flags: 0,
        };
        assert_eq!(
            create_3d(&mut cube, &huge),
            CUDA_ERROR_INVALID_VALUE,
            "overflowing size"
        );
        let big = Array3dDescriptor {
            width: 1 << 16,
            height: 1 << 16,
            depth: 2,
            format: FORMAT_FLOAT,
            channel_count: 1,
            flags: 0,
        };
        assert_eq!(create_3d(&mut cube, &big), CUDA_ERROR_OUT_OF_MEMORY);
    }
    assert_eq!(
        driver.stats(),
        Stats {
            capacity: 16 * GIB,
            ..Stats::default()
        }
    );
}
