//! `carve watch JOB` (and `carve submit --watch`): follows a job's event stream to its
//! end. On a terminal, a live progress bar shows the step, the loss, the throughput, the
//! slice's memory, the elapsed time and an ETA; while the job is queued, why it waits;
//! state changes, attempts, out-of-memory reports and shrink decisions print as lines as
//! they happen. Off a terminal everything is plain lines, progress at most one line a
//! second of the job's time (the last one always printed, before the next other line):
//! a 3,000-step run does not print 3,000 lines into a log file. A command job's program
//! output (`--logs`) is marked with its stream.
//! The exit code is the job's: 0 succeeded, 3 failed out of memory, 10 failed, 11
//! cancelled.

use std::cell::{Cell, RefCell};
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use carve_proto::v1;
use carve_proto::v1::job_event::Event;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::connection::{Connection, REOPEN_PATIENCE};
use super::failure::{ClientFailure, FailureKind, connection_lost};
use super::output::{
    attempt_note, bytes_text, config_text, is_terminal, is_terminal_state, job_state_name,
    oom_text, outcome_name,
};
use crate::elapsed::{between, now_timestamp, progress_timing_text};

/// Off a terminal, the least time between two progress lines, in the job's event time.
const PROGRESS_LINE_SPACING_MS: i64 = 1_000;

/// How often a watch of a queued job reads the job again for its waiting reason, which
/// changes with scheduling passes rather than with events.
const WAITING_REASON_INTERVAL: Duration = Duration::from_secs(2);

#[derive(Debug, clap::Args)]
pub struct WatchArguments {
    /// The job: its id, a unique prefix of it, or the job's name.
    job: String,
    /// Also print the attempts' log lines.
    #[arg(long)]
    logs: bool,
    #[command(flatten)]
    connection: super::connection::ConnectionOptions,
}

pub async fn watch(arguments: WatchArguments) -> Result<ExitCode> {
    let connection = Connection::open(&arguments.connection).await?;
    watch_job(&connection, &arguments.job, arguments.logs).await
}

/// Where the lines and the bar go.
enum Display {
    /// A terminal: a bar redrawn in place, lines printed above it.
    Terminal {
        bar: ProgressBar,
        /// Whether the bar shows steps yet (it starts as a spinner).
        showing_steps: Cell<bool>,
    },
    /// A pipe or a file: plain lines only, on stdout or stderr.
    Lines {
        to_stderr: bool,
        pacing: RefCell<ProgressLinePacing>,
    },
}

/// Off a terminal, which progress lines are printed: one a second at most of the job's
/// event time; one that comes sooner is held (replacing one held before) and printed
/// before the next other line or at the end, so the last progress is always printed.
#[derive(Debug, Default)]
struct ProgressLinePacing {
    /// The event time of the last progress line printed.
    last_printed_ms: Option<i64>,
    /// A progress line that came too soon.
    held: Option<String>,
}

impl ProgressLinePacing {
    /// A progress line at `at_ms` (the event's time; `None` from a scheduler that sends
    /// none, printed at once): `Some` to print it now.
    fn offer(&mut self, text: String, at_ms: Option<i64>) -> Option<String> {
        if let (Some(at), Some(last)) = (at_ms, self.last_printed_ms)
            && at.saturating_sub(last) < PROGRESS_LINE_SPACING_MS
        {
            self.held = Some(text);
            return None;
        }
        self.held = None;
        self.last_printed_ms = at_ms.or(self.last_printed_ms);
        Some(text)
    }

    /// The line held back, to print before anything else is.
    fn take_held(&mut self) -> Option<String> {
        self.held.take()
    }
}

