//! Synthetic traces with the shape of a shared research cluster, deterministic for a seed.
//!
//! - Arrivals are Poisson (exponential gaps with a chosen mean).
//! - Tenants are skewed: tenant `i` submits in proportion to `1 / (i + 1)`.
//! - Models come from the built-in CNN family in four size classes (estimated memory at
//!   their own configuration): small (55%, 0.5-6.5 GiB), medium (28%, 4.5-27 GiB), large
//!   (14%, 23-78 GiB) and huge (3%, 115-240 GiB: beyond one 80 GiB GPU, so only a shrink
//!   lets them run).
//! - Durations are log-normal (heavy-tailed), with a median that grows with the class,
//!   between one minute and one week.
//! - Declarations: most users over-declare by 1.5-4x and round up to whole GiB, as is
//!   typical; a fraction (10% by default) under-declare (0.5-0.9x), so a scheduler that
//!   trusts declarations sees them run out of memory.
//! - A fraction of jobs (5% by default) need more than the estimator sees (5-25% more:
//!   a library's private buffers), written as `actual_peak_bytes`, so Carve meets
//!   run-time out-of-memory errors too.
//!
//! The randomness is a SplitMix64 generator seeded by the caller (core reads no entropy).

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::error::{CoreError, FieldError};
use crate::estimator::estimate_job;
use crate::plan::RunConfig;
use crate::simulation::trace::ModelFamilyParameters;
use crate::validate::load_job_spec_toml;

/// What to generate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GeneratorOptions {
    pub jobs: usize,
    pub seed: u64,
    pub tenants: usize,
    /// Mean seconds between two submissions.
    pub mean_interarrival_s: f64,
    /// Share of jobs whose users declare less than the job needs.
    pub under_declaring_fraction: f64,
    /// Share of jobs that need more than the estimator sees.
    pub unseen_memory_fraction: f64,
    /// Share of jobs that are gangs of 2, 4 or 8 slices (half, 30 % and 20 % of them),
    /// as the multi-GPU pods of the Alibaba GPU traces; their rows give the need per slice
    /// (no model: model jobs keep one slice). 0 draws nothing, so the trace of a seed is
    /// the same as before gangs.
    pub gang_fraction: f64,
}

impl Default for GeneratorOptions {
    fn default() -> Self {
        GeneratorOptions {
            jobs: 1000,
            seed: 1,
            tenants: 4,
            mean_interarrival_s: 90.0,
            under_declaring_fraction: 0.10,
            unseen_memory_fraction: 0.05,
            gang_fraction: 0.0,
        }
    }
}

impl GeneratorOptions {
    fn check(&self) -> Result<(), CoreError> {
        let error =
            |field: &str, reason: String| CoreError::InvalidSpec(FieldError::new(field, reason));
        if self.jobs == 0 || self.jobs > 10_000_000 {
            return Err(error(
                "jobs",
                format!("{} must be between 1 and 10000000", self.jobs),
            ));
        }
        if self.tenants == 0 || self.tenants > 10_000 {
            return Err(error(
                "tenants",
                format!("{} must be between 1 and 10000", self.tenants),
            ));
        }
        if !(self.mean_interarrival_s.is_finite() && self.mean_interarrival_s > 0.0) {
            return Err(error(
                "mean_interarrival_s",
                format!("{} must be more than 0 seconds", self.mean_interarrival_s),
            ));
        }
        for (field, value) in [
            ("under_declaring_fraction", self.under_declaring_fraction),
            ("unseen_memory_fraction", self.unseen_memory_fraction),
            ("gang_fraction", self.gang_fraction),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(error(field, format!("{value} must be between 0 and 1")));
            }
        }
        Ok(())
    }
}

