//! The attempt process: `carve-worker attempt ...`, one per attempt, so a crash or a
//! runaway allocation stays inside it. It trains with the engine (the code `carve run`
//! uses) inside its slice and reports on stdout in [`ChildLine`]s. With
//! `CARVE_ATTEMPT_CUDA_DEVICE=N` in its environment it trains on GPU N with the cuda
//! backend (reserving and verifying the slice first); without it, on the cpu backend.
//!
//! Exit codes: 0 trained, 3 out of memory in the slice, 4 the worker is gone, 1 anything
//! else (the reason on stderr, which the worker forwards as the failure message).
//!
//! The process never outlives its worker: the worker arms the parent-death signal when
//! it starts it, and the process itself stops (exit code 4) as soon as a protocol line
//! cannot be written, its stdout pipe has no reader left, or its parent changes. An
//! orphan would otherwise train on unsupervised, holding its slice.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use carve_engine::EngineError;
use carve_engine::checkpoint::read_checkpoint;
use carve_engine::cuda::CudaTraining;
use carve_engine::data::open_data_sets;
use carve_engine::trainer::{Progress, TrainingOptions, train};
use carve_proto::v1;

use crate::attempt_lease::hold_the_lease;
use crate::checkpoint_files::promote;
use crate::child_protocol::{
    CheckpointLine, ChildLine, ConfigArgument, OUT_OF_MEMORY_EXIT_CODE,
    STOPPED_ON_SIGTERM_EXIT_CODE, WORKER_GONE_EXIT_CODE,
};
use crate::error::WorkerError;

/// What the worker hands an attempt process: the `attempt` subcommand's flags, the same
/// for `carve-worker attempt` and `carve attempt`.
#[derive(Debug, Clone, clap::Args)]
pub struct AttemptArguments {
    /// The job spec JSON, as submitted.
    #[arg(long)]
    pub spec_file: PathBuf,
    /// The attempt's configuration (a `ConfigArgument`) as JSON.
    #[arg(long)]
    pub config_json: String,
    /// The slice's size in bytes.
    #[arg(long)]
    pub slice_bytes: u64,
    /// Where to write checkpoints.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The checkpoint to resume from, if any.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Milliseconds left of the attempt's lease, renewed by `lease-ms N` lines on stdin
    /// (see `attempt_lease`); without it the process holds no lease.
    #[arg(long)]
    pub worker_lease_ms: Option<u64>,
    /// Milliseconds after the lease's end at which the process exits without finishing
    /// its step.
    #[arg(long, default_value_t = 0)]
    pub worker_lease_grace_ms: u64,
}