impl Display {
    /// On stdout, or on stderr when stdout carries a document (`submit --watch -o json`).
    fn new(to_stderr: bool) -> Display {
        let (is_terminal, target) = if to_stderr {
            (
                std::io::stderr().is_terminal(),
                ProgressDrawTarget::stderr(),
            )
        } else {
            (
                std::io::stdout().is_terminal(),
                ProgressDrawTarget::stdout(),
            )
        };
        if is_terminal {
            // A spinner until the first progress report says how many steps there are.
            let bar = ProgressBar::with_draw_target(None, target);
            bar.set_style(
                ProgressStyle::with_template("{spinner} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            bar.set_message("waiting for the first progress report");
            bar.enable_steady_tick(Duration::from_millis(250));
            Display::Terminal {
                bar,
                showing_steps: Cell::new(false),
            }
        } else {
            Display::Lines {
                to_stderr,
                pacing: RefCell::new(ProgressLinePacing::default()),
            }
        }
    }

    /// What the job is waiting for, until its first progress report: on a terminal the
    /// spinner's text, off one a line (the caller only calls when it changed).
    fn waiting(&self, text: &str) {
        match self {
            Display::Terminal { bar, showing_steps } => {
                if !showing_steps.get() {
                    bar.set_message(text.to_string());
                }
            }
            Display::Lines { .. } => self.line(text),
        }
    }

    fn line(&self, text: &str) {
        self.print_held_progress();
        self.print(text);
    }

    fn print(&self, text: &str) {
        match self {
            Display::Terminal { bar, .. } => bar.println(text),
            Display::Lines {
                to_stderr: false, ..
            } => println!("{text}"),
            Display::Lines {
                to_stderr: true, ..
            } => eprintln!("{text}"),
        }
    }

    /// The progress line held back, if any: the last progress before what comes next.
    fn print_held_progress(&self) {
        if let Display::Lines { pacing, .. } = self
            && let Some(held) = pacing.borrow_mut().take_held()
        {
            self.print(&held);
        }
    }

    /// Off a terminal, a progress line at `at_ms` (the event's time): printed when a
    /// second passed since the last one printed, else held (replacing one held before).
    fn progress_line(&self, text: String, at_ms: Option<i64>) {
        let Display::Lines { pacing, .. } = self else {
            return;
        };
        let now = pacing.borrow_mut().offer(text, at_ms);
        if let Some(text) = now {
            self.print(&text);
        }
    }

    fn progress(
        &self,
        attempt: u32,
        progress: &v1::TrainingProgress,
        running: Option<&v1::Attempt>,
        at_ms: Option<i64>,
    ) {
        let running = running.filter(|running| running.number == attempt);
        let memory = match running.map(|running| running.slice_bytes) {
            Some(slice) => format!(
                "{} of {} slice (peak {})",
                bytes_text(Some(progress.memory_in_use_bytes)),
                bytes_text(Some(slice)),
                bytes_text(Some(progress.memory_peak_bytes))
            ),
            None => format!(
                "{} in use (peak {})",
                bytes_text(Some(progress.memory_in_use_bytes)),
                bytes_text(Some(progress.memory_peak_bytes))
            ),
        };
        let timing = running
            .and_then(|running| {
                let started = running.started_at.as_ref()?;
                Some(progress_timing_text(
                    progress,
                    between(started, &now_timestamp()),
                ))
            })
            .map(|timing| format!("  {timing}"))
            .unwrap_or_default();
        let message = format!(
            "loss {:.4}  {:.0} samples/s  {memory}{timing}",
            progress.loss, progress.samples_per_second
        );
        match self {
            Display::Terminal { bar, showing_steps } => {
                if !showing_steps.replace(true) {
                    bar.set_style(
                        ProgressStyle::with_template(
                            "{prefix} [{bar:30.cyan/blue}] {pos}/{len} steps  {msg}",
                        )
                        .unwrap_or_else(|_| ProgressStyle::default_bar())
                        .progress_chars("=> "),
                    );
                }
                bar.set_prefix(format!("attempt {attempt}"));
                bar.set_length(progress.total_steps);
                bar.set_position(progress.step);
                bar.set_message(message);
            }
            Display::Lines { .. } => self.progress_line(
                format!(
                    "attempt {attempt}: step {}/{}  {message}",
                    progress.step, progress.total_steps
                ),
                at_ms,
            ),
        }
    }

    fn finish(&self) {
        self.print_held_progress();
        if let Display::Terminal { bar, .. } = self {
            bar.finish_and_clear();
        }
    }
}

/// Follows `job_id` to its end and returns the job's exit code (as an error for every
/// end but success, so `main` prints why).
pub async fn watch_job(
    connection: &Connection,
    job_id: &str,
    include_logs: bool,
) -> Result<ExitCode> {
    let ended = follow_job(connection, job_id, include_logs, false).await?;
    let code = job_exit(&ended)?;
    println!("job {} ({}) succeeded", ended.id, ended.name);
    Ok(code)
}

/// Shows `job_id`'s events as they come (on stderr when `to_stderr`) and returns the job
/// as it ended.
///
/// The watch is resumable: when its connection breaks (the leader died, or the replica
/// stopped leading) it connects again over every endpoint and asks for the events after
/// the last one it showed, so nothing is shown twice and nothing is missed. A scheduler
/// older than resumable watches numbers no events; then the watch starts over with the
/// job's current state.
pub async fn follow_job(
    connection: &Connection,
    job_id: &str,
    include_logs: bool,
    to_stderr: bool,
) -> Result<v1::Job> {
    let mut connection = connection.clone();
    let job = connection.fetch_job(job_id).await?;
    // `job_id` may be a prefix or a name: from here on, the job's own id.
    let job_id = job.id.as_str();
    let display = Display::new(to_stderr);
    let mut running = running_attempt(&job);
    let mut waiting = Waiting::default();
    waiting.show(&display, &job);
    // The log sequence of the last event shown: where a broken watch resumes.
    let mut last_shown: Option<u64> = None;
    let result = async {
        loop {
            let request = v1::WatchJobRequest {
                job_id: job_id.to_string(),
                include_logs,
                resumable: true,
                after_log_sequence: last_shown,
            };
            let mut stream = match connection.jobs().watch_job(request).await {
                Ok(response) => response.into_inner(),
                Err(status) if connection_lost(&status) => {
                    connection = reconnect(&connection, &display, &status).await?;
                    continue;
                }
                Err(status) => {
                    return Err(connection.failure(&status, &format!("cannot watch job {job_id}")));
                }
            };
            let mut reread = tokio::time::interval(WAITING_REASON_INTERVAL);
            reread.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // The stream's own deadline: a scheduler silent for a call's deadline is
            // asked whether it is still there (see `still_there`).
            let silence = connection.call_timeout;
            let idle = tokio::time::sleep(silence);
            tokio::pin!(idle);
            let broken = loop {
                let message = tokio::select! {
                    message = stream.message() => message,
                    _ = reread.tick(), if waiting.wants_rereads(running.as_ref()) => {
                        if let Ok(now) = connection.fetch_job(job_id).await {
                            waiting.show(&display, &now);
                        }
                        continue;
                    }
                    () = &mut idle => {
                        if let Err(status) = still_there(&connection, job_id).await {
                            break Some(status);
                        }
                        idle.as_mut().reset(tokio::time::Instant::now() + silence);
                        continue;
                    }
                };
                idle.as_mut().reset(tokio::time::Instant::now() + silence);
                match message {
                    Ok(Some(event)) => {
                        if event.log_sequence > 0 {
                            last_shown = Some(event.log_sequence);
                        }
                        let time = event.time;
                        if let Some(event) = event.event {
                            if let Event::StateChanged(changed) = &event {
                                waiting.state = changed.state;
                            }
                            // An attempt that started between reading the job and the
                            // watch's first event was never shown starting: read it, so
                            // its progress has the slice and the elapsed time.
                            if let Event::Progress(progress) = &event
                                && running
                                    .as_ref()
                                    .is_none_or(|attempt| attempt.number != progress.attempt_number)
                                && let Ok(now) = connection.fetch_job(job_id).await
                            {
                                running = now
                                    .attempts
                                    .iter()
                                    .find(|attempt| attempt.number == progress.attempt_number)
                                    .cloned();
                            }
                            let at_ms = time.map(|time| {
                                time.seconds.saturating_mul(1_000)
                                    + i64::from(time.nanos / 1_000_000)
                            });
                            show_event(&display, &job, event, &mut running, at_ms);
                        }
                    }
                    // The stream ends after the event that makes the job terminal.
                    Ok(None) => break None,
                    // The watcher fell behind the scheduler's events: watch again.
                    Err(status) if status.code() == tonic::Code::DataLoss => {
                        display.line(&format!("({}; watching again)", status.message()));
                        break None;
                    }
                    Err(status) if connection_lost(&status) => break Some(status),
                    Err(status) => {
                        return Err(connection.failure(&status, &format!("watching job {job_id}")));
                    }
                }
            };
            if let Some(status) = broken {
                connection = reconnect(&connection, &display, &status).await?;
                continue;
            }
            let now = connection.fetch_job(job_id).await?;
            if is_terminal(&now) {
                return Ok(now);
            }
        }
    }
    .await;
    display.finish();
    result
}

/// Whether the scheduler a watch's stream comes from still answers: one read of the job
/// on that connection alone (no other replica), within the call's deadline. A leader
/// frozen mid-watch (SIGSTOP) keeps the stream open and sends nothing, and a quiet job
/// sends nothing either; only an answer tells them apart. `Err` (the status to report)
/// when it did not answer: the watch then moves on to a leader, from its last event.
async fn still_there(connection: &Connection, job_id: &str) -> Result<(), tonic::Status> {
    let request = v1::GetJobRequest {
        job_id: job_id.to_string(),
    };
    // The channel gives the call the deadline too; this one holds whatever the server
    // does with it.
    match tokio::time::timeout(connection.call_timeout, connection.jobs().get_job(request)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status))
            if connection_lost(&status) || status.code() == tonic::Code::DeadlineExceeded =>
        {
            Err(tonic::Status::unavailable(format!(
                "the watch heard nothing for {:?} and the scheduler did not answer ({})",
                connection.call_timeout,
                status.message()
            )))
        }
        // It answered (a refusal is an answer): the stream is only quiet.
        Ok(Err(_)) => Ok(()),
        Err(_) => Err(tonic::Status::unavailable(format!(
            "the watch heard nothing for {:?} and the scheduler did not answer within it",
            connection.call_timeout
        ))),
    }
}

