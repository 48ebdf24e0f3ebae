//! Backends: where a plan's buffers live and how its operations run.
//!
//! The executor owns the slice allocator and decides where every buffer goes; a backend
//! only creates storage at the offset it is given, runs operations on it, and moves data
//! in and out. `CpuBackend` (in `cpu/`) does real math over host buffers; `CudaBackend`
//! (in `cuda/`) implements the same trait over one reserved device region. Both run an
//! operation through `dispatch::run_operation`.

use carve_core::model::ModelGraph;
use carve_core::plan::{BufferId, BufferSpec, Operation, StepPlan};

use crate::error::EngineError;
use crate::kernels::optimizer::LossScaler;

/// Everything an operation needs beyond its buffers.
#[derive(Debug)]
pub struct OperationContext<'a> {
    pub plan: &'a StepPlan,
    pub graph: &'a ModelGraph,
    pub optimizer: &'a carve_core::spec::OptimizerSpec,
    /// The training seed: dropout masks are drawn from (seed, step, micro-batch, layer).
    pub seed: u64,
    /// 0-based optimizer step being computed.
    pub step: u64,
    /// 0-based micro-batch within the step.
    pub micro_batch: u64,
    /// Samples in this micro-batch (the last evaluation batch may be short).
    pub samples: usize,
    /// Multiplies the loss gradient: loss scale / effective batch size.
    pub loss_gradient_scale: f32,
    /// Updates applied so far plus one (Adam's bias correction counts applied updates).
    pub optimizer_update_number: u64,
    pub loss_scaler: &'a mut LossScaler,
    /// Set by the overflow check; optimizer updates are skipped when false.
    pub apply_update: &'a mut bool,
}

/// What an operation reports back.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OperationResult {
    /// Sum of per-sample losses (loss operations).
    pub loss_sum: Option<f64>,
    /// Correct predictions (classification loss operations).
    pub correct: Option<usize>,
}

/// The values of a write into buffer `id` of `length` elements, zero-padded to its length;
/// more values than fit are an error.
pub(crate) fn padded_write(
    id: BufferId,
    values: &[f32],
    length: usize,
) -> Result<Vec<f32>, EngineError> {
    if values.len() > length {
        return Err(EngineError::Backend(format!(
            "{} values do not fit buffer {} of {length}",
            values.len(),
            id.0
        )));
    }
    let mut padded = values.to_vec();
    padded.resize(length, 0.0);
    Ok(padded)
}

/// Which of the plan's phases a run of the executor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PhaseKind {
    Setup,
    MicroBatch,
    Update,
    Evaluation,
}

/// How a phase ended, as the backend sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PhaseEnd {
    /// Done; the results the backend held back until the end of the phase, if any.
    Done(Option<OperationResult>),
    /// The backend could not record the phase and nothing of it ran: run it again.
    RunAgain,
}

/// Storage and compute for one attempt.
///
/// A backend may record a phase the first time it runs and replay the recording after
/// (the cuda backend's CUDA graphs): the executor asks `replay_phase` first and brackets
/// every phase it walks with `begin_phase` and `end_phase`.
pub trait Backend {
    fn name(&self) -> &'static str;
    /// Creates the storage of `buffer`, which the allocator placed at `offset` in the slice.
    fn create_buffer(&mut self, buffer: &BufferSpec, offset: u64) -> Result<(), EngineError>;
    fn release_buffer(&mut self, id: BufferId);
    fn run(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<OperationResult, EngineError>;
    /// Writes f32 values into a buffer, rounding to its element type.
    fn write_f32(&mut self, id: BufferId, values: &[f32]) -> Result<(), EngineError>;
    fn write_i32(&mut self, id: BufferId, values: &[i32]) -> Result<(), EngineError>;
    /// Reads a buffer as f32.
    fn read_f32(&self, id: BufferId) -> Result<Vec<f32>, EngineError>;

    /// Runs the recording of phase `kind`, if there is one that fits `context`, and
    /// returns the phase's results; `None` when the executor must walk the phase.
    fn replay_phase(
        &mut self,
        _kind: PhaseKind,
        _context: &OperationContext<'_>,
    ) -> Result<Option<OperationResult>, EngineError> {
        Ok(None)
    }

    /// Called before the executor walks phase `kind`.
    fn begin_phase(
        &mut self,
        _kind: PhaseKind,
        _context: &OperationContext<'_>,
    ) -> Result<(), EngineError> {
        Ok(())
    }

    /// Called after the executor walked phase `kind`; `completed` is false when the walk
    /// failed (the backend then drops what it recorded, and the result is ignored).
    fn end_phase(&mut self, _kind: PhaseKind, _completed: bool) -> Result<PhaseEnd, EngineError> {
        Ok(PhaseEnd::Done(None))
    }
}
