//! Synthetic data that a model can actually learn, generated from the training seed and the
//! sample index alone: nothing is stored, any sample can be read in any order, and a resumed
//! run sees exactly the samples the first attempt saw.
//!
//! - Classification (`softmax_cross_entropy`, `classes` = the model's output features):
//!   every class has a fixed random prototype (entries approximately N(0, 1)); a sample is
//!   its class's prototype plus noise of standard deviation [`CLASSIFICATION_NOISE_STD`],
//!   and its label is a deterministic draw from its index. A nearest-class-mean rule already
//!   separates the classes, so a small model ends well above chance.
//! - Regression (`mse`): inputs are approximately N(0, 1); each target element is a fixed
//!   random sparse linear combination of the inputs plus a little noise, so a model can
//!   drive the loss down towards the noise floor.
//!
//! The training and the test split share the prototypes (and the linear map) but draw their
//! samples from different streams, so test samples are new samples of the same problem.

use std::sync::Arc;

use super::{SampleLayout, SampleRequest, SampleSource, SampleTarget, TargetKind};
use crate::error::EngineError;
use crate::rng::Rng;

/// Standard deviation of the noise around a class prototype.
pub const CLASSIFICATION_NOISE_STD: f32 = 0.75;
/// Standard deviation of the noise added to a regression target.
pub const REGRESSION_NOISE_STD: f32 = 0.05;
/// Inputs each regression target element depends on (fewer when the input is smaller).
pub const REGRESSION_TAPS_PER_OUTPUT: usize = 16;

/// Prototypes and linear maps up to this many f32 (or taps) are kept in memory (32 MiB);
/// larger ones are regenerated for every sample, which gives the same values.
const DEFAULT_CACHE_LIMIT_ELEMENTS: usize = 1 << 23;

// Stream tags keep these draws apart from every other use of the training seed (weight
// initialization, dropout), so data and model never share random numbers.
const PROTOTYPE_STREAM: u64 = 0x5359_4e5f_5052_4f54; // "SYN_PROT"
const SAMPLE_STREAM: u64 = 0x5359_4e5f_5341_4d50; // "SYN_SAMP"
const LINEAR_MAP_STREAM: u64 = 0x5359_4e5f_4c49_4e4d; // "SYN_LINM"

/// Which split a synthetic set is: the same problem, different samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyntheticSplit {
    Train,
    Test,
}

impl SyntheticSplit {
    fn stream_id(self) -> u64 {
        match self {
            SyntheticSplit::Train => 0,
            SyntheticSplit::Test => 1,
        }
    }
}

/// The problem both splits sample from: the seed, the sizes and the fixed random structure
/// (class prototypes or the linear map), cached when small.
#[derive(Debug)]
pub struct SyntheticGenerator {
    seed: u64,
    input_elements: usize,
    target_kind: TargetKind,
    problem: Problem,
}

#[derive(Debug)]
enum Problem {
    Classification {
        classes: u64,
        /// `classes x input_elements`, when small enough to keep.
        prototypes: Option<Vec<f32>>,
    },
    Regression {
        output_elements: usize,
        taps_per_output: usize,
        /// `output_elements x taps_per_output` (input index, weight), when small enough.
        taps: Option<Vec<(usize, f32)>>,
    },
}

impl SyntheticGenerator {
    pub fn new(
        seed: u64,
        input_elements: usize,
        target_kind: TargetKind,
    ) -> Result<Self, EngineError> {
        Self::with_cache_limit(
            seed,
            input_elements,
            target_kind,
            DEFAULT_CACHE_LIMIT_ELEMENTS,
        )
    }

