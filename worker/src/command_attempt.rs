//! The worker's side of a command job's attempt: the user's own program, started directly
//! (no shell) in its own process group with the guard's environment, its output turned
//! into the job's log lines and progress, and its end classified (`carve_core::command::
//! oom`) into success, an OOM with its numbers, or a failure with the tail of stderr.
//!
//! A training attempt is one run of the program. A profile attempt
//! ([`CommandAttemptLaunch::profile`]) is one short run per profile micro-batch, one
//! after the other in the same slice, each with a fresh guard account, and ends with the
//! guard's peak of each run as profile points.
//!
//! Reports, in order: `AttemptStarted` once the (first) program started; log lines and
//! progress while it runs; at the end either `OomReport` then `AttemptFinished
//! (OUT_OF_MEMORY)`, or one `AttemptFinished`. A program that cannot be started ends the
//! attempt FAILED without an `AttemptStarted`.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use carve_core::allocator::OutOfMemory;
use carve_core::command::memory_model::learning::run_peak_bytes;
use carve_core::command::oom::{CommandExit, CommandRunEnd, classify_command_exit};
use carve_core::command::validate::ValidatedCommandJob;
use carve_core::plan::RunConfig;
use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use tokio::process::Child;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::attempt_lease::renew_attempt_lease;
use crate::attempt_process::{
    AttemptControl, ProcessStopper, WorkerStop, signal_process_group, sleep_until_or_never,
    spawn_supervised_with_stdin, uncontained_log_line,
};
use crate::command_output::{
    LineTail, ProgressLine, ProgressPacing, STDERR_TAIL_LINES, parse_progress_line,
    start_error_text,
};
use crate::command_supervisor::Supervision;
use crate::gang_member::GangMemberLaunch;
use crate::guard_environment::AttemptGuard;
use crate::image::{ImageRequest, PullProgress, PulledImage, RegistryCredential};
use crate::program_output::{MOST_LINE_BYTES, OutputLine, OutputStream, ProgramOutput};
use crate::sandbox::{Container, GpuDevices, Sandbox, container_exit_status};
use carve_core::command::checkpoint::parse_checkpoint_line;
use carve_core::command::image::parse_image_reference;
use carve_core::step_rate::StepRate;

mod checkpoints;
mod image;
mod reports;
use checkpoints::{CheckpointRecorder, ResumePoint};

pub use image::AssignedImage;
pub use reports::training_final_reports;
use reports::{ended, finished, stop_of};
mod setup;
use setup::PreparedRun;

/// The variable that tells the program its slice's size, with or without the guard (a
/// program on a simulated GPU without the guard can account for itself against it).
pub const ENVIRONMENT_SLICE_BYTES: &str = "CARVE_SLICE_BYTES";

/// How often a run that prints no progress lines gets a progress report with the guard's
/// memory figures.
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

/// How long the output pipes may stay open after the program exited (a process it left
/// behind holds them) before the worker stops reading them.
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);

