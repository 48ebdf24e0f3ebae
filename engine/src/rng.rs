//! A small deterministic random number generator whose whole state is one `u64`, so a
//! checkpoint can store it and a resumed run draws exactly the same numbers.
//!
//! SplitMix64: fast, good enough statistically for initialization, dropout masks,
//! shuffling and synthetic data, and trivially splittable by hashing a seed with a
//! stream identifier (`Rng::for_stream`), which is how dropout gets the same mask when a
//! layer is recomputed.

/// SplitMix64 generator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rng {
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// An independent generator for one purpose, e.g. `(seed, [step, micro_batch, layer])`
    /// for a dropout mask: the same inputs always give the same stream.
    pub fn for_stream(seed: u64, stream: &[u64]) -> Self {
        let mut state = mix(seed ^ 0x6a09_e667_f3bc_c908);
        for part in stream {
            state = mix(state ^ mix(part.wrapping_add(0x9e37_79b9_7f4a_7c15)));
        }
        Rng { state }
    }

    /// The state to store in a checkpoint; `Rng::new(state)` continues the sequence.
    pub fn state(&self) -> u64 {
        self.state
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.state)
    }

    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..bound` (bound > 0), without modulo bias.
    pub fn below(&mut self, bound: u64) -> u64 {
        let zone = u64::MAX - u64::MAX % bound;
        loop {
            let value = self.next_u64();
            if value < zone {
                return value % bound;
            }
        }
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.next_f64().max(f64::MIN_POSITIVE);
        let u2 = self.next_f64();
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for index in (1..items.len()).rev() {
            let other = self.below(index as u64 + 1) as usize;
            items.swap(index, other);
        }
    }
}

fn mix(value: u64) -> u64 {
    let mut z = value;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_numbers_and_the_state_resumes_them() {
        let mut first = Rng::new(42);
        let mut second = Rng::new(42);
        for _ in 0..10 {
            first.next_u64();
            second.next_u64();
        }
        let mut resumed = Rng::new(first.state());
        assert_eq!(first.next_u64(), resumed.next_u64());
        // `first` drew one more than `second` above.
        second.next_u64();
        assert_eq!(first.next_u64(), second.next_u64());
        assert_ne!(
            Rng::for_stream(1, &[2, 3]).next_u64(),
            Rng::for_stream(1, &[3, 2]).next_u64()
        );
        assert_eq!(
            Rng::for_stream(1, &[2, 3]).next_u64(),
            Rng::for_stream(1, &[2, 3]).next_u64()
        );
    }

    #[test]
    fn draws_are_in_range_and_roughly_uniform() {
        let mut rng = Rng::new(7);
        let mut buckets = [0u32; 10];
        for _ in 0..100_000 {
            let value = rng.next_f32();
            assert!((0.0..1.0).contains(&value));
            buckets[(value * 10.0) as usize] += 1;
            assert!(rng.below(3) < 3);
        }
        assert!(
            buckets.iter().all(|count| (9_000..11_000).contains(count)),
            "{buckets:?}"
        );
        let mean: f32 = (0..10_000).map(|_| rng.normal()).sum::<f32>() / 10_000.0;
        assert!(mean.abs() < 0.05, "{mean}");
    }
}
