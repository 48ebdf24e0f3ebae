//! Which cuDNN API runs a convolution, and which of the graph (backend) API's engines it
//! runs with, as pure functions the cpu tests check without a GPU.
//!
//! The legacy API (`cudnn_ops.rs`) picks among a fixed list of algorithms. The graph API
//! (`cudnn_graph.rs`) asks cuDNN's heuristics for engine configurations of a one-operation
//! graph, as PyTorch's `Conv_v8.cpp` does; it reaches engines the legacy API has not,
//! notably fast FMA-only fp32 ones for strict mode. Either way the choice is bound by the
//! same budget, the plan's workspace buffer for that convolution
//! (`algorithms::workspace_budget`), so the switch changes speed and never the plan: an
//! engine configuration that needs one byte more than the buffer is refused like a legacy
//! algorithm would be (`choose_graph_engine`, which is `choose_algorithm` after the
//! numerical filter), and the peak on the GPU stays the estimate.

use carve_core::plan::ElementType;

use super::algorithms::{AlgorithmCandidate, AlgorithmChoiceError, choose_algorithm};
use super::tuning::ConvolutionApiChoice;

/// The API a convolution runs through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConvolutionApi {
    /// `cudnnConvolutionForward` and friends with `cudnnFind*`/`cudnnGet*_v7` algorithms.
    Legacy,
    /// Operation graphs, heuristics and execution plans (`cudnnBackend*`).
    Graph,
}

/// The oldest cuDNN whose graph API the engine uses: the bindings are cuDNN 9's headers
/// (cudarc's `cudnn-09021`), and the backend API's attribute numbers are stable within a
/// major version, not across them. `cudnnGetVersion` is major * 10000 + minor * 100 +
/// patch from cuDNN 9 on.
pub const GRAPH_API_MINIMUM_VERSION: usize = 9_00_00;

/// Whether the loaded cuDNN (`cudnnGetVersion`) has a graph API the engine can use.
pub fn graph_api_available(cudnn_version: usize) -> bool {
    (GRAPH_API_MINIMUM_VERSION..10_00_00).contains(&cudnn_version)
}

/// The API convolutions of `element_type` run through. By default the legacy one, which
/// is measured on GPUs (BENCHMARKS.md), except strict fp32 (TF32 off), where the legacy
/// API's FMA-only algorithms are the slow ones and the graph API is used wherever cuDNN
/// has it. `graph-api` asks for it everywhere and is an error without it, so a benchmark
/// never measures the legacy path under the graph path's name.
pub fn resolve_convolution_api(
    choice: ConvolutionApiChoice,
    element_type: ElementType,
    allow_tf32: bool,
    cudnn_version: usize,
) -> Result<ConvolutionApi, String> {
    let available = graph_api_available(cudnn_version);
    match choice {
        ConvolutionApiChoice::Legacy => Ok(ConvolutionApi::Legacy),
        ConvolutionApiChoice::Graph if available => Ok(ConvolutionApi::Graph),
        ConvolutionApiChoice::Graph => Err(format!(
            "graph-api was asked for, but cuDNN {cudnn_version} has no graph API the engine \
             can use (it needs cuDNN 9)"
        )),
        ConvolutionApiChoice::Automatic
            if available && element_type == ElementType::F32 && !allow_tf32 =>
        {
            Ok(ConvolutionApi::Graph)
        }
        ConvolutionApiChoice::Automatic => Ok(ConvolutionApi::Legacy),
    }
}

/// What cuDNN says about an engine's numerics (`CUDNN_ATTR_ENGINE_NUMERICAL_NOTE`), the
/// notes the choice reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineNotes {
    /// Tensor cores: TF32 for fp32 data.
    pub tensor_core: bool,
    /// Inputs converted to a narrower type (fp32 to fp16/bf16).
    pub down_convert_inputs: bool,
    /// Sums in less than fp32.
    pub reduced_precision_reduction: bool,
}

/// Why an engine's numerics rule it out, `None` when they do not: strict fp32 takes no
/// tensor-core (TF32) engine, as PyTorch filters them with `allow_tf32` off; no fp32
/// convolution takes one that converts its inputs down (worse than TF32, never asked for);
/// and no convolution sums in less than fp32, which the legacy path never does either
/// (its half convolutions accumulate in fp32).
pub fn numerics_refusal(
    notes: EngineNotes,
    element_type: ElementType,
    allow_tf32: bool,
) -> Option<&'static str> {
    let fp32 = element_type == ElementType::F32;
    if fp32 && !allow_tf32 && notes.tensor_core {
        Some("tensor cores (TF32) in strict fp32")
    } else if fp32 && notes.down_convert_inputs {
        Some("inputs converted below fp32")
    } else if notes.reduced_precision_reduction {
        Some("sums in less than fp32")
    } else {
        None
    }
}

