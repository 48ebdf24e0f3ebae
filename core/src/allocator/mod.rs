//! The slice allocator bookkeeping: where each buffer of an attempt lives inside its
//! slice of device memory, as offsets only (no real memory is touched here).
//!
//! Every attempt gets one region of `limit` bytes. The engine asks this allocator where
//! to put each real buffer, and the estimator replays a step plan through the very same
//! bookkeeping with no data at all, so the estimate *is* this allocator's peak and
//! high-water mark, fragmentation included, and there is no second copy of the
//! allocation logic to drift (see "The memory model" in docs/design.md).
//!
//! The policy is the idea of TensorFlow's BFC allocator:
//!
//! - **Best fit**: a request takes the smallest free block that can hold it, ties broken
//!   by the lowest offset. Taking the smallest block leaves the large blocks whole for
//!   the large buffers that come later (weights, activations kept for backward), which
//!   is what keeps a training step from failing with plenty of memory free but none of
//!   it in one piece. The tie rule makes placement a pure function of the call sequence,
//!   so an estimate replays exactly what the engine will do.
//! - **Split from the low end**: the buffer takes the start of the chosen block and the
//!   remainder stays free, so live buffers pack towards offset 0 and the high-water mark
//!   stays close to the real need.
//! - **Coalescing**: a freed block merges immediately with free neighbours on both sides,
//!   so there are never two adjacent free blocks and a fully freed region is one block
//!   again.
//!
//! Every operation is `O(log n)` in the number of blocks: free blocks are indexed twice,
//! by offset (to find neighbours when coalescing) and by `(size, offset)` (to find the
//! best fit with one ordered range lookup).

use std::collections::{BTreeMap, BTreeSet};

use crate::bytes::HumanBytes;

/// Every allocation is rounded up to a multiple of this (cudaMalloc's alignment); a
/// 0-byte request takes one unit.
pub const ALLOCATION_ALIGNMENT: u64 = 256;

/// Where one buffer was placed inside the slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// Byte offset of the buffer from the start of the slice; always a multiple of
    /// [`ALLOCATION_ALIGNMENT`] because every earlier block was rounded.
    pub offset: u64,
    /// The rounded size actually taken, which is what counts against the slice.
    pub size: u64,
}

impl Allocation {
    /// One past the last byte of the allocation.
    pub fn end(&self) -> u64 {
        self.offset + self.size
    }
}

/// A request that fits in no free block, with the allocator's numbers at the moment of
/// failure: the shrink planner reads them to decide what to try next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "out of memory: requested {} with {} in use of a {} slice (largest free block {}, peak {})",
    HumanBytes(*requested),
    HumanBytes(*in_use),
    HumanBytes(*limit),
    HumanBytes(*largest_free),
    HumanBytes(*peak)
)]
pub struct OutOfMemory {
    /// The caller's requested byte count, before rounding.
    pub requested: u64,
    /// Bytes held by live allocations (rounded sizes).
    pub in_use: u64,
    /// Size of the whole slice.
    pub limit: u64,
    /// Size of the largest free block: when this is below the request while
    /// `limit - in_use` is not, the failure is fragmentation rather than volume.
    pub largest_free: u64,
    /// Peak in-use bytes so far.
    pub peak: u64,
}

/// A free that does not match a live allocation. Reported rather than panicking because
/// the engine and the estimator replay plans, and a bad plan must surface as an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FreeError {
    #[error("no allocation starts at offset {offset}")]
    UnknownOffset { offset: u64 },
}

/// Best-fit, coalescing bookkeeping over one region of `limit` bytes.
///
/// Invariant: live allocations and free blocks tile `[0, limit)` exactly, with no two
/// free blocks adjacent.
#[derive(Debug, Clone)]
pub struct SliceAllocator {
    limit: u64,
    /// Free blocks keyed by offset, for finding the neighbours of a freed block.
    free_blocks_by_offset: BTreeMap<u64, u64>,
    /// The same free blocks ordered by `(size, offset)`, so the first entry at or above
    /// `(rounded, 0)` is the best fit with the lowest offset among equals.
    free_blocks_by_size: BTreeSet<(u64, u64)>,
    /// Live allocations keyed by offset, value is the rounded size. Ordered so that the
    /// last entry gives the highest end without a scan.
    live_allocations_by_offset: BTreeMap<u64, u64>,
    in_use: u64,
    peak_in_use: u64,
    high_water_mark: u64,
}

impl SliceAllocator {
    /// An allocator over an empty region of `limit` bytes. `limit` need not be a multiple
    /// of [`ALLOCATION_ALIGNMENT`]; the last block is simply smaller. A zero limit is
    /// allowed and fails every allocation.
    pub fn new(limit: u64) -> Self {
        let mut allocator = SliceAllocator {
            limit,
            free_blocks_by_offset: BTreeMap::new(),
            free_blocks_by_size: BTreeSet::new(),
            live_allocations_by_offset: BTreeMap::new(),
            in_use: 0,
            peak_in_use: 0,
            high_water_mark: 0,
        };
        if limit > 0 {
            allocator.insert_free_block(0, limit);
        }
        allocator
    }