/// Everything needed to run one attempt of a command job.
#[derive(Debug, Clone)]
pub struct CommandAttemptLaunch {
    pub attempt: v1::AttemptRef,
    pub job: ValidatedCommandJob,
    /// The configuration the scheduler chose for this attempt.
    pub config: RunConfig,
    pub slice_bytes: u64,
    /// The slice's GPU (`CUDA_VISIBLE_DEVICES` under the guard).
    pub gpu_uuid: String,
    /// The checked guard library; `None` runs the program without the guard (a simulated
    /// GPU on a worker without one: no peaks are measured then).
    pub guard_library: Option<PathBuf>,
    /// `{checkpoint_dir}`: the job's own directory, the same for every attempt of the job
    /// so that a retry resumes from what the last one wrote.
    pub checkpoint_dir: PathBuf,
    /// This attempt's directory: the guard's account and OOM record, the program's
    /// working directory when the spec names none, the profile's scratch checkpoints.
    pub attempt_directory: PathBuf,
    /// Run the profile instead of training.
    pub profile: bool,
    /// The checkpoint the scheduler recorded for the job (the assignment's
    /// `resume_from`): a training run resumes from it when it is a recorded copy on this
    /// node (`CARVE_RESUME_FROM`, [`crate::command_checkpoint`]).
    pub resume_from: Option<v1::Checkpoint>,
    /// Where each run is contained; `None`: the program runs with the worker's rights.
    pub sandbox: Option<Arc<Sandbox>>,
    /// The job's tenant: whose host ids its container runs under.
    pub tenant: String,
    /// What the scheduler's assignment says of the job's image: the digest its first
    /// pull resolved and its pull secret's credential (issue 30).
    pub image: AssignedImage,
    /// The slice's GPU's device nodes, the only ones its container sees, and the host
    /// paths its driver needs (a CDI spec's mounts).
    pub devices: GpuDevices,
    /// A simulated GPU's ledger socket (`simulated_gpu_ledger.rs`): the fake driver's
    /// device, bound into the container at its device path.
    pub simulated_gpu_socket: Option<PathBuf>,
    /// The first part of its containers' names (a run number follows).
    pub container_name: String,
    /// The lease each run of the program holds through its supervisor; `None` runs the
    /// program as the worker's direct child, with no lease (tests of this module).
    pub supervision: Option<Supervision>,
}

/// What the worker learns of the processes an attempt starts (a profile starts one per
/// run): it records them, and lets the watchdog watch them.
pub trait CommandProcesses: Send {
    /// `container_processes`: the `cgroup.procs` file of the run's container, when it has
    /// one.
    fn started(
        &mut self,
        process_id: u32,
        guard_account: Option<&Path>,
        container_processes: Option<&Path>,
    );
    fn exited(&mut self, process_id: u32);
}

/// Nobody to tell (tests).
impl CommandProcesses for () {
    fn started(&mut self, _: u32, _: Option<&Path>, _: Option<&Path>) {}
    fn exited(&mut self, _process_id: u32) {}
}

/// Runs the attempt to its end and sends every report about it to `reports`, the final
/// one last. `before_final_report` runs once no process of the attempt runs any more and
/// before the final reports: the caller frees the slice there.
pub async fn run_command_attempt(
    launch: CommandAttemptLaunch,
    reports: mpsc::UnboundedSender<Body>,
    control: mpsc::UnboundedReceiver<AttemptControl>,
    processes: impl CommandProcesses,
    before_final_report: impl FnOnce(),
) {
    run_attempt(
        launch,
        None,
        reports,
        control,
        processes,
        before_final_report,
    )
    .await;
}

/// As [`run_command_attempt`], for one member of a gang (issue 31,
/// [`crate::gang_member`]): the program gets its place in the gang in its argv and
/// environment, and its container shares the node's network so that the members meet.
/// Its reports name the member by `launch.attempt.gang_rank`, which the caller sets.
pub async fn run_gang_member_attempt(
    launch: CommandAttemptLaunch,
    gang: GangMemberLaunch,
    reports: mpsc::UnboundedSender<Body>,
    control: mpsc::UnboundedReceiver<AttemptControl>,
    processes: impl CommandProcesses,
    before_final_report: impl FnOnce(),
) {
    run_attempt(
        launch,
        Some(&gang),
        reports,
        control,
        processes,
        before_final_report,
    )
    .await;
}

async fn run_attempt(
    launch: CommandAttemptLaunch,
    gang: Option<&GangMemberLaunch>,
    reports: mpsc::UnboundedSender<Body>,
    mut control: mpsc::UnboundedReceiver<AttemptControl>,
    mut processes: impl CommandProcesses,
    before_final_report: impl FnOnce(),
) {
    // The job's image first: an attempt that cannot have it ends before any run.
    let image = match image::job_image(&launch, &reports).await {
        Ok(image) => image,
        Err(finals) => {
            before_final_report();
            for body in finals {
                let _ = reports.send(body);
            }
            return;
        }
    };
    let mut runner = Runner {
        launch: &launch,
        reports: &reports,
        control: &mut control,
        processes: &mut processes,
        announced: false,
        runs: 0,
        image: image.as_ref(),
        gang,
    };
    let finals = if launch.profile {
        runner.profile().await
    } else {
        runner.train().await
    };
    before_final_report();
    for body in finals {
        // The receiver lives as long as the worker; a send fails only at shutdown.
        let _ = reports.send(body);
    }
}