/// The job's attempt that is running, if any.
fn running_attempt(job: &v1::Job) -> Option<v1::Attempt> {
    job.attempts
        .last()
        .filter(|attempt| attempt.outcome == v1::AttemptOutcome::Running as i32)
        .cloned()
}

/// Says the connection broke and opens it again (see [`Connection::reopen_within`]).
async fn reconnect(
    connection: &Connection,
    display: &Display,
    status: &tonic::Status,
) -> Result<Connection> {
    display.line(&format!(
        "(lost the scheduler at {}: {}; reconnecting)",
        connection.endpoint,
        status.message()
    ));
    connection.reopen_within(REOPEN_PATIENCE).await
}

/// "attempt 2 started on WORKER GPU in a 6 GiB slice: CONFIG (estimate E)".
fn attempt_placement(verb: &str, attempt: &v1::Attempt) -> String {
    format!(
        "attempt {} {verb} on {} {} in a {} slice: {} (estimate {})",
        attempt.number,
        attempt.worker_id,
        attempt.gpu_uuid,
        bytes_text(Some(attempt.slice_bytes)),
        config_text(attempt.config.as_ref()),
        bytes_text(Some(attempt.estimate_bytes))
    )
}

/// What a watch says while the job waits in the queue: its waiting reason, read again
/// every [`WAITING_REASON_INTERVAL`] while it is queued.
#[derive(Debug, Default)]
struct Waiting {
    /// The job's state, as the stream last said.
    state: i32,
    /// The last text shown, so a line is printed only when it changes.
    shown: String,
}

