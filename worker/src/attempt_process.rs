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

use crate::child_protocol::{ChildLine, STOPPED_ON_SIGTERM_EXIT_CODE};
use crate::error::WorkerError;
use crate::sandbox::{
    Container, ContainerRequest, Sandbox, UNCONTAINED_WARNING, container_exit_status,
};

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
    /// The attempt's own lease (`crate::attempt_lease`): the time left until its
    /// worker's stop deadline, and the grace after it; `None`: it holds none.
    pub worker_lease: Option<(Duration, Duration)>,
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
    /// Stop because no scheduler leader heard the worker for half its lease
    /// ([`crate::leader_lease`]): stopped as a preemption is (SIGTERM, a checkpoint), and
    /// the attempt ends INTERRUPTED, which the scheduler retries from its checkpoint.
    StopWithoutLeader {
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
    /// Stopped for want of a leader: INTERRUPTED, retried from its checkpoint.
    Interrupted(String),
}

impl WorkerStop {
    /// How the stopped attempt ends, and the message it ends with.
    pub fn outcome_and_reason(self) -> (v1::AttemptOutcome, String) {
        match self {
            WorkerStop::Cancelled(reason) => (v1::AttemptOutcome::Cancelled, reason),
            WorkerStop::Failed(reason) => (v1::AttemptOutcome::Failed, reason),
            WorkerStop::Interrupted(reason) => (v1::AttemptOutcome::Interrupted, reason),
        }
    }
}

/// Variables of the worker's own environment an engine attempt process gets: where the
/// CUDA libraries are, the engine's tuning switches, and Rust's diagnostics. The engine
/// is Carve's own code, so these are the operator's, never a tenant's; nothing else of
/// the worker's environment reaches it.
const ENGINE_ENVIRONMENT_PREFIXES: [&str; 5] = [
    "PATH",
    "LD_LIBRARY_PATH",
    "CARVE_CUDA_",
    "RUST_BACKTRACE",
    "RUST_LOG",
];

impl AttemptLaunch {
    /// The attempt process's command line: `PROGRAM attempt --spec-file ...`.
    pub fn argv(&self) -> Vec<String> {
        let path = |path: &PathBuf| path.to_string_lossy().into_owned();
        let mut argv = vec![
            path(&self.program),
            "attempt".into(),
            "--spec-file".into(),
            path(&self.spec_file),
            "--config-json".into(),
            self.config_json.clone(),
            "--slice-bytes".into(),
            self.slice_bytes.to_string(),
            "--checkpoint".into(),
            path(&self.checkpoint),
        ];
        if let Some(resume) = &self.resume {
            argv.extend(["--resume".into(), path(resume)]);
        }
        if let Some((left, grace)) = self.worker_lease {
            argv.extend([
                "--worker-lease-ms".into(),
                left.as_millis().to_string(),
                "--worker-lease-grace-ms".into(),
                grace.as_millis().to_string(),
            ]);
        }
        argv
    }

    /// The attempt process's whole environment: [`ENGINE_ENVIRONMENT_PREFIXES`] of the
    /// worker's, and its GPU.
    pub fn environment(&self) -> Vec<(String, String)> {
        let mut environment: Vec<(String, String)> = std::env::vars()
            .filter(|(name, _)| {
                ENGINE_ENVIRONMENT_PREFIXES.iter().any(|prefix| {
                    name == prefix || (prefix.ends_with('_') && name.starts_with(prefix))
                })
            })
            .collect();
        if let Some(uuid) = &self.cuda_gpu_uuid {
            // NVML's index and CUDA's device ordinal can differ (CUDA orders by speed
            // unless told otherwise); the uuid names the same GPU for both, and the
            // process then sees it as its only device, ordinal 0.
            environment.push(("CUDA_VISIBLE_DEVICES".into(), uuid.clone()));
            environment.push((
                crate::attempt_child::CUDA_DEVICE_VARIABLE.into(),
                "0".into(),
            ));
        }
        environment
    }
}

