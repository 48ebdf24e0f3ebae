//! The training loop: runs a job's step plan on a backend inside a slice, step after step
//! — micro-batches with gradient accumulation, dynamic loss scaling under fp16,
//! checkpoints, resume, and evaluation on the test set.
//!
//! Every source of randomness is a pure function of the seed and the position (parameter
//! initialization of (seed, layer, parameter), data order of (seed, epoch), dropout of
//! (seed, step, micro-batch, layer)), which is what makes resuming exact without saving
//! RNG state.

use std::path::PathBuf;
use std::time::Instant;

use carve_core::estimator::{MemoryEstimate, estimate_plan};
use carve_core::model::{LayerNode, LayerOp, ParameterTensor};
use carve_core::plan::{
    BufferId, BufferOwner, BufferRole, PlanStep, RunConfig, StepPlan, compile_step_plan,
};
use carve_core::spec::Precision;
use carve_core::validate::ValidatedJob;

use crate::backend::{Backend, OperationContext, PhaseKind};
use crate::checkpoint::{Checkpoint, NamedTensor, read_checkpoint, write_checkpoint};
use crate::cpu::CpuBackend;
use crate::data::{
    Batch, BatchLoader, DataSets, Dataset, Targets, evaluation_batches, steps_for_epochs,
};
use crate::error::EngineError;
use crate::executor::{Executor, PhaseTotals};
use crate::kernels::optimizer::LossScaler;
use crate::rng::Rng;

/// How to run one attempt.
#[derive(Debug, Clone)]
pub struct TrainingOptions {
    pub config: RunConfig,
    /// The slice: every device buffer of the attempt must fit in it.
    pub slice_bytes: u64,
    /// Where to write checkpoints (every `checkpoint_every_steps` and at the end).
    pub checkpoint_path: Option<PathBuf>,
    pub resume_from: Option<PathBuf>,
    /// Stop after this many steps in total even if the job asks for more (a checkpoint is
    /// written there), e.g. to hand over to another attempt.
    pub stop_after_steps: Option<u64>,
    /// Set from outside (the attempt process's SIGTERM watcher) to stop after the step
    /// under way: the checkpoint is written there and the test set is not evaluated, so
    /// a preempted attempt can be resumed without losing its work.
    pub stop_requested: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// Reported after every step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Steps completed.
    pub step: u64,
    pub total_steps: u64,
    /// Mean loss of the step's batch.
    pub loss: f64,
    pub samples_per_second: f64,
    pub memory_in_use_bytes: u64,
    pub memory_peak_bytes: u64,
    /// Whether the step's update was skipped for a loss-scale overflow.
    pub skipped: bool,
}

/// How a finished (or stopped) run went.
#[derive(Debug, Clone)]
pub struct TrainingReport {
    /// Steps completed in total (including those before a resume).
    pub steps: u64,
    pub total_steps: u64,
    /// Mean loss of the last step.
    pub final_loss: f64,
    pub test_loss: Option<f64>,
    pub test_accuracy: Option<f64>,
    /// The allocator's peak bytes in use: equal to `estimate.peak_bytes`.
    pub peak_bytes: u64,
    pub estimate: MemoryEstimate,
    pub slice_bytes: u64,
    pub skipped_steps: u64,
    pub samples_per_second: f64,
    /// The trained parameters in fp32, named as in checkpoints.
    pub parameters: Vec<NamedTensor>,
    pub checkpoint_path: Option<PathBuf>,
}

/// Where each parameter's buffers are in the plan.
#[derive(Debug, Clone)]
struct ParameterBuffers {
    name: String,
    layer: usize,
    parameter: usize,
    /// The model's tensor: its name and shape decide its initial values.
    tensor: ParameterTensor,
    elements: usize,
    trainable: bool,
    weights: BufferId,
    master: Option<BufferId>,
    optimizer_state: Vec<BufferId>,
}

impl ParameterBuffers {
    /// The buffer holding the fp32 truth: the master under mixed precision.
    fn truth(&self) -> BufferId {
        self.master.unwrap_or(self.weights)
    }
}