impl Waiting {
    fn wants_rereads(&self, running: Option<&v1::Attempt>) -> bool {
        self.state == v1::JobState::Queued as i32 && running.is_none()
    }

    /// Shows why `job` waits, when it is queued and the text changed.
    fn show(&mut self, display: &Display, job: &v1::Job) {
        self.state = job.state;
        let text = match v1::JobState::try_from(job.state) {
            Ok(v1::JobState::Queued) if job.waiting_reason.is_empty() => {
                "queued: waiting for a scheduling pass".to_string()
            }
            Ok(v1::JobState::Queued) => format!("queued: {}", job.waiting_reason),
            _ => return,
        };
        if text != self.shown {
            display.waiting(&text);
            self.shown = text;
        }
    }
}

fn show_event(
    display: &Display,
    job: &v1::Job,
    event: Event,
    running: &mut Option<v1::Attempt>,
    at_ms: Option<i64>,
) {
    match event {
        Event::StateChanged(changed) => {
            if changed.state == v1::JobState::Queued as i32 {
                // Back in the queue (an out-of-memory retry, a lost worker): the attempt
                // that ran is over.
                *running = None;
            }
            let state = job_state_name(changed.state);
            if changed.previous_state == v1::JobState::Unspecified as i32
                || changed.previous_state == changed.state
            {
                display.line(&format!("job {} ({}): {state}", job.id, job.name));
                // Joining a job midway: say where its attempt runs, which the stream
                // told before this watch began.
                if let Some(attempt) = job.attempts.last().filter(|attempt| {
                    attempt.outcome == v1::AttemptOutcome::Running as i32
                        && !is_terminal_state(changed.state)
                }) {
                    display.line(&attempt_placement("running", attempt));
                }
            } else {
                // Reasons often start with the state itself ("cancelled: not needed").
                let now = if changed.reason.is_empty() {
                    state
                } else if changed.reason.starts_with(&state) {
                    changed.reason
                } else {
                    format!("{state}: {}", changed.reason)
                };
                display.line(&format!(
                    "{} -> {now}",
                    job_state_name(changed.previous_state)
                ));
            }
        }
        Event::Progress(progress) => {
            if let Some(training) = &progress.progress {
                display.progress(progress.attempt_number, training, running.as_ref(), at_ms);
            }
        }
        Event::ImagePull(pull) => {
            if let Some(progress) = &pull.pull {
                display.line(&format!(
                    "attempt {}: {}",
                    pull.attempt_number,
                    super::attempt_results::image_pull_text(progress)
                ));
            }
        }
        Event::Oom(oom) => display.line(&format!(
            "attempt {} ran out of memory with {}: {}",
            oom.attempt_number,
            config_text(oom.config.as_ref()),
            oom.report.as_ref().map(oom_text).unwrap_or_default()
        )),
        Event::Shrink(decision) => {
            let steps: Vec<String> = decision
                .steps
                .iter()
                .map(|step| format!("{}: {}", step.strategy, step.description))
                .collect();
            display.line(&format!(
                "shrink: {} -> {} (needs {} of a {} budget){}",
                config_text(decision.old_config.as_ref()),
                config_text(decision.new_config.as_ref()),
                bytes_text(
                    decision
                        .estimate
                        .as_ref()
                        .map(|estimate| estimate.required_bytes)
                ),
                bytes_text(Some(decision.budget_bytes)),
                if steps.is_empty() {
                    String::new()
                } else {
                    format!("; {}", steps.join("; "))
                }
            ));
        }
        Event::AttemptStarted(attempt) => {
            display.line(&attempt_placement("started", &attempt));
            // The placement line says it off a terminal; the spinner says it on one.
            if let Display::Terminal { .. } = display {
                display.waiting(&format!(
                    "attempt {} placed; waiting for its first progress report",
                    attempt.number
                ));
            }
            *running = Some(attempt);
        }
        Event::AttemptFinished(attempt) => {
            let note = attempt_note(&attempt);
            display.line(&format!(
                "attempt {} finished: {}, peak {}{}",
                attempt.number,
                outcome_name(attempt.outcome).replace('_', " "),
                bytes_text(attempt.measured_peak_bytes),
                if note.is_empty() {
                    String::new()
                } else {
                    format!(" ({note})")
                }
            ));
        }
        Event::Log(line) => {
            let source = if line.attempt_number == 0 {
                "scheduler".to_string()
            } else {
                format!("attempt {}", line.attempt_number)
            };
            // A program's line says its stream; the worker's and scheduler's their level.
            let kind = if line.stream.is_empty() {
                &line.level
            } else {
                &line.stream
            };
            display.line(&format!("[{source}] {kind}: {}", line.message));
        }
    }
}

