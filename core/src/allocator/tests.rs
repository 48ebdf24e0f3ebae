//! The allocator on hand-picked cases: rounding, best fit, out of memory, bad frees,
//! coalescing, peak tracking; `properties` checks its invariants on random sequences.

use super::*;

mod properties;

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
