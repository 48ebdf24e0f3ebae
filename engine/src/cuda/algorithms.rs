//! Workspace-aware choice of cuDNN convolution algorithms.
//!
//! For every convolution (forward, backward data, backward filter) the backend asks
//! cuDNN for its algorithms with their workspace sizes — measured times from
//! `cudnnFind*AlgorithmEx`, or the heuristic's ranking from `cudnnGet*Algorithm_v7` — and
//! [`choose_algorithm`] takes the fastest one whose workspace fits the budget, instead of
//! trusting the heuristic's first pick (which may want more workspace than the slice has).
//!
//! The budget is the plan's workspace buffer for that convolution, never free space
//! elsewhere in the slice: the plan sizes that buffer as whole samples' im2col with
//! headroom for cuDNN, up to `RunConfig::workspace_limit_bytes`
//! (`carve_core::plan::workspace_elements`), and the estimator counts exactly that
//! buffer. Taking more would make the measured peak exceed the estimate; the cap therefore
//! holds twice (it bounds the buffer, and [`workspace_budget`] bounds the choice again).

/// One algorithm as cuDNN reported it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AlgorithmCandidate {
    /// cuDNN's algorithm number (`cudnnConvolutionFwdAlgo_t` and friends).
    pub algorithm: u32,
    /// Measured milliseconds (`cudnnFind*`), `None` for a heuristic ranking (`cudnnGet*_v7`,
    /// which reports -1).
    pub time_milliseconds: Option<f32>,
    pub workspace_bytes: u64,
    /// Whether cuDNN reported `CUDNN_STATUS_SUCCESS` for it (unsupported algorithms come
    /// back in the list with an error status).
    pub usable: bool,
}

/// Why no algorithm could be chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlgorithmChoiceError {
    /// Every usable algorithm needs more workspace than the budget; the smallest need is
    /// reported so the caller can say how much was missing.
    WorkspaceTooSmall {
        budget_bytes: u64,
        smallest_workspace_bytes: u64,
    },
    /// cuDNN reported no usable algorithm at all.
    NoUsableAlgorithm,
}

impl std::fmt::Display for AlgorithmChoiceError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AlgorithmChoiceError::WorkspaceTooSmall {
                budget_bytes,
                smallest_workspace_bytes,
            } => write!(
                formatter,
                "every cudnn algorithm needs more workspace than the {budget_bytes} bytes \
                 available (the smallest needs {smallest_workspace_bytes})"
            ),
            AlgorithmChoiceError::NoUsableAlgorithm => {
                write!(formatter, "cudnn reported no usable algorithm")
            }
        }
    }
}

/// The workspace a convolution may use: the plan's workspace buffer (0 without one),
/// never more than the config's cap.
pub fn workspace_budget(plan_workspace_bytes: Option<u64>, workspace_limit_bytes: u64) -> u64 {
    plan_workspace_bytes.unwrap_or(0).min(workspace_limit_bytes)
}

/// Picks the algorithm to run: among the usable candidates whose workspace fits
/// `budget_bytes`, the one with the smallest measured time; candidates without a
/// measurement rank after measured ones, in the order given (cuDNN's heuristic order).
/// Ties keep the earlier candidate, so the choice is deterministic.
pub fn choose_algorithm(
    candidates: &[AlgorithmCandidate],
    budget_bytes: u64,
) -> Result<AlgorithmCandidate, AlgorithmChoiceError> {
    let usable = candidates.iter().filter(|candidate| {
        candidate.usable
            && candidate
                .time_milliseconds
                .is_none_or(|time| time.is_finite() && time >= 0.0)
    });
    let mut best: Option<AlgorithmCandidate> = None;
    let mut smallest_workspace: Option<u64> = None;
    for candidate in usable {
        smallest_workspace = Some(
            smallest_workspace.map_or(candidate.workspace_bytes, |smallest| {
                smallest.min(candidate.workspace_bytes)
            }),
        );
        if candidate.workspace_bytes > budget_bytes {
            continue;
        }
        let better = match (&best, candidate.time_milliseconds) {
            (None, _) => true,
            (Some(current), Some(time)) => current.time_milliseconds.is_none_or(|now| time < now),
            (Some(_), None) => false,
        };
        if better {
            best = Some(*candidate);
        }
    }
    match (best, smallest_workspace) {
        (Some(chosen), _) => Ok(chosen),
        (None, Some(smallest_workspace_bytes)) => Err(AlgorithmChoiceError::WorkspaceTooSmall {
            budget_bytes,
            smallest_workspace_bytes,
        }),
        (None, None) => Err(AlgorithmChoiceError::NoUsableAlgorithm),
    }
}

