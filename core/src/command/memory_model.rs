//! The memory of a program Carve cannot see into: `fixed + per_sample x micro_batch`,
//! fitted from the guard's peaks in a profile, scaled for precision and recomputation,
//! and raised by what later runs measured.
//!
//! The scaling for a precision or recomputation the profile did not run with is an
//! assumption (documented on [`CommandMemoryModel::need_bytes`]); the first run with it
//! measures the truth, and [`CommandMemoryModel::refined`] keeps it. What a model may
//! learn at all (unmeasured profiles, outliers, the floor, declared sizes) is
//! [`learning`]'s.

use serde::{Deserialize, Serialize};

use crate::allocator::OutOfMemory;
use crate::bytes::HumanBytes;
use crate::error::FieldError;
use crate::estimator::MemoryEstimate;
use crate::plan::{MemoryCategory, RunConfig};
use crate::spec::Precision;

pub mod learning;

/// One profile run: the micro-batch it ran with and the guard's peak for it. A run that
/// ran out of memory gives `in_use + requested` as a lower bound, with `ran_out` set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfilePoint {
    pub micro_batch: u64,
    pub peak_bytes: u64,
    #[serde(default)]
    pub ran_out: bool,
}

/// `need(micro) = fixed_bytes + per_sample_bytes x micro`, as measured at `precision`
/// with recomputation `recompute`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandMemoryModel {
    pub fixed_bytes: u64,
    pub per_sample_bytes: u64,
    pub precision: Precision,
    pub recompute: bool,
}

/// The share of per-sample memory (activations) a half precision keeps from fp32: 0.6,
/// not 0.5, because frameworks keep some activations in fp32 under autocast (softmax,
/// norms, the loss).
pub const HALF_PRECISION_PER_SAMPLE_SHARE: f64 = 0.6;

/// The share of per-sample memory recomputation keeps: 0.5, conservative for
/// checkpointing every block of a CNN.
pub const RECOMPUTE_PER_SAMPLE_SHARE: f64 = 0.5;

impl CommandMemoryModel {
    /// Fits the model to profile points (two or more distinct micro-batches: the line
    /// through them, per-sample never below 0, fixed never below 0; one point or equal
    /// micro-batches: all of it per sample). A point that `ran_out` is a lower bound: the
    /// fitted line is raised until it covers it. Errors name `profile` when there is
    /// nothing to fit.
    ///
    /// The line is the least-squares one over the measured points (exact through two).
    /// When those are fewer than two micro-batches, the lower bounds are fitted with them
    /// as if measured: a line through a measured point and a lower bound at a larger
    /// micro-batch never under-predicts a smaller micro-batch, which is where a shrink
    /// goes, while "all of it per sample" would. A clamped line is the smallest one of
    /// its kind that covers every point it was fitted to.
    pub fn fit(
        points: &[ProfilePoint],
        precision: Precision,
        recompute: bool,
    ) -> Result<CommandMemoryModel, FieldError> {
        if points.is_empty() {
            return Err(FieldError::new(
                "profile",
                "has no points: the profile measured nothing to fit a memory model to",
            ));
        }
        let measured: Vec<ProfilePoint> = points
            .iter()
            .filter(|point| !point.ran_out)
            .copied()
            .collect();
        let basis = if distinct_micro_batches(&measured) >= 2 {
            &measured[..]
        } else {
            points
        };
        let (mut fixed_bytes, mut per_sample_bytes) = line_through(basis);
        for point in points.iter().filter(|point| point.ran_out) {
            let predicted =
                fixed_bytes.saturating_add(per_sample_bytes.saturating_mul(point.micro_batch));
            if predicted >= point.peak_bytes {
                continue;
            }
            if point.micro_batch == 0 {
                fixed_bytes = point.peak_bytes;
            } else {
                per_sample_bytes = (point.peak_bytes - fixed_bytes).div_ceil(point.micro_batch);
            }
        }
        Ok(CommandMemoryModel {
            fixed_bytes,
            per_sample_bytes,
            precision,
            recompute,
        })
    }

    /// The most a run with `config` can need, from what an OOM said alone (no profile):
    /// all of `in_use + requested` per sample of `config.micro_batch_size`, the worst case.
    pub fn from_out_of_memory(config: &RunConfig, report: &OutOfMemory) -> CommandMemoryModel {
        let needed = report.in_use.saturating_add(report.requested);
        CommandMemoryModel {
            fixed_bytes: 0,
            per_sample_bytes: needed.div_ceil(config.micro_batch_size.max(1)),
            precision: config.precision,
            recompute: config.recompute_segment_layers.is_some(),
        }
    }

    /// The predicted peak of a run with `config`: fixed plus per-sample x micro-batch,
    /// the per-sample part scaled by [`HALF_PRECISION_PER_SAMPLE_SHARE`] between fp32 and
    /// a half precision (up when going back to fp32) and by
    /// [`RECOMPUTE_PER_SAMPLE_SHARE`] when recomputation differs from the model's.
    /// Saturates rather than overflows.
    pub fn need_bytes(&self, config: &RunConfig) -> u64 {
        self.fixed_bytes.saturating_add(
            self.per_sample_bytes_for(config)
                .saturating_mul(config.micro_batch_size),
        )
    }

