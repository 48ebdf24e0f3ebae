//! What a command's memory model may learn, and what a slice may be sized at: the rules
//! that keep nonsense out of a model every later run of the command is sized by.
//!
//! - A profile that measured nothing (every point 0 B: a simulated GPU sees no CUDA
//!   calls, a program that uses no GPU, a guard that could not count) is **unmeasured**:
//!   never a 0-byte model. The job runs in the slice its profile had (or its declared
//!   size), and the stored model says it is a fallback ([`assess_profile`]).
//! - One absurd measurement never moves a model ([`judge_measurement`]).
//! - No slice is sized below an operator's floor ([`floored_slice_bytes`]).
//! - A declared size larger than every GPU is refused, whatever a model says
//!   ([`check_declared_vram`]).
//! - A bare number written as `vram` (`vram = 2`, two bytes) is refused as a missing unit
//!   ([`check_declared_vram_is_a_size`]).
//!
//! Which tenant a model belongs to is the store's key (the scheduler's); nothing here
//! mixes two commands' numbers.

use serde::{Deserialize, Serialize};

use crate::bytes::HumanBytes;
use crate::error::FieldError;
use crate::plan::RunConfig;
use crate::spec::{Precision, VramRequest};

use super::{CommandMemoryModel, ProfilePoint};

/// The floor no slice is sized below unless the operator sets another: 256 MiB, what a
/// CUDA context and a framework's own allocations take before a program holds any data
/// (PyTorch's context alone is 300-500 MiB on current GPUs), so a smaller slice can
/// only fail.
pub const DEFAULT_SLICE_FLOOR_BYTES: u64 = 256 << 20;

/// The smallest `resources.vram` a command job may declare: 1 MiB. Nothing runs on a GPU
/// in less, and a number that small is a size written without its unit (`vram = 2`).
pub const MIN_DECLARED_VRAM_BYTES: u64 = 1 << 20;

/// A command's stored memory model with what it rests on: `measured` is false for the
/// fallback an unmeasured profile left (its fixed part is the slice the job ran in, not
/// anything the program was seen to use).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LearnedModel {
    pub model: CommandMemoryModel,
    pub measured: bool,
}

/// What a profile's points give.
#[derive(Debug, Clone, PartialEq)]
pub enum ProfileAssessment {
    /// A model fitted from the points that measured something; `ignored` says which
    /// points were left out and why (empty when none was).
    Measured {
        model: CommandMemoryModel,
        ignored: Vec<String>,
    },
    /// Nothing was measured: the job is sized by `fallback` (a model of `fallback_bytes`,
    /// all fixed, `measured: false`), and `why` says so for people.
    Unmeasured { fallback: LearnedModel, why: String },
}

/// Judges a profile's `points` run at `precision` / `recompute` in a slice of
/// `profile_slice_bytes`, with `largest_gpu_bytes` the largest usable GPU (when known).
///
/// A point of 0 B that did not run out measured nothing: a real program that ran a step
/// on a GPU holds at least its CUDA context, so 0 is the absence of a measurement, not
/// a measurement of 0. A point larger than the largest GPU is not a measurement of a run
/// that fitted in a slice of one (a guard cannot count past its slice; a program's own
/// report can say anything). Both are left out; with nothing left the profile is
/// unmeasured and the fallback is `declared_bytes` when the spec declared a size, else
/// the profile's slice: the room the program demonstrably ran in.
pub fn assess_profile(
    points: &[ProfilePoint],
    precision: Precision,
    recompute: bool,
    profile_slice_bytes: u64,
    largest_gpu_bytes: Option<u64>,
    declared_bytes: Option<u64>,
) -> ProfileAssessment {
    let mut ignored = Vec::new();
    let kept: Vec<ProfilePoint> = points
        .iter()
        .filter(
            |point| match judge_measurement(point.peak_bytes, largest_gpu_bytes) {
                Ok(()) => true,
                Err(why) => {
                    ignored.push(format!("micro-batch {}: {why}", point.micro_batch));
                    false
                }
            },
        )
        .copied()
        .collect();
    let fallback_bytes = declared_bytes.unwrap_or(profile_slice_bytes);
    let unmeasured = |why: String| ProfileAssessment::Unmeasured {
        fallback: LearnedModel {
            model: CommandMemoryModel {
                fixed_bytes: fallback_bytes,
                per_sample_bytes: 0,
                precision,
                recompute,
            },
            measured: false,
        },
        why: format!(
            "unmeasured: {why}; sized by {} {} instead",
            if declared_bytes.is_some() {
                "the declared vram"
            } else {
                "the profile's slice"
            },
            HumanBytes(fallback_bytes)
        ),
    };
    if kept.is_empty() {
        let why = if points.is_empty() {
            "the profile reported no points".to_string()
        } else {
            format!(
                "the profile measured nothing usable ({}; a simulated GPU or a program \
                 that uses no CUDA memory shows 0 B unless it reports memory_peak_bytes \
                 in its CARVE_PROGRESS lines)",
                ignored.join(", ")
            )
        };
        return unmeasured(why);
    }
    match CommandMemoryModel::fit(&kept, precision, recompute) {
        Ok(model) => ProfileAssessment::Measured { model, ignored },
        Err(error) => unmeasured(error.reason),
    }
}