    /// As `new`, caching the prototypes or the map only up to `cache_limit_elements` (tests
    /// use 0 to check that regenerating gives the same samples).
    pub fn with_cache_limit(
        seed: u64,
        input_elements: usize,
        target_kind: TargetKind,
        cache_limit_elements: usize,
    ) -> Result<Self, EngineError> {
        if input_elements == 0 {
            return Err(EngineError::data(
                "synthetic",
                "the model input has no elements",
            ));
        }
        let problem = match target_kind {
            TargetKind::Classes { classes } => {
                if classes < 2 || classes > i32::MAX as u64 {
                    return Err(EngineError::data(
                        "synthetic",
                        format!(
                            "{classes} classes; synthetic classification needs 2..={}",
                            i32::MAX
                        ),
                    ));
                }
                let cached = (classes as usize)
                    .checked_mul(input_elements)
                    .filter(|elements| *elements <= cache_limit_elements);
                let prototypes = cached.map(|elements| {
                    let mut prototypes = Vec::with_capacity(elements);
                    for class in 0..classes {
                        let mut rng = prototype_rng(seed, class);
                        prototypes.extend(
                            (0..input_elements).map(|_| approximately_standard_normal(&mut rng)),
                        );
                    }
                    prototypes
                });
                Problem::Classification {
                    classes,
                    prototypes,
                }
            }
            TargetKind::Values { elements } => {
                if elements == 0 {
                    return Err(EngineError::data(
                        "synthetic",
                        "the model output has no elements",
                    ));
                }
                let taps_per_output = input_elements.min(REGRESSION_TAPS_PER_OUTPUT);
                let cached = elements
                    .checked_mul(taps_per_output)
                    .filter(|taps| *taps <= cache_limit_elements);
                let taps = cached.map(|count| {
                    let mut taps = Vec::with_capacity(count);
                    for output in 0..elements {
                        push_taps(seed, output, input_elements, taps_per_output, &mut taps);
                    }
                    taps
                });
                Problem::Regression {
                    output_elements: elements,
                    taps_per_output,
                    taps,
                }
            }
        };
        Ok(SyntheticGenerator {
            seed,
            input_elements,
            target_kind,
            problem,
        })
    }

    /// Writes sample `index` of `split`.
    fn generate(
        &self,
        split: SyntheticSplit,
        index: u64,
        input: &mut [f32],
        target_values: &mut [f32],
    ) -> SampleTarget {
        let mut rng = Rng::for_stream(self.seed, &[SAMPLE_STREAM, split.stream_id(), index]);
        match &self.problem {
            Problem::Classification {
                classes,
                prototypes,
            } => {
                let class = rng.below(*classes);
                match prototypes {
                    Some(prototypes) => {
                        let start = class as usize * self.input_elements;
                        let prototype = &prototypes[start..start + self.input_elements];
                        for (value, center) in input.iter_mut().zip(prototype) {
                            *value = center
                                + CLASSIFICATION_NOISE_STD
                                    * approximately_standard_normal(&mut rng);
                        }
                    }
                    None => {
                        let mut prototype = prototype_rng(self.seed, class);
                        for value in input.iter_mut() {
                            let center = approximately_standard_normal(&mut prototype);
                            *value = center
                                + CLASSIFICATION_NOISE_STD
                                    * approximately_standard_normal(&mut rng);
                        }
                    }
                }
                SampleTarget::Class(class as i32)
            }
            Problem::Regression {
                output_elements,
                taps_per_output,
                taps,
            } => {
                for value in input.iter_mut() {
                    *value = approximately_standard_normal(&mut rng);
                }
                let mut regenerated = Vec::new();
                for (output, target) in target_values.iter_mut().enumerate().take(*output_elements)
                {
                    let output_taps = match taps {
                        Some(taps) => {
                            &taps[output * taps_per_output..(output + 1) * taps_per_output]
                        }
                        None => {
                            regenerated.clear();
                            push_taps(
                                self.seed,
                                output,
                                self.input_elements,
                                *taps_per_output,
                                &mut regenerated,
                            );
                            &regenerated[..]
                        }
                    };
                    let clean: f32 = output_taps
                        .iter()
                        .map(|(input_index, weight)| weight * input[*input_index])
                        .sum();
                    *target =
                        clean + REGRESSION_NOISE_STD * approximately_standard_normal(&mut rng);
                }
                SampleTarget::Values
            }
        }
    }
}

fn prototype_rng(seed: u64, class: u64) -> Rng {
    Rng::for_stream(seed, &[PROTOTYPE_STREAM, class])
}

/// The taps of one regression output: input indices and weights of variance 1/taps, so a
/// target has about unit variance like the inputs.
fn push_taps(
    seed: u64,
    output: usize,
    input_elements: usize,
    taps_per_output: usize,
    taps: &mut Vec<(usize, f32)>,
) {
    let mut rng = Rng::for_stream(seed, &[LINEAR_MAP_STREAM, output as u64]);
    let scale = 1.0 / (taps_per_output as f32).sqrt();
    for _ in 0..taps_per_output {
        let input_index = rng.below(input_elements as u64) as usize;
        taps.push((input_index, rng.normal() * scale));
    }
}

/// A cheap, approximately standard normal number: the sum of four 16-bit uniforms from one
/// draw (Irwin-Hall), centred and scaled to unit variance. Box-Muller costs a logarithm, a
/// square root and a cosine per value, and large synthetic images (millions of elements per
/// sample) would make the generator, not the model, the bottleneck.
fn approximately_standard_normal(rng: &mut Rng) -> f32 {
    let bits = rng.next_u64();
    let sum = (bits & 0xffff) + ((bits >> 16) & 0xffff) + ((bits >> 32) & 0xffff) + (bits >> 48);
    // Each uniform is in [0, 1] after dividing by 65535: mean 1/2, variance 1/12.
    let uniform_sum = sum as f32 / 65535.0;
    (uniform_sum - 2.0) * 3f32.sqrt()
}