/// SplitMix64, as in the engine's `rng.rs` (core cannot depend on the engine).
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut value = self.state;
        value = (value ^ (value >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        value = (value ^ (value >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        value ^ (value >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(crate) fn uniform(&mut self, low: f64, high: f64) -> f64 {
        low + (high - low) * self.next_f64()
    }

    pub(crate) fn pick<T: Copy>(&mut self, choices: &[T]) -> T {
        choices[(self.next_u64() % choices.len() as u64) as usize]
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let radius = (-2.0 * (1.0 - self.next_f64()).ln()).sqrt();
        radius * (std::f64::consts::TAU * self.next_f64()).cos()
    }
}

/// One size class of the mix.
struct SizeClass {
    share: f64,
    widths: &'static [u64],
    depths: &'static [u64],
    batches: &'static [u64],
    images: &'static [u64],
    median_duration_s: f64,
}

const SIZE_CLASSES: [SizeClass; 4] = [
    // About 0.5 to 6.5 GiB.
    SizeClass {
        share: 0.55,
        widths: &[32, 64],
        depths: &[6, 8],
        batches: &[64, 128],
        images: &[96, 128, 160],
        median_duration_s: 20.0 * 60.0,
    },
    // About 4.5 to 27 GiB.
    SizeClass {
        share: 0.28,
        widths: &[64, 96],
        depths: &[8, 12],
        batches: &[64, 128],
        images: &[192, 224],
        median_duration_s: 60.0 * 60.0,
    },
    // About 23 to 78 GiB.
    SizeClass {
        share: 0.14,
        widths: &[128],
        depths: &[12, 16],
        batches: &[64, 128],
        images: &[256, 288],
        median_duration_s: 3.0 * 3600.0,
    },
    // About 115 to 240 GiB: more than one GPU at their own configuration.
    SizeClass {
        share: 0.03,
        widths: &[128],
        depths: &[16, 20],
        batches: &[192, 256],
        images: &[288, 320],
        median_duration_s: 6.0 * 3600.0,
    },
];

/// The trace as CSV text, with a comment line saying how it was made.
pub fn generate_trace(options: &GeneratorOptions) -> Result<String, CoreError> {
    options.check()?;
    let mut random = SplitMix64::new(options.seed);
    let mut required_by_model: HashMap<ModelFamilyParameters, u64> = HashMap::new();
    let tenant_weights: Vec<f64> = (0..options.tenants)
        .map(|index| 1.0 / (index as f64 + 1.0))
        .collect();
    let tenant_weight_sum: f64 = tenant_weights.iter().sum();
    let mut text = String::with_capacity(options.jobs * 80);
    let _ = writeln!(
        text,
        "# carve sim generate --jobs {} --seed {} --tenants {} --mean-interarrival-s {}",
        options.jobs, options.seed, options.tenants, options.mean_interarrival_s
    );
    text.push_str("submit_time_s,duration_s,tenant,gpus,requested_bytes,model,actual_peak_bytes\n");
    let mut time_s = 0.0;
    for _ in 0..options.jobs {
        time_s += -options.mean_interarrival_s * (1.0 - random.next_f64()).ln();
        let tenant = {
            let mut target = random.next_f64() * tenant_weight_sum;
            let mut chosen = options.tenants - 1;
            for (index, weight) in tenant_weights.iter().enumerate() {
                if target < *weight {
                    chosen = index;
                    break;
                }
                target -= weight;
            }
            chosen
        };
        let class = {
            let draw = random.next_f64();
            let mut cumulative = 0.0;
            SIZE_CLASSES
                .iter()
                .find(|class| {
                    cumulative += class.share;
                    draw < cumulative
                })
                .unwrap_or(&SIZE_CLASSES[0])
        };
        let parameters = ModelFamilyParameters {
            width: random.pick(class.widths),
            depth: random.pick(class.depths),
            batch: random.pick(class.batches),
            image: random.pick(class.images),
        };
        let required = match required_by_model.get(&parameters) {
            Some(required) => *required,
            None => {
                let job = load_job_spec_toml(&parameters.job_spec_toml())?;
                let required = estimate_job(&job, &RunConfig::from_spec(&job.spec))?.required_bytes;
                required_by_model.insert(parameters, required);
                required
            }
        };
        let duration_s =
            (class.median_duration_s * (1.2 * random.normal()).exp()).clamp(60.0, 7.0 * 86_400.0);
        let actual_peak_bytes = (random.next_f64() < options.unseen_memory_fraction).then(|| {
            let extra = random.uniform(0.05, 0.25);
            round_up(required + (required as f64 * extra) as u64, 1 << 20)
        });
        let need = actual_peak_bytes.unwrap_or(required);
        let factor = if random.next_f64() < options.under_declaring_fraction {
            random.uniform(0.5, 0.9)
        } else {
            random.uniform(1.5, 4.0)
        };
        let declared_gib = round_up((need as f64 * factor) as u64, 1 << 30) >> 30;
        if options.gang_fraction > 0.0 && random.next_f64() < options.gang_fraction {
            let draw = random.next_f64();
            let gpus = if draw < 0.5 {
                2
            } else if draw < 0.8 {
                4
            } else {
                8
            };
            let _ = writeln!(
                text,
                "{time_s:.1},{duration_s:.1},tenant-{tenant:02},{gpus},{}GiB,,{need}",
                declared_gib.max(1)
            );
            continue;
        }
        let _ = writeln!(
            text,
            "{time_s:.1},{duration_s:.1},tenant-{tenant:02},1,{}GiB,{parameters},{}",
            declared_gib.max(1),
            actual_peak_bytes.map_or(String::new(), |bytes| bytes.to_string())
        );
    }
    Ok(text)
}

fn round_up(value: u64, unit: u64) -> u64 {
    value.div_ceil(unit).saturating_mul(unit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulation::trace::parse_trace;

    #[test]
    fn the_same_seed_gives_the_same_trace_and_another_seed_another() {
        let options = GeneratorOptions {
            jobs: 50,
            ..GeneratorOptions::default()
        };
        let first = generate_trace(&options).unwrap();
        assert_eq!(first, generate_trace(&options).unwrap());
        let other = generate_trace(&GeneratorOptions { seed: 2, ..options }).unwrap();
        assert_ne!(first, other);
        let trace = parse_trace(&first).unwrap();
        assert_eq!(trace.rows.len(), 50);
        assert!(
            trace
                .rows
                .windows(2)
                .all(|pair| pair[0].submit_time_s <= pair[1].submit_time_s)
        );
    }

    #[test]
    fn bad_options_name_the_field() {
        let error = generate_trace(&GeneratorOptions {
            jobs: 0,
            ..GeneratorOptions::default()
        })
        .unwrap_err();
        assert!(error.to_string().starts_with("jobs: 0 must be"), "{error}");
        let error = generate_trace(&GeneratorOptions {
            under_declaring_fraction: 1.5,
            ..GeneratorOptions::default()
        })
        .unwrap_err();
        assert!(
            error.to_string().starts_with("under_declaring_fraction"),
            "{error}"
        );
    }
}
