//! The memory of a program Carve cannot see into: `fixed + per_sample x micro_batch`,
//! fitted from the guard's peaks in a profile, scaled for precision and recomputation,
//! and raised by what later runs measured.
//!
//! The scaling for a precision or recomputation the profile did not run with is an
//! assumption (documented on [`CommandMemoryModel::need_bytes`]); the first run with it
//! measures the truth, and [`CommandMemoryModel::refined`] keeps it.

use serde::{Deserialize, Serialize};

use crate::allocator::OutOfMemory;
use crate::error::FieldError;
use crate::estimator::MemoryEstimate;
use crate::plan::RunConfig;
use crate::spec::Precision;

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
    pub fn fit(
        points: &[ProfilePoint],
        precision: Precision,
        recompute: bool,
    ) -> Result<CommandMemoryModel, FieldError> {
        let _ = (points, precision, recompute);
        todo!()
    }

    /// The most a run with `config` can need, from what an OOM said alone (no profile):
    /// all of `in_use + requested` per sample of `config.micro_batch_size`, the worst case.
    pub fn from_out_of_memory(config: &RunConfig, report: &OutOfMemory) -> CommandMemoryModel {
        let _ = (config, report);
        todo!()
    }

    /// The predicted peak of a run with `config`: fixed plus per-sample x micro-batch,
    /// the per-sample part scaled by [`HALF_PRECISION_PER_SAMPLE_SHARE`] between fp32 and
    /// a half precision (up when going back to fp32) and by
    /// [`RECOMPUTE_PER_SAMPLE_SHARE`] when recomputation differs from the model's.
    /// Saturates rather than overflows.
    pub fn need_bytes(&self, config: &RunConfig) -> u64 {
        let _ = config;
        todo!()
    }

    /// This model raised so that it predicts at least `measured_peak_bytes` for `config`
    /// (the per-sample part grows; a model is never lowered by a measurement).
    pub fn refined(&self, config: &RunConfig, measured_peak_bytes: u64) -> CommandMemoryModel {
        let _ = (config, measured_peak_bytes);
        todo!()
    }

    /// What reads show for a command job in place of the estimator's answer: peak and
    /// required both `need_bytes(config)`, persistent the fixed part, no fragmentation,
    /// the categories all zero, no layers, `peak_during` saying where the number comes
    /// from ("command: fixed 1.2 GiB + 35 MiB per sample x 64, fitted from a profile").
    pub fn estimate(&self, config: &RunConfig) -> MemoryEstimate {
        let _ = config;
        todo!()
    }
}