fn parameter_buffers(job: &ValidatedJob, plan: &StepPlan) -> Vec<ParameterBuffers> {
    let mut found = Vec::new();
    for layer in &job.graph.layers {
        for (parameter_index, parameter) in layer.parameters.iter().enumerate() {
            let find = |wanted: &dyn Fn(BufferRole) -> bool| {
                plan.buffers
                    .iter()
                    .filter(|buffer| {
                        buffer.owner == BufferOwner::Layer(layer.index) && wanted(buffer.role)
                    })
                    .map(|buffer| buffer.id)
                    .collect::<Vec<_>>()
            };
            let weights = find(&|role| {
                role == BufferRole::Parameter {
                    parameter: parameter_index,
                }
            });
            let master = find(&|role| {
                role == BufferRole::MasterParameter {
                    parameter: parameter_index,
                }
            });
            let optimizer_state = find(
                &|role| matches!(role, BufferRole::OptimizerState { parameter, .. } if parameter == parameter_index),
            );
            found.push(ParameterBuffers {
                name: format!("{}/{}", layer.label(), parameter.name),
                layer: layer.index,
                parameter: parameter_index,
                tensor: parameter.clone(),
                elements: parameter.elements as usize,
                trainable: parameter.trainable,
                weights: weights[0],
                master: master.first().copied(),
                optimizer_state,
            });
        }
    }
    found
}

/// Keras defaults: Glorot-uniform kernels, zero biases and betas, unit gammas, running
/// mean 0 and variance 1.
fn initial_values(
    layer: &LayerNode,
    parameter: usize,
    tensor: &ParameterTensor,
    seed: u64,
) -> Vec<f32> {
    let elements = tensor.elements as usize;
    match tensor.name {
        "kernel" => {
            let (fan_in, fan_out) = match layer.op {
                LayerOp::Conv2d {
                    filters, window, ..
                } => {
                    let receptive = window.kernel_height * window.kernel_width;
                    (receptive * tensor.shape[2], receptive * filters)
                }
                _ => (tensor.shape[0], tensor.shape[1]),
            };
            let limit = (6.0 / (fan_in + fan_out) as f64).sqrt() as f32;
            let mut rng = Rng::for_stream(seed, &[0x1417, layer.index as u64, parameter as u64]);
            (0..elements)
                .map(|_| (rng.next_f32() * 2.0 - 1.0) * limit)
                .collect()
        }
        "gamma" | "running_variance" => vec![1.0; elements],
        _ => vec![0.0; elements],
    }
}

fn optimizer_state_name(parameter: &ParameterBuffers, slot: usize) -> String {
    format!("{}/optimizer_state{slot}", parameter.name)
}

fn write_targets<B: Backend>(
    executor: &mut Executor<B>,
    target: BufferId,
    batch: &Batch,
) -> Result<(), EngineError> {
    match &batch.targets {
        Targets::Classes(labels) => executor.backend_mut().write_i32(target, labels),
        Targets::Values(values) => executor.backend_mut().write_f32(target, values),
    }
}

/// The slots the plan reads micro-batches from.
fn data_slots(plan: &StepPlan) -> Result<(BufferId, BufferId), EngineError> {
    let slot = |wanted: BufferRole| {
        plan.buffers
            .iter()
            .find(|buffer| buffer.role == wanted)
            .map(|buffer| buffer.id)
            .ok_or_else(|| EngineError::Backend("the plan has no input slot".into()))
    };
    Ok((
        slot(BufferRole::InputSlot { slot: 0 })?,
        slot(BufferRole::TargetSlot { slot: 0 })?,
    ))
}

/// Trains `job` on the cpu backend.
pub fn train(
    job: &ValidatedJob,
    data: &DataSets,
    options: &TrainingOptions,
    on_progress: &mut dyn FnMut(&Progress),
) -> Result<TrainingReport, EngineError> {
    let plan = compile_step_plan(job, &options.config)?;
    let estimate = estimate_plan(&plan);
    let executor = Executor::new(&plan, options.slice_bytes, CpuBackend::new());
    train_with(job, data, options, plan, estimate, executor, on_progress)
}

