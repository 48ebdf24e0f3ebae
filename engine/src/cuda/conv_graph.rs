//! The cuda backend's convolutions through cuDNN's graph API (`cudnn_graph.rs`): which API
//! a convolution takes (`graph_engines::resolve_convolution_api`), the engine chosen once
//! per shape, direction, scale, alignment and budget, and its runs.
//!
//! The choice mirrors the legacy path's (`conv.rs`, `convolution_algorithm`): the budget is
//! the plan's workspace buffer capped by the config (`algorithms::workspace_budget`); where
//! the output may be overwritten, the first `GRAPH_ENGINES_MEASURED` plans that fit are
//! timed on the real buffers and the fastest taken; a filter gradient added into fp32 is
//! timed on a scratch copy at the start of the workspace, as `cudnnFind*` is there, and
//! otherwise the heuristics' first fitting engine is taken. Choosing happens in the first
//! step, which is walked, never inside a CUDA graph capture (`graphs.rs`).

use carve_core::plan::ElementType;

use super::CudaBackend;
use super::algorithms::{filter_measurement_split, workspace_budget};
use super::cudnn_graph::{GraphKey, GraphPlan, graph_engines};
use super::cudnn_ops::{ConvolutionBuffers, ConvolutionDirection, ConvolutionShape};
use super::error::{CudaFailure, is_allocation_failure};
use super::graph_engines::{
    ConvolutionApi, GRAPH_ENGINES_MEASURED, GraphEngineCandidate, choose_graph_engine,
    common_alignment, resolve_convolution_api,
};
use super::tuning::ConvolutionApiChoice;
use crate::error::EngineError;

/// Runs of each measured plan after its warm-up run.
const MEASURED_RUNS: u32 = 3;

impl CudaBackend {
    /// The API convolutions of `element_type` run through. `CudaBackend::new` refused a
    /// `graph-api` the loaded cuDNN cannot serve, so the error case cannot arise here.
    pub(super) fn convolution_api(&self, element_type: ElementType) -> ConvolutionApi {
        resolve_convolution_api(
            self.tuning.convolution_api,
            element_type,
            self.tuning.allow_tf32,
            self.cudnn_version,
        )
        .unwrap_or(ConvolutionApi::Legacy)
    }

