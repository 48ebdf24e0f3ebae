//! The CI run's mutator: small, seeded edits of corpus inputs (bit flips, byte changes,
//! inserted and deleted ranges, dictionary tokens, splices of two inputs), so the run is
//! the same on every machine and a failure names the seed and iteration that found it.
//! Coverage guidance is the campaign's job; this only has to reach past the seeds.

/// SplitMix64: a tiny, seedable generator with good mixing.
#[derive(Debug, Clone)]
pub struct SeededRandom {
    state: u64,
}

impl SeededRandom {
    pub fn new(seed: u64) -> SeededRandom {
        SeededRandom { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut mixed = self.state;
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        mixed ^ (mixed >> 31)
    }

    /// A number in `0..bound` (`bound` > 0).
    pub fn below(&mut self, bound: usize) -> usize {
        (self.next_u64() % bound as u64) as usize
    }
}

/// Values that break arithmetic and length checks, written over 1, 2, 4 or 8 bytes.
const INTERESTING_VALUES: [u64; 8] = [
    0,
    1,
    0x7F,
    0xFF,
    0x7FFF_FFFF,
    0xFFFF_FFFF,
    0x7FFF_FFFF_FFFF_FFFF,
    u64::MAX,
];

/// `input` with one to four random edits; `corpus` supplies splices, `dictionary` tokens.
pub fn mutate(
    input: &[u8],
    corpus: &[Vec<u8>],
    dictionary: &[&[u8]],
    random: &mut SeededRandom,
    max_len: usize,
) -> Vec<u8> {
    let mut data = input.to_vec();
    let edits = 1 + random.below(4);
    for _ in 0..edits {
        match random.below(8) {
            0 if !data.is_empty() => {
                let index = random.below(data.len());
                data[index] ^= 1 << random.below(8);
            }
            1 if !data.is_empty() => {
                let index = random.below(data.len());
                data[index] = random.next_u64() as u8;
            }
            2 => {
                let index = random.below(data.len() + 1);
                data.insert(index, random.next_u64() as u8);
            }
            3 if !data.is_empty() => {
                let start = random.below(data.len());
                let length = 1 + random.below((data.len() - start).min(16));
                data.drain(start..start + length);
            }
            4 if !data.is_empty() => {
                let start = random.below(data.len());
                let length = 1 + random.below((data.len() - start).min(32));
                let copy = data[start..start + length].to_vec();
                let at = random.below(data.len() + 1);
                data.splice(at..at, copy);
            }
            5 if !dictionary.is_empty() => {
                let token = dictionary[random.below(dictionary.len())];
                let at = random.below(data.len() + 1);
                if random.below(2) == 0 || data.len() < at + token.len() {
                    data.splice(at..at, token.iter().copied());
                } else {
                    data.splice(at..at + token.len(), token.iter().copied());
                }
            }
            6 if !corpus.is_empty() => {
                let other = &corpus[random.below(corpus.len())];
                let keep = random.below(data.len() + 1);
                let from = random.below(other.len() + 1);
                data.truncate(keep);
                data.extend_from_slice(&other[from..]);
            }
            7 if !data.is_empty() => {
                let width = 1 << random.below(4);
                let value = INTERESTING_VALUES[random.below(INTERESTING_VALUES.len())];
                let at = random.below(data.len());
                let bytes = value.to_le_bytes();
                for (offset, byte) in bytes.iter().take(width).enumerate() {
                    if let Some(slot) = data.get_mut(at + offset) {
                        *slot = *byte;
                    }
                }
            }
            _ => {
                let index = random.below(data.len() + 1);
                data.truncate(index);
            }
        }
    }
    data.truncate(max_len);
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_one_sequence_of_mutations() {
        let corpus = vec![b"alpha beta".to_vec(), b"gamma".to_vec()];
        let run = |seed| {
            let mut random = SeededRandom::new(seed);
            (0..50)
                .map(|index| mutate(&corpus[index % 2], &corpus, &[b"=="], &mut random, 64))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        assert!(run(7).iter().any(|mutant| !corpus.contains(mutant)));
        assert!(run(7).iter().all(|mutant| mutant.len() <= 64));
    }
}
