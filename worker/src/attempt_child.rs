//! The attempt process: `carve-worker attempt ...`, one per attempt, so a crash or a
//! runaway allocation stays inside it. It trains with the engine (the code `carve run`
//! uses) inside its slice and reports on stdout in [`ChildLine`]s. With
//! `CARVE_ATTEMPT_CUDA_DEVICE=N` in its environment it trains on GPU N with the cuda
//! backend (reserving and verifying the slice first); without it, on the cpu backend.
//!
//! Exit codes: 0 trained, 3 out of memory in the slice, 1 anything else (the reason on
//! stderr, which the worker forwards as the failure message).

use std::io::Write;
use std::path::{Path, PathBuf};

use carve_engine::EngineError;
use carve_engine::checkpoint::read_checkpoint;
use carve_engine::cuda::CudaTraining;
use carve_engine::data::open_data_sets;
use carve_engine::trainer::{Progress, TrainingOptions, train};
use carve_proto::v1;

use crate::child_protocol::{CheckpointLine, ChildLine, ConfigArgument, OUT_OF_MEMORY_EXIT_CODE};
use crate::error::WorkerError;

/// What the worker hands an attempt process.
#[derive(Debug, Clone)]
pub struct AttemptArguments {
    /// The job spec JSON, as submitted.
    pub spec_file: PathBuf,
    /// [`ConfigArgument`] as JSON.
    pub config_json: String,
    pub slice_bytes: u64,
    /// Where to write checkpoints.
    pub checkpoint: PathBuf,
    /// The checkpoint to resume from, if any.
    pub resume: Option<PathBuf>,
}

fn emit(line: &ChildLine) {
    // One object a line, flushed at once: the worker reads progress as it comes.
    let mut stdout = std::io::stdout().lock();
    if let Ok(text) = serde_json::to_string(line) {
        let _ = writeln!(stdout, "{text}");
        let _ = stdout.flush();
    }
}