/// Starts the engine's attempt process (`PROGRAM attempt ...`), supervised as
/// [`spawn_supervised`] says: in the container `container` describes when there is one,
/// else directly with the worker's rights.
pub async fn spawn_attempt_process(
    launch: &AttemptLaunch,
    container: Option<(&Sandbox, ContainerRequest)>,
) -> Result<(Child, Option<Container>), WorkerError> {
    let argv = launch.argv();
    let environment = launch.environment();
    let (command, container) = match container {
        Some((sandbox, request)) => {
            let (command, container) = sandbox.prepare(&ContainerRequest {
                argv,
                environment,
                ..request
            })?;
            (command, Some(container))
        }
        None => {
            let mut command = Command::new(&argv[0]);
            command.args(&argv[1..]).env_clear().envs(environment);
            (command, None)
        }
    };
    // Its stdin carries the renewals of its lease, when it holds one.
    let stdin = if launch.worker_lease.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    };
    match spawn_supervised_with_stdin(command, stdin).await {
        Ok(child) => Ok((child, container)),
        Err(error) => {
            if let Some(container) = &container {
                container.remove();
            }
            Err(WorkerError::AttemptProcess(format!(
                "cannot start {}: {error}",
                launch.program.display()
            )))
        }
    }
}

/// Starts `command` as an attempt's process, engine or command job alike: stdin closed,
/// stdout and stderr piped, killed with the worker's handle if the worker drops it
/// (`kill_on_drop`) and with the worker process itself (the parent-death signal), and
/// leading its own process group, so a stop reaches whatever it starts too.
pub async fn spawn_supervised(command: Command) -> std::io::Result<Child> {
    spawn_supervised_with_stdin(command, Stdio::null()).await
}

/// [`spawn_supervised`] with `stdin` as the process's stdin.
pub(crate) async fn spawn_supervised_with_stdin(
    mut command: Command,
    stdin: Stdio,
) -> std::io::Result<Child> {
    command
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .process_group(0);
    die_with_this_process(&mut command);
    spawn_from_long_lived_thread(command).await
}

/// Asks the kernel to SIGKILL the child when the worker dies, whatever kills the worker
/// (kill -9 included): an attempt that outlives its worker trains on unsupervised, keeps
/// its slice's memory and writes checkpoints next to its replacement.
#[allow(unsafe_code)]
pub(crate) fn die_with_this_process(command: &mut Command) {
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
    container: Option<Container>,
    attempt: v1::AttemptRef,
    reports: mpsc::UnboundedSender<Body>,
    mut control: mpsc::UnboundedReceiver<AttemptControl>,
    before_final_report: impl FnOnce(),
) {
    let process_id = child.id().unwrap_or(0);
    let stderr_tail: Arc<Mutex<VecDeque<String>>> = Arc::default();
    let stderr_reader = child.stderr.take().map(|stderr| {
        let tail = stderr_tail.clone();
        let reports = reports.clone();
        let attempt = attempt.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                // The program's own output belongs in the job's logs; the worker's
                // channel outlives this task, so a failed send means shutdown.
                let _ = reports.send(output_log_line(&attempt, line.clone()));
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
    let mut steps_reported: Option<u64> = None;
    // The time left from the pace of the steps after the first one reported.
    let mut step_rate = carve_core::step_rate::StepRate::default();
    let started = Instant::now();
    let mut stopper = ProcessStopper::new(process_id, container.clone());
    let uncontained = container.is_none();
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
                                match &line {
                                    ChildLine::Progress { memory_peak_bytes, step, .. } => {
                                        measured_peak_bytes = measured_peak_bytes.max(*memory_peak_bytes);
                                        steps_reported = steps_reported.max(Some(*step));
                                        step_rate.observe(*step, started.elapsed());
                                    }
                                    // Written after its step: as far as the attempt got.
                                    ChildLine::Checkpoint { step, .. } => {
                                        steps_reported = steps_reported.max(Some(*step));
                                    }
                                    _ => {}
                                }
                                if let Some(mut body) = report_for_line(&attempt, &line, uncontained) {
                                    if let Body::Progress(v1::worker_message::Progress {
                                        progress: Some(progress),
                                        ..
                                    }) = &mut body
                                    {
                                        progress.seconds_left = step_rate
                                            .time_left(progress.total_steps)
                                            .map(|left| left.as_secs_f64());
                                    }
                                    send(body);
                                    if uncontained && matches!(line, ChildLine::Started { .. }) {
                                        send(uncontained_log_line(&attempt));
                                    }
                                } else {
                                    final_line = Some(line);
                                }
                            }
                            // Not ours (a library printing): pass it on as a log line.
                            Err(_) => send(output_log_line(&attempt, text)),
                        }
                    }
                    Ok(None) | Err(_) => stdout_lines = None,
                }
            }
            status = child.wait(), if stdout_lines.is_none() => {
                // The engine's own 143 means it checkpointed on SIGTERM.
                break status.map(|status| match &container {
                    Some(_) => container_exit_status(status, &[STOPPED_ON_SIGTERM_EXIT_CODE]),
                    None => status,
                });
            }
            command = control.recv(), if !stopper.is_stopping() => {
                stopper.begin(&mut child, command, &attempt.job_id);
            }
            _ = sleep_until_or_never(stopper.kill_deadline()) => {
                stopper.kill(&mut child, &attempt.job_id);
            }
        }
    };
    // Read before the container's cgroups go with it.
    let host_memory_limit_reached = container.as_ref().and_then(Container::reached_memory_limit);
    if let Some(container) = &container {
        container.remove();
    }
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
    let observed = Observed {
        peak_bytes: measured_peak_bytes,
        steps: steps_reported,
        host_memory_limit_reached,
    };
    for body in final_reports(
        &attempt,
        exit_status,
        final_line,
        stopper.into_stop(),
        observed,
        &stderr_tail,
    ) {
        send(body);
    }
}

