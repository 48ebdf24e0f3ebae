//! CUDA arrays: `cuArrayCreate_v2`, `cuArray3DCreate_v2`, `cuMipmappedArrayCreate`, their
//! destroys and `cu(Mipmapped)ArrayGetMemoryRequirements` (which answer the size counted). Arrays are opaque to the program (no host memory behind them); they only
//! count against the capacity, sized from their descriptors: width x height x depth x
//! channels x the format's element size (a zero height or depth counts as 1; layered and
//! cubemap arrays carry their layers in the depth), and for a mipmapped array the sum over
//! its levels, each half the one before (at least 1). Block-compressed and video formats are
//! refused with `CUDA_ERROR_INVALID_VALUE`: the fake does not size them.

#![allow(unsafe_code)]
// The exports' safety contract is the CUDA driver API's: valid or null pointers.
#![allow(clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::ffi::c_uint;

use crate::{
    CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS,
    CUdevice, CUresult, DriverState, Handle, answer_call, handle_pointer, handle_value,
    initialized_call,
};

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ArrayDescriptor {
    pub width: usize,
    pub height: usize,
    pub format: c_uint,
    pub channel_count: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Array3dDescriptor {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: c_uint,
    pub channel_count: c_uint,
    pub flags: c_uint,
}

/// `CUDA_ARRAY_MEMORY_REQUIREMENTS`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ArrayMemoryRequirements {
    pub size: usize,
    pub alignment: usize,
    pub reserved: [c_uint; 4],
}

/// The alignment the fake answers for array memory (a texture alignment real GPUs give).
const ARRAY_ALIGNMENT: usize = 512;

/// The live arrays and mipmapped arrays by handle, with their sizes.
#[derive(Debug, Default)]
pub(crate) struct ArrayTable {
    arrays: HashMap<u64, u64>,
    mipmapped_arrays: HashMap<u64, u64>,
    bytes: u64,
}

impl ArrayTable {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn count(&self) -> u64 {
        (self.arrays.len() + self.mipmapped_arrays.len()) as u64
    }
}

/// Bytes per element of one channel, for the formats the fake sizes (`CUarray_format`).
fn element_bytes(format: c_uint) -> Option<u64> {
    match format {
        // UNSIGNED_INT8, SIGNED_INT8, UNORM_INT8X1, SNORM_INT8X1
        0x01 | 0x08 | 0xc0 | 0xc6 => Some(1),
        // UNSIGNED_INT16, SIGNED_INT16, HALF, UNORM_INT8X2, SNORM_INT8X2, UNORM_INT16X1,
        // SNORM_INT16X1
        0x02 | 0x09 | 0x10 | 0xc1 | 0xc7 | 0xc3 | 0xc9 => Some(2),
        // UNSIGNED_INT32, SIGNED_INT32, FLOAT, UNORM_INT8X4, SNORM_INT8X4, UNORM_INT16X2,
        // SNORM_INT16X2
        0x03 | 0x0a | 0x20 | 0xc2 | 0xc8 | 0xc4 | 0xca => Some(4),
        // UNORM_INT16X4, SNORM_INT16X4
        0xc5 | 0xcb => Some(8),
        _ => None,
    }
}

/// The bytes one array level takes; `None` for a descriptor the driver refuses.
fn level_bytes(
    width: u64,
    height: u64,
    depth: u64,
    format: c_uint,
    channel_count: c_uint,
) -> Option<u64> {
    if width == 0 || ![1, 2, 4].contains(&channel_count) {
        return None;
    }
    width
        .checked_mul(height.max(1))?
        .checked_mul(depth.max(1))?
        .checked_mul(u64::from(channel_count))?
        .checked_mul(element_bytes(format)?)
}

