//! The step's phases as CUDA graphs: the micro-batch phase (forward, loss, backward) and
//! the update phase are recorded once, with stream capture, and replayed every step
//! after, so the host enqueues one graph instead of a few hundred cuDNN, cuBLAS and NVRTC
//! calls. On an H200 those calls took the host longer than the GPU took to run them
//! (about 100 us per cuDNN convolution call), so the GPU waited on the host.
//!
//! A recording can be replayed because the slice never moves and the plan places every
//! buffer at the same offset in every run of a phase. What a recording cannot follow is
//! anything that changes between steps in the arguments of its calls, or a decision the
//! host makes in the middle of a phase, so a phase is recorded only when none applies
//! ([`why_not_recordable`]): fp16's dynamic loss scaling (its overflow check is read on the
//! host, its scale changes), dropout (a new mask each step), Adam (its bias correction
//! changes each step). A replay also requires the same samples and scales as the
//! recording ([`ReplayKey`]); otherwise the phase is walked as usual.
//!
//! Recording starts at the second step: the first chooses the convolution algorithms
//! (cuDNN's measuring runs cannot be captured) and lets cuBLAS set up its workspace. A
//! recorded call does not run, so the recording is launched once right away. The loss
//! the micro-batch phase reads from the result area is read after the graph ran
//! ([`HeldBackLoss`]). If any call fails while recording, the recording is dropped, the
//! phase is walked again without one, and that phase is never recorded again.
//! The graphs' own memory is outside the slice, like the context's.

use std::collections::HashMap;

use carve_core::model::LayerOp;
use carve_core::plan::Operation;
use carve_core::spec::{LossKind, OptimizerSpec, Precision};
use cudarc::driver::CudaGraph;

use super::CudaBackend;
use super::profile::operation_label;
use crate::backend::{OperationContext, OperationResult, PhaseEnd, PhaseKind};
use crate::dispatch::run_operation;
use crate::error::EngineError;

/// Why phase `kind` cannot be recorded in this run, or `None` when it can.
pub fn why_not_recordable(kind: PhaseKind, context: &OperationContext<'_>) -> Option<&'static str> {
    match kind {
        PhaseKind::Setup | PhaseKind::Evaluation => return Some("runs once or varies"),
        PhaseKind::MicroBatch | PhaseKind::Update => {}
    }
    if context.plan.config.precision == Precision::Fp16 {
        return Some("fp16's loss scaling is decided on the host every step");
    }
    if kind == PhaseKind::MicroBatch
        && context
            .graph
            .layers
            .iter()
            .any(|layer| matches!(layer.op, LayerOp::Dropout { .. }))
    {
        return Some("dropout draws a new mask every step");
    }
    if kind == PhaseKind::Update && !matches!(context.optimizer, OptimizerSpec::Sgd(_)) {
        return Some("Adam's bias correction changes every step");
    }
    None
}

/// What a recording baked into its calls that could still differ between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayKey {
    samples: usize,
    loss_gradient_scale_bits: u32,
    unscale_factor_bits: u32,
    apply_update: bool,
}

impl ReplayKey {
    pub fn of(context: &OperationContext<'_>) -> ReplayKey {
        ReplayKey {
            samples: context.samples,
            loss_gradient_scale_bits: context.loss_gradient_scale.to_bits(),
            unscale_factor_bits: context.loss_scaler.unscale_factor().to_bits(),
            apply_update: *context.apply_update,
        }
    }
}

/// The loss a recorded phase leaves in the result area, to read after each launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldBackLoss {
    pub kind: LossKind,
    /// The labels, to name a bad one.
    pub target_address: u64,
    pub per_sample: usize,
}

/// One phase's recording.
pub struct PhaseGraph {
    pub graph: CudaGraph,
    pub key: ReplayKey,
    pub loss: Option<HeldBackLoss>,
}