    /// Runs one direction through the graph API. `Ok(false)` when no engine the precision
    /// allows fits the budget and the graph API was not asked for by name: the legacy API
    /// runs it then, within the same budget.
    pub(super) fn run_graph_convolution(
        &mut self,
        shape: &ConvolutionShape,
        direction: ConvolutionDirection,
        buffers: &ConvolutionBuffers,
        may_overwrite_output: bool,
        beta: f32,
        label: &str,
    ) -> Result<bool, EngineError> {
        let key = GraphKey {
            shape: *shape,
            direction,
            budget_bytes: workspace_budget(
                Some(buffers.workspace_bytes),
                self.workspace_limit_bytes,
            ),
            alignment: common_alignment(&[buffers.input, buffers.filter, buffers.output]),
            beta_bits: beta.to_bits(),
        };
        if !self.graph_plans.contains_key(&key) {
            let chosen = self.choose_graph_plan(&key, buffers, may_overwrite_output, label)?;
            self.graph_plans.insert(key, chosen);
        }
        match self.graph_plans.get(&key) {
            Some(Some(plan)) => {
                plan.execute(&self.cudnn, buffers).map_err(|failure| {
                    self.fail(failure.during(format!("{label} {direction:?} (graph api)")))
                })?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Lists, measures where it may, and chooses the plan for `key`; `None` when the
    /// legacy API is to run it instead.
    fn choose_graph_plan(
        &mut self,
        key: &GraphKey,
        buffers: &ConvolutionBuffers,
        may_overwrite_output: bool,
        label: &str,
    ) -> Result<Option<GraphPlan>, EngineError> {
        let shape = &key.shape;
        let filter_bytes =
            shape.filter().iter().product::<usize>() as u64 * shape.element_type.bytes();
        let measuring = if may_overwrite_output {
            Some(*buffers)
        } else if key.direction == ConvolutionDirection::BackwardFilter
            && self.tuning.measure_accumulated_filter_gradients
        {
            filter_measurement_split(buffers.workspace_bytes, filter_bytes).map(
                |(offset, bytes)| ConvolutionBuffers {
                    filter: buffers.workspace,
                    workspace: buffers.workspace + offset,
                    workspace_bytes: bytes,
                    ..*buffers
                },
            )
        } else {
            None
        };
        let wanted = if measuring.is_some() {
            GRAPH_ENGINES_MEASURED
        } else {
            1
        };
        let mut found = graph_engines(&self.cudnn, key, self.cudnn.allow_tf32(), wanted).map_err(
            |failure| self.fail(failure.during(format!("{label}: listing graph api engines"))),
        )?;
        if let Some(measured_buffers) = measuring {
            let limit = measured_buffers.workspace_bytes.min(key.budget_bytes);
            let fitting = found
                .iter()
                .filter(|(_, plan)| {
                    plan.as_ref()
                        .is_some_and(|plan| plan.workspace_bytes <= limit)
                })
                .count();
            if fitting > 1 {
                for (candidate, plan) in &mut found {
                    let Some(built) = plan.as_ref() else { continue };
                    if built.workspace_bytes > limit {
                        continue;
                    }
                    match self.time_graph_plan(built, &measured_buffers) {
                        Ok(time) => candidate.time_milliseconds = time,
                        Err(failure) if is_allocation_failure(failure.library, failure.code) => {
                            return Err(self.fail(failure));
                        }
                        // A plan that fails to run is not a candidate.
                        Err(_) => {
                            candidate.workspace_bytes = None;
                            *plan = None;
                        }
                    }
                }
            }
        }
        let candidates: Vec<GraphEngineCandidate> =
            found.iter().map(|(candidate, _)| *candidate).collect();
        let chosen = choose_graph_engine(
            &candidates,
            shape.element_type,
            self.cudnn.allow_tf32(),
            key.budget_bytes,
        );
        self.note_graph_choice(key, label, &candidates, &chosen, measuring.is_some());
        match chosen {
            Ok(position) => Ok(found.into_iter().nth(position).and_then(|(_, plan)| plan)),
            Err(error) if self.tuning.convolution_api == ConvolutionApiChoice::Graph => {
                Err(EngineError::Backend(format!(
                    "cuda: {label} {:?} (graph api): {error}",
                    key.direction
                )))
            }
            Err(_) => Ok(None),
        }
    }

    /// Mean milliseconds of one run of `plan` on `buffers`, after a warm-up run; `None`
    /// when the events cannot be read (the plan then ranks as unmeasured, not unusable).
    fn time_graph_plan(
        &self,
        plan: &GraphPlan,
        buffers: &ConvolutionBuffers,
    ) -> Result<Option<f32>, CudaFailure> {
        plan.execute(&self.cudnn, buffers)?;
        let start = self.device.record_timing_event()?;
        for _ in 0..MEASURED_RUNS {
            plan.execute(&self.cudnn, buffers)?;
        }
        let end = self.device.record_timing_event()?;
        self.device.synchronize()?;
        Ok(start
            .elapsed_ms(&end)
            .ok()
            .map(|total| total / MEASURED_RUNS as f32))
    }

    /// The choice in the profile's notes (`profile` tuning), like the legacy path's.
    fn note_graph_choice(
        &mut self,
        key: &GraphKey,
        label: &str,
        candidates: &[GraphEngineCandidate],
        chosen: &Result<usize, super::AlgorithmChoiceError>,
        measured: bool,
    ) {
        let Some(profile) = self.profile.as_mut() else {
            return;
        };
        let listed: Vec<String> = candidates
            .iter()
            .map(|candidate| {
                format!(
                    "engine{}:{}/{}{}",
                    candidate.global_index,
                    candidate
                        .time_milliseconds
                        .map_or_else(|| "-".into(), |time| format!("{time:.3}ms")),
                    candidate
                        .workspace_bytes
                        .map_or_else(|| "unbuilt".into(), |bytes| bytes.to_string()),
                    if candidate.notes.tensor_core {
                        "(tc)"
                    } else {
                        ""
                    },
                )
            })
            .collect();
        let outcome = match chosen {
            Ok(position) => format!("chose engine{}", candidates[*position].global_index),
            Err(error) => format!("none ({error}); legacy api runs it"),
        };
        profile.note(format!(
            "graph api {label} {:?} {:?} {:?}->{:?} budget {} align {}{}: {outcome}; candidates {}",
            key.direction,
            key.shape.element_type,
            key.shape.input,
            key.shape.output,
            key.budget_bytes,
            key.alignment,
            if measured { ", measured" } else { "" },
            listed.join(" ")
        ));
    }
}