/// One engine configuration as the heuristics listed it, with the workspace its execution
/// plan reported and, when it was measured, its time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GraphEngineCandidate {
    /// `CUDNN_ATTR_ENGINE_GLOBAL_INDEX`, for the profile's notes.
    pub global_index: i64,
    pub notes: EngineNotes,
    /// `CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE`; `None` when no plan was built (its
    /// numerics refused it, or cuDNN could not finalize it).
    pub workspace_bytes: Option<u64>,
    pub time_milliseconds: Option<f32>,
}

/// The position in `candidates` of the engine to run: among those whose numerics are
/// allowed and whose plan was built, the fastest measured one whose workspace fits
/// `budget_bytes`, else the first in the heuristics' order that fits — exactly
/// `choose_algorithm`'s rule, so the two APIs are bound by the same budget the same way.
pub fn choose_graph_engine(
    candidates: &[GraphEngineCandidate],
    element_type: ElementType,
    allow_tf32: bool,
    budget_bytes: u64,
) -> Result<usize, AlgorithmChoiceError> {
    let as_algorithms: Vec<AlgorithmCandidate> = candidates
        .iter()
        .enumerate()
        .map(|(position, candidate)| AlgorithmCandidate {
            algorithm: position as u32,
            time_milliseconds: candidate.time_milliseconds,
            workspace_bytes: candidate.workspace_bytes.unwrap_or(u64::MAX),
            usable: candidate.workspace_bytes.is_some()
                && numerics_refusal(candidate.notes, element_type, allow_tf32).is_none(),
        })
        .collect();
    choose_algorithm(&as_algorithms, budget_bytes).map(|chosen| chosen.algorithm as usize)
}

/// How many engine configurations that fit the budget are built and measured before the
/// fastest is taken (building a plan may compile kernels: seconds for some engines).
pub const GRAPH_ENGINES_MEASURED: usize = 4;

/// At most this many configurations are looked at, fitting or not.
pub const GRAPH_ENGINES_EXAMINED: usize = 24;

/// Whether enumerating may stop: enough configurations that fit the budget were built.
pub fn enough_engines(
    candidates: &[GraphEngineCandidate],
    budget_bytes: u64,
    wanted: usize,
) -> bool {
    let fitting = candidates
        .iter()
        .filter(|candidate| {
            candidate
                .workspace_bytes
                .is_some_and(|bytes| bytes <= budget_bytes)
        })
        .count();
    fitting >= wanted || candidates.len() >= GRAPH_ENGINES_EXAMINED
}

/// The byte alignment every pointer of a call shares, capped at 16 (what cuDNN's tensor
/// descriptors take as `CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT`): an execution plan is built for
/// an alignment and must not run on pointers with less, which a chunk of a padded
/// convolution may have (its output starts at a sample's offset).
pub fn common_alignment(addresses: &[u64]) -> u64 {
    addresses
        .iter()
        .filter(|&&address| address != 0)
        .map(|&address| 1u64 << address.trailing_zeros().min(4))
        .min()
        .unwrap_or(16)
}

/// The workspace a convolution's cuDNN call may use, from the plan's buffer for it: the
/// whole buffer up to the config's cap, or without the headroom tuning only its im2col
/// part. The same for both APIs, which is why the switch leaves the estimate alone.
pub fn usable_workspace_bytes(
    buffer_bytes: u64,
    workspace_limit_bytes: u64,
    workspace_headroom: bool,
    im2col_bytes: u64,
) -> u64 {
    let usable = buffer_bytes.min(workspace_limit_bytes);
    if workspace_headroom {
        usable
    } else {
        usable.min(im2col_bytes)
    }
}

#[cfg(test)]
mod tests {
    use carve_core::estimator::estimate_plan;
    use carve_core::plan::{BufferRole, RunConfig, compile_step_plan};

    use super::*;
    use crate::cuda::algorithms::workspace_budget;
    use crate::cuda::tuning::CudaTuning;

    const CUDNN_9_1: usize = 9_01_00;

    fn candidate(index: i64, workspace_bytes: u64) -> GraphEngineCandidate {
        GraphEngineCandidate {
            global_index: index,
            notes: EngineNotes::default(),
            workspace_bytes: Some(workspace_bytes),
            time_milliseconds: None,
        }
    }