/// Trains `job` with a given executor (and so backend).
pub fn train_with<B: Backend>(
    job: &ValidatedJob,
    data: &DataSets,
    options: &TrainingOptions,
    plan: StepPlan,
    estimate: MemoryEstimate,
    mut executor: Executor<B>,
    on_progress: &mut dyn FnMut(&Progress),
) -> Result<TrainingReport, EngineError> {
    // Every operation read through core's operand accessors once, before anything runs:
    // a plan the engine would misread stops the attempt here (each run reads them again).
    let result = plan
        .check_operands(&job.graph)
        .map_err(EngineError::from)
        .and_then(|()| {
            run_training(
                job,
                data,
                options,
                &plan,
                estimate,
                &mut executor,
                on_progress,
            )
        });
    // Whatever happened, the attempt gives its slice back.
    executor.release_everything();
    result
}

fn run_training<B: Backend>(
    job: &ValidatedJob,
    data: &DataSets,
    options: &TrainingOptions,
    plan: &StepPlan,
    estimate: MemoryEstimate,
    executor: &mut Executor<B>,
    on_progress: &mut dyn FnMut(&Progress),
) -> Result<TrainingReport, EngineError> {
    let config = options.config;
    let training = &job.spec.training;
    let total_steps = match (training.steps, training.epochs) {
        (Some(steps), _) => steps,
        (None, Some(epochs)) => steps_for_epochs(data.train.len(), config.batch_size, epochs),
        (None, None) => 0,
    };
    let stop_at = options
        .stop_after_steps
        .map_or(total_steps, |stop| stop.min(total_steps));
    let parameters = parameter_buffers(job, plan);
    let (input_slot, target_slot) = data_slots(plan)?;

    let resumed = options
        .resume_from
        .as_deref()
        .map(read_checkpoint)
        .transpose()?;
    let mut run = Run {
        job,
        plan,
        executor,
        input_slot,
        target_slot,
        loss_scaler: starting_loss_scaler(resumed.as_ref(), config.precision),
        apply_update: true,
        step: resumed.as_ref().map_or(0, |checkpoint| checkpoint.step),
        applied_updates: resumed
            .as_ref()
            .map_or(0, |checkpoint| checkpoint.applied_updates),
    };
    run.set_up(&parameters, resumed.as_ref())?;

    let micro_batch_size = config.micro_batch_size as usize;
    let mut loader = BatchLoader::new(
        data.train.clone(),
        micro_batch_size,
        training.seed,
        job.spec.data.shuffle,
        run.step * config.accumulation_steps(),
        job.spec.data.prefetch_batches as usize,
    );
    let mut final_loss = f64::NAN;
    let mut skipped_steps = 0;
    let started = Instant::now();
    let first_step = run.step;
    let stop_requested = || {
        options
            .stop_requested
            .as_ref()
            .is_some_and(|stop| stop.load(std::sync::atomic::Ordering::Acquire))
    };
    while run.step < stop_at && !stop_requested() {
        let step_started = Instant::now();
        let loss_sum = run.train_step(&mut loader, &config)?;
        if run.apply_update {
            run.applied_updates += 1;
        } else {
            skipped_steps += 1;
        }
        run.step += 1;
        final_loss = loss_sum / config.batch_size as f64;
        let elapsed = step_started.elapsed().as_secs_f64().max(1e-9);
        on_progress(&Progress {
            step: run.step,
            total_steps,
            loss: final_loss,
            samples_per_second: config.batch_size as f64 / elapsed,
            memory_in_use_bytes: run.executor.allocator().in_use(),
            memory_peak_bytes: run.executor.allocator().peak_in_use(),
            skipped: !run.apply_update,
        });
        let every = training.checkpoint_every_steps;
        if let Some(path) = &options.checkpoint_path
            && every > 0
            && run.step.is_multiple_of(every)
            && run.step < stop_at
        {
            write_checkpoint(path, &run.snapshot(&parameters)?)?;
        }
    }
    let trained_steps = run.step - first_step;
    let samples_per_second =
        (trained_steps * config.batch_size) as f64 / started.elapsed().as_secs_f64().max(1e-9);
    let checkpoint = run.snapshot(&parameters)?;
    if let Some(path) = &options.checkpoint_path {
        write_checkpoint(path, &checkpoint)?;
    }

    let (test_loss, test_accuracy) = match &data.test {
        Some(test) if !stop_requested() => run.evaluate(test.as_ref(), micro_batch_size)?,
        _ => (None, None),
    };

    Ok(TrainingReport {
        steps: run.step,
        total_steps,
        final_loss,
        test_loss,
        test_accuracy,
        peak_bytes: run.executor.allocator().peak_in_use(),
        estimate,
        slice_bytes: options.slice_bytes,
        skipped_steps,
        samples_per_second,
        parameters: checkpoint
            .tensors
            .into_iter()
            .filter(|tensor| !tensor.name.contains("/optimizer_state"))
            .collect(),
        checkpoint_path: options.checkpoint_path.clone(),
    })
}