/// Whether `measured_bytes` (a run's peak, or what an out-of-memory showed was needed)
/// may teach a model anything; `Err` says why not.
///
/// The rule is absolute bounds, not distance from the model: 0 B is no measurement (see
/// [`assess_profile`]), and more than the largest GPU is no measurement of a run on one.
/// A relative rule ("more than N x the model") would refuse the real growth a short
/// profile cannot see (memory a program allocates only from a later step on), which is
/// exactly what later measurements are for; inside the bounds a single measurement can
/// only raise its own tenant's model of its own command to something a GPU can hold.
pub fn judge_measurement(
    measured_bytes: u64,
    largest_gpu_bytes: Option<u64>,
) -> Result<(), String> {
    if measured_bytes == 0 {
        return Err("0 B is no measurement (nothing was seen to use the GPU)".to_string());
    }
    if let Some(largest) = largest_gpu_bytes
        && measured_bytes > largest
    {
        return Err(format!(
            "{} is more than the largest GPU ({}), not a measurement of a run on one",
            HumanBytes(measured_bytes),
            HumanBytes(largest)
        ));
    }
    Ok(())
}

/// The peak of one run of a program: the guard's (`guard_peak_bytes`, what its account
/// counted of the program's CUDA allocations) when it counted anything, else what the
/// program reported itself (`memory_peak_bytes` in its `CARVE_PROGRESS` lines), else 0
/// (nothing measured: [`assess_profile`] calls that unmeasured).
///
/// The guard wins whenever it saw an allocation: it is the measurement a program cannot
/// bend. A program's own figure is used only where the guard saw nothing (a simulated
/// GPU, which sees no CUDA calls; a framework the guard cannot see into), and is still
/// judged by [`judge_measurement`] before a model learns from it; it sizes only its own
/// tenant's runs of its own command.
pub fn run_peak_bytes(guard_peak_bytes: Option<u64>, program_peak_bytes: Option<u64>) -> u64 {
    match guard_peak_bytes {
        Some(peak) if peak > 0 => peak,
        _ => program_peak_bytes.unwrap_or(0),
    }
}

/// What a measurement does to a stored model.
#[derive(Debug, Clone, PartialEq)]
pub enum Refinement {
    /// The model already covers it.
    Unchanged,
    /// The model, raised or (for an unmeasured fallback) replaced by the first real
    /// measurement.
    Changed(LearnedModel),
    /// An outlier: the model stays as it was, for the reason given.
    Rejected(String),
}

/// What a run showed of its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measurement {
    /// The peak of a run that succeeded.
    Peak(u64),
    /// What a run that ran out of memory needed: `in_use + requested`, a lower bound.
    OutOfMemory(u64),
}

impl Measurement {
    pub fn bytes(self) -> u64 {
        match self {
            Measurement::Peak(bytes) | Measurement::OutOfMemory(bytes) => bytes,
        }
    }