/// The exit code of a job that ended: success, or a failure naming how it ended.
pub fn job_exit(job: &v1::Job) -> Result<ExitCode> {
    let why = if job.message.is_empty() {
        String::new()
    } else {
        format!(": {}", job.message)
    };
    match v1::JobState::try_from(job.state) {
        Ok(v1::JobState::Succeeded) => Ok(ExitCode::SUCCESS),
        Ok(v1::JobState::Failed) => {
            let out_of_memory = job
                .attempts
                .last()
                .is_some_and(|attempt| attempt.outcome == v1::AttemptOutcome::OutOfMemory as i32);
            let kind = if out_of_memory {
                FailureKind::OutOfMemory
            } else {
                FailureKind::JobFailed
            };
            Err(
                ClientFailure::new(kind, format!("job {} ({}) failed{why}", job.id, job.name))
                    .into(),
            )
        }
        Ok(v1::JobState::Cancelled) => {
            let what = if job.message.starts_with("cancelled") {
                job.message.clone()
            } else {
                format!("was cancelled{why}")
            };
            Err(ClientFailure::new(
                FailureKind::JobCancelled,
                format!("job {} ({}) {what}", job.id, job.name),
            )
            .into())
        }
        _ => Err(ClientFailure::new(
            FailureKind::Other,
            format!("job {} is {}, not ended", job.id, job_state_name(job.state)),
        )
        .into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::failure::exit_code_for_error;

    fn ended(state: v1::JobState, last_outcome: v1::AttemptOutcome) -> v1::Job {
        v1::Job {
            id: "job-1".into(),
            name: "mnist".into(),
            state: state as i32,
            attempts: vec![v1::Attempt {
                number: 1,
                outcome: last_outcome as i32,
                ..v1::Attempt::default()
            }],
            message: "why".into(),
            ..v1::Job::default()
        }
    }

    fn code(job: &v1::Job) -> ExitCode {
        match job_exit(job) {
            Ok(code) => code,
            Err(error) => exit_code_for_error(&error),
        }
    }

    #[test]
    fn off_a_terminal_progress_is_a_line_a_second_and_the_last_is_kept() {
        let mut pacing = ProgressLinePacing::default();
        let mut printed = Vec::new();
        // A 3,000-step run reporting every 4 ms of its 12 s.
        for step in 1..=3_000_i64 {
            if let Some(line) = pacing.offer(format!("step {step}"), Some(step * 4)) {
                printed.push(line);
            }
        }
        printed.extend(pacing.take_held());
        assert!(printed.len() <= 13, "{} lines", printed.len());
        assert_eq!(printed.first().map(String::as_str), Some("step 1"));
        assert_eq!(printed.last().map(String::as_str), Some("step 3000"));
        assert_eq!(pacing.take_held(), None);
        // Without event times (an older scheduler) every line is printed.
        let mut untimed = ProgressLinePacing::default();
        assert!(untimed.offer("a".into(), None).is_some());
        assert!(untimed.offer("b".into(), None).is_some());
    }

    #[test]
    fn a_watched_job_exits_with_the_code_of_how_it_ended() {
        use v1::AttemptOutcome as Outcome;
        use v1::JobState as State;
        assert_eq!(
            code(&ended(State::Succeeded, Outcome::Succeeded)),
            ExitCode::SUCCESS
        );
        assert_eq!(
            code(&ended(State::Failed, Outcome::OutOfMemory)),
            ExitCode::from(FailureKind::OutOfMemory)
        );
        assert_eq!(
            code(&ended(State::Failed, Outcome::Failed)),
            ExitCode::from(FailureKind::JobFailed)
        );
        assert_eq!(
            code(&ended(State::Cancelled, Outcome::Cancelled)),
            ExitCode::from(FailureKind::JobCancelled)
        );
        assert_eq!(
            code(&ended(State::Running, Outcome::Running)),
            ExitCode::from(FailureKind::Other)
        );
        let error = job_exit(&ended(State::Failed, Outcome::Failed)).unwrap_err();
        assert_eq!(error.to_string(), "job job-1 (mnist) failed: why");
    }
}