/// The loss scaler a run starts with: the checkpoint's under fp16 when resuming.
fn starting_loss_scaler(resumed: Option<&Checkpoint>, precision: Precision) -> LossScaler {
    match (resumed, precision) {
        (Some(checkpoint), Precision::Fp16) => {
            LossScaler::from_state(checkpoint.loss_scale, checkpoint.loss_scale_good_steps)
        }
        (_, Precision::Fp16) => LossScaler::new(65536.0),
        _ => LossScaler::disabled(),
    }
}

/// One attempt's run: the plan on its executor, and where the run is.
struct Run<'a, B: Backend> {
    job: &'a ValidatedJob,
    plan: &'a StepPlan,
    executor: &'a mut Executor<B>,
    input_slot: BufferId,
    target_slot: BufferId,
    loss_scaler: LossScaler,
    /// Cleared by the overflow check when this step's update is skipped.
    apply_update: bool,
    /// 0-based step being computed.
    step: u64,
    applied_updates: u64,
}

impl<B: Backend> Run<'_, B> {
    /// Runs `phase` of the plan at the current step.
    fn run_phase(
        &mut self,
        kind: PhaseKind,
        phase: &[PlanStep],
        micro_batch: u64,
        samples: usize,
        loss_gradient_scale: f32,
    ) -> Result<PhaseTotals, EngineError> {
        let mut context = OperationContext {
            plan: self.plan,
            graph: &self.job.graph,
            optimizer: &self.job.spec.training.optimizer,
            seed: self.job.spec.training.seed,
            step: self.step,
            micro_batch,
            samples,
            loss_gradient_scale,
            optimizer_update_number: self.applied_updates + 1,
            loss_scaler: &mut self.loss_scaler,
            apply_update: &mut self.apply_update,
        };
        self.executor
            .run_phase(self.plan, kind, phase, &mut context)
    }

    /// Setup: persistent buffers, then their values (initial or from the checkpoint),
    /// then the casts that derive from them.
    fn set_up(
        &mut self,
        parameters: &[ParameterBuffers],
        resumed: Option<&Checkpoint>,
    ) -> Result<(), EngineError> {
        let plan = self.plan;
        let (allocations, setup_operations): (Vec<PlanStep>, Vec<PlanStep>) = plan
            .setup
            .iter()
            .cloned()
            .partition(|step| matches!(step, PlanStep::Allocate(_)));
        self.run_phase(PhaseKind::Setup, &allocations, 0, 0, 0.0)?;
        for parameter in parameters {
            let layer = &self.job.graph.layers[parameter.layer];
            let values = match resumed {
                Some(checkpoint) => {
                    checkpoint_values(checkpoint, &parameter.name, parameter.elements)?
                }
                None => initial_values(
                    layer,
                    parameter.parameter,
                    &parameter.tensor,
                    self.job.spec.training.seed,
                ),
            };
            // Under mixed precision the compute copy is cast from the master by the setup
            // operations below.
            self.executor
                .backend_mut()
                .write_f32(parameter.truth(), &values)?;
            if let Some(checkpoint) = resumed {
                for (slot, state) in parameter.optimizer_state.iter().enumerate() {
                    let values = checkpoint_values(
                        checkpoint,
                        &optimizer_state_name(parameter, slot),
                        parameter.elements,
                    )?;
                    self.executor.backend_mut().write_f32(*state, &values)?;
                }
            }
        }
        self.run_phase(PhaseKind::Setup, &setup_operations, 0, 0, 0.0)?;
        Ok(())
    }

    /// Writes a batch into the plan's input and target slots.
    fn load_batch(&mut self, batch: &Batch) -> Result<(), EngineError> {
        self.executor
            .backend_mut()
            .write_f32(self.input_slot, &batch.inputs)?;
        write_targets(self.executor, self.target_slot, batch)
    }

    /// One optimizer step: every micro-batch's forward and backward, then the update.
    /// Returns the step's loss sum.
    fn train_step(
        &mut self,
        loader: &mut BatchLoader,
        config: &RunConfig,
    ) -> Result<f64, EngineError> {
        let plan = self.plan;
        let mut loss_sum = 0.0;
        self.apply_update = true;
        for micro_batch in 0..config.accumulation_steps() {
            let batch = loader.next_batch()?;
            self.load_batch(&batch)?;
            // Each micro-batch's gradient is a share of the whole batch's mean.
            let loss_gradient_scale = self.loss_scaler.scale() / config.batch_size as f32;
            loss_sum += self
                .run_phase(
                    PhaseKind::MicroBatch,
                    &plan.micro_batch,
                    micro_batch,
                    batch.samples,
                    loss_gradient_scale,
                )?
                .loss_sum;
        }
        self.run_phase(
            PhaseKind::Update,
            &plan.update,
            0,
            config.micro_batch_size as usize,
            0.0,
        )?;
        Ok(loss_sum)
    }

    /// The mean loss (and accuracy, for classes) over `test`.
    fn evaluate(
        &mut self,
        test: &dyn Dataset,
        micro_batch_size: usize,
    ) -> Result<(Option<f64>, Option<f64>), EngineError> {
        let plan = self.plan;
        let mut loss_sum = 0.0;
        let mut correct = 0usize;
        let mut samples = 0usize;
        let mut has_accuracy = false;
        for batch in evaluation_batches(test, micro_batch_size) {
            let batch = batch?;
            self.load_batch(&batch)?;
            let totals = self.run_phase(
                PhaseKind::Evaluation,
                &plan.evaluation,
                0,
                batch.samples,
                0.0,
            )?;
            loss_sum += totals.loss_sum;
            correct += totals.correct;
            has_accuracy |= totals.has_accuracy;
            samples += batch.samples;
        }
        let samples = samples.max(1) as f64;
        Ok((
            Some(loss_sum / samples),
            has_accuracy.then_some(correct as f64 / samples),
        ))
    }

    fn snapshot(&self, parameters: &[ParameterBuffers]) -> Result<Checkpoint, EngineError> {
        snapshot(
            self.job,
            self.executor,
            parameters,
            self.step,
            self.applied_updates,
            &self.loss_scaler,
        )
    }
}