    /// For people and a model's basis: "measured peak", "out-of-memory (in use +
    /// requested)".
    pub fn describe(self) -> &'static str {
        match self {
            Measurement::Peak(_) => "measured peak",
            Measurement::OutOfMemory(_) => "out-of-memory (in use + requested)",
        }
    }
}

/// `learned` after a run with `config` showed `measurement` ([`judge_measurement`]
/// first). A measured model is only ever raised ([`CommandMemoryModel::refined`]). An
/// unmeasured fallback is replaced by the first real measurement: a successful run's
/// peak all fixed (the run fitted in its slice at `config`, and Carve only ever shrinks
/// a configuration from there, so a fixed need never under-predicts); an out-of-memory
/// all per sample, as [`CommandMemoryModel::from_out_of_memory`] reads one, so the retry
/// can plan a smaller micro-batch.
pub fn refine_learned(
    learned: &LearnedModel,
    config: &RunConfig,
    measurement: Measurement,
    largest_gpu_bytes: Option<u64>,
) -> Refinement {
    let measured_bytes = measurement.bytes();
    if let Err(why) = judge_measurement(measured_bytes, largest_gpu_bytes) {
        return Refinement::Rejected(why);
    }
    if !learned.measured {
        let (fixed_bytes, per_sample_bytes) = match measurement {
            Measurement::Peak(bytes) => (bytes, 0),
            Measurement::OutOfMemory(bytes) => (0, bytes.div_ceil(config.micro_batch_size.max(1))),
        };
        return Refinement::Changed(LearnedModel {
            model: CommandMemoryModel {
                fixed_bytes,
                per_sample_bytes,
                precision: config.precision,
                recompute: config.recompute_segment_layers.is_some(),
            },
            measured: true,
        });
    }
    let refined = learned.model.refined(config, measured_bytes);
    if refined == learned.model {
        Refinement::Unchanged
    } else {
        Refinement::Changed(LearnedModel {
            model: refined,
            measured: true,
        })
    }
}

/// `slice_bytes` raised to the operator's `floor_bytes`, but never past the largest GPU
/// (a floor larger than every GPU would make every job unplaceable).
pub fn floored_slice_bytes(
    slice_bytes: u64,
    floor_bytes: u64,
    largest_gpu_bytes: Option<u64>,
) -> u64 {
    let floor = largest_gpu_bytes.map_or(floor_bytes, |largest| floor_bytes.min(largest));
    slice_bytes.max(floor)
}

/// A command job's declared `resources.vram` against the cluster: a size larger than
/// every GPU (`largest_gpu_bytes`, when any is known) is refused, naming `resources.vram`.
/// A declared size is the program's own statement of its need; no model may shrink it
/// into a GPU it says it does not fit.
pub fn check_declared_vram(
    vram: VramRequest,
    largest_gpu_bytes: Option<u64>,
) -> Result<(), FieldError> {
    if let (VramRequest::Bytes(bytes), Some(largest)) = (vram, largest_gpu_bytes)
        && bytes > largest
    {
        return Err(FieldError::new(
            "resources.vram",
            format!(
                "{} is more than the largest GPU of the cluster has to give ({}): \
                 declare at most that, or vram = \"auto\" to have it measured",
                HumanBytes(bytes),
                HumanBytes(largest)
            ),
        ));
    }
    Ok(())
}

/// A declared `resources.vram` below [`MIN_DECLARED_VRAM_BYTES`] is refused: a bare
/// number is bytes, and `vram = 2` meant "2 GiB", not a 2-byte slice.
pub fn check_declared_vram_is_a_size(vram: VramRequest) -> Result<(), FieldError> {
    match vram {
        VramRequest::Bytes(bytes) if bytes < MIN_DECLARED_VRAM_BYTES => Err(FieldError::new(
            "resources.vram",
            format!(
                "{bytes} bytes is too small to run anything: a number without a unit is \
                 bytes; write the unit, for example vram = \"{bytes} GiB\" (or \"auto\")"
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
