//! The worker's side of one attempt: starts the attempt process (leading its own process
//! group, armed to die with the worker), turns its stdout lines into worker messages,
//! stops it on cancel (SIGTERM to its group, then SIGKILL after the grace period) or when
//! the watchdog stops it for breaking its slice (the same, but it ends FAILED) and
//! reports how it ended. A process that ends without its final line is never an
//! out-of-memory: killed by a signal the worker did not send, or gone without a status,
//! it was INTERRUPTED (an infrastructure failure the scheduler retries from the
//! checkpoint); an exit code or a fault signal of its own makes it FAILED. Both quote the
//! last lines of its stderr.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use rustix::process::Signal;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::child_protocol::{ChildLine, OUT_OF_MEMORY_EXIT_CODE, WORKER_GONE_EXIT_CODE};
use crate::error::WorkerError;

/// How many stderr lines a failure message quotes.
const STDERR_LINES_KEPT: usize = 20;

/// Everything needed to start one attempt process.
#[derive(Debug, Clone)]
pub struct AttemptLaunch {
    /// The program to run: normally this very binary (`carve-worker`).
    pub program: PathBuf,
    pub attempt: v1::AttemptRef,
    pub spec_file: PathBuf,
    pub config_json: String,
    pub slice_bytes: u64,
    pub checkpoint: PathBuf,
    pub resume: Option<PathBuf>,
    /// The NVML uuid of the real GPU the slice is on; `None` on a simulated GPU.
    pub cuda_gpu_uuid: Option<String>,
}

/// What the worker can tell a running attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptControl {
    /// Stop: SIGTERM now, SIGKILL once the grace period is over. The attempt ends
    /// CANCELLED with `reason`.
    Cancel {
        grace_period: Duration,
        reason: String,
    },
    /// Stop for breaking the rules of its slice (the watchdog, [`crate::watchdog`]):
    /// stopped as a cancel is, but the attempt ends FAILED with `reason`, since running
    /// it again would break them again.
    StopAsFailed {
        grace_period: Duration,
        reason: String,
    },
}

/// Why the worker stopped an attempt, which decides how it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerStop {
    /// Cancelled by the scheduler or by the worker shutting down: CANCELLED.
    Cancelled(String),
    /// Stopped by the watchdog: FAILED, with the watchdog's message.
    Failed(String),
}

impl WorkerStop {
    /// How the stopped attempt ends, and the message it ends with.
    pub fn outcome_and_reason(self) -> (v1::AttemptOutcome, String) {
        match self {
            WorkerStop::Cancelled(reason) => (v1::AttemptOutcome::Cancelled, reason),
            WorkerStop::Failed(reason) => (v1::AttemptOutcome::Failed, reason),
        }
    }
}

/// Starts the attempt process. Its stdout and stderr are piped; it dies with the
/// worker's handle if the worker drops it (`kill_on_drop`), and with the worker process
/// itself (the parent-death signal). It leads its own process group, so a cancel reaches
/// whatever it starts too.
pub async fn spawn_attempt_process(launch: &AttemptLaunch) -> Result<Child, WorkerError> {
    let mut command = Command::new(&launch.program);
    command
        .arg("attempt")
        .arg("--spec-file")
        .arg(&launch.spec_file)
        .arg("--config-json")
        .arg(&launch.config_json)
        .arg("--slice-bytes")
        .arg(launch.slice_bytes.to_string())
        .arg("--checkpoint")
        .arg(&launch.checkpoint);
    if let Some(resume) = &launch.resume {
        command.arg("--resume").arg(resume);
    }
    if let Some(uuid) = &launch.cuda_gpu_uuid {
        // NVML's index and CUDA's device ordinal can differ (CUDA orders by speed unless
        // told otherwise); the uuid names the same GPU for both, and the process then
        // sees it as its only device, ordinal 0.
        command
            .env("CUDA_VISIBLE_DEVICES", uuid)
            .env(crate::attempt_child::CUDA_DEVICE_VARIABLE, "0");
    }
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .process_group(0);
    die_with_this_process(&mut command);
    spawn_from_long_lived_thread(command)
        .await
        .map_err(|error| {
            WorkerError::AttemptProcess(format!(
                "cannot start {}: {error}",
                launch.program.display()
            ))
        })
}

