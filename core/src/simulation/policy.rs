//! The three admission policies the simulator compares, and the modelling assumptions
//! that are policy-specific: the slice a job asks for at submit, what happens after an
//! out-of-memory, and how much slower a shrunk configuration runs.

use std::fmt;
use std::str::FromStr;

use crate::allocator::OutOfMemory;
use crate::plan::RunConfig;
use crate::shrink::OomObservation;

/// How a cluster gives memory to jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Policy {
    /// One whole GPU per job, whatever it needs (Slurm `--gres=gpu:1`, the Kubernetes
    /// device plugin). A job that needs more than a GPU runs out of memory and fails.
    WholeGpu,
    /// Trust the declared memory (memory-sharing schedulers): the slice is what the user
    /// wrote. A job whose true need is above it runs out of memory; its user resubmits it
    /// with twice the declaration after a delay.
    Declared,
    /// Carve: admission by the estimator (with the scheduler's measured-peak correction),
    /// shrinking at admission when the job does not fit the largest GPU, and the shrink
    /// planner after an out-of-memory, retrying from the last checkpoint at once.
    Carve,
}

impl Policy {
    pub const ALL: [Policy; 3] = [Policy::WholeGpu, Policy::Declared, Policy::Carve];

    pub fn name(self) -> &'static str {
        match self {
            Policy::WholeGpu => "whole-gpu",
            Policy::Declared => "declared",
            Policy::Carve => "carve",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Policy::ALL
            .into_iter()
            .find(|policy| policy.name() == text)
            .ok_or_else(|| {
                format!("unknown policy `{text}`; expected whole-gpu, declared or carve")
            })
    }
}

/// How much longer a step takes in `shrunk` than in `own`, the job's own configuration.
///
/// The assumptions, kept deliberately simple and written down in docs/simulator.md:
/// - mixed precision: 1.0 (tensor cores usually make it faster; no speed-up is claimed);
/// - gradient accumulation: +10% per halving of the micro-batch (smaller kernels use the
///   GPU less well), i.e. `1 + 0.1 * log2(own micro-batch / shrunk micro-batch)`;
/// - recomputation in segments of k layers: about one extra forward pass over the
///   `(k - 1) / k` of the layers that are recomputed, a forward being a third of a step:
///   `1 + (k - 1) / (3k)`;
/// - a smaller convolution workspace: +5%, or +15% when it drops to none;
/// - a smaller batch (`shrink_batch`): 1.0 per sample, since the job trains the same
///   number of samples in smaller steps.
///
/// The factors multiply.
pub fn slowdown_factor(own: &RunConfig, shrunk: &RunConfig) -> f64 {
    let mut factor = 1.0;
    let own_micro = own.micro_batch_size.min(shrunk.batch_size).max(1) as f64;
    let shrunk_micro = shrunk.micro_batch_size.max(1) as f64;
    if shrunk_micro < own_micro {
        factor *= 1.0 + 0.1 * (own_micro / shrunk_micro).log2();
    }
    if shrunk.recompute_segment_layers != own.recompute_segment_layers
        && let Some(segment) = shrunk.recompute_segment_layers
        && segment > 1
    {
        let segment = segment as f64;
        factor *= 1.0 + (segment - 1.0) / (3.0 * segment);
    }
    if shrunk.workspace_limit_bytes() < own.workspace_limit_bytes() {
        factor *= if shrunk.workspace_limit_bytes() == 0 {
            1.15
        } else {
            1.05
        };
    }
    factor
}

/// The out-of-memory report an attempt that needed `need_bytes` would make in a slice
/// of `slice_bytes`, with the estimate it was admitted by. It failed on the allocation
/// that crossed the slice: `in_use + requested = need_bytes`, so the planner sees exactly
/// the bytes the estimator missed (`need_bytes - estimated_required_bytes`).
pub fn oom_observation(
    need_bytes: u64,
    slice_bytes: u64,
    estimated_required_bytes: u64,
) -> OomObservation {
    let in_use = estimated_required_bytes.min(slice_bytes).min(need_bytes);
    OomObservation {
        report: OutOfMemory {
            requested: need_bytes - in_use,
            in_use,
            limit: slice_bytes,
            largest_free: slice_bytes - in_use,
            peak: in_use,
        },
        estimated_required_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::EngineSettings;
    use crate::spec::Precision;

    fn config(micro: u64, recompute: Option<u64>, workspace: u64) -> RunConfig {
        RunConfig {
            batch_size: 64,
            micro_batch_size: micro,
            precision: Precision::Fp32,
            recompute_segment_layers: recompute,
            engine: Some(EngineSettings {
                workspace_limit_bytes: workspace,
                prefetch_batches: 2,
            }),
        }
    }

    #[test]
    fn slowdown_follows_the_documented_factors() {
        let own = config(64, None, 256 << 20);
        assert_eq!(slowdown_factor(&own, &own), 1.0);
        let mixed = RunConfig {
            precision: Precision::Fp16,
            ..own
        };
        assert_eq!(slowdown_factor(&own, &mixed), 1.0);
        assert!((slowdown_factor(&own, &config(16, None, 256 << 20)) - 1.2).abs() < 1e-12);
        assert!((slowdown_factor(&own, &config(64, Some(4), 256 << 20)) - 1.25).abs() < 1e-12);
        assert!((slowdown_factor(&own, &config(64, None, 0)) - 1.15).abs() < 1e-12);
        assert!((slowdown_factor(&own, &config(32, None, 128 << 20)) - 1.1 * 1.05).abs() < 1e-12);
    }

    #[test]
    fn observation_shows_the_missed_bytes() {
        let observation = oom_observation(10 << 30, 8 << 30, 7 << 30);
        assert_eq!(observation.unaccounted_bytes(), 3 << 30);
        assert_eq!(observation.report.limit, 8 << 30);
        assert_eq!(
            observation.report.in_use + observation.report.requested,
            10 << 30
        );
        assert_eq!("carve".parse::<Policy>(), Ok(Policy::Carve));
        assert!("slurm".parse::<Policy>().unwrap_err().contains("whole-gpu"));
    }
}