    #[test]
    fn strict_fp32_takes_the_graph_api_and_everything_else_the_legacy_one_by_default() {
        let automatic = ConvolutionApiChoice::Automatic;
        let api = |element_type, allow_tf32, version| {
            resolve_convolution_api(automatic, element_type, allow_tf32, version).unwrap()
        };
        assert_eq!(
            api(ElementType::F32, false, CUDNN_9_1),
            ConvolutionApi::Graph
        );
        assert_eq!(
            api(ElementType::F32, true, CUDNN_9_1),
            ConvolutionApi::Legacy
        );
        assert_eq!(
            api(ElementType::F16, false, CUDNN_9_1),
            ConvolutionApi::Legacy
        );
        assert_eq!(
            api(ElementType::Bf16, true, CUDNN_9_1),
            ConvolutionApi::Legacy
        );
        // cuDNN 8 numbers its versions major * 1000 + ...: 8.9.7 is 8907.
        assert_eq!(api(ElementType::F32, false, 8907), ConvolutionApi::Legacy);
        assert_eq!(
            api(ElementType::F32, false, 10_00_00),
            ConvolutionApi::Legacy
        );
    }

    #[test]
    fn the_switch_forces_either_api_and_a_forced_graph_api_without_cudnn_9_is_an_error() {
        let tuning = CudaTuning::parse("graph-api").unwrap();
        assert_eq!(
            resolve_convolution_api(tuning.convolution_api, ElementType::F16, true, CUDNN_9_1),
            Ok(ConvolutionApi::Graph)
        );
        let error = resolve_convolution_api(tuning.convolution_api, ElementType::F16, true, 8907)
            .unwrap_err();
        assert!(error.contains("8907"), "{error}");
        let tuning = CudaTuning::parse("strict,legacy-api").unwrap();
        assert_eq!(
            resolve_convolution_api(tuning.convolution_api, ElementType::F32, false, CUDNN_9_1),
            Ok(ConvolutionApi::Legacy)
        );
    }

    #[test]
    fn an_engine_needing_more_workspace_than_the_plan_reserved_is_rejected() {
        // The heuristics' first pick wants one byte more than the plan's buffer.
        let budget = 4 << 20;
        let candidates = [
            candidate(57, budget + 1),
            candidate(12, budget),
            candidate(3, 0),
        ];
        assert_eq!(
            choose_graph_engine(&candidates, ElementType::F32, false, budget),
            Ok(1)
        );
        assert_eq!(
            choose_graph_engine(&candidates, ElementType::F32, false, budget - 1),
            Ok(2)
        );
        assert_eq!(
            choose_graph_engine(&candidates[..1], ElementType::F32, false, budget),
            Err(AlgorithmChoiceError::WorkspaceTooSmall {
                budget_bytes: budget,
                smallest_workspace_bytes: budget + 1
            })
        );
    }

    #[test]
    fn the_fastest_measured_engine_that_fits_wins() {
        let mut fast_but_large = candidate(1, 64 << 20);
        fast_but_large.time_milliseconds = Some(0.2);
        let mut slower = candidate(2, 1 << 20);
        slower.time_milliseconds = Some(0.9);
        let mut fastest_that_fits = candidate(3, 2 << 20);
        fastest_that_fits.time_milliseconds = Some(0.4);
        let candidates = [fast_but_large, slower, fastest_that_fits];
        assert_eq!(
            choose_graph_engine(&candidates, ElementType::F16, true, 4 << 20),
            Ok(2)
        );
        assert_eq!(
            choose_graph_engine(&candidates, ElementType::F16, true, 64 << 20),
            Ok(0)
        );
    }

    #[test]
    fn strict_fp32_refuses_tensor_core_engines_and_no_one_takes_reduced_sums() {
        let mut tf32 = candidate(9, 0);
        tf32.notes.tensor_core = true;
        let plain = candidate(4, 1 << 10);
        let candidates = [tf32, plain];
        assert_eq!(
            choose_graph_engine(&candidates, ElementType::F32, false, 1 << 20),
            Ok(1)
        );
        assert_eq!(
            choose_graph_engine(&candidates, ElementType::F32, true, 1 << 20),
            Ok(0)
        );
        assert_eq!(
            choose_graph_engine(&candidates, ElementType::F16, false, 1 << 20),
            Ok(0)
        );
        let mut down = candidate(5, 0);
        down.notes.down_convert_inputs = true;
        assert!(numerics_refusal(down.notes, ElementType::F32, true).is_some());
        assert!(numerics_refusal(down.notes, ElementType::Bf16, true).is_none());
        let mut reduced = candidate(6, 0);
        reduced.notes.reduced_precision_reduction = true;
        assert_eq!(
            choose_graph_engine(&[reduced], ElementType::F16, true, 1 << 20),
            Err(AlgorithmChoiceError::NoUsableAlgorithm)
        );
        let mut unbuilt = candidate(7, 0);
        unbuilt.workspace_bytes = None;
        assert_eq!(
            choose_graph_engine(&[unbuilt], ElementType::F16, true, 1 << 20),
            Err(AlgorithmChoiceError::NoUsableAlgorithm)
        );
    }