/// Asks the kernel to SIGKILL the child when the worker dies, whatever kills the worker
/// (kill -9 included): an attempt that outlives its worker trains on unsupervised, keeps
/// its slice's memory and writes checkpoints next to its replacement.
#[allow(unsafe_code)]
fn die_with_this_process(command: &mut Command) {
    let worker = rustix::process::getpid();
    // SAFETY: the hook runs in the forked child before exec, where only
    // async-signal-safe calls are allowed: it makes two raw system calls (prctl,
    // getppid) through rustix, and allocates nothing (the error is a plain errno).
    unsafe {
        command.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
            // The worker may have died between fork and prctl, before the signal was
            // armed: then the child has been reparented already and must not run.
            if rustix::process::getppid() != Some(worker) {
                return Err(rustix::io::Errno::SRCH.into());
            }
            Ok(())
        });
    }
}

/// A spawn request for [`spawn_from_long_lived_thread`].
struct SpawnRequest {
    command: Command,
    runtime: tokio::runtime::Handle,
    reply: oneshot::Sender<std::io::Result<Child>>,
}

/// Spawns `command` from one thread that lives as long as the process. The parent-death
/// signal fires when the *thread* that forked the child exits, not the process: a child
/// forked from a runtime thread that tokio retires (blocking-pool threads end after
/// idling) would be killed with it.
async fn spawn_from_long_lived_thread(command: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<std::sync::mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (requests, incoming) = std::sync::mpsc::channel::<SpawnRequest>();
        let started = std::thread::Builder::new()
            .name("attempt-spawner".into())
            .spawn(move || {
                for request in incoming {
                    // tokio's Child registers with the runtime's process driver.
                    let _runtime = request.runtime.enter();
                    let mut command = request.command;
                    let _ = request.reply.send(command.spawn());
                }
            });
        if let Err(error) = started {
            tracing::error!(%error, "cannot start the attempt spawner thread");
        }
        Mutex::new(requests)
    });
    let (reply, replied) = oneshot::channel();
    let request = SpawnRequest {
        command,
        runtime: tokio::runtime::Handle::current(),
        reply,
    };
    spawner
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .send(request)
        .map_err(|_| std::io::Error::other("the attempt spawner thread is not running"))?;
    replied
        .await
        .map_err(|_| std::io::Error::other("the attempt spawner thread ended"))?
}

/// Sends `signal` to the attempt's process group (the process and anything it
/// started). Never to a group id of 0 or 1, which would mean this worker's own group
/// or every process it may signal.
pub fn signal_process_group(process_group: u32, signal: Signal) -> std::io::Result<()> {
    let group = i32::try_from(process_group)
        .ok()
        .filter(|group| *group > 1)
        .and_then(rustix::process::Pid::from_raw)
        .ok_or_else(|| {
            std::io::Error::other(format!("{process_group} is not a process group to signal"))
        })?;
    rustix::process::kill_process_group(group, signal).map_err(std::io::Error::from)
}

