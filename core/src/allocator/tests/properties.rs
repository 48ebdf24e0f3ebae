//! Properties of the allocator over random operation sequences: every invariant holds
//! after every operation, and replaying a sequence gives the same results.

use super::*;
use proptest::prelude::*;

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
