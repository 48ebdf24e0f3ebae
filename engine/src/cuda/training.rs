//! Training on a GPU: the plan compiled and the slice reserved first (so the caller can
//! report the reservation), then the trainer's loop over the cuda backend.

use carve_core::estimator::{MemoryEstimate, estimate_plan};
use carve_core::plan::{StepPlan, compile_step_plan};
use carve_core::validate::ValidatedJob;

use super::{CudaBackend, CudaOptions, CudaTuning, SliceReservation};
use crate::data::DataSets;
use crate::error::EngineError;
use crate::executor::Executor;
use crate::trainer::{Progress, TrainingOptions, TrainingReport, train_with};

/// An attempt ready to train on a GPU: the plan compiled, the slice reserved and
/// verified. Preparing first lets the caller report the reservation before training.
#[derive(Debug)]
pub struct CudaTraining {
    plan: StepPlan,
    estimate: MemoryEstimate,
    executor: Executor<CudaBackend>,
    reservation: SliceReservation,
}

impl CudaTraining {
    /// Compiles the plan for `options.config` and reserves `options.slice_bytes` on GPU
    /// `device_ordinal`, with the tuning of `CARVE_CUDA_TUNING` (the fast defaults when it
    /// is not set).
    pub fn prepare(
        job: &ValidatedJob,
        options: &TrainingOptions,
        device_ordinal: usize,
    ) -> Result<CudaTraining, EngineError> {
        let tuning = CudaTuning::from_environment().map_err(EngineError::Backend)?;
        Self::prepare_with(job, options, device_ordinal, tuning)
    }

    /// `prepare` with the given tuning.
    pub fn prepare_with(
        job: &ValidatedJob,
        options: &TrainingOptions,
        device_ordinal: usize,
        tuning: CudaTuning,
    ) -> Result<CudaTraining, EngineError> {
        let plan = compile_step_plan(job, &options.config)?;
        let estimate = estimate_plan(&plan);
        let backend = CudaBackend::new(
            CudaOptions {
                device_ordinal,
                slice_bytes: options.slice_bytes,
                workspace_limit_bytes: options.config.workspace_limit_bytes(),
                tuning,
            },
            &job.graph,
        )?;
        let reservation = backend.reservation().clone();
        let executor = Executor::new(&plan, options.slice_bytes, backend);
        Ok(CudaTraining {
            plan,
            estimate,
            executor,
            reservation,
        })
    }

    /// What was reserved on the GPU.
    pub fn reservation(&self) -> &SliceReservation {
        &self.reservation
    }

    /// Trains as `trainer::train` does on the cpu backend; the slice is released after.
    pub fn train(
        self,
        job: &ValidatedJob,
        data: &DataSets,
        options: &TrainingOptions,
        on_progress: &mut dyn FnMut(&Progress),
    ) -> Result<TrainingReport, EngineError> {
        train_with(
            job,
            data,
            options,
            self.plan,
            self.estimate,
            self.executor,
            on_progress,
        )
    }
}

/// Trains `job` on GPU `device_ordinal` inside a slice of `options.slice_bytes`: the
/// `train` of the cpu backend, with the reservation report alongside.
pub fn train_on_cuda(
    job: &ValidatedJob,
    data: &DataSets,
    options: &TrainingOptions,
    device_ordinal: usize,
    on_progress: &mut dyn FnMut(&Progress),
) -> Result<(TrainingReport, SliceReservation), EngineError> {
    let tuning = CudaTuning::from_environment().map_err(EngineError::Backend)?;
    train_on_cuda_with(job, data, options, device_ordinal, tuning, on_progress)
}

/// `train_on_cuda` with the given tuning.
pub fn train_on_cuda_with(
    job: &ValidatedJob,
    data: &DataSets,
    options: &TrainingOptions,
    device_ordinal: usize,
    tuning: CudaTuning,
    on_progress: &mut dyn FnMut(&Progress),
) -> Result<(TrainingReport, SliceReservation), EngineError> {
    let prepared = CudaTraining::prepare_with(job, options, device_ordinal, tuning)?;
    let reservation = prepared.reservation().clone();
    let report = prepared.train(job, data, options, on_progress)?;
    Ok((report, reservation))
}