/// Watches a started attempt process until it exits and sends every report about it
/// to `reports`, the final one (AttemptFinished) last. `before_final_report` runs once
/// the process has exited and before the final reports go out: the caller frees the
/// slice there, so the scheduler never hears "finished" while the slice is still held.
pub async fn watch_attempt_process(
    mut child: Child,
    attempt: v1::AttemptRef,
    reports: mpsc::UnboundedSender<Body>,
    mut control: mpsc::UnboundedReceiver<AttemptControl>,
    before_final_report: impl FnOnce(),
) {
    let process_id = child.id().unwrap_or(0);
    let stderr_tail: Arc<Mutex<VecDeque<String>>> = Arc::default();
    let stderr_reader = child.stderr.take().map(|stderr| {
        let tail = stderr_tail.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let mut tail = tail.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                if tail.len() == STDERR_LINES_KEPT {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        })
    });
    let mut stdout_lines = child
        .stdout
        .take()
        .map(|stdout| BufReader::new(stdout).lines());
    let mut final_line: Option<ChildLine> = None;
    let mut measured_peak_bytes = 0u64;
    let mut worker_stop: Option<WorkerStop> = None;
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;
    let send = |body: Body| {
        // The receiver lives as long as the worker; a send fails only at shutdown.
        let _ = reports.send(body);
    };
    let exit_status: std::io::Result<ExitStatus> = loop {
        tokio::select! {
            line = async {
                match stdout_lines.as_mut() {
                    Some(lines) => lines.next_line().await,
                    None => Ok(None),
                }
            }, if stdout_lines.is_some() => {
                match line {
                    Ok(Some(text)) => {
                        match serde_json::from_str::<ChildLine>(&text) {
                            Ok(line) => {
                                if let ChildLine::Progress { memory_peak_bytes, .. } = &line {
                                    measured_peak_bytes = measured_peak_bytes.max(*memory_peak_bytes);
                                }
                                if let Some(body) = report_for_line(&attempt, &line) {
                                    send(body);
                                } else {
                                    final_line = Some(line);
                                }
                            }
                            // Not ours (a library printing): pass it on as a log line.
                            Err(_) => send(Body::Log(v1::worker_message::LogLine {
                                attempt: Some(attempt.clone()),
                                level: "info".into(),
                                message: text,
                            })),
                        }
                    }
                    Ok(None) | Err(_) => stdout_lines = None,
                }
            }
            status = child.wait(), if stdout_lines.is_none() => break status,
            command = control.recv(), if worker_stop.is_none() => {
                let (grace_period, stop) = match command {
                    Some(AttemptControl::Cancel { grace_period, reason }) => {
                        (grace_period, WorkerStop::Cancelled(reason))
                    }
                    Some(AttemptControl::StopAsFailed { grace_period, reason }) => {
                        (grace_period, WorkerStop::Failed(reason))
                    }
                    // The worker dropped its handle: it is going away.
                    None => (
                        Duration::ZERO,
                        WorkerStop::Cancelled("the worker is shutting down".to_string()),
                    ),
                };
                tracing::info!(job = %attempt.job_id, process_id, ?grace_period, ?stop, "stopping an attempt");
                worker_stop = Some(stop);
                if grace_period.is_zero() {
                    kill_group(&mut child, process_id);
                    killed = true;
                } else {
                    if let Err(error) = signal_process_group(process_id, Signal::TERM) {
                        tracing::warn!(process_id, %error, "cannot send sigterm");
                    }
                    kill_at = Some(Instant::now() + grace_period);
                }
            }
            _ = async {
                match kill_at {
                    Some(deadline) => tokio::time::sleep_until(deadline).await,
                    None => std::future::pending().await,
                }
            }, if kill_at.is_some() && !killed => {
                tracing::info!(job = %attempt.job_id, process_id, "grace period over: killing the attempt");
                kill_group(&mut child, process_id);
                killed = true;
            }
        }
    };
    if let Some(reader) = stderr_reader {
        // The pipe closes when the process is gone; a grandchild holding it must not
        // hold up the report.
        let _ = tokio::time::timeout(Duration::from_secs(2), reader).await;
    }
    let stderr_tail: Vec<String> = stderr_tail
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .iter()
        .cloned()
        .collect();
    before_final_report();
    for body in final_reports(
        &attempt,
        exit_status,
        final_line,
        worker_stop,
        measured_peak_bytes,
        &stderr_tail,
    ) {
        send(body);
    }
}

/// SIGKILL to the attempt's process group, and to the process itself should the group
/// signal fail. Only ever called before the process is reaped, so the group id still
/// names its group.
fn kill_group(child: &mut Child, process_group: u32) {
    if let Err(error) = signal_process_group(process_group, Signal::KILL) {
        tracing::warn!(process_group, %error, "cannot kill the attempt's process group");
        let _ = child.start_kill();
    }
}

/// The message for a line that is not final; `None` for the final lines (finished,
/// oom), which are reported once the process has exited.
fn report_for_line(attempt: &v1::AttemptRef, line: &ChildLine) -> Option<Body> {
    let attempt = Some(attempt.clone());
    match line {
        ChildLine::Started { reserved_bytes, .. } => {
            Some(Body::AttemptStarted(v1::worker_message::AttemptStarted {
                attempt,
                reserved_bytes: *reserved_bytes,
            }))
        }
        ChildLine::Progress {
            step,
            total_steps,
            loss,
            samples_per_second,
            memory_in_use_bytes,
            memory_peak_bytes,
        } => Some(Body::Progress(v1::worker_message::Progress {
            attempt,
            progress: Some(v1::TrainingProgress {
                step: *step,
                total_steps: *total_steps,
                loss: *loss,
                samples_per_second: *samples_per_second,
                memory_in_use_bytes: *memory_in_use_bytes,
                memory_peak_bytes: *memory_peak_bytes,
            }),
        })),
        ChildLine::Checkpoint { step, location } => Some(Body::CheckpointWritten(
            v1::worker_message::CheckpointWritten {
                attempt,
                checkpoint: Some(v1::Checkpoint {
                    step: *step,
                    location: location.clone(),
                }),
            },
        )),
        ChildLine::Finished { .. } | ChildLine::Oom { .. } => None,
    }
}