/// One split of a synthetic problem.
#[derive(Debug, Clone)]
pub struct SyntheticDataset {
    generator: Arc<SyntheticGenerator>,
    split: SyntheticSplit,
    samples: u64,
}

impl SyntheticDataset {
    pub fn new(
        generator: Arc<SyntheticGenerator>,
        split: SyntheticSplit,
        samples: u64,
    ) -> Result<Self, EngineError> {
        if samples == 0 {
            return Err(EngineError::data(
                "synthetic",
                "has no samples; set data.samples to at least 1",
            ));
        }
        Ok(SyntheticDataset {
            generator,
            split,
            samples,
        })
    }
}

impl SampleSource for SyntheticDataset {
    fn source(&self) -> &str {
        "synthetic"
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout {
            samples: self.samples,
            input_elements: self.generator.input_elements,
            target_kind: self.generator.target_kind,
        }
    }

    fn read_checked(&self, request: SampleRequest<'_>) -> Result<SampleTarget, EngineError> {
        let (index, input, target_values) = (request.index, request.input, request.target_values);
        Ok(self
            .generator
            .generate(self.split, index, input, target_values))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Dataset;

    fn read(dataset: &SyntheticDataset, index: u64) -> (Vec<f32>, SampleTarget, Vec<f32>) {
        let mut input = vec![0.0; dataset.input_elements()];
        let mut target = vec![0.0; dataset.target_kind().value_elements()];
        let label = dataset.read_sample(index, &mut input, &mut target).unwrap();
        (input, label, target)
    }

    #[test]
    fn regenerating_the_prototypes_and_the_map_gives_the_same_samples() {
        for kind in [
            TargetKind::Classes { classes: 5 },
            TargetKind::Values { elements: 3 },
        ] {
            let cached = Arc::new(SyntheticGenerator::new(9, 20, kind).unwrap());
            let regenerated =
                Arc::new(SyntheticGenerator::with_cache_limit(9, 20, kind, 0).unwrap());
            assert!(matches!(
                (&cached.problem, &regenerated.problem),
                (
                    Problem::Classification {
                        prototypes: Some(_),
                        ..
                    },
                    Problem::Classification {
                        prototypes: None,
                        ..
                    }
                ) | (
                    Problem::Regression { taps: Some(_), .. },
                    Problem::Regression { taps: None, .. }
                )
            ));
            for split in [SyntheticSplit::Train, SyntheticSplit::Test] {
                let first = SyntheticDataset::new(cached.clone(), split, 50).unwrap();
                let second = SyntheticDataset::new(regenerated.clone(), split, 50).unwrap();
                for index in [0, 1, 17, 49] {
                    assert_eq!(read(&first, index), read(&second, index));
                }
            }
        }
    }

    #[test]
    fn the_approximate_normal_has_zero_mean_and_unit_variance() {
        let mut rng = Rng::new(3);
        let count = 200_000;
        let values: Vec<f32> = (0..count)
            .map(|_| approximately_standard_normal(&mut rng))
            .collect();
        let mean = values.iter().sum::<f32>() / count as f32;
        let variance = values
            .iter()
            .map(|value| (value - mean).powi(2))
            .sum::<f32>()
            / count as f32;
        assert!(mean.abs() < 0.01, "{mean}");
        assert!((variance - 1.0).abs() < 0.02, "{variance}");
    }

    #[test]
    fn sizes_that_cannot_be_generated_are_errors() {
        assert!(SyntheticGenerator::new(1, 0, TargetKind::Classes { classes: 3 }).is_err());
        assert!(SyntheticGenerator::new(1, 4, TargetKind::Classes { classes: 1 }).is_err());
        assert!(SyntheticGenerator::new(1, 4, TargetKind::Values { elements: 0 }).is_err());
        let generator =
            Arc::new(SyntheticGenerator::new(1, 4, TargetKind::Classes { classes: 3 }).unwrap());
        assert!(SyntheticDataset::new(generator.clone(), SyntheticSplit::Train, 0).is_err());
        let dataset = SyntheticDataset::new(generator, SyntheticSplit::Train, 2).unwrap();
        let mut input = vec![0.0; 4];
        let error = dataset
            .read_sample(2, &mut input, &mut [])
            .unwrap_err()
            .to_string();
        assert!(error.contains("sample index 2 is outside 0..2"), "{error}");
        let mut short = vec![0.0; 3];
        assert!(dataset.read_sample(0, &mut short, &mut []).is_err());
    }
}