/// Runs one attempt and returns the process exit code.
pub fn run_attempt(arguments: &AttemptArguments) -> Result<i32, WorkerError> {
    let spec_json = std::fs::read_to_string(&arguments.spec_file).map_err(|error| {
        WorkerError::io(
            format!("cannot read {}", arguments.spec_file.display()),
            error,
        )
    })?;
    let job = carve_proto::convert::validated_job_from_json(&spec_json)
        .map_err(|error| WorkerError::Attempt(format!("the job spec: {error}")))?;
    let config_argument: ConfigArgument = serde_json::from_str(&arguments.config_json)
        .map_err(|error| WorkerError::Attempt(format!("--config-json: {error}")))?;
    let config = carve_proto::convert::run_config_for_job(
        &v1::RunConfig::from(&config_argument),
        &job,
        "config",
    )
    .map_err(|error| WorkerError::Attempt(format!("the run config: {error}")))?;
    // Relative data paths are relative to the worker's working directory.
    let data = open_data_sets(&job, Path::new(".")).map_err(engine_error)?;
    // A checkpoint to resume from is only used when it is really there: the scheduler
    // names the place a checkpoint would be even for a first attempt.
    let resume = arguments.resume.clone().filter(|path| path.is_file());
    let resumed_step = match &resume {
        Some(path) => Some(read_checkpoint(path).map_err(engine_error)?.step),
        None => None,
    };
    let options = TrainingOptions {
        config,
        slice_bytes: arguments.slice_bytes,
        checkpoint_path: Some(arguments.checkpoint.clone()),
        resume_from: resume.clone(),
        stop_after_steps: None,
    };
    // On a GPU the slice is reserved (and verified) before training starts; on the cpu
    // backend the executor's arena is the slice itself.
    let prepared_cuda = cuda_device_from_environment()?
        .map(|ordinal| CudaTraining::prepare(&job, &options, ordinal));
    let reserved_bytes = match &prepared_cuda {
        Some(Ok(prepared)) => {
            eprintln!("{}", prepared.reservation());
            prepared.reservation().reserved_bytes
        }
        _ => arguments.slice_bytes,
    };
    emit(&ChildLine::Started {
        reserved_bytes,
        pid: std::process::id(),
    });
    let checkpoint_every = job.spec.training.checkpoint_every_steps;
    let checkpoint_location = arguments.checkpoint.display().to_string();
    // The trainer writes a checkpoint right after the progress callback of every
    // `checkpoint_every`-th step (except the last); it is on disk once the next step
    // reports, or once training returns.
    let mut last_checkpoint: Option<CheckpointLine> = match (resume, resumed_step) {
        (Some(path), Some(step)) => Some(CheckpointLine {
            step,
            location: path.display().to_string(),
        }),
        _ => None,
    };
    let mut checkpoint_pending: Option<u64> = None;
    let pending_checkpoint_becomes_written =
        |pending: &mut Option<u64>, last: &mut Option<CheckpointLine>| {
            if let Some(step) = pending.take() {
                emit(&ChildLine::Checkpoint {
                    step,
                    location: checkpoint_location.clone(),
                });
                *last = Some(CheckpointLine {
                    step,
                    location: checkpoint_location.clone(),
                });
            }
        };
    let result = {
        let mut on_progress = |progress: &Progress| {
            pending_checkpoint_becomes_written(&mut checkpoint_pending, &mut last_checkpoint);
            let every = (progress.total_steps / 10).max(1);
            if progress.step == 1
                || progress.step.is_multiple_of(every)
                || progress.step == progress.total_steps
            {
                emit(&ChildLine::Progress {
                    step: progress.step,
                    total_steps: progress.total_steps,
                    loss: progress.loss,
                    samples_per_second: progress.samples_per_second,
                    memory_in_use_bytes: progress.memory_in_use_bytes,
                    memory_peak_bytes: progress.memory_peak_bytes,
                });
            }
            if checkpoint_every > 0
                && progress.step.is_multiple_of(checkpoint_every)
                && progress.step < progress.total_steps
            {
                checkpoint_pending = Some(progress.step);
            }
        };
        match prepared_cuda {
            Some(Ok(prepared)) => prepared.train(&job, &data, &options, &mut on_progress),
            Some(Err(error)) => Err(error),
            None => train(&job, &data, &options, &mut on_progress),
        }
    };
    match result {
        Ok(report) => {
            // The final checkpoint replaces any pending one.
            if let Some(path) = &report.checkpoint_path {
                emit(&ChildLine::Checkpoint {
                    step: report.steps,
                    location: path.display().to_string(),
                });
            }
            emit(&ChildLine::Finished {
                final_loss: report.final_loss,
                test_accuracy: report.test_accuracy,
                peak_bytes: report.peak_bytes,
            });
            Ok(0)
        }
        Err(EngineError::OutOfMemory(report)) => {
            pending_checkpoint_becomes_written(&mut checkpoint_pending, &mut last_checkpoint);
            emit(&ChildLine::Oom {
                requested_bytes: report.requested,
                in_use_bytes: report.in_use,
                limit_bytes: report.limit,
                largest_free_bytes: report.largest_free,
                peak_bytes: report.peak,
                checkpoint: last_checkpoint,
            });
            Ok(OUT_OF_MEMORY_EXIT_CODE)
        }
        Err(error) => Err(engine_error(error)),
    }
}

/// The variable that asks an attempt process to train on a GPU: the CUDA device ordinal.
/// Unset, the attempt uses the cpu backend (simulated GPUs).
pub const CUDA_DEVICE_VARIABLE: &str = "CARVE_ATTEMPT_CUDA_DEVICE";

fn cuda_device_from_environment() -> Result<Option<usize>, WorkerError> {
    match std::env::var(CUDA_DEVICE_VARIABLE) {
        Ok(text) if text.trim().is_empty() => Ok(None),
        Ok(text) => text.trim().parse().map(Some).map_err(|_| {
            WorkerError::Attempt(format!(
                "{CUDA_DEVICE_VARIABLE}={text}: not a cuda device ordinal"
            ))
        }),
        Err(_) => Ok(None),
    }
}

fn engine_error(error: EngineError) -> WorkerError {
    WorkerError::Attempt(error.to_string())
}