/// The `attempt` subcommand of `program`: runs the attempt and turns its outcome into
/// the process's exit code (the reason for a failure goes to stderr, which the worker
/// forwards; stdout is the report channel, so nothing else is printed there).
pub fn attempt_command(arguments: &AttemptArguments, program: &str) -> std::process::ExitCode {
    match run_attempt(arguments) {
        Ok(code) => std::process::ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(error) => {
            eprintln!("{program} attempt: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn emit(line: &ChildLine) {
    // One object a line, flushed at once: the worker reads progress as it comes.
    let Ok(text) = serde_json::to_string(line) else {
        return;
    };
    let mut stdout = std::io::stdout().lock();
    let written = writeln!(stdout, "{text}").and_then(|()| stdout.flush());
    if let Err(error) = written {
        stop_because_the_worker_is_gone(&format!("cannot write to stdout ({error})"));
    }
}

/// Exits with [`WORKER_GONE_EXIT_CODE`]: nobody reads this attempt's reports any more,
/// and its scheduler has (or will have) handed the job to another attempt.
fn stop_because_the_worker_is_gone(why: &str) -> ! {
    // stderr may be as broken as stdout; eprintln! would panic.
    let _ = writeln!(
        std::io::stderr(),
        "carve-worker attempt: the worker is gone: {why}; stopping"
    );
    std::process::exit(WORKER_GONE_EXIT_CODE)
}

/// How often the watch over the worker looks.
const WORKER_WATCH_INTERVAL: Duration = Duration::from_millis(200);

/// Starts a thread that stops the process once its parent changes (the worker died and
/// the process was reparented) or its stdout pipe has no reader: between two protocol
/// lines (minutes apart for a long step) nothing else would notice.
fn watch_the_worker() {
    let worker = std::os::unix::process::parent_id();
    let started = std::thread::Builder::new()
        .name("worker-watch".into())
        .spawn(move || {
            loop {
                if let Some(why) = worker_gone(worker) {
                    stop_because_the_worker_is_gone(&why);
                }
                std::thread::sleep(WORKER_WATCH_INTERVAL);
            }
        });
    if let Err(error) = started {
        let _ = writeln!(
            std::io::stderr(),
            "carve-worker attempt: cannot watch the worker: {error}"
        );
    }
}

/// Why the worker is gone, if it is: `worker` is the parent this process started with.
fn worker_gone(worker: u32) -> Option<String> {
    let parent = std::os::unix::process::parent_id();
    if parent != worker {
        return Some(format!(
            "the parent process changed from {worker} to {parent}"
        ));
    }
    stdout_has_no_reader().then(|| "its stdout pipe has no reader".to_string())
}

/// Whether stdout is a pipe whose read end is closed: poll reports POLLERR on such a
/// write end without anything being written. A terminal or a file never does.
fn stdout_has_no_reader() -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let stdout = std::io::stdout();
    let mut descriptors = [PollFd::new(&stdout, PollFlags::OUT)];
    let no_wait = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut descriptors, Some(&no_wait)) {
        Ok(_) => descriptors[0]
            .revents()
            .intersects(PollFlags::ERR | PollFlags::HUP),
        Err(_) => false,
    }
}

/// Runs one attempt and returns the process exit code.
pub fn run_attempt(arguments: &AttemptArguments) -> Result<i32, WorkerError> {
    watch_the_worker();
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
    // A checkpoint to resume from is only used when it is really there: the file an
    // earlier attempt reported may be gone (on another node's own disk, or removed).
    let resume = arguments.resume.clone().filter(|path| path.is_file());
    let resumed_step = match &resume {
        Some(path) => Some(read_checkpoint(path).map_err(engine_error)?.step),
        None => None,
    };
    let stop_requested = stop_on_sigterm()?;
    if let Some(left) = arguments.worker_lease_ms {
        // The same stop as SIGTERM's, raised by the lease's end.
        hold_the_lease(
            Duration::from_millis(left),
            Duration::from_millis(arguments.worker_lease_grace_ms),
            stop_requested.clone(),
        );
    }
    let options = TrainingOptions {
        config,
        slice_bytes: arguments.slice_bytes,
        checkpoint_path: Some(arguments.checkpoint.clone()),
        resume_from: resume.clone(),
        stop_after_steps: None,
        stop_requested: Some(stop_requested),
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
        // What was really loaded: the scheduler stores it as where this attempt resumed.
        resumed_from: resume
            .as_ref()
            .zip(resumed_step)
            .map(|(path, step)| CheckpointLine {
                step,
                location: path.display().to_string(),
            }),
    });
    let checkpoint_every = job.spec.training.checkpoint_every_steps;
    let working_checkpoint = arguments.checkpoint.clone();
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
    // Runs on the training thread, between steps: the working file holds `step` (the
    // next checkpoint is written after the next step's callback).
    let pending_checkpoint_becomes_written =
        |pending: &mut Option<u64>, last: &mut Option<CheckpointLine>| {
            if let Some(step) = pending.take()
                && let Some(location) = promoted_location(&working_checkpoint, step)
            {
                emit(&ChildLine::Checkpoint {
                    step,
                    location: location.clone(),
                });
                *last = Some(CheckpointLine { step, location });
            }
        };
    let mut progress_reports = ProgressCadence::new(options.config.batch_size);
    let result = {
        let mut on_progress = |progress: &Progress| {
            pending_checkpoint_becomes_written(&mut checkpoint_pending, &mut last_checkpoint);
            if let Some(samples_per_second) = progress_reports.report_now(progress, Instant::now())
            {
                emit(&ChildLine::Progress {
                    step: progress.step,
                    total_steps: progress.total_steps,
                    loss: progress.loss,
                    samples_per_second,
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
    let stopped = options
        .stop_requested
        .as_ref()
        .is_some_and(|stop| stop.load(std::sync::atomic::Ordering::Acquire));
    match result {
        Ok(report) if stopped && report.steps < report.total_steps => {
            // Told to stop (preempted, cancelled): the checkpoint of the step reached is
            // on disk; the worker reports the stop it asked for, with no Finished line.
            if let Some(path) = &report.checkpoint_path
                && let Some(location) = promoted_location(path, report.steps)
            {
                emit(&ChildLine::Checkpoint {
                    step: report.steps,
                    location,
                });
            }
            Ok(STOPPED_ON_SIGTERM_EXIT_CODE)
        }
        Ok(report) => {
            // The final checkpoint replaces any pending one.
            if let Some(path) = &report.checkpoint_path
                && let Some(location) = promoted_location(path, report.steps)
            {
                emit(&ChildLine::Checkpoint {
                    step: report.steps,
                    location,
                });
            }
            emit(&ChildLine::Finished {
                final_loss: report.final_loss,
                test_accuracy: report.test_accuracy,
                peak_bytes: report.peak_bytes,
                steps: report.steps,
                samples_per_second: report.samples_per_second,
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

/// The location to report for the checkpoint of `step` in the working file `working`:
/// its promoted name, which nothing writes again ([`crate::checkpoint_files`]). A
/// checkpoint that cannot be promoted is not reported (said on stderr): the job then
/// resumes from the last one that was, rather than from a file this attempt may change.
fn promoted_location(working: &Path, step: u64) -> Option<String> {
    match promote(working, step) {
        Ok(promoted) => Some(promoted.display().to_string()),
        Err(error) => {
            eprintln!(
                "the checkpoint of step {step} in {} could not be given its own name ({error}): \
                 not reported",
                working.display()
            );
            None
        }
    }
}

/// A flag SIGTERM sets: a thread waits for the signal (which then no longer ends the
/// process at once), so training stops after its current step and checkpoints within
/// the worker's grace period; the worker's SIGKILL after the grace stays the backstop.
fn stop_on_sigterm() -> Result<std::sync::Arc<std::sync::atomic::AtomicBool>, WorkerError> {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|error| WorkerError::Attempt(format!("cannot watch for SIGTERM: {error}")))?;
    // Registered here, before training starts, so a SIGTERM from now on is caught.
    let mut terminate = runtime
        .block_on(async {
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        })
        .map_err(|error| WorkerError::Attempt(format!("cannot watch for SIGTERM: {error}")))?;
    let flag = stop.clone();
    std::thread::spawn(move || {
        runtime.block_on(terminate.recv());
        flag.store(true, std::sync::atomic::Ordering::Release);
    });
    Ok(stop)
}

/// How often a running attempt reports progress, besides its first step and its last:
/// often enough that `carve watch` moves and shows a useful ETA on a long run (a report
/// every tenth of the run left a 500-step job at "1/500" for minutes), rarely enough that
/// a scheduler with thousands of attempts is not flooded (each report is a message, a
/// watcher event and a job log line).
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

/// Which steps an attempt reports, on a time basis: the first, then one at least every
/// [`PROGRESS_INTERVAL`], and the last. The throughput it reports is the mean since the
/// previous report, so a short slow step does not stand for the whole interval.
#[derive(Debug)]
pub struct ProgressCadence {
    batch_size: u64,
    /// The step and time of the previous report; `None` before the first.
    previous: Option<(u64, Instant)>,
}

impl ProgressCadence {
    pub fn new(batch_size: u64) -> ProgressCadence {
        ProgressCadence {
            batch_size,
            previous: None,
        }
    }

    /// The samples per second to report for `progress` at `now`, or `None` when this step
    /// is not reported.
    pub fn report_now(&mut self, progress: &Progress, now: Instant) -> Option<f64> {
        let last = progress.step >= progress.total_steps;
        let samples_per_second = match self.previous {
            None => progress.samples_per_second,
            Some((step, at)) => {
                let elapsed = now.saturating_duration_since(at);
                if elapsed < PROGRESS_INTERVAL && !last {
                    return None;
                }
                let samples = progress.step.saturating_sub(step) * self.batch_size;
                samples as f64 / elapsed.as_secs_f64().max(1e-9)
            }
        };
        self.previous = Some((progress.step, now));
        Some(samples_per_second)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64, total_steps: u64) -> Progress {
        Progress {
            step,
            total_steps,
            loss: 0.5,
            samples_per_second: 7.0,
            memory_in_use_bytes: 0,
            memory_peak_bytes: 0,
            skipped: false,
        }
    }

    #[test]
    fn progress_is_reported_at_the_first_step_every_interval_and_the_last() {
        let start = Instant::now();
        let mut cadence = ProgressCadence::new(4);
        // The first step of the attempt (after a resume it is not step 1) reports its own
        // throughput.
        assert_eq!(cadence.report_now(&step(101, 500), start), Some(7.0));
        let second = Duration::from_secs(1);
        for (index, number) in (102..105).enumerate() {
            let at = start + second * (index as u32 + 1);
            assert_eq!(cadence.report_now(&step(number, 500), at), None, "{number}");
        }
        // Five seconds on: the mean throughput over the interval (10 steps of 4 samples).
        let reported = cadence.report_now(&step(111, 500), start + PROGRESS_INTERVAL);
        assert_eq!(reported, Some(40.0 / PROGRESS_INTERVAL.as_secs_f64()));
        // The last step always reports, however soon.
        let soon = start + PROGRESS_INTERVAL + Duration::from_millis(10);
        assert!(cadence.report_now(&step(500, 500), soon).is_some());
    }
}
