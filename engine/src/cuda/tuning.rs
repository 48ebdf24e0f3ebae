//! The cuda backend's speed switches, so that one binary can be measured with each change
//! on and off on a GPU machine (`engine/benches/gpu_check.sh`), and the tests can ask for
//! the math that matches the cpu backend.
//!
//! The defaults are the fast settings. `CARVE_CUDA_TUNING` takes a comma-separated list
//! of words that turn one off or on:
//! - `strict`: fp32 convolutions with FMA math only, never TF32 (the cpu backend's
//!   rounding within 1e-4). By default fp32 convolutions may use TF32 tensor cores, as
//!   PyTorch allows cuDNN to (`torch.backends.cudnn.allow_tf32` is True by default).
//! - `zero-fill`: zero every buffer when it is allocated, as the first wave did, instead
//!   of only the buffers that must start at zero (`BufferRole::must_start_at_zero`).
//! - `heuristic-filter`: take cuDNN's heuristic pick for a filter gradient that is added
//!   into the fp32 gradient instead of measuring every algorithm on a scratch output.
//! - `legacy-batch-norm`: one block per channel (the first wave's kernels) instead of
//!   the coalesced ones.
//! - `no-graphs`: walk every phase on the host instead of replaying the step's phases as
//!   CUDA graphs (`graphs.rs`).
//! - `no-workspace-headroom`: give cuDNN only the im2col part of a convolution's
//!   workspace, as the first wave's plan did, not the headroom the plan adds for it
//!   (`carve_core::plan::CONVOLUTION_WORKSPACE_HEADROOM`); the buffer stays allocated,
//!   so only the speed changes.
//! - `profile`: time every plan operation with CUDA events and print the table when the
//!   backend is dropped (a profile on a GPU machine without nsys); phases are then always
//!   walked, so each operation is seen.
//! - `graph-api` / `legacy-api`: run every convolution through cuDNN's graph (backend)
//!   API (an error where cuDNN 9 is missing), or none. By default the legacy API runs
//!   them, except in strict fp32, where the graph API does wherever cuDNN 9 is loaded
//!   (`graph_engines::resolve_convolution_api`): the legacy API's FMA-only fp32
//!   algorithms are the slow ones. The default changes only once the graph API measures
//!   faster on a GPU (`engine/benches/gpu_check.sh` runs both).

/// Which cuDNN API convolutions run through (`graph_engines::resolve_convolution_api`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConvolutionApiChoice {
    /// The legacy API, except the graph API for strict fp32 where cuDNN 9 is loaded.
    #[default]
    Automatic,
    /// Always the legacy API.
    Legacy,
    /// Always the graph API.
    Graph,
}

/// Which of the backend's speed changes are on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaTuning {
    /// fp32 convolutions may round their inputs to TF32 on tensor cores.
    pub allow_tf32: bool,
    /// Every buffer is zeroed when allocated, not only those that must start at zero.
    pub zero_every_buffer: bool,
    /// A filter gradient accumulated into fp32 is measured on a scratch output.
    pub measure_accumulated_filter_gradients: bool,
    /// Batch norm runs the coalesced kernels.
    pub coalesced_batch_norm: bool,
    /// Phases that can be are recorded once as CUDA graphs and replayed.
    pub cuda_graphs: bool,
    /// cuDNN may use a convolution's whole workspace, the plan's headroom included.
    pub workspace_headroom: bool,
    /// Every operation is timed with CUDA events.
    pub profile: bool,
    /// Which cuDNN API runs convolutions.
    pub convolution_api: ConvolutionApiChoice,
}

impl Default for CudaTuning {
    fn default() -> Self {
        CudaTuning {
            allow_tf32: true,
            zero_every_buffer: false,
            measure_accumulated_filter_gradients: true,
            coalesced_batch_norm: true,
            cuda_graphs: true,
            workspace_headroom: true,
            profile: false,
            convolution_api: ConvolutionApiChoice::Automatic,
        }
    }
}

/// The environment variable read by [`CudaTuning::from_environment`].
pub const TUNING_VARIABLE: &str = "CARVE_CUDA_TUNING";

impl CudaTuning {
    /// The defaults with the words of `CARVE_CUDA_TUNING` applied; an unknown word is an
    /// error naming it, so a typo in a benchmark script does not measure the wrong thing.
    pub fn from_environment() -> Result<CudaTuning, String> {
        match std::env::var(TUNING_VARIABLE) {
            Ok(words) => CudaTuning::parse(&words),
            Err(_) => Ok(CudaTuning::default()),
        }
    }

    /// The defaults with `words` (comma-separated) applied.
    pub fn parse(words: &str) -> Result<CudaTuning, String> {
        let mut tuning = CudaTuning::default();
        for word in words
            .split(',')
            .map(str::trim)
            .filter(|word| !word.is_empty())
        {
            match word {
                "strict" => tuning.allow_tf32 = false,
                "zero-fill" => tuning.zero_every_buffer = true,
                "heuristic-filter" => tuning.measure_accumulated_filter_gradients = false,
                "legacy-batch-norm" => tuning.coalesced_batch_norm = false,
                "no-graphs" => tuning.cuda_graphs = false,
                "no-workspace-headroom" => tuning.workspace_headroom = false,
                "profile" => tuning.profile = true,
                "graph-api" => tuning.convolution_api = ConvolutionApiChoice::Graph,
                "legacy-api" => tuning.convolution_api = ConvolutionApiChoice::Legacy,
                other => {
                    return Err(format!(
                        "{TUNING_VARIABLE}: unknown word {other:?} (known: strict, zero-fill, \
                         heuristic-filter, legacy-batch-norm, no-graphs, \
                         no-workspace-headroom, profile, graph-api, legacy-api)"
                    ));
                }
            }
        }
        Ok(tuning)
    }

    /// The same switches with fp32 math that matches the cpu backend.
    pub fn strict(self) -> CudaTuning {
        CudaTuning {
            allow_tf32: false,
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_turn_single_switches_and_unknown_words_are_refused_by_name() {
        assert_eq!(CudaTuning::parse("").unwrap(), CudaTuning::default());
        let tuning = CudaTuning::parse("strict, zero-fill,profile").unwrap();
        assert!(!tuning.allow_tf32 && tuning.zero_every_buffer && tuning.profile);
        assert!(tuning.coalesced_batch_norm && tuning.measure_accumulated_filter_gradients);
        let tuning = CudaTuning::parse("heuristic-filter,legacy-batch-norm,no-graphs").unwrap();
        assert!(!tuning.measure_accumulated_filter_gradients && !tuning.coalesced_batch_norm);
        assert!(!tuning.cuda_graphs && CudaTuning::default().cuda_graphs);
        let tuning = CudaTuning::parse("no-workspace-headroom").unwrap();
        assert!(!tuning.workspace_headroom && CudaTuning::default().workspace_headroom);
        let error = CudaTuning::parse("strict,tf33").unwrap_err();
        assert!(error.contains("\"tf33\""), "{error}");
        assert!(!CudaTuning::default().strict().allow_tf32);
        assert_eq!(
            CudaTuning::default().convolution_api,
            ConvolutionApiChoice::Automatic
        );
        assert_eq!(
            CudaTuning::parse("graph-api").unwrap().convolution_api,
            ConvolutionApiChoice::Graph
        );
        assert_eq!(
            CudaTuning::parse("legacy-api").unwrap().convolution_api,
            ConvolutionApiChoice::Legacy
        );
    }
}
