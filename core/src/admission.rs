//! Sizing a job's slice at admission: the one rule the scheduler's `submit` and the
//! simulator's Carve policy both follow, so the simulator measures what the scheduler
//! does.
//!
//! The slice is the estimate's `required_bytes`, raised by the measured-peak correction
//! for the same job shape. A job that asks for a fixed `resources.vram`, or whose slice
//! would not fit the largest GPU, is shrunk to fit the smaller of the two; an explicit
//! `vram` is then reserved as asked even when the job needs less.

use crate::plan::RunConfig;
use crate::spec::VramRequest;

/// The configuration a job is admitted with and the slice it is placed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmittedSlice {
    pub config: RunConfig,
    pub slice_bytes: u64,
    /// Whether the shrink planner changed the configuration at admission.
    pub shrunk: bool,
}

/// Sizes the slice of a job whose configuration `config` needs `required_bytes`.
///
/// `peak_correction` is the ratio of measured to estimated peaks seen for this job shape
/// (1.0 when none was measured; values below 1 are ignored, so an estimate is never
/// lowered). `largest_usable_gpu` is the most any GPU of the cluster can give one slice,
/// `None` while no GPU is known. `shrink_into(config, limit)` returns the configuration
/// the shrink planner chooses within `limit` bytes and its required bytes; its error is
/// passed through (the job can never fit as asked).
pub fn size_slice_at_admission<E>(
    vram: VramRequest,
    config: RunConfig,
    required_bytes: u64,
    peak_correction: f64,
    largest_usable_gpu: Option<u64>,
    shrink_into: impl FnOnce(&RunConfig, u64) -> Result<(RunConfig, u64), E>,
) -> Result<AdmittedSlice, E> {
    let mut admitted = AdmittedSlice {
        config,
        slice_bytes: (required_bytes as f64 * peak_correction.max(1.0)).ceil() as u64,
        shrunk: false,
    };
    let limit = match vram {
        VramRequest::Bytes(bytes) => {
            Some(largest_usable_gpu.map_or(bytes, |largest| bytes.min(largest)))
        }
        VramRequest::Auto => largest_usable_gpu.filter(|largest| admitted.slice_bytes > *largest),
    };
    if let Some(limit) = limit
        && admitted.slice_bytes > limit
    {
        let (config, required_bytes) = shrink_into(&admitted.config, limit)?;
        admitted = AdmittedSlice {
            config,
            slice_bytes: required_bytes,
            shrunk: true,
        };
    }
    if let VramRequest::Bytes(bytes) = vram {
        // An explicit slice is reserved as asked, even when the job needs less.
        admitted.slice_bytes = admitted
            .slice_bytes
            .max(largest_usable_gpu.map_or(bytes, |largest| bytes.min(largest)));
    }
    Ok(admitted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{EngineSettings, RunConfig};
    use crate::spec::Precision;

    fn config() -> RunConfig {
        RunConfig {
            batch_size: 64,
            micro_batch_size: 64,
            precision: Precision::Fp32,
            recompute_segment_layers: None,
            engine: Some(EngineSettings {
                workspace_limit_bytes: 1 << 20,
                prefetch_batches: 1,
            }),
        }
    }

    fn halve(config: &RunConfig, limit: u64) -> Result<(RunConfig, u64), String> {
        let mut smaller = *config;
        smaller.micro_batch_size /= 2;
        Ok((smaller, limit / 2))
    }

    #[test]
    fn an_auto_job_that_fits_gets_its_corrected_estimate() {
        let admitted =
            size_slice_at_admission(VramRequest::Auto, config(), 1000, 1.5, Some(10_000), halve)
                .unwrap();
        assert_eq!(admitted.slice_bytes, 1500);
        assert!(!admitted.shrunk);
        // A correction below 1 never lowers the estimate.
        let admitted =
            size_slice_at_admission(VramRequest::Auto, config(), 1000, 0.5, Some(10_000), halve)
                .unwrap();
        assert_eq!(admitted.slice_bytes, 1000);
    }

    #[test]
    fn an_auto_job_larger_than_every_gpu_is_shrunk_to_the_largest() {
        let admitted =
            size_slice_at_admission(VramRequest::Auto, config(), 5000, 1.0, Some(4000), halve)
                .unwrap();
        assert!(admitted.shrunk);
        assert_eq!(admitted.slice_bytes, 2000);
        assert_eq!(admitted.config.micro_batch_size, 32);
        // Without any GPU known there is nothing to shrink to.
        let admitted =
            size_slice_at_admission(VramRequest::Auto, config(), 5000, 1.0, None, halve).unwrap();
        assert_eq!(admitted.slice_bytes, 5000);
    }

    #[test]
    fn an_explicit_vram_is_shrunk_into_and_then_reserved_as_asked() {
        let admitted = size_slice_at_admission(
            VramRequest::Bytes(3000),
            config(),
            5000,
            1.0,
            Some(10_000),
            halve,
        )
        .unwrap();
        assert!(admitted.shrunk);
        assert_eq!(admitted.slice_bytes, 3000, "1500 needed, 3000 reserved");
        // Larger than the largest GPU: capped at it.
        let admitted = size_slice_at_admission(
            VramRequest::Bytes(20_000),
            config(),
            1000,
            1.0,
            Some(8000),
            halve,
        )
        .unwrap();
        assert_eq!(admitted.slice_bytes, 8000);
        assert!(!admitted.shrunk);
    }

    #[test]
    fn the_shrink_planner_s_refusal_is_passed_through() {
        let refused = size_slice_at_admission(
            VramRequest::Bytes(100),
            config(),
            5000,
            1.0,
            Some(10_000),
            |_: &RunConfig, _| Err::<(RunConfig, u64), _>("nothing fits"),
        );
        assert_eq!(refused, Err("nothing fits"));
    }
}
