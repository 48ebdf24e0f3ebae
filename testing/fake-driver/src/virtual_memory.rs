//! Virtual memory management: `cuMemCreate`/`cuMemRelease` (physical memory, counted
//! against the capacity), `cuMemAddressReserve`/`cuMemAddressFree` (address space only),
//! `cuMemMap`/`cuMemUnmap`, `cuMemSetAccess` and `cuMemGetAllocationGranularity`
//! (PyTorch's expandable segments use all of them).
//!
//! As in the real driver, physical memory is freed when its handle has been released AND
//! every mapping of it is gone: `cuMemRelease` of a mapped handle keeps the bytes counted
//! until the last `cuMemUnmap`. A reservation is host address space (`MAP_NORESERVE`), so
//! mapped ranges can be read and written; two mappings of one handle do not share
//! contents, which no test needs.

#![allow(unsafe_code)]
// The exports' safety contract is the CUDA driver API's: valid or null pointers.
#![allow(clippy::missing_safety_doc)]

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_int, c_ulonglong, c_void};

use crate::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CUdeviceptr, CUresult,
    GRANULARITY, answer_call, host_memory, initialized_call,
};

/// `CUmemGenericAllocationHandle`.
pub type CUmemGenericAllocationHandle = u64;

#[derive(Debug)]
struct Physical {
    bytes: u64,
    released: bool,
    mapping_count: u64,
}

#[derive(Debug, Clone, Copy)]
struct Mapping {
    length: u64,
    handle: CUmemGenericAllocationHandle,
}

/// The physical handles, reservations and mappings.
#[derive(Debug, Default)]
pub(crate) struct VirtualMemory {
    physical: HashMap<CUmemGenericAllocationHandle, Physical>,
    physical_bytes: u64,
    /// Start -> length of each `cuMemAddressReserve` range.
    reservations: BTreeMap<u64, u64>,
    /// Start -> mapping, for each `cuMemMap`.
    mappings: BTreeMap<u64, Mapping>,
}

impl VirtualMemory {
    /// Physical bytes not yet freed.
    pub fn physical_bytes(&self) -> u64 {
        self.physical_bytes
    }

    /// Physical handles not yet released (a released but still mapped one is the program's
    /// no more).
    pub fn live_handles(&self) -> u64 {
        self.physical
            .values()
            .filter(|entry| !entry.released)
            .count() as u64
    }

    /// Whether every byte of `[start, start + length)` is mapped.
    pub fn range_is_mapped(&self, start: u64, length: u64) -> bool {
        let Some(end) = start.checked_add(length) else {
            return false;
        };
        let mut covered_to = start;
        let first = self
            .mappings
            .range(..=start)
            .next_back()
            .map_or(start, |(first_start, _)| *first_start);
        for (mapping_start, mapping) in self.mappings.range(first..end) {
            if *mapping_start > covered_to {
                return false;
            }
            covered_to = covered_to.max(mapping_start + mapping.length);
            if covered_to >= end {
                return true;
            }
        }
        covered_to >= end
    }

    fn inside_one_reservation(&self, start: u64, length: u64) -> bool {
        self.reservations.range(..=start).next_back().is_some_and(
            |(reservation_start, reservation_length)| {
                start.saturating_add(length) <= reservation_start + reservation_length
            },
        )
    }

    fn overlaps_a_mapping(&self, start: u64, end: u64) -> bool {
        let before = self
            .mappings
            .range(..start)
            .next_back()
            .is_some_and(|(mapping_start, mapping)| mapping_start + mapping.length > start);
        before || self.mappings.range(start..end).next().is_some()
    }

    /// Forgets a physical handle's bytes once it is released and unmapped.
    fn free_if_unused(&mut self, handle: CUmemGenericAllocationHandle) {
        if let Some(entry) = self.physical.get(&handle)
            && entry.released
            && entry.mapping_count == 0
        {
            self.physical_bytes -= entry.bytes;
            self.physical.remove(&handle);
        }
    }
}

fn is_granular(value: u64) -> bool {
    value > 0 && value.is_multiple_of(GRANULARITY)
}