/// How one run of the program ended.
#[derive(Debug, Clone, PartialEq)]
pub enum RunEnd {
    /// It could not be set up or started.
    NotStarted(String),
    /// The worker stopped it (cancel, shutdown, the watchdog).
    Stopped(WorkerStop),
    /// It exited by itself (or the worker could not wait for it), classified.
    Exited(CommandRunEnd),
}

/// What one run left: how it ended, the guard's peak, and its last progress.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRecord {
    pub end: RunEnd,
    /// The guard account's peak (or the program's own figure without the guard; 0 when
    /// neither is known).
    pub peak_bytes: u64,
    /// Every progress line of the run, merged: the latest value of each key.
    pub progress: ProgressLine,
}

/// One run's settings.
struct RunPlan {
    config: RunConfig,
    max_steps: Option<u64>,
    checkpoint_dir: PathBuf,
    /// Before every log line ("profile micro-batch 8: "), empty for training.
    log_prefix: String,
    /// A training run: progress lines become progress reports and checkpoint lines are
    /// recorded; a profile run's only count.
    training: bool,
    /// The recorded checkpoint the run resumes from (training only).
    resume: Option<ResumePoint>,
}

struct Runner<'a, P: CommandProcesses> {
    launch: &'a CommandAttemptLaunch,
    reports: &'a mpsc::UnboundedSender<Body>,
    control: &'a mut mpsc::UnboundedReceiver<AttemptControl>,
    processes: &'a mut P,
    /// Whether `AttemptStarted` went out.
    announced: bool,
    /// Runs started so far (each run's container has its own name).
    runs: u32,
    /// The job's image (`command.image`), held in the cache while the attempt runs.
    image: Option<&'a PulledImage>,
    /// The attempt's place in its gang; `None` for a single process.
    gang: Option<&'a GangMemberLaunch>,
}