/// A recording in progress.
#[derive(Debug)]
pub struct Capture {
    pub kind: PhaseKind,
    pub key: ReplayKey,
    pub loss: Option<HeldBackLoss>,
    /// The first call that failed while recording.
    pub failure: Option<String>,
}

/// The recordings of an attempt and the phases that will not be recorded.
#[derive(Default)]
pub struct PhaseGraphs {
    pub recorded: HashMap<PhaseKind, PhaseGraph>,
    /// Phases never to record again, with the reason.
    pub refused: HashMap<PhaseKind, String>,
    pub capture: Option<Capture>,
}

impl std::fmt::Debug for PhaseGraphs {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("PhaseGraphs")
            .field("recorded", &self.recorded.keys().collect::<Vec<_>>())
            .field("refused", &self.refused)
            .field("capture", &self.capture)
            .finish()
    }
}

impl PhaseGraphs {
    /// Whether phase `kind` should be recorded now, at `context`'s step.
    pub fn should_record(&self, kind: PhaseKind, context: &OperationContext<'_>) -> bool {
        context.step >= 1
            && self.capture.is_none()
            && !self.recorded.contains_key(&kind)
            && !self.refused.contains_key(&kind)
            && why_not_recordable(kind, context).is_none()
    }
}

impl CudaBackend {
    /// Runs the recording of phase `kind` when it fits `context` (see `Backend::replay_phase`).
    pub(super) fn replay_recorded_phase(
        &mut self,
        kind: PhaseKind,
        context: &OperationContext<'_>,
    ) -> Result<Option<OperationResult>, EngineError> {
        let Some(recorded) = self.graphs.recorded.get(&kind) else {
            return Ok(None);
        };
        if recorded.key != ReplayKey::of(context) {
            return Ok(None);
        }
        self.device
            .launch_graph(&recorded.graph)
            .map_err(|failure| self.fail(failure))?;
        match recorded.loss {
            Some(loss) => self.read_loss(&loss).map(Some),
            None => Ok(Some(OperationResult::default())),
        }
    }

    /// Starts recording phase `kind` when it should be recorded now.
    pub(super) fn begin_recording(
        &mut self,
        kind: PhaseKind,
        context: &OperationContext<'_>,
    ) -> Result<(), EngineError> {
        if !self.tuning.cuda_graphs
            || self.profile.is_some()
            || !self.graphs.should_record(kind, context)
        {
            return Ok(());
        }
        self.device
            .begin_capture()
            .map_err(|failure| self.fail(failure))?;
        self.graphs.capture = Some(Capture {
            kind,
            key: ReplayKey::of(context),
            loss: None,
            failure: None,
        });
        Ok(())
    }

    /// One operation while recording: a failed call (some cannot be captured) drops the
    /// recording and the phase is walked again, so the first failure is noted and the
    /// rest of the phase passes without running.
    pub(super) fn run_while_recording(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> OperationResult {
        if self
            .graphs
            .capture
            .as_ref()
            .is_some_and(|capture| capture.failure.is_some())
        {
            return OperationResult::default();
        }
        match run_operation(self, operation, context) {
            Ok(result) => result,
            Err(error) => {
                if let Some(capture) = self.graphs.capture.as_mut() {
                    capture.failure = Some(format!(
                        "{}: {error}",
                        operation_label(operation, context.graph)
                    ));
                }
                OperationResult::default()
            }
        }
    }

    /// Ends the recording of phase `kind`, if one is in progress, and runs it once: what
    /// was recorded has not run yet. `completed` is false when the walk failed.
    pub(super) fn end_recording(
        &mut self,
        kind: PhaseKind,
        completed: bool,
    ) -> Result<PhaseEnd, EngineError> {
        let Some(capture) = self.graphs.capture.take() else {
            return Ok(PhaseEnd::Done(None));
        };
        let ended = self.device.end_capture();
        if !completed {
            // The walk failed and the attempt ends with its error; nothing recorded runs.
            return Ok(PhaseEnd::Done(None));
        }
        let graph = match (ended, capture.failure) {
            (Ok(Some(graph)), None) => graph,
            (ended, failure) => {
                let reason = match (ended, failure) {
                    (_, Some(failure)) => failure,
                    (Err(failure), None) => self.fail(failure).to_string(),
                    (Ok(_), None) => "nothing was recorded".to_string(),
                };
                self.graphs.refused.insert(kind, reason);
                return Ok(PhaseEnd::RunAgain);
            }
        };
        self.device
            .launch_graph(&graph)
            .map_err(|failure| self.fail(failure))?;
        let held_back = match capture.loss {
            Some(loss) => Some(self.read_loss(&loss)?),
            None => None,
        };
        self.graphs.recorded.insert(
            capture.kind,
            PhaseGraph {
                graph,
                key: capture.key,
                loss: capture.loss,
            },
        );
        Ok(PhaseEnd::Done(held_back))
    }
}

#[cfg(test)]
mod tests {
    use carve_core::plan::{RunConfig, compile_step_plan};
    use carve_core::validate::{parse_job_spec_toml, validate_job_spec};

