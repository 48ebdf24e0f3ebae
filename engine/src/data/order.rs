//! The order samples are visited in within one epoch: identity, or a permutation of
//! `0..samples` that is a pure function of (seed, epoch), so a resumed run recomputes it
//! instead of saving it.
//!
//! Sets up to [`SHUFFLE_TABLE_LIMIT`] samples get a uniform Fisher-Yates shuffle kept as a
//! `u32` table (16 MiB at the limit). Larger sets (synthetic sets of billions of samples are
//! one line in a job file) use a keyed Feistel network with cycle walking instead: a
//! pseudo-random bijection computed per position, O(1) memory whatever the size.

use crate::rng::Rng;

/// Largest set shuffled with a table.
pub(crate) const SHUFFLE_TABLE_LIMIT: u64 = 1 << 22;
const SHUFFLE_STREAM: u64 = 0x4c4f_4144_5f53_4846; // "LOAD_SHF"
const FEISTEL_ROUNDS: usize = 6;

#[derive(Debug)]
pub(crate) enum EpochOrder {
    Identity,
    Table(Vec<u32>),
    Feistel(FeistelPermutation),
}

impl EpochOrder {
    pub(crate) fn new(samples: u64, seed: u64, epoch: u64, shuffle: bool) -> Self {
        Self::with_table_limit(samples, seed, epoch, shuffle, SHUFFLE_TABLE_LIMIT)
    }

    pub(crate) fn with_table_limit(
        samples: u64,
        seed: u64,
        epoch: u64,
        shuffle: bool,
        table_limit: u64,
    ) -> Self {
        if !shuffle || samples <= 1 {
            return EpochOrder::Identity;
        }
        let mut rng = Rng::for_stream(seed, &[SHUFFLE_STREAM, epoch]);
        if samples <= table_limit.min(u64::from(u32::MAX) + 1) {
            // Fits u32: samples <= 2^32, so every index is at most u32::MAX.
            let mut table: Vec<u32> = (0..samples).map(|index| index as u32).collect();
            rng.shuffle(&mut table);
            EpochOrder::Table(table)
        } else {
            EpochOrder::Feistel(FeistelPermutation::new(samples, &mut rng))
        }
    }

    /// The sample at `position` (in `0..samples`) of the epoch.
    pub(crate) fn sample_at(&self, position: u64) -> u64 {
        match self {
            EpochOrder::Identity => position,
            EpochOrder::Table(table) => u64::from(table[position as usize]),
            EpochOrder::Feistel(permutation) => permutation.permute(position),
        }
    }
}

/// A balanced Feistel network over the smallest even number of bits that covers
/// `0..samples`; positions that land outside are walked through the network again until
/// they land inside (cycle walking), which keeps it a bijection of `0..samples`. The domain
/// is less than 4x the set, so a position takes fewer than 4 passes on average.
#[derive(Debug)]
pub(crate) struct FeistelPermutation {
    samples: u64,
    half_bits: u32,
    round_keys: [u64; FEISTEL_ROUNDS],
}

impl FeistelPermutation {
    fn new(samples: u64, rng: &mut Rng) -> Self {
        let bits = (u64::BITS - (samples - 1).leading_zeros()).max(2);
        let half_bits = bits.div_ceil(2);
        let mut round_keys = [0u64; FEISTEL_ROUNDS];
        for key in &mut round_keys {
            *key = rng.next_u64();
        }
        FeistelPermutation {
            samples,
            half_bits,
            round_keys,
        }
    }

    fn permute(&self, position: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let mut value = position;
        loop {
            let mut left = value >> self.half_bits;
            let mut right = value & mask;
            for key in self.round_keys {
                let mixed = Rng::new(key ^ right).next_u64() & mask;
                (left, right) = (right, left ^ mixed);
            }
            value = (left << self.half_bits) | right;
            if value < self.samples {
                return value;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_permutation(order: &EpochOrder, samples: u64) -> bool {
        let mut seen = vec![false; samples as usize];
        for position in 0..samples {
            let sample = order.sample_at(position);
            if sample >= samples || seen[sample as usize] {
                return false;
            }
            seen[sample as usize] = true;
        }
        true
    }

    #[test]
    fn tables_and_feistel_networks_are_permutations_that_depend_on_seed_and_epoch() {
        for samples in [1u64, 2, 3, 5, 16, 17, 100, 1000, 4097] {
            for table_limit in [0, SHUFFLE_TABLE_LIMIT] {
                let order = EpochOrder::with_table_limit(samples, 7, 3, true, table_limit);
                assert!(is_permutation(&order, samples), "{samples} {order:?}");
                if samples > 1 {
                    let expected_feistel = table_limit == 0;
                    assert_eq!(matches!(order, EpochOrder::Feistel(_)), expected_feistel);
                }
            }
        }
        for table_limit in [0, SHUFFLE_TABLE_LIMIT] {
            let order_of = |seed, epoch| {
                let order = EpochOrder::with_table_limit(1000, seed, epoch, true, table_limit);
                (0..1000)
                    .map(|position| order.sample_at(position))
                    .collect::<Vec<_>>()
            };
            assert_eq!(order_of(1, 0), order_of(1, 0));
            assert_ne!(order_of(1, 0), order_of(1, 1));
            assert_ne!(order_of(1, 0), order_of(2, 0));
            assert_ne!(order_of(1, 0), (0..1000).collect::<Vec<_>>());
        }
    }

    #[test]
    fn feistel_permutations_reach_the_top_of_the_u64_range() {
        let order = EpochOrder::with_table_limit(u64::MAX, 1, 0, true, 0);
        for position in [0, 1, u64::MAX / 2, u64::MAX - 1] {
            assert!(order.sample_at(position) < u64::MAX);
        }
        let near_power = EpochOrder::with_table_limit((1 << 40) + 1, 1, 0, true, 0);
        assert!(near_power.sample_at(1 << 40) <= 1 << 40);
    }

    #[test]
    fn no_shuffle_is_the_identity() {
        let order = EpochOrder::new(10, 1, 4, false);
        assert!((0..10).all(|position| order.sample_at(position) == position));
    }
}
