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
use carve_core::model::{LayerNode, LayerOp};
use carve_core::plan::{
    BufferId, BufferOwner, BufferRole, PlanStep, RunConfig, StepPlan, compile_step_plan,
};
use carve_core::spec::Precision;
use carve_core::validate::ValidatedJob;

use crate::backend::{Backend, OperationContext};
use crate::checkpoint::{Checkpoint, NamedTensor, read_checkpoint, write_checkpoint};
use crate::cpu::CpuBackend;
use crate::data::{Batch, BatchLoader, DataSets, Targets, evaluation_batches, steps_for_epochs};
use crate::error::EngineError;
use crate::executor::Executor;
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
fn initial_values(layer: &LayerNode, parameter: usize, seed: u64) -> Vec<f32> {
    let tensor = &layer.parameters[parameter];
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
    let result = run_training(
        job,
        data,
        options,
        &plan,
        estimate,
        &mut executor,
        on_progress,
    );
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
    let seed = training.seed;
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
    let mut loss_scaler = match (&resumed, config.precision) {
        (Some(checkpoint), Precision::Fp16) => {
            LossScaler::from_state(checkpoint.loss_scale, checkpoint.loss_scale_good_steps)
        }
        (_, Precision::Fp16) => LossScaler::new(65536.0),
        _ => LossScaler::disabled(),
    };
    let mut step = resumed.as_ref().map_or(0, |checkpoint| checkpoint.step);
    let mut applied_updates = resumed
        .as_ref()
        .map_or(0, |checkpoint| checkpoint.applied_updates);

    // Setup: persistent buffers, then their values, then the casts that derive from them.
    let (allocations, setup_operations): (Vec<PlanStep>, Vec<PlanStep>) = plan
        .setup
        .iter()
        .cloned()
        .partition(|step| matches!(step, PlanStep::Allocate(_)));
    let mut apply_update = true;
    {
        let mut operation_context = operation_context(
            plan,
            job,
            Position {
                step,
                micro_batch: 0,
                samples: 0,
                loss_gradient_scale: 0.0,
                optimizer_update_number: applied_updates + 1,
            },
            &mut loss_scaler,
            &mut apply_update,
        );
        executor.run_phase(plan, &allocations, &mut operation_context)?;
        for parameter in &parameters {
            let layer = &job.graph.layers[parameter.layer];
            let values = match &resumed {
                Some(checkpoint) => {
                    checkpoint_values(checkpoint, &parameter.name, parameter.elements)?
                }
                None => initial_values(layer, parameter.parameter, seed),
            };
            // Under mixed precision the compute copy is cast from the master by the setup
            // operations below.
            executor
                .backend_mut()
                .write_f32(parameter.truth(), &values)?;
            if let Some(checkpoint) = &resumed {
                for (slot, state) in parameter.optimizer_state.iter().enumerate() {
                    let values = checkpoint_values(
                        checkpoint,
                        &optimizer_state_name(parameter, slot),
                        parameter.elements,
                    )?;
                    executor.backend_mut().write_f32(*state, &values)?;
                }
            }
        }
        executor.run_phase(plan, &setup_operations, &mut operation_context)?;
    }

    let accumulation_steps = config.accumulation_steps();
    let micro_batch_size = config.micro_batch_size as usize;
    let mut loader = BatchLoader::new(
        data.train.clone(),
        micro_batch_size,
        seed,
        job.spec.data.shuffle,
        step * accumulation_steps,
        job.spec.data.prefetch_batches as usize,
    );
    let mut final_loss = f64::NAN;
    let mut skipped_steps = 0;
    let started = Instant::now();
    let first_step = step;
    while step < stop_at {
        let step_started = Instant::now();
        let mut loss_sum = 0.0;
        apply_update = true;
        for micro_batch in 0..accumulation_steps {
            let batch = loader.next_batch()?;
            executor
                .backend_mut()
                .write_f32(input_slot, &batch.inputs)?;
            write_targets(executor, target_slot, &batch)?;
            let mut operation_context = operation_context(
                plan,
                job,
                Position {
                    step,
                    micro_batch,
                    samples: batch.samples,
                    // Each micro-batch's gradient is a share of the whole batch's mean.
                    loss_gradient_scale: loss_scaler.scale() / config.batch_size as f32,
                    optimizer_update_number: applied_updates + 1,
                },
                &mut loss_scaler,
                &mut apply_update,
            );
            loss_sum += executor
                .run_phase(plan, &plan.micro_batch, &mut operation_context)?
                .loss_sum;
        }
        let mut operation_context = operation_context(
            plan,
            job,
            Position {
                step,
                micro_batch: 0,
                samples: micro_batch_size,
                loss_gradient_scale: 0.0,
                optimizer_update_number: applied_updates + 1,
            },
            &mut loss_scaler,
            &mut apply_update,
        );
        executor.run_phase(plan, &plan.update, &mut operation_context)?;
        if apply_update {
            applied_updates += 1;
        } else {
            skipped_steps += 1;
        }
        step += 1;
        final_loss = loss_sum / config.batch_size as f64;
        let elapsed = step_started.elapsed().as_secs_f64().max(1e-9);
        on_progress(&Progress {
            step,
            total_steps,
            loss: final_loss,
            samples_per_second: config.batch_size as f64 / elapsed,
            memory_in_use_bytes: executor.allocator().in_use(),
            memory_peak_bytes: executor.allocator().peak_in_use(),
            skipped: !apply_update,
        });
        let every = training.checkpoint_every_steps;
        if let Some(path) = &options.checkpoint_path
            && every > 0
            && step % every == 0
            && step < stop_at
        {
            write_checkpoint(
                path,
                &snapshot(
                    job,
                    executor,
                    &parameters,
                    step,
                    applied_updates,
                    &loss_scaler,
                )?,
            )?;
        }
    }
    let trained_steps = step - first_step;
    let samples_per_second =
        (trained_steps * config.batch_size) as f64 / started.elapsed().as_secs_f64().max(1e-9);
    let checkpoint = snapshot(
        job,
        executor,
        &parameters,
        step,
        applied_updates,
        &loss_scaler,
    )?;
    if let Some(path) = &options.checkpoint_path {
        write_checkpoint(path, &checkpoint)?;
    }

    let (test_loss, test_accuracy) = match &data.test {
        Some(test) => {
            let mut loss_sum = 0.0;
            let mut correct = 0usize;
            let mut samples = 0usize;
            let mut has_accuracy = false;
            for batch in evaluation_batches(test.as_ref(), micro_batch_size) {
                let batch = batch?;
                executor
                    .backend_mut()
                    .write_f32(input_slot, &batch.inputs)?;
                write_targets(executor, target_slot, &batch)?;
                let mut operation_context = operation_context(
                    plan,
                    job,
                    Position {
                        step,
                        micro_batch: 0,
                        samples: batch.samples,
                        loss_gradient_scale: 0.0,
                        optimizer_update_number: applied_updates + 1,
                    },
                    &mut loss_scaler,
                    &mut apply_update,
                );
                let totals = executor.run_phase(plan, &plan.evaluation, &mut operation_context)?;
                loss_sum += totals.loss_sum;
                correct += totals.correct;
                has_accuracy |= totals.has_accuracy;
                samples += batch.samples;
            }
            let samples = samples.max(1) as f64;
            (
                Some(loss_sum / samples),
                has_accuracy.then_some(correct as f64 / samples),
            )
        }
        None => (None, None),
    };

    Ok(TrainingReport {
        steps: step,
        total_steps,
        final_loss,
        test_loss,
        test_accuracy,
        peak_bytes: executor.allocator().peak_in_use(),
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

/// Where in the run an operation happens.
#[derive(Debug, Clone, Copy)]
struct Position {
    step: u64,
    micro_batch: u64,
    samples: usize,
    loss_gradient_scale: f32,
    optimizer_update_number: u64,
}

fn operation_context<'a>(
    plan: &'a StepPlan,
    job: &'a ValidatedJob,
    position: Position,
    loss_scaler: &'a mut LossScaler,
    apply_update: &'a mut bool,
) -> OperationContext<'a> {
    OperationContext {
        plan,
        graph: &job.graph,
        optimizer: &job.spec.training.optimizer,
        seed: job.spec.training.seed,
        step: position.step,
        micro_batch: position.micro_batch,
        samples: position.samples,
        loss_gradient_scale: position.loss_gradient_scale,
        optimizer_update_number: position.optimizer_update_number,
        loss_scaler,
        apply_update,
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