    use super::*;
    use crate::kernels::optimizer::LossScaler;

    fn recordability(text: &str, precision: Precision) -> Vec<Option<&'static str>> {
        let job = validate_job_spec(parse_job_spec_toml(text).unwrap()).unwrap();
        let config = RunConfig {
            precision,
            ..RunConfig::from_spec(&job.spec)
        };
        let plan = compile_step_plan(&job, &config).unwrap();
        let mut scaler = LossScaler::disabled();
        let mut apply = true;
        let context = OperationContext {
            plan: &plan,
            graph: &job.graph,
            optimizer: &job.spec.training.optimizer,
            seed: 1,
            step: 1,
            micro_batch: 0,
            samples: 8,
            loss_gradient_scale: 1.0,
            optimizer_update_number: 1,
            loss_scaler: &mut scaler,
            apply_update: &mut apply,
        };
        [
            PhaseKind::Setup,
            PhaseKind::MicroBatch,
            PhaseKind::Update,
            PhaseKind::Evaluation,
        ]
        .into_iter()
        .map(|kind| why_not_recordable(kind, &context))
        .collect()
    }

    const SPEC: &str = r#"
name = "graphs"
[model]
input_shape = [4, 4, 1]
loss = "softmax_cross_entropy"
layers = [{ conv2d = { filters = 2, kernel = 3, padding = "same" } }, { relu = {} }, { flatten = {} }, { dense = { units = 3 } }]
[training]
batch_size = 8
steps = 2
optimizer = { sgd = { learning_rate = 0.1 } }
[data]
format = "synthetic"
samples = 16
"#;

    #[test]
    fn only_phases_whose_calls_repeat_exactly_are_recorded() {
        let recordable = recordability(SPEC, Precision::Bf16);
        assert!(recordable[0].is_some() && recordable[3].is_some());
        assert_eq!(recordable[1], None);
        assert_eq!(recordable[2], None);
        let fp16 = recordability(SPEC, Precision::Fp16);
        assert!(fp16[1].unwrap().contains("fp16") && fp16[2].unwrap().contains("fp16"));
        let dropout = SPEC.replace(
            "{ flatten = {} }",
            "{ flatten = {} }, { dropout = { rate = 0.5 } }",
        );
        let with_dropout = recordability(&dropout, Precision::Fp32);
        assert!(with_dropout[1].unwrap().contains("dropout"));
        assert_eq!(with_dropout[2], None);
        let adam = SPEC.replace(
            "sgd = { learning_rate = 0.1 }",
            "adam = { learning_rate = 0.01 }",
        );
        let with_adam = recordability(&adam, Precision::Fp32);
        assert_eq!(with_adam[1], None);
        assert!(with_adam[2].unwrap().contains("Adam"));
    }
}