impl<P: CommandProcesses> Runner<'_, P> {
    fn send(&self, body: Body) {
        let _ = self.reports.send(body);
    }

    async fn train(&mut self) -> Vec<Body> {
        let plan = RunPlan {
            config: self.launch.config,
            max_steps: None,
            checkpoint_dir: self.launch.checkpoint_dir.clone(),
            log_prefix: String::new(),
            training: true,
            resume: ResumePoint::of_assignment(
                &self.launch.checkpoint_dir,
                self.launch.resume_from.as_ref(),
            ),
        };
        let record = self.run(&plan).await;
        training_final_reports(&self.launch.attempt, record)
    }

    /// One short run per profile micro-batch; see the module docs.
    async fn profile(&mut self) -> Vec<Body> {
        let attempt = &self.launch.attempt;
        let mut micro_batches = self.launch.job.profile_micro_batches().to_vec();
        micro_batches.dedup();
        let mut points = Vec::new();
        for micro_batch in micro_batches {
            // A stop that came between two runs ends the profile before the next.
            if let Ok(control) = self.control.try_recv() {
                let (outcome, reason) = stop_of(control).outcome_and_reason();
                return ended(attempt, outcome, reason);
            }
            let scratch = self
                .launch
                .attempt_directory
                .join(format!("profile-checkpoints-micro-batch-{micro_batch}"));
            // Each run starts from nothing: no checkpoint of an earlier try is resumed.
            let _ = std::fs::remove_dir_all(&scratch);
            let plan = RunPlan {
                config: RunConfig {
                    micro_batch_size: micro_batch,
                    ..self.launch.config
                },
                max_steps: Some(self.launch.job.spec.command.profile.steps),
                checkpoint_dir: scratch.clone(),
                log_prefix: format!("profile micro-batch {micro_batch}: "),
                training: false,
                resume: None,
            };
            let record = self.run(&plan).await;
            let _ = std::fs::remove_dir_all(&scratch);
            let point = match record.end {
                RunEnd::Exited(CommandRunEnd::Succeeded) => v1::ProfilePoint {
                    micro_batch,
                    peak_bytes: record.peak_bytes,
                    ran_out: false,
                },
                // What it held and asked for when it ran out is a lower bound.
                RunEnd::Exited(CommandRunEnd::OutOfMemory { report, .. }) => v1::ProfilePoint {
                    micro_batch,
                    peak_bytes: report
                        .in_use
                        .saturating_add(report.requested)
                        .max(record.peak_bytes),
                    ran_out: true,
                },
                RunEnd::Exited(
                    CommandRunEnd::Failed { message } | CommandRunEnd::Interrupted { message },
                )
                | RunEnd::NotStarted(message) => {
                    return ended(
                        attempt,
                        v1::AttemptOutcome::Failed,
                        format!("the profile run at micro-batch {micro_batch} failed: {message}"),
                    );
                }
                RunEnd::Stopped(stop) => {
                    let (outcome, reason) = stop.outcome_and_reason();
                    return ended(attempt, outcome, reason);
                }
            };
            tracing::info!(
                job = %attempt.job_id,
                micro_batch,
                peak_bytes = point.peak_bytes,
                ran_out = point.ran_out,
                "profile run measured"
            );
            points.push(point);
        }
        // The peaks are in the points; the attempt's own peak stays 0 so that nothing
        // takes it for the peak of the configuration it was assigned.
        let mut done = finished(attempt, v1::AttemptOutcome::Succeeded, String::new(), None);
        done.profile_points = points;
        vec![Body::AttemptFinished(done)]
    }

    /// Sets up, starts and watches one run of the program to its end.
    async fn run(&mut self, plan: &RunPlan) -> RunRecord {
        let not_started = |message: String| RunRecord {
            end: RunEnd::NotStarted(message),
            peak_bytes: 0,
            progress: ProgressLine::default(),
        };
        self.runs += 1;
        // `_image_root` is dropped at the end, after the container is removed: the run's
        // root is unmounted only once nothing runs in it.
        let PreparedRun {
            command,
            argv,
            guard,
            container,
            image_root: _image_root,
            supervised,
        } = match self.prepare(plan) {
            Ok(prepared) => prepared,
            Err(message) => return not_started(message),
        };
        // A supervised run's stdin carries its lease's renewals.
        let stdin = if supervised {
            Stdio::piped()
        } else {
            Stdio::null()
        };
        let mut child = match spawn_supervised_with_stdin(command, stdin).await {
            Ok(child) => child,
            Err(error) => {
                if let Some(container) = &container {
                    container.remove();
                }
                return not_started(format!(
                    "could not start {}: {}",
                    argv[0],
                    start_error_text(&error)
                ));
            }
        };
        if let (Some(stdin), Some(supervision)) = (child.stdin.take(), &self.launch.supervision) {
            tokio::spawn(renew_attempt_lease(stdin, supervision.deadlines.clone()));
        }
        let process_id = child.id().unwrap_or(0);
        // In a container the program is the runtime's child, not the worker's: its own
        // pid is what the worker records and the watchdog starts from.
        let program_process_id = match &container {
            Some(container) => container.program_process_id().await,
            None => None,
        }
        .unwrap_or(process_id);
        let attempt = &self.launch.attempt;
        tracing::info!(
            job = %attempt.job_id,
            attempt = attempt.attempt_number,
            process_id,
            under_guard = guard.is_some(),
            contained = container.is_some(),
            argv = ?argv,
            "command started"
        );
        self.processes.started(
            program_process_id,
            guard.as_ref().map(AttemptGuard::account_file),
            container.as_ref().map(Container::processes_file),
        );
        if !self.announced {
            self.announced = true;
            self.send(Body::AttemptStarted(v1::worker_message::AttemptStarted {
                attempt: Some(attempt.clone()),
                reserved_bytes: self.launch.slice_bytes,
                // The recorded checkpoint it was given; whether it loads it is its own.
                resumed_from: plan.resume.as_ref().map(|resume| v1::Checkpoint {
                    step: resume.step,
                    location: resume.path.to_string_lossy().into_owned(),
                }),
                command_argv: argv,
                uncontained: container.is_none(),
                // What the image resolved to: the scheduler pins later attempts to it.
                image_digest: self
                    .image
                    .map(|image| image.record.digest.clone())
                    .unwrap_or_default(),
            }));
            if container.is_none() {
                self.send(uncontained_log_line(attempt));
            }
        }
        let record = self
            .watch(child, process_id, plan, guard.as_ref(), container.as_ref())
            .await;
        if let Some(container) = &container {
            container.remove();
        }
        self.processes.exited(program_process_id);
        record
    }

    /// Reads the run's output and controls until it has exited, then classifies its end.
    async fn watch(
        &mut self,
        mut child: Child,
        process_id: u32,
        plan: &RunPlan,
        guard: Option<&AttemptGuard>,
        container: Option<&Container>,
    ) -> RunRecord {
        let job_id = self.launch.attempt.job_id.clone();
        let mut lines =
            ProgramOutput::new(child.stdout.take(), child.stderr.take(), MOST_LINE_BYTES);
        let mut output = RunOutput {
            progress: ProgressLine::default(),
            stderr_tail: LineTail::new(STDERR_TAIL_LINES),
            progress_since_tick: false,
            pacing: ProgressPacing::default(),
            step_rate: StepRate::default(),
            started: Instant::now(),
            checkpoints: plan.training.then(|| {
                CheckpointRecorder::start(
                    self.launch.attempt.clone(),
                    plan.checkpoint_dir.clone(),
                    self.reports.clone(),
                )
            }),
        };
        let mut stopper = ProcessStopper::new(process_id, container.cloned());
        let mut status: Option<std::io::Result<ExitStatus>> = None;
        let mut drain_until: Option<Instant> = None;
        let mut ticks =
            tokio::time::interval_at(Instant::now() + PROGRESS_INTERVAL, PROGRESS_INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while status.is_none() || !lines.is_done() {
            tokio::select! {
                line = lines.next_line(), if !lines.is_done() => {
                    if let Some(line) = line {
                        self.on_line(line, plan, guard, &mut output);
                    }
                }
                // A progress line that came too soon after the last report, reported now.
                _ = sleep_until_or_never(output.pacing.pending_due()) => {
                    output.pacing.reported(Instant::now());
                    self.report_progress(&output, guard);
                }
                exited = child.wait(), if status.is_none() => {
                    // `runc run` and the supervisor both exit 128 + the program's signal.
                    status = Some(exited.map(|status| {
                        if container.is_some() || self.launch.supervision.is_some() {
                            container_exit_status(status, &[])
                        } else {
                            status
                        }
                    }));
                    drain_until = Some(Instant::now() + OUTPUT_DRAIN);
                }
                // A process the program left behind holds the pipes: stop reading.
                _ = sleep_until_or_never(drain_until) => break,
                control = self.control.recv(), if status.is_none() && !stopper.is_stopping() => {
                    stopper.begin(&mut child, control, &job_id);
                }
                _ = sleep_until_or_never(stopper.kill_deadline()), if status.is_none() => {
                    stopper.kill(&mut child, &job_id);
                }
                _ = ticks.tick(), if plan.training && guard.is_some() => {
                    if !std::mem::take(&mut output.progress_since_tick) {
                        output.pacing.reported(Instant::now());
                        self.report_progress(&output, guard);
                    }
                }
            }
        }
        // Every checkpoint it reported is recorded (or refused) before the run's end is.
        if let Some(checkpoints) = output.checkpoints.take() {
            checkpoints.finish().await;
        }
        // The last progress is always reported, before the attempt's end.
        if output.pacing.is_pending() {
            output.pacing.reported(Instant::now());
            self.report_progress(&output, guard);
        }
        let status = status.unwrap_or_else(|| Err(std::io::Error::other("not waited for")));
        // What the program left running in its process group (a data loader's worker, a
        // process in the background) would hold the slice's GPU memory after the attempt
        // ended, when the slice is another job's: the attempt ends with it, as a job's
        // processes end with the job under Slurm. Usually nothing is left (ESRCH).
        if let Err(error) = signal_process_group(process_id, rustix::process::Signal::KILL)
            && error.raw_os_error() != Some(rustix::io::Errno::SRCH.raw_os_error())
        {
            tracing::warn!(job = %job_id, %error, "cannot stop what the program left running");
        }
        let usage = guard.and_then(|guard| {
            guard
                .read_usage()
                .inspect_err(
                    |error| tracing::warn!(job = %job_id, %error, "cannot read the guard account"),
                )
                .ok()
                .flatten()
        });
        // The guard's peak when it counted anything, else the program's own figure (a
        // simulated GPU sees no CUDA call): core's rule.
        let peak_bytes = run_peak_bytes(
            usage.map(|usage| usage.peak_bytes),
            output.progress.memory_peak_bytes,
        );
        // A run that ended once the worker's lease had lapsed was stopped by its
        // supervisor (or is as good as stopped: the scheduler gives the job away), never
        // a success or a failure of the program's own, whatever it exited with.
        let lapsed = self
            .launch
            .supervision
            .as_ref()
            .filter(|supervision| supervision.lapsed());
        let end = match (stopper.into_stop(), lapsed) {
            (Some(stop), _) => RunEnd::Stopped(stop),
            (None, Some(_)) => RunEnd::Stopped(WorkerStop::Interrupted(
                "stopped by its supervisor: no scheduler leader heard its worker for half \
                 the worker's lease (the scheduler would give the attempt to another worker \
                 at the lease's end)"
                    .to_string(),
            )),
            (None, None) => RunEnd::Exited(self.classify(
                &status,
                guard,
                &output.stderr_tail.to_vec(),
                peak_bytes,
                container.and_then(Container::reached_memory_limit),
            )),
        };
        RunRecord {
            end,
            peak_bytes,
            progress: output.progress,
        }
    }

    /// One line of the program's output: a progress line counts (and is reported, at
    /// most one a second: [`ProgressPacing`]), a checkpoint line is recorded (training
    /// only), any other is a log line marked with its stream, info from stdout and warn
    /// from stderr.
    fn on_line(
        &self,
        line: OutputLine,
        plan: &RunPlan,
        guard: Option<&AttemptGuard>,
        output: &mut RunOutput,
    ) {
        let OutputLine { stream, text } = line;
        if let Some(checkpoint) = parse_checkpoint_line(&text) {
            match (checkpoint, &output.checkpoints) {
                (Ok(checkpoint), Some(checkpoints)) => checkpoints.reported(checkpoint),
                (Ok(_), None) => {}
                (Err(reason), _) => self.send(Body::Log(v1::worker_message::LogLine {
                    attempt: Some(self.launch.attempt.clone()),
                    level: "warn".to_string(),
                    message: format!(
                        "{}a checkpoint line is not taken: {reason}",
                        plan.log_prefix
                    ),
                    stream: String::new(),
                })),
            }
            return;
        }
        if let Some(progress) = parse_progress_line(&text) {
            let now = Instant::now();
            if let Some(step) = progress.step {
                output
                    .step_rate
                    .observe(step, now.duration_since(output.started));
            }
            output.progress.merge(&progress);
            if plan.training && progress.has_step_figures() {
                output.progress_since_tick = true;
                if output.pacing.line_came(now) {
                    self.report_progress(output, guard);
                }
            }
            return;
        }
        if stream == OutputStream::Stderr {
            output.stderr_tail.push(text.clone());
        }
        self.send(Body::Log(v1::worker_message::LogLine {
            attempt: Some(self.launch.attempt.clone()),
            level: match stream {
                OutputStream::Stdout => "info",
                OutputStream::Stderr => "warn",
            }
            .to_string(),
            message: format!("{}{text}", plan.log_prefix),
            stream: stream.name().to_string(),
        }));
    }

    /// A progress report: the program's last figures with the time left at their pace,
    /// and the guard account's memory (the program's own figures without the guard).
    fn report_progress(&self, output: &RunOutput, guard: Option<&AttemptGuard>) {
        let progress = &output.progress;
        let total_steps = progress
            .total_steps
            .or(self.launch.job.spec.command.steps)
            .unwrap_or(0);
        let usage = guard.and_then(|guard| guard.read_usage().ok().flatten());
        let (in_use, peak) = match (&usage, guard) {
            (Some(usage), _) => (usage.in_use_bytes, usage.peak_bytes),
            (None, None) => (
                progress.memory_in_use_bytes.unwrap_or(0),
                progress.memory_peak_bytes.unwrap_or(0),
            ),
            (None, Some(_)) => (0, 0),
        };
        self.send(Body::Progress(v1::worker_message::Progress {
            attempt: Some(self.launch.attempt.clone()),
            progress: Some(v1::TrainingProgress {
                step: progress.step.unwrap_or(0),
                total_steps,
                loss: progress.loss.unwrap_or(0.0),
                samples_per_second: progress.samples_per_second.unwrap_or(0.0),
                memory_in_use_bytes: in_use,
                memory_peak_bytes: peak,
                seconds_left: output
                    .step_rate
                    .time_left(total_steps)
                    .map(|left| left.as_secs_f64()),
            }),
        }));
    }

    /// How an exited run ended: the guard's first OOM record, the stderr tail, the exit
    /// status and whether its container reached its host memory limit, as
    /// `carve_core::command::oom` decides.
    fn classify(
        &self,
        status: &std::io::Result<ExitStatus>,
        guard: Option<&AttemptGuard>,
        stderr_tail: &[String],
        peak_bytes: u64,
        host_memory_limit_reached: Option<u64>,
    ) -> CommandRunEnd {
        let status = match status {
            Ok(status) => status,
            Err(error) => {
                return CommandRunEnd::Failed {
                    message: format!("the program vanished: it cannot be waited for ({error})"),
                };
            }
        };
        let guard_refusal = guard.and_then(|guard| match guard.read_oom_record() {
            Ok(record) => record.first().map(|line| OutOfMemory {
                requested: line.requested_bytes,
                in_use: line.in_use_bytes,
                limit: line.limit_bytes,
                largest_free: line.limit_bytes.saturating_sub(line.in_use_bytes),
                peak: line.peak_bytes,
            }),
            Err(error) => {
                tracing::warn!(job = %self.launch.attempt.job_id, %error, "cannot read the guard's OOM record");
                None
            }
        });
        classify_command_exit(&CommandExit {
            exit_code: status.code(),
            signal: status.signal(),
            guard_refusal,
            stderr_tail,
            slice_bytes: self.launch.slice_bytes,
            peak_bytes,
            host_memory_limit_reached,
        })
    }
}

/// What a run's output built up while it ran.
struct RunOutput {
    progress: ProgressLine,
    stderr_tail: LineTail,
    /// A progress line came since the last tick (no account-only report needed).
    progress_since_tick: bool,
    pacing: ProgressPacing,
    /// The pace of the steps since the first reported one, for the time left.
    step_rate: StepRate,
    /// When the run started, the origin of `step_rate`'s moments.
    started: Instant,
    /// The run's reported checkpoints, recorded (training only).
    checkpoints: Option<CheckpointRecorder>,
}