fn checkpoint_values(
    checkpoint: &Checkpoint,
    name: &str,
    elements: usize,
) -> Result<Vec<f32>, EngineError> {
    match checkpoint.tensor(name) {
        Some(values) if values.len() == elements => Ok(values.to_vec()),
        Some(values) => Err(EngineError::checkpoint(
            name,
            format!("has {} values, the model needs {elements}", values.len()),
        )),
        None => Err(EngineError::checkpoint(
            name,
            "is missing: the checkpoint is from another model",
        )),
    }
}

fn snapshot<B: Backend>(
    job: &ValidatedJob,
    executor: &Executor<B>,
    parameters: &[ParameterBuffers],
    step: u64,
    applied_updates: u64,
    loss_scaler: &LossScaler,
) -> Result<Checkpoint, EngineError> {
    let mut tensors = Vec::new();
    for parameter in parameters {
        tensors.push(NamedTensor {
            name: parameter.name.clone(),
            values: executor.backend().read_f32(parameter.truth())?,
        });
        if parameter.trainable {
            for (slot, state) in parameter.optimizer_state.iter().enumerate() {
                tensors.push(NamedTensor {
                    name: optimizer_state_name(parameter, slot),
                    values: executor.backend().read_f32(*state)?,
                });
            }
        }
    }
    let (loss_scale, loss_scale_good_steps) = loss_scaler.state();
    Ok(Checkpoint {
        job_name: job.spec.name.clone(),
        step,
        applied_updates,
        loss_scale,
        loss_scale_good_steps,
        seed: job.spec.training.seed,
        tensors,
    })
}