/// `cuMemCreate`: the size must be a positive multiple of the granularity; the properties
/// must be there (their contents are not checked: one device, one kind of memory).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle_out: *mut CUmemGenericAllocationHandle,
    bytes: usize,
    properties: *const c_void,
    flags: c_ulonglong,
) -> CUresult {
    answer_call(handle_out, |state| {
        let bytes = bytes as u64;
        if properties.is_null() || flags != 0 || !is_granular(bytes) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if !state.fits(bytes) {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let handle = state.new_handle();
        let memory = &mut state.virtual_memory;
        let physical = Physical {
            bytes,
            released: false,
            mapping_count: 0,
        };
        memory.physical.insert(handle, physical);
        memory.physical_bytes += bytes;
        Ok(handle)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    initialized_call(|state| {
        let memory = &mut state.virtual_memory;
        match memory.physical.get_mut(&handle) {
            Some(entry) if !entry.released => entry.released = true,
            _ => return CUDA_ERROR_INVALID_VALUE,
        }
        memory.free_if_unused(handle);
        CUDA_SUCCESS
    })
}

/// `cuMemAddressReserve`: the address hint is ignored; the range is aligned to the larger of
/// the granularity and `alignment`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    pointer_out: *mut CUdeviceptr,
    length: usize,
    alignment: usize,
    _address_hint: CUdeviceptr,
    flags: c_ulonglong,
) -> CUresult {
    answer_call(pointer_out, |state| {
        let alignment_is_valid = alignment == 0 || alignment.is_power_of_two();
        if flags != 0 || !is_granular(length as u64) || !alignment_is_valid {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let alignment = alignment.max(GRANULARITY as usize);
        let start = host_memory::map_aligned(length, alignment).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        state
            .virtual_memory
            .reservations
            .insert(start, length as u64);
        Ok(start)
    })
}

/// `cuMemAddressFree`: the whole reservation, with nothing mapped in it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressFree(start: CUdeviceptr, length: usize) -> CUresult {
    initialized_call(|state| {
        let memory = &mut state.virtual_memory;
        let length = length as u64;
        if memory.reservations.get(&start) != Some(&length)
            || memory.overlaps_a_mapping(start, start.saturating_add(length))
        {
            return CUDA_ERROR_INVALID_VALUE;
        }
        memory.reservations.remove(&start);
        host_memory::unmap_exact(start, length as usize);
        CUDA_SUCCESS
    })
}

/// `cuMemMap`: maps `[offset, offset + length)` of a live physical handle at `start`, inside
/// one reservation, over nothing already mapped.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    start: CUdeviceptr,
    length: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: c_ulonglong,
) -> CUresult {
    initialized_call(|state| {
        let memory = &mut state.virtual_memory;
        let (length, offset) = (length as u64, offset as u64);
        let fits_handle = memory.physical.get(&handle).is_some_and(|entry| {
            !entry.released
                && offset
                    .checked_add(length)
                    .is_some_and(|end| end <= entry.bytes)
        });
        if flags != 0
            || !is_granular(length)
            || !fits_handle
            || !memory.inside_one_reservation(start, length)
            || memory.overlaps_a_mapping(start, start.saturating_add(length))
        {
            return CUDA_ERROR_INVALID_VALUE;
        }
        memory.mappings.insert(start, Mapping { length, handle });
        if let Some(entry) = memory.physical.get_mut(&handle) {
            entry.mapping_count += 1;
        }
        CUDA_SUCCESS
    })
}

/// `cuMemUnmap`: unmaps every mapping in the range, which must cover whole mappings and at
/// least one; their pages are discarded.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(start: CUdeviceptr, length: usize) -> CUresult {
    initialized_call(|state| {
        let memory = &mut state.virtual_memory;
        let Some(end) = start.checked_add(length as u64) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        let straddles_start = memory
            .mappings
            .range(..start)
            .next_back()
            .is_some_and(|(mapping_start, mapping)| mapping_start + mapping.length > start);
        let inside: Vec<(u64, Mapping)> = memory
            .mappings
            .range(start..end)
            .map(|(mapping_start, mapping)| (*mapping_start, *mapping))
            .collect();
        let straddles_end = inside
            .last()
            .is_some_and(|(mapping_start, mapping)| mapping_start + mapping.length > end);
        if inside.is_empty() || straddles_start || straddles_end {
            return CUDA_ERROR_INVALID_VALUE;
        }
        for (mapping_start, mapping) in inside {
            memory.mappings.remove(&mapping_start);
            host_memory::discard(mapping_start, mapping.length as usize);
            if let Some(entry) = memory.physical.get_mut(&mapping.handle) {
                entry.mapping_count -= 1;
            }
            memory.free_if_unused(mapping.handle);
        }
        CUDA_SUCCESS
    })
}

/// `cuMemSetAccess`: the range must be mapped and at least one descriptor given; access is
/// always read-write here.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    start: CUdeviceptr,
    length: usize,
    descriptors: *const c_void,
    count: usize,
) -> CUresult {
    initialized_call(|state| {
        if descriptors.is_null()
            || count == 0
            || !state.virtual_memory.range_is_mapped(start, length as u64)
        {
            return CUDA_ERROR_INVALID_VALUE;
        }
        CUDA_SUCCESS
    })
}

/// `cuMemGetAllocationGranularity`: 2 MiB, minimum and recommended alike.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity_out: *mut usize,
    properties: *const c_void,
    option: c_int,
) -> CUresult {
    answer_call(granularity_out, |_| {
        if properties.is_null() || !(0..=1).contains(&option) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(GRANULARITY as usize)
    })
}
