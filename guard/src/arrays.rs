//! CUDA arrays (textures and surfaces): `cuArrayCreate_v2`, `cuArray3DCreate_v2`,
//! `cuMipmappedArrayCreate` and their destroys. The charge is computed from the
//! descriptor (extent times element size, every mip level), since the driver does not
//! say how much it took; layouts the guard cannot size are charged as 16-byte elements.
#![allow(unsafe_code)] // Exported C entry points reading the caller's descriptors.
#![allow(non_snake_case)] // The exported names are cuda.h's.

use crate::driver_types::{
    ARRAY3D_CUBEMAP, ARRAY3D_LAYERED, Array3dDescriptor, ArrayDescriptor, CuResult, Handle,
};
use crate::hook;
use crate::memory::{charge_around, credit_around};
use crate::real::call_real;
use crate::state::Kind;

/// Bytes of one element of `format` (`CUarray_format`) per channel.
fn element_bytes(format: u32) -> u64 {
    match format {
        0x01 | 0x08 | 0xc0 | 0xc6 => 1, // 8-bit integers, UNORM/SNORM_INT8X1
        0x02 | 0x09 | 0x10 | 0xc1 | 0xc3 | 0xc7 | 0xc9 | 0xb0 => 2, // 16-bit, INT8X2, INT16X1, NV12 (1.5 rounded up)
        0x03 | 0x0a | 0x20 | 0xc2 | 0xc4 | 0xc8 | 0xca => 4,        // 32-bit, INT8X4, INT16X2
        0xc5 | 0xcb => 8,                                           // INT16X4
        0x91..=0x9e => 1, // block-compressed: at most one byte per texel
        _ => 16,
    }
}

/// Bytes of an array of `width` x `height` x `depth` (0 meaning an absent dimension)
/// over `levels` mip levels; layered and cubemap depths are layer counts, never halved.
fn array_bytes(descriptor: &Array3dDescriptor, levels: u32) -> u64 {
    let per_element =
        element_bytes(descriptor.format).saturating_mul(u64::from(descriptor.channel_count.max(1)));
    let layers_not_depth = descriptor.flags & (ARRAY3D_LAYERED | ARRAY3D_CUBEMAP) != 0;
    let mut total: u64 = 0;
    for level in 0..levels.clamp(1, 64) {
        let shrink = |extent: usize| (extent as u64 >> level).max(1);
        let depth = if layers_not_depth {
            (descriptor.depth as u64).max(1)
        } else {
            shrink(descriptor.depth)
        };
        let texels = shrink(descriptor.width)
            .saturating_mul(shrink(descriptor.height))
            .saturating_mul(depth);
        total = total.saturating_add(texels.saturating_mul(per_element));
    }
    total
}

/// Charges what `descriptor` describes (`bytes_of`) around `create`; a null descriptor
/// goes to the driver as it is (which refuses it).
fn charge_described<D>(
    entry_point: &str,
    kind: Kind,
    handle: *mut Handle,
    descriptor: *const D,
    bytes_of: impl FnOnce(&D) -> u64,
    create: impl FnOnce() -> CuResult,
) -> CuResult {
    // SAFETY: a non-null descriptor points at the caller's descriptor of this layout.
    match unsafe { descriptor.as_ref() } {
        Some(described) => charge_around(
            entry_point,
            kind,
            bytes_of(described),
            handle.cast(),
            create,
        ),
        None => create(),
    }
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    handle: *mut Handle,
    descriptor: *const ArrayDescriptor,
) -> CuResult {
    const NAME: &str = "cuArrayCreate_v2";
    hook(NAME, || {
        let bytes_of = |flat: &ArrayDescriptor| {
            let as_3d = Array3dDescriptor {
                width: flat.width,
                height: flat.height,
                depth: 0,
                format: flat.format,
                channel_count: flat.channel_count,
                flags: 0,
            };
            array_bytes(&as_3d, 1)
        };
        charge_described(NAME, Kind::Array, handle, descriptor, bytes_of, || {
            call_real!(cuArrayCreate_v2(handle, descriptor))
        })
    })
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    handle: *mut Handle,
    descriptor: *const Array3dDescriptor,
) -> CuResult {
    const NAME: &str = "cuArray3DCreate_v2";
    hook(NAME, || {
        let bytes_of = |described: &Array3dDescriptor| array_bytes(described, 1);
        charge_described(NAME, Kind::Array, handle, descriptor, bytes_of, || {
            call_real!(cuArray3DCreate_v2(handle, descriptor))
        })
    })
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    handle: *mut Handle,
    descriptor: *const Array3dDescriptor,
    levels: u32,
) -> CuResult {
    const NAME: &str = "cuMipmappedArrayCreate";
    hook(NAME, || {
        let bytes_of = |described: &Array3dDescriptor| array_bytes(described, levels);
        charge_described(
            NAME,
            Kind::MipmappedArray,
            handle,
            descriptor,
            bytes_of,
            || call_real!(cuMipmappedArrayCreate(handle, descriptor, levels)),
        )
    })
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(handle: Handle) -> CuResult {
    hook("cuArrayDestroy", || {
        credit_around(Kind::Array, handle as u64, || {
            call_real!(cuArrayDestroy(handle))
        })
    })
}

/// # Safety
/// The caller's contract is the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(handle: Handle) -> CuResult {
    hook("cuMipmappedArrayDestroy", || {
        credit_around(Kind::MipmappedArray, handle as u64, || {
            call_real!(cuMipmappedArrayDestroy(handle))
        })
    })
}