/// How an attempt ended, as the scheduler hears it.
pub fn final_reports(
    attempt: &v1::AttemptRef,
    exit_status: std::io::Result<ExitStatus>,
    final_line: Option<ChildLine>,
    worker_stop: Option<WorkerStop>,
    measured_peak_bytes: u64,
    stderr_tail: &[String],
) -> Vec<Body> {
    let finished = |outcome: v1::AttemptOutcome,
                    final_loss: Option<f64>,
                    test_accuracy: Option<f64>,
                    peak: u64,
                    message: String| {
        Body::AttemptFinished(v1::worker_message::AttemptFinished {
            attempt: Some(attempt.clone()),
            outcome: outcome as i32,
            final_loss,
            test_accuracy,
            measured_peak_bytes: peak,
            message,
        })
    };
    let exit_code = exit_status.as_ref().ok().and_then(|status| status.code());
    match (worker_stop, final_line, exit_code) {
        // A stopped attempt that still finished training in time did finish.
        (
            _,
            Some(ChildLine::Finished {
                final_loss,
                test_accuracy,
                peak_bytes,
            }),
            Some(0),
        ) => vec![finished(
            v1::AttemptOutcome::Succeeded,
            final_loss.is_finite().then_some(final_loss),
            test_accuracy,
            peak_bytes.max(measured_peak_bytes),
            String::new(),
        )],
        (Some(stop), _, _) => {
            let (outcome, reason) = stop.outcome_and_reason();
            vec![finished(outcome, None, None, measured_peak_bytes, reason)]
        }
        (
            None,
            Some(ChildLine::Oom {
                requested_bytes,
                in_use_bytes,
                limit_bytes,
                largest_free_bytes,
                peak_bytes,
                checkpoint,
            }),
            Some(OUT_OF_MEMORY_EXIT_CODE),
        ) => vec![
            Body::Oom(v1::worker_message::OomReport {
                attempt: Some(attempt.clone()),
                report: Some(v1::OutOfMemoryReport {
                    requested_bytes,
                    in_use_bytes,
                    limit_bytes,
                    largest_free_bytes,
                    peak_bytes,
                }),
                checkpoint: checkpoint.map(|checkpoint| v1::Checkpoint {
                    step: checkpoint.step,
                    location: checkpoint.location,
                }),
            }),
            // The protocol's closing message; the scheduler already settled the attempt
            // on the report and only acknowledges it.
            finished(
                v1::AttemptOutcome::OutOfMemory,
                None,
                None,
                peak_bytes.max(measured_peak_bytes),
                String::new(),
            ),
        ],
        (None, _, _) => {
            let (outcome, mut message) = classify_unreported_end(&exit_status);
            if !stderr_tail.is_empty() {
                message.push_str("; last lines of its stderr:\n");
                message.push_str(&stderr_tail.join("\n"));
            }
            vec![finished(outcome, None, None, measured_peak_bytes, message)]
        }
    }
}

/// Why an attempt process the worker did not stop ended without its final line, and
/// whose fault that was. Killed by a signal from outside (the kernel's OOM killer, an
/// operator, a node agent) or gone without an exit status is INTERRUPTED: the program
/// did nothing wrong, and the scheduler retries it from its checkpoint. A fault signal
/// the program raised on itself (a segfault, an abort, an illegal instruction) and any
/// exit code are the program's own FAILED: retrying would repeat them.
fn classify_unreported_end(
    exit_status: &std::io::Result<ExitStatus>,
) -> (v1::AttemptOutcome, String) {
    use std::os::unix::process::ExitStatusExt;
    let status = match exit_status {
        Ok(status) => status,
        Err(error) => {
            return (
                v1::AttemptOutcome::Interrupted,
                format!("the attempt process vanished: it cannot be waited for ({error})"),
            );
        }
    };
    if let Some(signal) = status.signal() {
        let name = signal_name(signal);
        return if is_fault_signal(signal) {
            (
                v1::AttemptOutcome::Failed,
                format!(
                    "the attempt process ended without a result: it crashed with signal \
                     {signal} ({name})"
                ),
            )
        } else {
            (
                v1::AttemptOutcome::Interrupted,
                format!(
                    "the attempt process was killed by signal {signal} ({name}), which the \
                     worker did not send"
                ),
            )
        };
    }
    if status.code() == Some(WORKER_GONE_EXIT_CODE) {
        return (
            v1::AttemptOutcome::Interrupted,
            format!(
                "the attempt process lost its worker (its stdout closed or its parent \
                 changed) and stopped ({status})"
            ),
        );
    }
    (
        v1::AttemptOutcome::Failed,
        format!("the attempt process ended without a result ({status})"),
    )
}