fn mipmapped_bytes(descriptor: &Array3dDescriptor, level_count: c_uint) -> Option<u64> {
    if level_count == 0 {
        return None;
    }
    let (mut width, mut height, mut depth) = (
        descriptor.width as u64,
        descriptor.height as u64,
        descriptor.depth as u64,
    );
    let mut total: u64 = 0;
    for _ in 0..level_count {
        let level = level_bytes(
            width,
            height,
            depth,
            descriptor.format,
            descriptor.channel_count,
        )?;
        total = total.checked_add(level)?;
        // A zero dimension (a 1D or 2D array) stays zero; others halve down to 1.
        width = (width / 2).max(1);
        height = if height == 0 { 0 } else { (height / 2).max(1) };
        depth = if depth == 0 { 0 } else { (depth / 2).max(1) };
    }
    Some(total)
}

/// Counts the bytes of a new array (or mipmapped array) and answers its handle.
fn create(
    state: &mut DriverState,
    bytes: Option<u64>,
    mipmapped: bool,
) -> Result<Handle, CUresult> {
    let bytes = bytes.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if !state.fits(bytes) {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let handle = state.new_handle();
    let table = &mut state.arrays;
    if mipmapped {
        table.mipmapped_arrays.insert(handle, bytes);
    } else {
        table.arrays.insert(handle, bytes);
    }
    table.bytes += bytes;
    Ok(handle_pointer(handle))
}

fn destroy(state: &mut DriverState, handle: Handle, mipmapped: bool) -> CUresult {
    let table = &mut state.arrays;
    let entries = if mipmapped {
        &mut table.mipmapped_arrays
    } else {
        &mut table.arrays
    };
    match entries.remove(&handle_value(handle)) {
        Some(bytes) => {
            table.bytes -= bytes;
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_VALUE,
    }
}

/// A copy of the caller's descriptor; null is `CUDA_ERROR_INVALID_VALUE`.
fn read_descriptor<T: Copy>(descriptor: *const T) -> Result<T, CUresult> {
    // SAFETY: CUDA's contract: a descriptor pointer is null or valid for reading one T.
    unsafe { descriptor.as_ref() }
        .copied()
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    handle_out: *mut Handle,
    descriptor: *const ArrayDescriptor,
) -> CUresult {
    answer_call(handle_out, |state| {
        let descriptor = read_descriptor(descriptor)?;
        let bytes = level_bytes(
            descriptor.width as u64,
            descriptor.height as u64,
            1,
            descriptor.format,
            descriptor.channel_count,
        );
        create(state, bytes, false)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    handle_out: *mut Handle,
    descriptor: *const Array3dDescriptor,
) -> CUresult {
    answer_call(handle_out, |state| {
        let descriptor = read_descriptor(descriptor)?;
        create(state, mipmapped_bytes(&descriptor, 1), false)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    handle_out: *mut Handle,
    descriptor: *const Array3dDescriptor,
    level_count: c_uint,
) -> CUresult {
    answer_call(handle_out, |state| {
        let descriptor = read_descriptor(descriptor)?;
        create(state, mipmapped_bytes(&descriptor, level_count), true)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(handle: Handle) -> CUresult {
    initialized_call(|state| destroy(state, handle, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(handle: Handle) -> CUresult {
    initialized_call(|state| destroy(state, handle, true))
}

/// `cu(Mipmapped)ArrayGetMemoryRequirements`: the size the fake counts for the array.
fn memory_requirements(
    requirements_out: *mut ArrayMemoryRequirements,
    handle: Handle,
    device: CUdevice,
    mipmapped: bool,
) -> CUresult {
    answer_call(requirements_out, |state| {
        if device != 0 {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        let table = &state.arrays;
        let entries = if mipmapped {
            &table.mipmapped_arrays
        } else {
            &table.arrays
        };
        let bytes = entries
            .get(&handle_value(handle))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(ArrayMemoryRequirements {
            size: *bytes as usize,
            alignment: ARRAY_ALIGNMENT,
            reserved: [0; 4],
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayGetMemoryRequirements(
    requirements_out: *mut ArrayMemoryRequirements,
    array: Handle,
    device: CUdevice,
) -> CUresult {
    memory_requirements(requirements_out, array, device, false)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayGetMemoryRequirements(
    requirements_out: *mut ArrayMemoryRequirements,
    mipmapped_array: Handle,
    device: CUdevice,
) -> CUresult {
    memory_requirements(requirements_out, mipmapped_array, device, true)
}