/// How a convolution with asymmetric padding (TF "same" with an odd total) runs through
/// cuDNN, whose descriptors take one padding per dimension: a zero-padded copy of some
/// samples' input goes at the start of the plan's workspace buffer, cuDNN convolves it
/// without padding, and its own workspace is what is left of the buffer. No byte outside
/// the buffer the estimator counts is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PaddedConvolutionPlan {
    /// Rows and columns of the padded images: every window fits inside.
    pub padded_height: usize,
    pub padded_width: usize,
    /// Samples per chunk; the last chunk may hold fewer.
    pub samples_per_chunk: usize,
    /// Bytes of one chunk's padded copy, rounded up so cuDNN's workspace after it stays
    /// aligned.
    pub padded_chunk_bytes: u64,
}

/// The alignment of cuDNN's workspace after the padded copy.
const PADDED_COPY_ALIGNMENT: u64 = 256;

/// Plans a padded convolution of `batch` samples in a workspace of `workspace_bytes`:
/// chunks as large as the batch when the padded batch takes at most half of it (the other
/// half is cuDNN's), else as many samples as fill half; `None` when not one padded image
/// fits, and the direct kernels run instead.
pub fn plan_padded_convolution(
    batch: usize,
    output_size: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
    channels: usize,
    element_bytes: u64,
    workspace_bytes: u64,
) -> Option<PaddedConvolutionPlan> {
    if batch == 0 || output_size.contains(&0) {
        return None;
    }
    let padded_height = (output_size[0] - 1) * stride[0] + kernel[0];
    let padded_width = (output_size[1] - 1) * stride[1] + kernel[1];
    let sample_bytes = (padded_height as u64)
        .checked_mul(padded_width as u64)?
        .checked_mul(channels as u64)?
        .checked_mul(element_bytes)?;
    let aligned = |bytes: u64| bytes.checked_next_multiple_of(PADDED_COPY_ALIGNMENT);
    if sample_bytes == 0 || aligned(sample_bytes)? > workspace_bytes {
        return None;
    }
    let samples_in_half = usize::try_from(workspace_bytes / 2 / sample_bytes).unwrap_or(usize::MAX);
    let samples_per_chunk = samples_in_half.clamp(1, batch);
    Some(PaddedConvolutionPlan {
        padded_height,
        padded_width,
        samples_per_chunk,
        padded_chunk_bytes: aligned(sample_bytes * samples_per_chunk as u64)?,
    })
}

/// Alignment of the filter-gradient scratch inside a workspace (cuDNN's own for buffers).
const SCRATCH_ALIGNMENT: u64 = 256;