    /// Places a buffer of `requested` bytes (rounded up to [`ALLOCATION_ALIGNMENT`]) in
    /// the smallest free block that holds it, lowest offset first among equal sizes.
    /// On failure nothing changes.
    pub fn allocate(&mut self, requested: u64) -> Result<Allocation, OutOfMemory> {
        let best_fit = rounded_allocation_size(requested).and_then(|rounded_size| {
            self.free_blocks_by_size
                .range((rounded_size, 0)..)
                .next()
                .map(|&(block_size, block_offset)| (rounded_size, block_size, block_offset))
        });
        let Some((rounded_size, block_size, block_offset)) = best_fit else {
            return Err(OutOfMemory {
                requested,
                in_use: self.in_use,
                limit: self.limit,
                largest_free: self.largest_free_block(),
                peak: self.peak_in_use,
            });
        };

        self.remove_free_block(block_offset, block_size);
        let remainder = block_size - rounded_size;
        if remainder > 0 {
            self.insert_free_block(block_offset + rounded_size, remainder);
        }
        self.live_allocations_by_offset
            .insert(block_offset, rounded_size);

        let allocation = Allocation {
            offset: block_offset,
            size: rounded_size,
        };
        self.in_use += rounded_size;
        self.peak_in_use = self.peak_in_use.max(self.in_use);
        self.high_water_mark = self.high_water_mark.max(allocation.end());
        Ok(allocation)
    }

    /// Frees the allocation starting at `offset` and returns its rounded size. The block
    /// merges with free neighbours on both sides. An offset that is not the start of a
    /// live allocation (including a second free of the same one) is an error and
    /// changes nothing.
    pub fn free(&mut self, offset: u64) -> Result<u64, FreeError> {
        let Some(freed_size) = self.live_allocations_by_offset.remove(&offset) else {
            return Err(FreeError::UnknownOffset { offset });
        };
        self.in_use -= freed_size;

        let mut merged_offset = offset;
        let mut merged_size = freed_size;

        let free_block_before = self
            .free_blocks_by_offset
            .range(..offset)
            .next_back()
            .map(|(&before_offset, &before_size)| (before_offset, before_size));
        if let Some((before_offset, before_size)) = free_block_before
            && before_offset + before_size == offset
        {
            self.remove_free_block(before_offset, before_size);
            merged_offset = before_offset;
            merged_size += before_size;
        }

        let after_offset = offset + freed_size;
        if let Some(&after_size) = self.free_blocks_by_offset.get(&after_offset) {
            self.remove_free_block(after_offset, after_size);
            merged_size += after_size;
        }

        self.insert_free_block(merged_offset, merged_size);
        Ok(freed_size)
    }

    /// Size of the whole region.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Sum of the rounded sizes of live allocations.
    pub fn in_use(&self) -> u64 {
        self.in_use
    }

    /// The largest [`in_use`](Self::in_use) seen since creation or the last
    /// [`reset_peak`](Self::reset_peak).
    pub fn peak_in_use(&self) -> u64 {
        self.peak_in_use
    }

    /// The highest end (offset + size) of any allocation made since creation or the last
    /// [`reset_peak`](Self::reset_peak): the smallest region that would have held
    /// everything with the same placement, fragmentation included. This, not the peak,
    /// is what a slice must be sized to.
    pub fn high_water_mark(&self) -> u64 {
        self.high_water_mark
    }

    /// `limit - in_use`, whether or not it is in one piece.
    pub fn free_bytes(&self) -> u64 {
        self.limit - self.in_use
    }

    /// Size of the largest free block (0 when the region is full).
    pub fn largest_free_block(&self) -> u64 {
        self.free_blocks_by_size
            .last()
            .map_or(0, |&(block_size, _)| block_size)
    }

    /// `1 - largest_free_block / free_bytes`: 0.0 when all free memory is one block,
    /// approaching 1.0 as it splinters. 0.0 when nothing is free.
    pub fn fragmentation(&self) -> f64 {
        let free_bytes = self.free_bytes();
        if free_bytes == 0 {
            return 0.0;
        }
        1.0 - self.largest_free_block() as f64 / free_bytes as f64
    }

    /// Number of allocations not yet freed.
    pub fn live_allocations(&self) -> usize {
        self.live_allocations_by_offset.len()
    }

    /// Starts a new measurement window (e.g. per training step): the peak becomes the
    /// current in-use bytes and the high-water mark the current highest live end.
    pub fn reset_peak(&mut self) {
        self.peak_in_use = self.in_use;
        self.high_water_mark = self.live_extent();
    }

    /// The end of the highest live allocation: the part of the region in use now, holes
    /// included.
    pub fn live_extent(&self) -> u64 {
        // Live allocations never overlap, so the one with the highest offset also has
        // the highest end.
        self.live_allocations_by_offset
            .last_key_value()
            .map_or(0, |(&offset, &size)| offset + size)
    }

    /// Free blocks as `(offset, size)` in offset order, for tests and debugging.
    pub fn free_blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.free_blocks_by_offset
            .iter()
            .map(|(&offset, &size)| (offset, size))
    }

    fn insert_free_block(&mut self, offset: u64, size: u64) {
        self.free_blocks_by_offset.insert(offset, size);
        self.free_blocks_by_size.insert((size, offset));
    }

    fn remove_free_block(&mut self, offset: u64, size: u64) {
        self.free_blocks_by_offset.remove(&offset);
        self.free_blocks_by_size.remove(&(size, offset));
    }
}

/// The size a request really takes: at least one alignment unit, rounded up to a
/// multiple of it. `None` when rounding would overflow, which no region can satisfy.
fn rounded_allocation_size(requested: u64) -> Option<u64> {
    requested
        .max(1)
        .checked_next_multiple_of(ALLOCATION_ALIGNMENT)
}

#[cfg(test)]
mod tests;