    /// This model raised so that it predicts at least `measured_peak_bytes` for `config`
    /// (the per-sample part grows; a model is never lowered by a measurement).
    pub fn refined(&self, config: &RunConfig, measured_peak_bytes: u64) -> CommandMemoryModel {
        if self.need_bytes(config) >= measured_peak_bytes {
            return *self;
        }
        let mut refined = *self;
        if config.micro_batch_size > 0 {
            let per_sample_at_config =
                (measured_peak_bytes - self.fixed_bytes).div_ceil(config.micro_batch_size);
            let per_sample = scaled(per_sample_at_config, 1.0 / self.per_sample_share(config));
            refined.per_sample_bytes = per_sample.max(self.per_sample_bytes);
        }
        // The share's rounding (or a micro-batch of 0) can leave a few bytes short: they
        // go to the fixed part, so the prediction always covers the measurement.
        let shortfall = measured_peak_bytes.saturating_sub(refined.need_bytes(config));
        refined.fixed_bytes = refined.fixed_bytes.saturating_add(shortfall);
        refined
    }

    /// What reads show for a command job in place of the estimator's answer: peak and
    /// required both `need_bytes(config)`, persistent the fixed part, no fragmentation,
    /// the categories all zero, no layers, `peak_during` saying where the number comes
    /// from ("command: fixed 1.2 GiB + 35 MiB per sample x 64, fitted from a profile").
    pub fn estimate(&self, config: &RunConfig) -> MemoryEstimate {
        let need_bytes = self.need_bytes(config);
        MemoryEstimate {
            config: *config,
            peak_bytes: need_bytes,
            required_bytes: need_bytes,
            persistent_bytes: self.fixed_bytes,
            fragmentation_bytes_at_peak: 0,
            fragmentation_at_peak: 0.0,
            by_category: MemoryCategory::ALL
                .iter()
                .map(|category| (*category, 0))
                .collect(),
            by_layer: Vec::new(),
            peak_during: format!(
                "command: fixed {} + {} per sample x {}, from the program's memory model",
                HumanBytes(self.fixed_bytes),
                HumanBytes(self.per_sample_bytes_for(config)),
                config.micro_batch_size
            ),
        }
    }

    /// The per-sample bytes of a run with `config`, scaled from the model's.
    fn per_sample_bytes_for(&self, config: &RunConfig) -> u64 {
        scaled(self.per_sample_bytes, self.per_sample_share(config))
    }

    /// What share of the model's per-sample memory a run with `config` keeps.
    fn per_sample_share(&self, config: &RunConfig) -> f64 {
        let mut share = 1.0;
        match (self.precision.is_mixed(), config.precision.is_mixed()) {
            (false, true) => share *= HALF_PRECISION_PER_SAMPLE_SHARE,
            (true, false) => share /= HALF_PRECISION_PER_SAMPLE_SHARE,
            _ => {}
        }
        match (self.recompute, config.recompute_segment_layers.is_some()) {
            (false, true) => share *= RECOMPUTE_PER_SAMPLE_SHARE,
            (true, false) => share /= RECOMPUTE_PER_SAMPLE_SHARE,
            _ => {}
        }
        share
    }
}

/// `bytes x share`, rounded up; exact when the share is 1, saturating when huge.
fn scaled(bytes: u64, share: f64) -> u64 {
    if share == 1.0 {
        bytes
    } else {
        // `as` saturates at u64::MAX rather than wrapping.
        (bytes as f64 * share).ceil() as u64
    }
}

fn distinct_micro_batches(points: &[ProfilePoint]) -> usize {
    let mut micro_batches: Vec<u64> = points.iter().map(|point| point.micro_batch).collect();
    micro_batches.sort_unstable();
    micro_batches.dedup();
    micro_batches.len()
}

/// `(fixed, per_sample)` of the line through `points` (not empty), both at least 0.
fn line_through(points: &[ProfilePoint]) -> (u64, u64) {
    let highest_peak = points
        .iter()
        .map(|point| point.peak_bytes)
        .max()
        .unwrap_or(0);
    let first_micro_batch = points[0].micro_batch;
    if points
        .iter()
        .all(|point| point.micro_batch == first_micro_batch)
    {
        return if first_micro_batch == 0 {
            (highest_peak, 0)
        } else {
            (0, highest_peak.div_ceil(first_micro_batch))
        };
    }
    let count = points.len() as f64;
    let mean_micro_batch = points
        .iter()
        .map(|point| point.micro_batch as f64)
        .sum::<f64>()
        / count;
    let mean_peak = points
        .iter()
        .map(|point| point.peak_bytes as f64)
        .sum::<f64>()
        / count;
    let (mut covariance, mut variance) = (0.0, 0.0);
    for point in points {
        let micro_batch_offset = point.micro_batch as f64 - mean_micro_batch;
        covariance += micro_batch_offset * (point.peak_bytes as f64 - mean_peak);
        variance += micro_batch_offset * micro_batch_offset;
    }
    let slope = covariance / variance;
    let intercept = mean_peak - slope * mean_micro_batch;
    if !slope.is_finite() || slope < 0.0 {
        // Memory that does not grow with the batch: all of it fixed.
        return (highest_peak, 0);
    }
    if !intercept.is_finite() || intercept < 0.0 {
        // All of it per sample: the smallest such line over every point.
        let per_sample = points
            .iter()
            .filter(|point| point.micro_batch > 0)
            .map(|point| point.peak_bytes.div_ceil(point.micro_batch))
            .max()
            .unwrap_or(0);
        let fixed = points
            .iter()
            .filter(|point| point.micro_batch == 0)
            .map(|point| point.peak_bytes)
            .max()
            .unwrap_or(0);
        return (fixed, per_sample);
    }
    // `as` saturates: an absurd fit gives u64::MAX, never a wrap.
    (intercept.round() as u64, slope.round() as u64)
}

#[cfg(test)]
mod tests;