    #[test]
    fn enumeration_stops_at_enough_fitting_engines_or_the_examined_cap() {
        let budget = 1 << 20;
        let fits = candidate(1, budget);
        let too_large = candidate(2, budget + 1);
        assert!(!enough_engines(&[fits, too_large, too_large], budget, 2));
        assert!(enough_engines(&[fits, too_large, fits], budget, 2));
        assert!(enough_engines(
            &[too_large; GRAPH_ENGINES_EXAMINED],
            budget,
            2
        ));
    }

    #[test]
    fn pointers_share_the_alignment_of_the_least_aligned_capped_at_sixteen() {
        assert_eq!(common_alignment(&[0x1000, 0x2000, 0]), 16);
        assert_eq!(common_alignment(&[0x1000, 0x1008]), 8);
        assert_eq!(common_alignment(&[0x1000, 0x1002, 0x2000]), 2);
        assert_eq!(common_alignment(&[]), 16);
    }

    #[test]
    fn without_headroom_only_the_im2col_part_is_usable() {
        assert_eq!(usable_workspace_bytes(1000, 1 << 30, true, 400), 1000);
        assert_eq!(usable_workspace_bytes(1000, 1 << 30, false, 400), 400);
        assert_eq!(usable_workspace_bytes(1000, 600, true, 400), 600);
    }

    /// The plan accounting with the graph API on: for every convolution of the two
    /// benchmark models in strict fp32 (where the graph API is the default) the budget the
    /// engine choice gets is never more than the workspace buffer the plan allocates for
    /// it, an engine one byte over that budget is refused, and the estimate is the same
    /// whichever API runs (the plan is compiled from the run config alone), so the
    /// estimate with the switch on is what the plan reserves.
    #[test]
    fn with_the_graph_api_the_estimate_is_what_the_plan_reserves() {
        for text in [
            include_str!("../../../examples/resnet-cifar.toml"),
            include_str!("../../../examples/resnet18-cifar.toml"),
        ] {
            let job = carve_core::validate::load_job_spec_toml(text).unwrap();
            let config = RunConfig::from_spec(&job.spec);
            assert_eq!(config.precision.name(), "fp32");
            let limit = config.workspace_limit_bytes();
            for tuning in [
                CudaTuning::default().strict(),
                CudaTuning::parse("graph-api").unwrap(),
                CudaTuning::parse("strict,legacy-api").unwrap(),
            ] {
                let api = resolve_convolution_api(
                    tuning.convolution_api,
                    ElementType::F32,
                    false,
                    CUDNN_9_1,
                )
                .unwrap();
                let plan = compile_step_plan(&job, &config).unwrap();
                let estimate = estimate_plan(&plan);
                let workspaces: Vec<u64> = plan
                    .buffers
                    .iter()
                    .filter(|buffer| buffer.role == BufferRole::Workspace)
                    .map(|buffer| buffer.bytes)
                    .collect();
                assert!(!workspaces.is_empty());
                for &bytes in &workspaces {
                    let usable =
                        usable_workspace_bytes(bytes, limit, tuning.workspace_headroom, bytes);
                    let budget = workspace_budget(Some(usable), limit);
                    assert!(budget <= bytes, "{api:?}: budget {budget} > buffer {bytes}");
                    let candidates = [candidate(1, budget + 1), candidate(2, budget)];
                    assert_eq!(
                        choose_graph_engine(&candidates, ElementType::F32, false, budget),
                        Ok(1)
                    );
                }
                // The same plan, buffer for buffer, whichever API runs it: the switch is
                // not an input of the plan, so the estimate cannot move with it.
                let reference = compile_step_plan(&job, &config).unwrap();
                assert_eq!(plan.buffers, reference.buffers);
                assert_eq!(estimate, estimate_plan(&reference));
                let largest = workspaces.iter().max().copied().unwrap();
                assert!(largest <= limit && estimate.peak_bytes >= largest);
            }
        }
    }
}