/// A line the attempt's program wrote that is not a protocol line, as a log line of the
/// attempt; its level is guessed from its words (programs mark their warnings and errors
/// in the text, and write them on either stream).
fn output_log_line(attempt: &v1::AttemptRef, message: String) -> Body {
    Body::Log(v1::worker_message::LogLine {
        attempt: Some(attempt.clone()),
        level: output_level(&message).into(),
        message,
        stream: String::new(),
    })
}

/// The log line that says an attempt runs uncontained, so `carve logs` shows it (its
/// `AttemptStarted` says so too, for `carve get`).
pub(crate) fn uncontained_log_line(attempt: &v1::AttemptRef) -> Body {
    Body::Log(v1::worker_message::LogLine {
        attempt: Some(attempt.clone()),
        level: "warn".into(),
        message: UNCONTAINED_WARNING.to_string(),
        stream: String::new(),
    })
}

/// "error" or "warn" when the line says so near its start, "info" otherwise.
fn output_level(line: &str) -> &'static str {
    let start: String = line.chars().take(40).collect::<String>().to_lowercase();
    if start.contains("error") || start.contains("panic") || start.contains("traceback") {
        "error"
    } else if start.contains("warn") {
        "warn"
    } else {
        "info"
    }
}

/// What the worker saw of an attempt from its progress lines, for its final report.
#[derive(Debug, Clone, Copy, Default)]
pub struct Observed {
    /// The largest memory peak reported (0 when none).
    pub peak_bytes: u64,
    /// The step of the last progress line.
    pub steps: Option<u64>,
    /// The container's host memory limit, when its memory reached it (the kernel's OOM
    /// killer then killed a process in it).
    pub host_memory_limit_reached: Option<u64>,
}

/// A stop the worker asked for, as it goes: SIGTERM to the process group (every process
/// of its container, when it has one) at once, SIGKILL when the grace period is over (at
/// once without one). One per process: the process group is the process's id.
#[derive(Debug)]
pub struct ProcessStopper {
    process_group: u32,
    /// The container the process runs in: its processes are not in the runtime's
    /// process group, so they are signalled through the runtime.
    container: Option<Container>,
    stop: Option<WorkerStop>,
    kill_at: Option<Instant>,
    killed: bool,
}

