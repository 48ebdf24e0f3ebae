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
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * 1024;

    fn free_block_list(allocator: &SliceAllocator) -> Vec<(u64, u64)> {
        allocator.free_blocks().collect()
    }

    #[test]
    fn one_byte_and_zero_byte_requests_take_one_alignment_unit() {
        let mut allocator = SliceAllocator::new(4 * KIB);
        let one_byte = allocator.allocate(1).unwrap();
        let zero_bytes = allocator.allocate(0).unwrap();
        let exact_unit = allocator.allocate(256).unwrap();
        let just_over = allocator.allocate(257).unwrap();
        assert_eq!(
            one_byte,
            Allocation {
                offset: 0,
                size: 256
            }
        );
        assert_eq!(
            zero_bytes,
            Allocation {
                offset: 256,
                size: 256
            }
        );
        assert_eq!(
            exact_unit,
            Allocation {
                offset: 512,
                size: 256
            }
        );
        assert_eq!(
            just_over,
            Allocation {
                offset: 768,
                size: 512
            }
        );
        assert_eq!(allocator.in_use(), 1280);
        assert_eq!(allocator.live_allocations(), 4);
    }

    #[test]
    fn rounding_helper_is_checked_near_the_top_of_u64() {
        assert_eq!(rounded_allocation_size(0), Some(256));
        assert_eq!(
            rounded_allocation_size(u64::MAX - 255),
            Some(u64::MAX - 255)
        );
        assert_eq!(rounded_allocation_size(u64::MAX - 254), None);
        assert_eq!(rounded_allocation_size(u64::MAX), None);
    }

    /// Builds holes of `first_hole` and `second_hole` bytes (in that offset order),
    /// separated and bounded by live 256-byte allocations, with no other free space.
    fn allocator_with_two_holes(first_hole: u64, second_hole: u64) -> SliceAllocator {
        let limit = first_hole + second_hole + 3 * 256;
        let mut allocator = SliceAllocator::new(limit);
        let hole_a = allocator.allocate(first_hole).unwrap();
        allocator.allocate(256).unwrap();
        let hole_b = allocator.allocate(second_hole).unwrap();
        allocator.allocate(256).unwrap();
        allocator.allocate(256).unwrap();
        assert_eq!(allocator.free_bytes(), 0);
        allocator.free(hole_a.offset).unwrap();
        allocator.free(hole_b.offset).unwrap();
        allocator
    }

    #[test]
    fn best_fit_picks_the_smaller_hole_even_when_it_comes_later() {
        let mut allocator = allocator_with_two_holes(4 * KIB, KIB);
        assert_eq!(
            free_block_list(&allocator),
            vec![(0, 4 * KIB), (4 * KIB + 256, KIB)]
        );
        let placed = allocator.allocate(700).unwrap();
        assert_eq!(
            placed,
            Allocation {
                offset: 4 * KIB + 256,
                size: 768
            }
        );
        // The remainder of the chosen hole stays free, the large hole stays whole.
        assert_eq!(
            free_block_list(&allocator),
            vec![(0, 4 * KIB), (4 * KIB + 256 + 768, 256)]
        );
    }

    #[test]
    fn best_fit_takes_an_exact_fit_over_a_larger_earlier_block() {
        let mut allocator = allocator_with_two_holes(2 * KIB, KIB);
        let placed = allocator.allocate(KIB).unwrap();
        assert_eq!(placed.offset, 2 * KIB + 256);
        assert_eq!(free_block_list(&allocator), vec![(0, 2 * KIB)]);
    }

    #[test]
    fn equal_sized_holes_are_chosen_by_lowest_offset() {
        let mut allocator = allocator_with_two_holes(KIB, KIB);
        assert_eq!(allocator.allocate(KIB).unwrap().offset, 0);
        assert_eq!(allocator.allocate(KIB).unwrap().offset, KIB + 256);
    }

    #[test]
    fn out_of_memory_reports_exact_numbers_and_changes_nothing() {
        let mut allocator = SliceAllocator::new(MIB);
        let first = allocator.allocate(600 * KIB).unwrap();
        allocator.allocate(100 * KIB).unwrap();
        allocator.free(first.offset).unwrap();
        // Peak was 700 KiB; now 100 KiB in use, free blocks 600 KiB and 324 KiB.
        let blocks_before = free_block_list(&allocator);
        let error = allocator.allocate(601 * KIB + 1).unwrap_err();
        assert_eq!(
            error,
            OutOfMemory {
                requested: 601 * KIB + 1,
                in_use: 100 * KIB,
                limit: MIB,
                largest_free: 600 * KIB,
                peak: 700 * KIB,
            }
        );
        assert_eq!(free_block_list(&allocator), blocks_before);
        assert_eq!(allocator.in_use(), 100 * KIB);
        assert_eq!(allocator.live_allocations(), 1);
        assert_eq!(allocator.peak_in_use(), 700 * KIB);
    }

    #[test]
    fn out_of_memory_message_uses_human_sizes() {
        let error = OutOfMemory {
            requested: 2 << 30,
            in_use: 15 << 30,
            limit: 16 << 30,
            largest_free: 512 << 20,
            peak: 1_610_612_736,
        };
        assert_eq!(
            error.to_string(),
            "out of memory: requested 2 GiB with 15 GiB in use of a 16 GiB slice \
             (largest free block 512 MiB, peak 1.50 GiB)"
        );
    }

    #[test]
    fn out_of_memory_from_fragmentation_when_total_free_is_enough() {
        let mut allocator = SliceAllocator::new(4 * KIB);
        let pieces: Vec<Allocation> = (0..4).map(|_| allocator.allocate(KIB).unwrap()).collect();
        allocator.free(pieces[0].offset).unwrap();
        allocator.free(pieces[2].offset).unwrap();
        assert_eq!(allocator.free_bytes(), 2 * KIB);
        assert_eq!(allocator.largest_free_block(), KIB);
        assert!((allocator.fragmentation() - 0.5).abs() < 1e-12);
        let error = allocator.allocate(2 * KIB).unwrap_err();
        assert_eq!(error.largest_free, KIB);
        assert_eq!(error.limit - error.in_use, 2 * KIB);
    }

    #[test]
    fn unknown_offset_and_double_free_are_errors_and_change_nothing() {
        let mut allocator = SliceAllocator::new(4 * KIB);
        let first = allocator.allocate(KIB).unwrap();
        let second = allocator.allocate(KIB).unwrap();
        assert_eq!(allocator.free(first.offset), Ok(KIB));

        let blocks_before = free_block_list(&allocator);
        let in_use_before = allocator.in_use();
        assert_eq!(
            allocator.free(first.offset),
            Err(FreeError::UnknownOffset { offset: 0 })
        );
        // Inside a live allocation but not at its start.
        assert_eq!(
            allocator.free(second.offset + 256),
            Err(FreeError::UnknownOffset {
                offset: second.offset + 256
            })
        );
        assert_eq!(
            allocator.free(u64::MAX),
            Err(FreeError::UnknownOffset { offset: u64::MAX })
        );
        assert_eq!(free_block_list(&allocator), blocks_before);
        assert_eq!(allocator.in_use(), in_use_before);
        assert_eq!(allocator.live_allocations(), 1);
        assert_eq!(
            FreeError::UnknownOffset { offset: 42 }.to_string(),
            "no allocation starts at offset 42"
        );
    }

    #[test]
    fn freeing_everything_in_any_order_coalesces_back_to_one_block() {
        let sizes = [300, 1, 4096, 0, 777, 2048, 256, 1000];
        let limit = 20_000; // not a multiple of 256: the tail block is just smaller
        let orders: [[usize; 8]; 4] = [
            [0, 1, 2, 3, 4, 5, 6, 7],
            [7, 6, 5, 4, 3, 2, 1, 0],
            [1, 3, 5, 7, 0, 2, 4, 6],
            [4, 0, 7, 2, 6, 1, 5, 3],
        ];
        for order in orders {
            let mut allocator = SliceAllocator::new(limit);
            let placed: Vec<Allocation> = sizes
                .iter()
                .map(|&size| allocator.allocate(size).unwrap())
                .collect();
            for index in order {
                allocator.free(placed[index].offset).unwrap();
                let blocks = free_block_list(&allocator);
                for pair in blocks.windows(2) {
                    assert!(
                        pair[0].0 + pair[0].1 < pair[1].0,
                        "adjacent free blocks {blocks:?}"
                    );
                }
            }
            assert_eq!(free_block_list(&allocator), vec![(0, limit)]);
            assert_eq!(allocator.in_use(), 0);
            assert_eq!(allocator.live_allocations(), 0);
            assert_eq!(allocator.fragmentation(), 0.0);
        }
    }

    #[test]
    fn limit_that_is_not_a_multiple_of_the_alignment_has_a_smaller_tail() {
        let mut allocator = SliceAllocator::new(1000);
        assert_eq!(allocator.allocate(512).unwrap().offset, 0);
        assert_eq!(allocator.allocate(256).unwrap().offset, 512);
        assert_eq!(free_block_list(&allocator), vec![(768, 232)]);
        assert_eq!(allocator.allocate(1).unwrap_err().largest_free, 232);
        assert_eq!(allocator.free_bytes(), 232);
    }

    #[test]
    fn zero_limit_fails_every_allocation() {
        let mut allocator = SliceAllocator::new(0);
        assert_eq!(free_block_list(&allocator), vec![]);
        assert_eq!(allocator.largest_free_block(), 0);
        assert_eq!(allocator.fragmentation(), 0.0);
        let error = allocator.allocate(0).unwrap_err();
        assert_eq!(error.limit, 0);
        assert_eq!(error.largest_free, 0);
    }

    #[test]
    fn a_full_region_has_no_fragmentation() {
        let mut allocator = SliceAllocator::new(1024);
        allocator.allocate(1024).unwrap();
        assert_eq!(allocator.free_bytes(), 0);
        assert_eq!(allocator.largest_free_block(), 0);
        assert_eq!(allocator.fragmentation(), 0.0);
    }

    #[test]
    fn peak_and_high_water_mark_track_and_reset() {
        let mut allocator = SliceAllocator::new(16 * KIB);
        let first = allocator.allocate(4 * KIB).unwrap();
        let second = allocator.allocate(4 * KIB).unwrap();
        let third = allocator.allocate(2 * KIB).unwrap();
        assert_eq!(allocator.peak_in_use(), 10 * KIB);
        assert_eq!(allocator.high_water_mark(), 10 * KIB);

        allocator.free(first.offset).unwrap();
        allocator.free(third.offset).unwrap();
        assert_eq!(allocator.in_use(), 4 * KIB);
        assert_eq!(
            allocator.peak_in_use(),
            10 * KIB,
            "peak never decreases on free"
        );
        assert_eq!(allocator.high_water_mark(), 10 * KIB);

        allocator.reset_peak();
        assert_eq!(allocator.peak_in_use(), 4 * KIB);
        assert_eq!(allocator.high_water_mark(), second.end());

        // A 1 KiB buffer fits in the 4 KiB hole at 0, so neither number moves past it.
        allocator.allocate(KIB).unwrap();
        assert_eq!(allocator.peak_in_use(), 5 * KIB);
        assert_eq!(allocator.high_water_mark(), second.end());

        // A 6 KiB buffer does not fit below, so it raises the high-water mark beyond
        // what the in-use bytes alone would say: that gap is fragmentation.
        let big = allocator.allocate(6 * KIB).unwrap();
        assert_eq!(big.offset, 8 * KIB);
        assert_eq!(allocator.peak_in_use(), 11 * KIB);
        assert_eq!(allocator.high_water_mark(), 14 * KIB);

        allocator.free(big.offset).unwrap();
        allocator.free(second.offset).unwrap();
        allocator.reset_peak();
        assert_eq!(allocator.peak_in_use(), KIB);
        assert_eq!(allocator.high_water_mark(), KIB);
    }

    #[test]
    fn reset_peak_on_an_empty_allocator_zeroes_both() {
        let mut allocator = SliceAllocator::new(4 * KIB);
        let placed = allocator.allocate(KIB).unwrap();
        allocator.free(placed.offset).unwrap();
        allocator.reset_peak();
        assert_eq!(allocator.peak_in_use(), 0);
        assert_eq!(allocator.high_water_mark(), 0);
    }

    #[test]
    fn request_near_u64_max_is_out_of_memory_not_an_overflow() {
        let mut allocator = SliceAllocator::new(u64::MAX);
        for requested in [u64::MAX, u64::MAX - 1, u64::MAX - 254] {
            let error = allocator.allocate(requested).unwrap_err();
            assert_eq!(error.requested, requested);
            assert_eq!(error.largest_free, u64::MAX);
            assert_eq!(error.in_use, 0);
        }
        // The largest aligned size does fit in a region of u64::MAX bytes.
        let whole = allocator.allocate(u64::MAX - 255).unwrap();
        assert_eq!(
            whole,
            Allocation {
                offset: 0,
                size: u64::MAX - 255
            }
        );
        assert_eq!(free_block_list(&allocator), vec![(u64::MAX - 255, 255)]);
        assert_eq!(allocator.free(0), Ok(u64::MAX - 255));
        assert_eq!(free_block_list(&allocator), vec![(0, u64::MAX)]);
    }

    // ---- properties over random operation sequences ----

    #[derive(Debug, Clone)]
    enum Operation {
        Allocate(u64),
        /// Frees the live allocation at this index (modulo the live count).
        FreeLive(usize),
        /// Frees an arbitrary offset, which is usually not a live allocation.
        FreeArbitrary(u64),
        ResetPeak,
    }

    fn requested_size_strategy() -> impl Strategy<Value = u64> {
        prop_oneof![
            10 => 0..=(1u64 << 20),
            1 => prop_oneof![
                Just(u64::MAX),
                Just(u64::MAX - 255),
                Just(u64::MAX - 256),
                Just(1u64 << 40),
                (1u64 << 20)..(1u64 << 26),
            ],
        ]
    }

    fn operation_strategy() -> impl Strategy<Value = Operation> {
        prop_oneof![
            6 => requested_size_strategy().prop_map(Operation::Allocate),
            4 => any::<usize>().prop_map(Operation::FreeLive),
            1 => prop_oneof![(0u64..(1 << 24)), any::<u64>()].prop_map(Operation::FreeArbitrary),
            1 => Just(Operation::ResetPeak),
        ]
    }

    fn limit_strategy() -> impl Strategy<Value = u64> {
        prop_oneof![
            0u64..=(1 << 24),
            (1u64..=64).prop_map(|units| units * MIB),
            Just(u64::MAX),
        ]
    }

    /// What one operation returned, compared between two replays for determinism.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Outcome {
        Allocated(Result<Allocation, OutOfMemory>),
        Freed(Result<u64, FreeError>),
        PeakReset,
    }

    /// The best fit computed the slow, obvious way from the free block list.
    fn expected_best_fit(allocator: &SliceAllocator, rounded_size: u64) -> Option<u64> {
        allocator
            .free_blocks()
            .filter(|&(_, size)| size >= rounded_size)
            .min_by_key(|&(offset, size)| (size, offset))
            .map(|(offset, _)| offset)
    }

    /// Checks every structural invariant against the test's own record of live
    /// allocations.
    fn assert_invariants(
        allocator: &SliceAllocator,
        live: &BTreeMap<u64, u64>,
    ) -> Result<(), TestCaseError> {
        let limit = allocator.limit();
        prop_assert_eq!(allocator.live_allocations(), live.len());
        prop_assert_eq!(allocator.in_use(), live.values().sum::<u64>());
        prop_assert_eq!(allocator.free_bytes() + allocator.in_use(), limit);
        prop_assert!(allocator.peak_in_use() >= allocator.in_use());
        prop_assert!(allocator.high_water_mark() <= limit);
        prop_assert!(allocator.peak_in_use() <= allocator.high_water_mark());

        // Live allocations and free blocks, merged in offset order, must tile [0, limit)
        // with no gap, no overlap and no two free blocks side by side.
        let mut pieces: Vec<(u64, u64, bool)> = live
            .iter()
            .map(|(&offset, &size)| (offset, size, false))
            .chain(
                allocator
                    .free_blocks()
                    .map(|(offset, size)| (offset, size, true)),
            )
            .collect();
        pieces.sort_unstable();
        let mut cursor = 0u64;
        let mut previous_was_free = false;
        for &(offset, size, is_free) in &pieces {
            prop_assert!(size > 0, "empty piece at {}", offset);
            prop_assert_eq!(offset, cursor, "gap or overlap at {}", offset);
            prop_assert!(
                !(is_free && previous_was_free),
                "uncoalesced free blocks at {}",
                offset
            );
            if !is_free {
                prop_assert!(offset.is_multiple_of(ALLOCATION_ALIGNMENT));
                prop_assert!(size.is_multiple_of(ALLOCATION_ALIGNMENT));
            }
            cursor = offset + size;
            previous_was_free = is_free;
        }
        prop_assert_eq!(cursor, limit);

        let max_live_end = live
            .iter()
            .map(|(&offset, &size)| offset + size)
            .max()
            .unwrap_or(0);
        prop_assert!(allocator.high_water_mark() >= max_live_end);

        let largest = allocator
            .free_blocks()
            .map(|(_, size)| size)
            .max()
            .unwrap_or(0);
        prop_assert_eq!(allocator.largest_free_block(), largest);
        let fragmentation = allocator.fragmentation();
        prop_assert!((0.0..1.0).contains(&fragmentation) || allocator.free_bytes() == 0);
        Ok(())
    }

    /// Runs `operations`, checking every property after each step, and returns what each
    /// operation returned.
    fn run_and_check(limit: u64, operations: &[Operation]) -> Result<Vec<Outcome>, TestCaseError> {
        let mut allocator = SliceAllocator::new(limit);
        let mut live: BTreeMap<u64, u64> = BTreeMap::new();
        let mut outcomes = Vec::with_capacity(operations.len());
        let mut previous_peak = 0u64;
        let mut previous_high_water_mark = 0u64;

        for operation in operations {
            match *operation {
                Operation::Allocate(requested) => {
                    let rounded = rounded_allocation_size(requested);
                    let expected_offset =
                        rounded.and_then(|rounded| expected_best_fit(&allocator, rounded));
                    let result = allocator.allocate(requested);
                    match (&result, expected_offset) {
                        (Ok(placed), Some(expected_offset)) => {
                            prop_assert_eq!(placed.offset, expected_offset);
                            prop_assert_eq!(Some(placed.size), rounded);
                            prop_assert!(placed.end() <= limit);
                            live.insert(placed.offset, placed.size);
                        }
                        (Err(error), None) => {
                            // Failing is allowed only when no free block holds the
                            // rounded size (or the size cannot even be rounded).
                            if let Some(rounded) = rounded {
                                prop_assert!(error.largest_free < rounded);
                            }
                            prop_assert_eq!(error.requested, requested);
                            prop_assert_eq!(error.in_use, allocator.in_use());
                            prop_assert_eq!(error.limit, limit);
                            prop_assert_eq!(error.largest_free, allocator.largest_free_block());
                            prop_assert_eq!(error.peak, allocator.peak_in_use());
                        }
                        (result, expected) => {
                            return Err(TestCaseError::fail(format!(
                                "allocate({requested}) gave {result:?}, expected offset {expected:?}"
                            )));
                        }
                    }
                    outcomes.push(Outcome::Allocated(result));
                }
                Operation::FreeLive(index) => {
                    if live.is_empty() {
                        continue;
                    }
                    let (&offset, &size) = live.iter().nth(index % live.len()).unwrap();
                    let result = allocator.free(offset);
                    prop_assert_eq!(result, Ok(size));
                    live.remove(&offset);
                    outcomes.push(Outcome::Freed(result));
                }
                Operation::FreeArbitrary(offset) => {
                    let result = allocator.free(offset);
                    match live.remove(&offset) {
                        Some(size) => prop_assert_eq!(result, Ok(size)),
                        None => prop_assert_eq!(result, Err(FreeError::UnknownOffset { offset })),
                    }
                    outcomes.push(Outcome::Freed(result));
                }
                Operation::ResetPeak => {
                    allocator.reset_peak();
                    prop_assert_eq!(allocator.peak_in_use(), allocator.in_use());
                    previous_peak = allocator.peak_in_use();
                    previous_high_water_mark = allocator.high_water_mark();
                    outcomes.push(Outcome::PeakReset);
                }
            }
            prop_assert!(allocator.peak_in_use() >= previous_peak, "peak decreased");
            prop_assert!(
                allocator.high_water_mark() >= previous_high_water_mark,
                "high-water mark decreased"
            );
            previous_peak = allocator.peak_in_use();
            previous_high_water_mark = allocator.high_water_mark();
            assert_invariants(&allocator, &live)?;
        }

        // Free everything that is left, in the order the test recorded it: the region
        // must come back as one block.
        let remaining: Vec<u64> = live.keys().copied().collect();
        for offset in remaining {
            prop_assert!(allocator.free(offset).is_ok());
            live.remove(&offset);
            assert_invariants(&allocator, &live)?;
        }
        let expected_blocks = if limit == 0 { vec![] } else { vec![(0, limit)] };
        prop_assert_eq!(free_block_list(&allocator), expected_blocks);
        prop_assert_eq!(allocator.in_use(), 0);
        Ok(outcomes)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn random_operation_sequences_keep_every_invariant(
            limit in limit_strategy(),
            operations in prop::collection::vec(operation_strategy(), 0..200),
        ) {
            run_and_check(limit, &operations)?;
        }

        #[test]
        fn replaying_the_same_sequence_gives_identical_results(
            limit in limit_strategy(),
            operations in prop::collection::vec(operation_strategy(), 0..200),
        ) {
            let first_run = run_and_check(limit, &operations)?;
            let second_run = run_and_check(limit, &operations)?;
            prop_assert_eq!(first_run, second_run);
        }

        #[test]
        fn small_slices_under_heavy_pressure_keep_every_invariant(
            limit in 0u64..=(64 * KIB),
            operations in prop::collection::vec(
                prop_oneof![
                    3 => (0u64..=(8 * KIB)).prop_map(Operation::Allocate),
                    2 => any::<usize>().prop_map(Operation::FreeLive),
                ],
                0..300,
            ),
        ) {
            run_and_check(limit, &operations)?;
        }
    }

    #[test]
    fn a_few_thousand_operations_on_a_large_slice_stay_consistent() {
        // Shaped like a deep model's step plan: a long allocate/free interleaving.
        let mut allocator = SliceAllocator::new(16 << 30);
        let mut live = Vec::new();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for step in 0..5_000u64 {
            // A fixed linear congruential sequence: deterministic pseudo-random sizes.
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            let size = (state >> 40) % (64 * MIB);
            if step % 3 == 2 && !live.is_empty() {
                let index = (state as usize) % live.len();
                let offset: u64 = live.swap_remove(index);
                allocator.free(offset).unwrap();
            } else if let Ok(placed) = allocator.allocate(size) {
                live.push(placed.offset);
            }
        }
        for offset in live {
            allocator.free(offset).unwrap();
        }
        assert_eq!(free_block_list(&allocator), vec![(0, 16 << 30)]);
    }
}
