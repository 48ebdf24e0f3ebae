//! The worker's side of one attempt: starts the attempt process, turns its stdout lines
//! into worker messages, stops it on cancel (SIGTERM, then SIGKILL after the grace
//! period) and reports how it ended. A process that ends without its final line crashed:
//! that is a failed attempt with its exit status and the last lines of its stderr,
//! never an out-of-memory.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::child_protocol::{ChildLine, OUT_OF_MEMORY_EXIT_CODE};
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
#[derive(Debug, Clone)]
pub enum AttemptControl {
    /// Stop: SIGTERM now, SIGKILL once the grace period is over.
    Cancel {
        grace_period: Duration,
        reason: String,
    },
}

/// Starts the attempt process. Its stdout and stderr are piped; it dies with the
/// worker's handle if the worker drops it (`kill_on_drop`).
pub fn spawn_attempt_process(launch: &AttemptLaunch) -> Result<Child, WorkerError> {
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
        .kill_on_drop(true);
    command.spawn().map_err(|error| {
        WorkerError::AttemptProcess(format!(
            "cannot start {}: {error}",
            launch.program.display()
        ))
    })
}

/// Sends SIGTERM through `kill(1)`: std has no portable way short of `unsafe` libc,
/// which this workspace denies.
async fn terminate(process_id: u32) {
    let result = Command::new("kill")
        .arg("-TERM")
        .arg(process_id.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await;
    if let Err(error) = result {
        tracing::warn!(process_id, %error, "cannot send sigterm");
    }
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
    let mut cancel_reason: Option<String> = None;
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
            command = control.recv(), if cancel_reason.is_none() => {
                let (grace_period, reason) = match command {
                    Some(AttemptControl::Cancel { grace_period, reason }) => (grace_period, reason),
                    // The worker dropped its handle: it is going away.
                    None => (Duration::ZERO, "the worker is shutting down".to_string()),
                };
                tracing::info!(job = %attempt.job_id, process_id, ?grace_period, %reason, "stopping an attempt");
                cancel_reason = Some(reason);
                if grace_period.is_zero() {
                    let _ = child.start_kill();
                    killed = true;
                } else {
                    terminate(process_id).await;
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
                let _ = child.start_kill();
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
        cancel_reason,
        measured_peak_bytes,
        &stderr_tail,
    ) {
        send(body);
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
    cancel_reason: Option<String>,
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
    match (cancel_reason, final_line, exit_code) {
        // A cancelled attempt that still finished training in time did finish.
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
        (Some(reason), _, _) => vec![finished(
            v1::AttemptOutcome::Cancelled,
            None,
            None,
            measured_peak_bytes,
            reason,
        )],
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
            let status = match &exit_status {
                Ok(status) => status.to_string(),
                Err(error) => format!("cannot be waited for: {error}"),
            };
            let mut message = format!("the attempt process ended without a result ({status})");
            if !stderr_tail.is_empty() {
                message.push_str("; last lines of its stderr:\n");
                message.push_str(&stderr_tail.join("\n"));
            }
            vec![finished(
                v1::AttemptOutcome::Failed,
                None,
                None,
                measured_peak_bytes,
                message,
            )]
        }
    }
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
        let crashed = final_reports(
            &attempt(),
            Ok(ExitStatus::from_raw(9)),
            Some(oom.clone()),
            None,
            0,
            &["boom".into()],
        );
        assert_eq!(crashed.len(), 1);
        assert_eq!(outcome(&crashed[0]), v1::AttemptOutcome::Failed);
        let Body::AttemptFinished(finished) = &crashed[0] else {
            unreachable!()
        };
        assert!(
            finished.message.contains("signal: 9"),
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

    #[test]
    fn a_cancelled_attempt_is_cancelled_with_its_reason() {
        let reports = final_reports(
            &attempt(),
            Ok(ExitStatus::from_raw(15)),
            None,
            Some("cancelled by alice".into()),
            42,
            &[],
        );
        let Body::AttemptFinished(finished) = &reports[0] else {
            unreachable!()
        };
        assert_eq!(outcome(&reports[0]), v1::AttemptOutcome::Cancelled);
        assert_eq!(finished.message, "cancelled by alice");
        assert_eq!(finished.measured_peak_bytes, 42);
    }
}