/// Where a filter gradient that is accumulated into (so cuDNN's measuring run must not
/// write it) can be measured instead: at the start of the workspace, with the rest left
/// to the algorithms, as `(offset of the rest, bytes of the rest)`. `None` when the
/// workspace cannot hold the gradient; the heuristic pick is taken then.
pub fn filter_measurement_split(workspace_bytes: u64, filter_bytes: u64) -> Option<(u64, u64)> {
    let scratch = filter_bytes.checked_next_multiple_of(SCRATCH_ALIGNMENT)?;
    let rest = workspace_bytes.checked_sub(scratch)?;
    Some((scratch, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_gradient_is_measured_at_the_start_of_the_workspace_when_it_fits() {
        assert_eq!(
            filter_measurement_split(1 << 20, 1000),
            Some((1024, (1 << 20) - 1024))
        );
        assert_eq!(filter_measurement_split(1024, 1000), Some((1024, 0)));
        assert_eq!(filter_measurement_split(1000, 1000), None);
        assert_eq!(filter_measurement_split(0, 4), None);
    }

    fn measured(algorithm: u32, time: f32, workspace_bytes: u64) -> AlgorithmCandidate {
        AlgorithmCandidate {
            algorithm,
            time_milliseconds: Some(time),
            workspace_bytes,
            usable: true,
        }
    }

    fn ranked(algorithm: u32, workspace_bytes: u64) -> AlgorithmCandidate {
        AlgorithmCandidate {
            algorithm,
            time_milliseconds: None,
            workspace_bytes,
            usable: true,
        }
    }

    #[test]
    fn the_fastest_algorithm_that_fits_wins_over_a_faster_one_that_does_not() {
        let candidates = [
            measured(6, 0.5, 64 << 20),
            measured(1, 0.9, 1 << 20),
            measured(0, 1.4, 0),
        ];
        assert_eq!(choose_algorithm(&candidates, 2 << 20).unwrap().algorithm, 1);
        assert_eq!(
            choose_algorithm(&candidates, 64 << 20).unwrap().algorithm,
            6
        );
        assert_eq!(choose_algorithm(&candidates, 0).unwrap().algorithm, 0);
    }

    #[test]
    fn order_of_the_list_does_not_matter_for_measured_times() {
        let candidates = [
            measured(0, 1.4, 0),
            measured(1, 0.9, 1 << 20),
            measured(6, 0.5, 64 << 20),
        ];
        assert_eq!(choose_algorithm(&candidates, 2 << 20).unwrap().algorithm, 1);
    }

    #[test]
    fn unusable_and_failed_measurements_are_skipped() {
        let mut failed = measured(7, 0.1, 0);
        failed.usable = false;
        let candidates = [failed, measured(2, f32::NAN, 0), measured(3, 2.0, 0)];
        assert_eq!(choose_algorithm(&candidates, 0).unwrap().algorithm, 3);
    }

    #[test]
    fn a_heuristic_ranking_keeps_its_order_among_what_fits() {
        let candidates = [ranked(5, 8 << 20), ranked(1, 1 << 20), ranked(0, 0)];
        assert_eq!(choose_algorithm(&candidates, 4 << 20).unwrap().algorithm, 1);
        assert_eq!(choose_algorithm(&candidates, 0).unwrap().algorithm, 0);
    }

    #[test]
    fn measured_candidates_rank_before_unmeasured_ones() {
        let candidates = [ranked(5, 0), measured(1, 3.0, 0)];
        assert_eq!(choose_algorithm(&candidates, 0).unwrap().algorithm, 1);
    }

    #[test]
    fn nothing_fitting_reports_the_smallest_need() {
        let candidates = [measured(1, 0.9, 1 << 20), measured(6, 0.5, 64 << 20)];
        assert_eq!(
            choose_algorithm(&candidates, 1000),
            Err(AlgorithmChoiceError::WorkspaceTooSmall {
                budget_bytes: 1000,
                smallest_workspace_bytes: 1 << 20
            })
        );
        assert_eq!(
            choose_algorithm(&[], 1000),
            Err(AlgorithmChoiceError::NoUsableAlgorithm)
        );
    }

    #[test]
    fn the_budget_is_the_plan_buffer_capped_by_the_config() {
        assert_eq!(workspace_budget(None, 1 << 30), 0);
        assert_eq!(workspace_budget(Some(4096), 1 << 30), 4096);
        assert_eq!(workspace_budget(Some(4096), 1024), 1024);
    }

    #[test]
    fn a_padded_convolution_keeps_half_the_workspace_for_cudnn() {
        // resnet-cifar's stride-2 layer: 32x32x64 in, 16x16 out, 3x3; fp32; 256 MiB.
        let plan =
            plan_padded_convolution(128, [16, 16], [3, 3], [2, 2], 64, 4, 256 << 20).unwrap();
        assert_eq!((plan.padded_height, plan.padded_width), (33, 33));
        assert_eq!(plan.samples_per_chunk, 128);
        assert_eq!(plan.padded_chunk_bytes, 33 * 33 * 64 * 4 * 128);
        // A workspace holding five padded images' worth in its half: chunks of five.
        let sample = 33 * 33 * 64 * 4;
        let plan =
            plan_padded_convolution(128, [16, 16], [3, 3], [2, 2], 64, 4, 10 * sample + 7).unwrap();
        assert_eq!(plan.samples_per_chunk, 5);
        assert!(plan.padded_chunk_bytes <= 10 * sample + 7);
        assert_eq!(plan.padded_chunk_bytes % 256, 0);
    }

    #[test]
    fn a_padded_convolution_takes_one_sample_when_only_one_fits_and_none_when_none() {
        let sample: u64 = 7 * 7 * 3 * 2;
        let aligned = sample.next_multiple_of(256);
        let plan = plan_padded_convolution(4, [3, 3], [3, 3], [2, 2], 3, 2, aligned).unwrap();
        assert_eq!((plan.padded_height, plan.samples_per_chunk), (7, 1));
        assert_eq!(
            plan_padded_convolution(4, [3, 3], [3, 3], [2, 2], 3, 2, aligned - 1),
            None
        );
        assert_eq!(
            plan_padded_convolution(4, [3, 3], [3, 3], [2, 2], 3, 2, 0),
            None
        );
        assert_eq!(
            plan_padded_convolution(0, [3, 3], [3, 3], [2, 2], 3, 2, 1 << 20),
            None
        );
    }

    /// What cuDNN's fast fp32 filter-gradient algorithm (ALGO_1) wanted on an H200 for
    /// ResNet-18's two slow stride-2 layers at batch 128, against what the plan's workspace
    /// leaves it to be measured in: the filter-gradient scratch (and, for the asymmetric
    /// 3x3, the padded copy) come out of the workspace first. Without the headroom the 1x1
    /// shortcut had 1.5 MB left and the 3x3 4.8 MB, and both ran ALGO_0 (2.1 and 0.6 ms).
    #[test]
    fn the_workspace_headroom_leaves_resnet18s_stride_two_filter_gradients_room_to_measure() {
        use carve_core::plan::{RunConfig, workspace_elements};
        let job = carve_core::validate::load_job_spec_toml(include_str!(
            "../../../examples/resnet18-cifar.toml"
        ))
        .unwrap();
        let config = RunConfig::from_spec(&job.spec);
        assert_eq!(
            (config.micro_batch_size, config.precision.name()),
            (128, "fp32")
        );
        let workspace_bytes = |name: &str| {
            let layer = job
                .graph
                .layers
                .iter()
                .find(|layer| layer.name.as_deref() == Some(name))
                .unwrap();
            workspace_elements(layer, &config).unwrap() * 4
        };
        let filter_bytes = |kernel: u64| 512 * 256 * kernel * kernel * 4;

        // 1x1 stride 2, 256 -> 512 channels, 8x8 -> 4x4: ALGO_1 wanted 2.6 MB.
        let (_, left) =
            filter_measurement_split(workspace_bytes("stage4_block1_shortcut"), filter_bytes(1))
                .unwrap();
        assert!(left >= 2_600_000, "{left}");

        // 3x3 stride 2 "same" (asymmetric): ALGO_1 wanted 7.9 MB for 113 samples, so
        // about 9 MB for the whole batch, which now goes in one padded chunk.
        let workspace = workspace_bytes("stage4_block1_conv1");
        let padded =
            plan_padded_convolution(128, [4, 4], [3, 3], [2, 2], 256, 4, workspace).unwrap();
        assert_eq!(padded.samples_per_chunk, 128);
        let (_, left) =
            filter_measurement_split(workspace - padded.padded_chunk_bytes, filter_bytes(3))
                .unwrap();
        assert!(left >= 9_000_000, "{left}");
    }
}
