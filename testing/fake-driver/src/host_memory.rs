//! The host memory behind the fake device memory: anonymous `MAP_NORESERVE` mappings, so
//! an allocation's untouched pages cost nothing and its address works as a host pointer.
//!
//! Freed mappings of up to [`CACHED_MAPPING_LIMIT`] bytes are kept (a few per length) and
//! handed out again, as the real driver reuses its memory: without that, an alloc/free pair
//! costs two system calls and the guard's benchmark would measure the kernel rather than
//! the guard. Like `cuMemAlloc`, a reused block is not cleared.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::Mutex;

/// The total bytes of freed mappings kept for reuse.
const CACHED_MAPPING_LIMIT: usize = 64 << 20;
/// Freed mappings kept per length.
const CACHED_PER_LENGTH: usize = 16;

#[derive(Debug, Default)]
struct MappingCache {
    free_by_length: HashMap<usize, Vec<u64>>,
    cached_bytes: usize,
}

static CACHE: Mutex<Option<MappingCache>> = Mutex::new(None);

fn with_cache<R>(body: impl FnOnce(&mut MappingCache) -> R) -> R {
    let mut guard = CACHE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    body(guard.get_or_insert_with(MappingCache::default))
}

fn mmap_anonymous(length: usize, extra_flags: libc::c_int) -> Option<u64> {
    // SAFETY: an anonymous private mapping at an address the kernel picks touches no
    // existing memory; the result is checked against MAP_FAILED.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            length,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | extra_flags,
            -1,
            0,
        )
    };
    (address != libc::MAP_FAILED).then_some(address as usize as u64)
}

fn munmap(address: u64, length: usize) {
    // SAFETY: callers pass a range this module mapped and no one uses any more (the driver
    // forgot the allocation before unmapping it).
    unsafe { libc::munmap(address as usize as *mut libc::c_void, length) };
}

/// A new (or reused) mapping of `length` bytes; `None` when the kernel refuses.
pub(crate) fn map(length: usize) -> Option<u64> {
    let reused = with_cache(|cache| {
        let address = cache.free_by_length.get_mut(&length)?.pop()?;
        cache.cached_bytes -= length;
        Some(address)
    });
    reused.or_else(|| mmap_anonymous(length, 0))
}

/// Gives back a mapping [`map`] made.
pub(crate) fn unmap(address: u64, length: usize) {
    let kept = with_cache(|cache| {
        if cache.cached_bytes + length > CACHED_MAPPING_LIMIT {
            return false;
        }
        let list = cache.free_by_length.entry(length).or_default();
        if list.len() >= CACHED_PER_LENGTH {
            return false;
        }
        list.push(address);
        cache.cached_bytes += length;
        true
    });
    if !kept {
        munmap(address, length);
    }
}

/// A mapping below 4 GiB, for the legacy entry points whose device pointers are 32 bits.
/// Only x86-64 Linux can ask for one (`MAP_32BIT`); elsewhere, or when the low space is
/// full, `None`.
pub(crate) fn map_below_4_gib(length: usize) -> Option<u64> {
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    {
        let address = mmap_anonymous(length, libc::MAP_32BIT)?;
        if address + length as u64 > u64::from(u32::MAX) {
            munmap(address, length);
            return None;
        }
        Some(address)
    }
    #[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
    {
        let _ = length;
        None
    }
}

/// Gives back a mapping [`map_below_4_gib`] or [`map_aligned`] made (never cached).
pub(crate) fn unmap_exact(address: u64, length: usize) {
    munmap(address, length);
}

/// A mapping of `length` bytes starting at a multiple of `alignment` (a power of two), for
/// virtual-address reservations.
pub(crate) fn map_aligned(length: usize, alignment: usize) -> Option<u64> {
    let padded = length.checked_add(alignment)?;
    let start = mmap_anonymous(padded, 0)?;
    let aligned = (start + alignment as u64 - 1) & !(alignment as u64 - 1);
    let head = (aligned - start) as usize;
    let tail = padded - head - length;
    if head > 0 {
        munmap(start, head);
    }
    if tail > 0 {
        munmap(aligned + length as u64, tail);
    }
    Some(aligned)
}

/// Drops the contents of a range (its pages read as zeros again and cost nothing), for
/// virtual memory that is unmapped from its physical handle.
pub(crate) fn discard(address: u64, length: usize) {
    // SAFETY: the range lies in a reservation this module mapped; MADV_DONTNEED on a
    // private anonymous mapping only resets its pages.
    unsafe {
        libc::madvise(
            address as usize as *mut libc::c_void,
            length,
            libc::MADV_DONTNEED,
        )
    };
}