impl ProcessStopper {
    pub fn new(process_group: u32, container: Option<Container>) -> ProcessStopper {
        ProcessStopper {
            process_group,
            container,
            stop: None,
            kill_at: None,
            killed: false,
        }
    }

    /// Whether a stop has begun (a second control message changes nothing).
    pub fn is_stopping(&self) -> bool {
        self.stop.is_some()
    }

    /// Begins the stop `control` asks for; `None` (the worker dropped its handle: it is
    /// going away) kills at once.
    pub fn begin(&mut self, child: &mut Child, control: Option<AttemptControl>, job_id: &str) {
        let (grace_period, stop) = match control {
            Some(AttemptControl::Cancel {
                grace_period,
                reason,
            }) => (grace_period, WorkerStop::Cancelled(reason)),
            Some(AttemptControl::StopAsFailed {
                grace_period,
                reason,
            }) => (grace_period, WorkerStop::Failed(reason)),
            Some(AttemptControl::StopWithoutLeader {
                grace_period,
                reason,
            }) => (grace_period, WorkerStop::Interrupted(reason)),
            None => (
                Duration::ZERO,
                WorkerStop::Cancelled("the worker is shutting down".to_string()),
            ),
        };
        let process_id = self.process_group;
        tracing::info!(job = %job_id, process_id, ?grace_period, ?stop, "stopping an attempt");
        self.stop = Some(stop);
        if grace_period.is_zero() {
            self.kill_everything(child);
            self.killed = true;
        } else {
            let sent = match &self.container {
                Some(container) => container.signal_all("TERM"),
                None => signal_process_group(process_id, Signal::TERM),
            };
            if let Err(error) = sent {
                tracing::warn!(process_id, %error, "cannot send sigterm");
            }
            self.kill_at = Some(Instant::now() + grace_period);
        }
    }

    /// When the SIGKILL is due; `None` while none is (no stop, or killed already).
    pub fn kill_deadline(&self) -> Option<Instant> {
        self.kill_at.filter(|_| !self.killed)
    }

    /// The grace period is over: SIGKILL.
    pub fn kill(&mut self, child: &mut Child, job_id: &str) {
        let process_id = self.process_group;
        tracing::info!(job = %job_id, process_id, "grace period over: killing the attempt");
        self.kill_everything(child);
        self.killed = true;
    }

    /// SIGKILL to every process of the container first (the runtime's own process
    /// cannot pass a SIGKILL on), then to the process group.
    fn kill_everything(&self, child: &mut Child) {
        if let Some(container) = &self.container
            && let Err(error) = container.signal_all("KILL")
        {
            tracing::warn!(container = %container.name(), %error, "cannot kill the container");
        }
        kill_group(child, self.process_group);
    }

    /// Why the worker stopped the process; `None` when it did not.
    pub fn into_stop(self) -> Option<WorkerStop> {
        self.stop
    }
}

/// Sleeps until `deadline`; without one, never wakes (a `select!` branch that is off).
pub async fn sleep_until_or_never(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
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
/// oom), which are reported once the process has exited. `uncontained`: the attempt
/// runs without a container, which its start says.
fn report_for_line(attempt: &v1::AttemptRef, line: &ChildLine, uncontained: bool) -> Option<Body> {
    let attempt = Some(attempt.clone());
    match line {
        ChildLine::Started {
            reserved_bytes,
            resumed_from,
            ..
        } => Some(Body::AttemptStarted(v1::worker_message::AttemptStarted {
            attempt,
            reserved_bytes: *reserved_bytes,
            resumed_from: resumed_from.as_ref().map(|checkpoint| v1::Checkpoint {
                step: checkpoint.step,
                location: checkpoint.location.clone(),
            }),
            command_argv: Vec::new(),
            uncontained,
            // Engine attempts run no image.
            image_digest: String::new(),
        })),
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
                seconds_left: None,
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

mod ending;
pub use ending::final_reports;

#[cfg(test)]
mod tests;
