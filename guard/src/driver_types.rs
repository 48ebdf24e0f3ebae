//! The slice of the CUDA driver and NVML ABI the guard touches: result codes, handle
//! types and the few structures it reads. Values and layouts are cuda.h's and nvml.h's
//! (checked against cudarc's generated bindings for CUDA 11.4 to 13.0).

use std::ffi::c_void;

/// `CUresult`: an `enum` in C, passed as a 32-bit unsigned value.
pub(crate) type CuResult = u32;
/// `CUdeviceptr` on 64-bit hosts.
pub(crate) type DevicePointer = u64;
/// `CUdevice`.
pub(crate) type Device = i32;
/// `CUstream`, `CUmemoryPool`, `CUarray`, `CUmipmappedArray`: opaque handles.
pub(crate) type Handle = *mut c_void;
/// `CUmemGenericAllocationHandle`.
pub(crate) type GenericAllocationHandle = u64;
/// `nvmlReturn_t`.
pub(crate) type NvmlReturn = u32;
/// `nvmlDevice_t`.
pub(crate) type NvmlDevice = *mut c_void;

pub(crate) const CUDA_SUCCESS: CuResult = 0;
pub(crate) const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
pub(crate) const CUDA_ERROR_NOT_FOUND: CuResult = 500;
pub(crate) const CUDA_ERROR_NOT_PERMITTED: CuResult = 800;
pub(crate) const CUDA_ERROR_NOT_SUPPORTED: CuResult = 801;
pub(crate) const CUDA_ERROR_UNKNOWN: CuResult = 999;

pub(crate) const NVML_SUCCESS: NvmlReturn = 0;
/// `NVML_ERROR_UNKNOWN`: what an NVML hook answers if the guard itself failed.
pub(crate) const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`: the caller wants the `_ptsz` variants.
pub(crate) const PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;
/// `CU_GET_PROC_ADDRESS_SUCCESS` in `CUdriverProcAddressQueryResult`.
pub(crate) const PROC_ADDRESS_SYMBOL_FOUND: i32 = 0;

/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT` (a `cuuint64_t`).
pub(crate) const MEMPOOL_ATTR_RESERVED_MEM_CURRENT: u32 = 5;
/// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT` (a `cuuint64_t`).
pub(crate) const MEMPOOL_ATTR_USED_MEM_CURRENT: u32 = 7;

/// `CU_MEM_LOCATION_TYPE_DEVICE`: the only location whose `cuMemCreate` takes device memory.
pub(crate) const MEM_LOCATION_TYPE_DEVICE: u32 = 1;

/// `CUDA_ARRAY3D_LAYERED` and `CUDA_ARRAY3D_CUBEMAP`: the depth is a layer count, which
/// mip levels do not halve.
pub(crate) const ARRAY3D_LAYERED: u32 = 0x01;
pub(crate) const ARRAY3D_CUBEMAP: u32 = 0x04;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemLocation {
    pub(crate) location_type: u32,
    pub(crate) id: i32,
}

/// The head of `CUmemAllocationProp` up to the field the guard reads (the rest is never
/// touched through this type, so a shorter struct is a sound view of the driver's).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemAllocationPropHead {
    pub(crate) allocation_type: u32,
    pub(crate) requested_handle_types: u32,
    pub(crate) location: MemLocation,
}

/// `CUDA_ARRAY_DESCRIPTOR` (the `_v2` layout, with `size_t` extents).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ArrayDescriptor {
    pub(crate) width: usize,
    pub(crate) height: usize,
    pub(crate) format: u32,
    pub(crate) channel_count: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` (the `_v2` layout).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Array3dDescriptor {
    pub(crate) width: usize,
    pub(crate) height: usize,
    pub(crate) depth: usize,
    pub(crate) format: u32,
    pub(crate) channel_count: u32,
    pub(crate) flags: u32,
}

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct NvmlMemory {
    pub(crate) total: u64,
    pub(crate) free: u64,
    pub(crate) used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct NvmlMemoryV2 {
    pub(crate) version: u32,
    pub(crate) total: u64,
    pub(crate) reserved: u64,
    pub(crate) free: u64,
    pub(crate) used: u64,
}
