//! cuDNN's algorithm queries for the three convolution directions: the measured
//! (`cudnnFind*AlgorithmEx`) or heuristic (`cudnnGet*Algorithm_v7`) candidates with their
//! workspace sizes, read out of each direction's perf struct.

// The FFI boundary: every unsafe block below says why it is sound.
#![allow(unsafe_code)]

use super::*;

/// Up to this many algorithms are asked for (more than cuDNN has in any direction).
const ALGORITHM_QUERY_COUNT: usize = 16;

/// One algorithm as cuDNN reports it, in any direction's perf struct.
trait AlgorithmPerformance: Clone {
    /// An all-zero result for cuDNN to fill.
    fn zeroed() -> Self;
    fn candidate(&self, measured: bool) -> (AlgorithmCandidate, ConvolutionAlgorithm);
}

macro_rules! algorithm_performance {
    ($performance:ty, $direction:ident) => {
        impl AlgorithmPerformance for $performance {
            fn zeroed() -> Self {
                // SAFETY: an all-zero perf struct is valid: every enum field has a
                // variant 0 and the rest are plain numbers.
                unsafe { std::mem::zeroed() }
            }

            fn candidate(&self, measured: bool) -> (AlgorithmCandidate, ConvolutionAlgorithm) {
                let time = (measured && self.time >= 0.0).then_some(self.time);
                (
                    AlgorithmCandidate {
                        algorithm: self.algo as u32,
                        time_milliseconds: time,
                        workspace_bytes: self.memory as u64,
                        usable: self.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS,
                    },
                    ConvolutionAlgorithm::$direction(self.algo, self.mathType),
                )
            }
        }
    };
}

algorithm_performance!(sys::cudnnConvolutionFwdAlgoPerf_t, Forward);
algorithm_performance!(sys::cudnnConvolutionBwdDataAlgoPerf_t, BackwardData);
algorithm_performance!(sys::cudnnConvolutionBwdFilterAlgoPerf_t, BackwardFilter);

/// Runs one direction's algorithm query, `query(requested, &mut returned, results)`, into
/// `ALGORITHM_QUERY_COUNT` zeroed results and reads back the ones cuDNN returned (their
/// times only when `measured`: the heuristic ranking has none).
fn query_algorithms<P: AlgorithmPerformance>(
    during: &str,
    measured: bool,
    query: impl FnOnce(i32, &mut i32, *mut P) -> sys::cudnnStatus_t,
) -> Result<Vec<(AlgorithmCandidate, ConvolutionAlgorithm)>, CudaFailure> {
    let mut results = vec![P::zeroed(); ALGORITHM_QUERY_COUNT];
    let mut returned: i32 = 0;
    let status = query(
        ALGORITHM_QUERY_COUNT as i32,
        &mut returned,
        results.as_mut_ptr(),
    );
    check(status, during)?;
    Ok(results
        .iter()
        .take(returned.max(0) as usize)
        .map(|result| result.candidate(measured))
        .collect())
}

impl Cudnn {
    /// Asks cuDNN for the algorithms of one direction with their workspace sizes. With
    /// `measure`, runs them (`cudnnFind*AlgorithmEx`, which writes the direction's output
    /// buffer: only for outputs the caller overwrites anyway); otherwise takes the
    /// heuristic ranking (`cudnnGet*Algorithm_v7`, no times).
    pub fn convolution_algorithms(
        &self,
        shape: &ConvolutionShape,
        direction: ConvolutionDirection,
        buffers: &ConvolutionBuffers,
        measure: bool,
    ) -> Result<Vec<(AlgorithmCandidate, ConvolutionAlgorithm)>, CudaFailure> {
        let mut descriptors = Descriptors::default();
        let x = descriptors.tensor(shape.element_type, shape.input)?;
        let y = descriptors.tensor(shape.element_type, shape.output)?;
        let w = descriptors.filter(shape.element_type, shape.filter())?;
        let convolution = descriptors.convolution(shape, self.allow_tf32, None)?;
        let during = match direction {
            ConvolutionDirection::Forward => "querying convolution forward algorithms",
            ConvolutionDirection::BackwardData => "querying convolution backward-data algorithms",
            ConvolutionDirection::BackwardFilter => {
                "querying convolution backward-filter algorithms"
            }
        };
        match direction {
            ConvolutionDirection::Forward => {
                query_algorithms(during, measure, |requested, returned, results| {
                    // SAFETY: descriptors are live; `results` holds `requested` entries;
                    // the buffers are live slice buffers matching the descriptors, and the
                    // workspace pointer/size are the plan's workspace buffer (or null/0).
                    unsafe {
                        if measure {
                            sys::cudnnFindConvolutionForwardAlgorithmEx(
                                self.handle,
                                x,
                                pointer(buffers.input),
                                w,
                                pointer(buffers.filter),
                                convolution,
                                y,
                                pointer_mut(buffers.output),
                                requested,
                                returned,
                                results,
                                pointer_mut(buffers.workspace),
                                buffers.workspace_bytes as usize,
                            )
                        } else {
                            sys::cudnnGetConvolutionForwardAlgorithm_v7(
                                self.handle,
                                x,
                                w,
                                convolution,
                                y,
                                requested,
                                returned,
                                results,
                            )
                        }
                    }
                })
            }
            ConvolutionDirection::BackwardData => {
                query_algorithms(during, measure, |requested, returned, results| {
                    // SAFETY: as for forward; `input` is dx (written by Find), `output` dy.
                    unsafe {
                        if measure {
                            sys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                                self.handle,
                                w,
                                pointer(buffers.filter),
                                y,
                                pointer(buffers.output),
                                convolution,
                                x,
                                pointer_mut(buffers.input),
                                requested,
                                returned,
                                results,
                                pointer_mut(buffers.workspace),
                                buffers.workspace_bytes as usize,
                            )
                        } else {
                            sys::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                                self.handle,
                                w,
                                y,
                                convolution,
                                x,
                                requested,
                                returned,
                                results,
                            )
                        }
                    }
                })
            }
            ConvolutionDirection::BackwardFilter => {
                query_algorithms(during, measure, |requested, returned, results| {
                    // SAFETY: as for forward; `filter` is dw (written by Find).
                    unsafe {
                        if measure {
                            sys::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                                self.handle,
                                x,
                                pointer(buffers.input),
                                y,
                                pointer(buffers.output),
                                convolution,
                                w,
                                pointer_mut(buffers.filter),
                                requested,
                                returned,
                                results,
                                pointer_mut(buffers.workspace),
                                buffers.workspace_bytes as usize,
                            )
                        } else {
                            sys::cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                                self.handle,
                                x,
                                y,
                                convolution,
                                w,
                                requested,
                                returned,
                                results,
                            )
                        }
                    }
                })
            }
        }
    }
}