/// Signals the kernel raises on a process for its own fault.
fn is_fault_signal(signal: i32) -> bool {
    [
        Signal::SEGV,
        Signal::BUS,
        Signal::ILL,
        Signal::FPE,
        Signal::ABORT,
        Signal::SYS,
        Signal::TRAP,
    ]
    .iter()
    .any(|fault| fault.as_raw() == signal)
}

/// The usual name of a signal number, for failure messages.
fn signal_name(signal: i32) -> &'static str {
    const NAMES: [(Signal, &str); 17] = [
        (Signal::HUP, "SIGHUP"),
        (Signal::INT, "SIGINT"),
        (Signal::QUIT, "SIGQUIT"),
        (Signal::ILL, "SIGILL"),
        (Signal::TRAP, "SIGTRAP"),
        (Signal::ABORT, "SIGABRT"),
        (Signal::BUS, "SIGBUS"),
        (Signal::FPE, "SIGFPE"),
        (Signal::KILL, "SIGKILL"),
        (Signal::USR1, "SIGUSR1"),
        (Signal::SEGV, "SIGSEGV"),
        (Signal::USR2, "SIGUSR2"),
        (Signal::PIPE, "SIGPIPE"),
        (Signal::ALARM, "SIGALRM"),
        (Signal::TERM, "SIGTERM"),
        (Signal::XCPU, "SIGXCPU"),
        (Signal::SYS, "SIGSYS"),
    ];
    NAMES
        .iter()
        .find(|(known, _)| known.as_raw() == signal)
        .map_or("an unnamed signal", |(_, name)| name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn attempt() -> v1::AttemptRef {
        v1::AttemptRef {
            job_id: "job-1".into(),
            attempt_number: 1,
            lease_epoch: 1,
        }
    }

    fn outcome(body: &Body) -> v1::AttemptOutcome {
        match body {
            Body::AttemptFinished(finished) => {
                v1::AttemptOutcome::try_from(finished.outcome).unwrap()
            }
            other => panic!("not a finish: {other:?}"),
        }
    }

    #[test]
    fn an_oom_line_without_its_exit_code_is_a_crash_not_an_oom() {
        let oom = ChildLine::Oom {
            requested_bytes: 10,
            in_use_bytes: 5,
            limit_bytes: 12,
            largest_free_bytes: 7,
            peak_bytes: 5,
            checkpoint: None,
        };
        let killed = final_reports(
            &attempt(),
            Ok(ExitStatus::from_raw(9)),
            Some(oom.clone()),
            None,
            0,
            &["boom".into()],
        );
        assert_eq!(killed.len(), 1);
        assert_eq!(outcome(&killed[0]), v1::AttemptOutcome::Interrupted);
        let Body::AttemptFinished(finished) = &killed[0] else {
            unreachable!()
        };
        assert!(
            finished
                .message
                .contains("killed by signal 9 (SIGKILL), which the worker did not send"),
            "{}",
            finished.message
        );
        assert!(finished.message.contains("boom"), "{}", finished.message);

        let out_of_memory = final_reports(
            &attempt(),
            Ok(ExitStatus::from_raw(OUT_OF_MEMORY_EXIT_CODE << 8)),
            Some(oom),
            None,
            0,
            &[],
        );
        assert!(matches!(out_of_memory[0], Body::Oom(_)));
        assert_eq!(outcome(&out_of_memory[1]), v1::AttemptOutcome::OutOfMemory);
    }

    fn finish_message(body: &Body) -> &str {
        match body {
            Body::AttemptFinished(finished) => &finished.message,
            other => panic!("not a finish: {other:?}"),
        }
    }

    /// The one report for a process that ended with `status` and no final line.
    fn unreported_end(status: std::io::Result<ExitStatus>) -> (v1::AttemptOutcome, String) {
        let reports = final_reports(&attempt(), status, None, None, 7, &["last words".into()]);
        assert_eq!(reports.len(), 1);
        let message = finish_message(&reports[0]).to_string();
        assert!(
            message.ends_with("last lines of its stderr:\nlast words"),
            "{message}"
        );
        (outcome(&reports[0]), message)
    }

    #[test]
    fn a_signal_from_outside_interrupts_and_the_program_s_own_end_fails() {
        for (signal, name) in [
            (9, "SIGKILL"),
            (15, "SIGTERM"),
            (1, "SIGHUP"),
            (13, "SIGPIPE"),
        ] {
            let (outcome, message) = unreported_end(Ok(ExitStatus::from_raw(signal)));
            assert_eq!(outcome, v1::AttemptOutcome::Interrupted, "{message}");
            assert!(
                message.contains(&format!("killed by signal {signal} ({name})")),
                "{message}"
            );
        }
        // Faults the program raised on itself would repeat on every retry.
        for (signal, name) in [
            (11, "SIGSEGV"),
            (6, "SIGABRT"),
            (4, "SIGILL"),
            (7, "SIGBUS"),
        ] {
            let (outcome, message) = unreported_end(Ok(ExitStatus::from_raw(signal)));
            assert_eq!(outcome, v1::AttemptOutcome::Failed, "{message}");
            assert!(
                message.contains(&format!("crashed with signal {signal} ({name})")),
                "{message}"
            );
        }
        // An exit code is the program's own word: failed, even 0 without its result.
        for code in [1, 0, 101] {
            let (outcome, message) = unreported_end(Ok(ExitStatus::from_raw(code << 8)));
            assert_eq!(outcome, v1::AttemptOutcome::Failed, "{message}");
            assert!(message.contains("ended without a result"), "{message}");
        }
        let (outcome, message) =
            unreported_end(Ok(ExitStatus::from_raw(WORKER_GONE_EXIT_CODE << 8)));
        assert_eq!(outcome, v1::AttemptOutcome::Interrupted, "{message}");
        assert!(message.contains("lost its worker"), "{message}");
        // Reaped by someone else: the process vanished.
        let (outcome, message) = unreported_end(Err(std::io::Error::from_raw_os_error(10)));
        assert_eq!(outcome, v1::AttemptOutcome::Interrupted, "{message}");
        assert!(message.contains("vanished"), "{message}");
    }

    #[test]
    fn a_signal_the_worker_sent_is_a_cancel_not_an_interruption() {
        let reports = final_reports(
            &attempt(),
            Ok(ExitStatus::from_raw(9)),
            None,
            Some(WorkerStop::Cancelled("the worker is shutting down".into())),
            0,
            &[],
        );
        assert_eq!(outcome(&reports[0]), v1::AttemptOutcome::Cancelled);
    }

    #[test]
    fn group_ids_that_would_reach_other_processes_are_never_signalled() {
        for group in [0, 1, u32::MAX] {
            assert!(
                signal_process_group(group, Signal::KILL).is_err(),
                "{group}"
            );
        }
    }

    #[test]
    fn a_stopped_attempt_is_cancelled_or_failed_with_its_reason() {
        for (stop, expected) in [
            (
                WorkerStop::Cancelled("cancelled by alice".into()),
                v1::AttemptOutcome::Cancelled,
            ),
            // The watchdog's stop: the stderr tail is not the story, the reason is.
            (
                WorkerStop::Failed("over its slice".into()),
                v1::AttemptOutcome::Failed,
            ),
        ] {
            let (_, reason) = stop.clone().outcome_and_reason();
            let reports = final_reports(
                &attempt(),
                Ok(ExitStatus::from_raw(15)),
                None,
                Some(stop),
                42,
                &["ignored".into()],
            );
            let Body::AttemptFinished(finished) = &reports[0] else {
                unreachable!()
            };
            assert_eq!(reports.len(), 1);
            assert_eq!(outcome(&reports[0]), expected);
            assert_eq!(finished.message, reason);
            assert_eq!(finished.measured_peak_bytes, 42);
        }
    }
}
