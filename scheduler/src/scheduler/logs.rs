//! Job events and job logs: every event is sent to watchers and makes a log line telling
//! the job's story: the scheduler's notes (attempt 0), and under each attempt's number its
//! output (a command's marked with its stream), its progress, its checkpoints and its
//! results.
//!
//! Progress is paced: at most one progress event a second per job is sent and stored
//! ([`ProgressPacing`]); one that comes sooner is held, replaced by any later one, and
//! sent before the job's next other event or once its second has passed (the background
//! loop's next turn), so the last progress is always told. A worker
//! reporting every step of a fast run makes a line a second, not one per step.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use carve_core::allocator::OutOfMemory;
use carve_core::job_state::JobState;
use carve_core::plan::RunConfig;
use carve_core::shrink::ShrinkDecision;

use crate::auth::Caller;
use crate::error::SchedulerError;
use crate::store::{AttemptRecord, AttemptResults};

use super::worker_reports::{AttemptRef, TrainingProgress};
use super::{Scheduler, StateChange, now_ms};

/// What watchers of a job are told, as the scheduler's own type; the watch handler makes
/// the wire event of it (`convert::job_update_to_proto`), and the encoder the scheduler
/// was built with ([`EncodeJobEvent`]) the bytes its log line stores.
#[derive(Debug, Clone, PartialEq)]
pub struct JobUpdate {
    pub job_id: String,
    /// Counts up across all jobs' updates of this scheduler.
    pub sequence: u64,
    pub time_ms: i64,
    pub kind: JobUpdateKind,
}

/// What happened to the job.
#[derive(Debug, Clone, PartialEq)]
pub enum JobUpdateKind {
    StateChanged {
        previous: JobState,
        state: JobState,
        reason: String,
    },
    Progress {
        attempt_number: u32,
        progress: Option<TrainingProgress>,
    },
    /// The attempt's worker is pulling its image (paced like progress; no log line of
    /// its own: the worker's lines say it).
    ImagePull {
        attempt_number: u32,
        pull: super::worker_reports::ImagePullProgress,
    },
    OutOfMemory {
        attempt_number: u32,
        /// The configuration that did not fit.
        config: RunConfig,
        report: OutOfMemory,
    },
    /// The shrink planner chose the configuration that replaces `old_config`.
    Shrink {
        old_config: RunConfig,
        decision: ShrinkDecision,
    },
    AttemptStarted(AttemptRecord),
    /// A line the attempt's worker sent.
    Log {
        attempt_number: u32,
        level: String,
        message: String,
        /// "stdout" or "stderr" for a command's program output; empty otherwise.
        stream: String,
    },
}

/// The least time between two progress events of one job that are sent and stored.
pub const PROGRESS_EVENT_SPACING_MS: i64 = 1_000;

/// Per job: when its last progress event went out, and the one held back since.
#[derive(Debug, Default)]
pub struct ProgressPacing {
    jobs: Mutex<HashMap<String, PacedProgress>>,
}

#[derive(Debug, Default)]
struct PacedProgress {
    last_sent_ms: Option<i64>,
    held: Option<JobUpdateKind>,
}

impl ProgressPacing {
    /// A progress event of `job_id` at `now_ms`: `Some` to send it now, `None` when it
    /// is held back (it replaces an earlier held one).
    fn progress(&self, job_id: &str, now_ms: i64, kind: JobUpdateKind) -> Option<JobUpdateKind> {
        let mut jobs = self
            .jobs
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let paced = jobs.entry(job_id.to_string()).or_default();
        if paced
            .last_sent_ms
            .is_some_and(|last| now_ms.saturating_sub(last) < PROGRESS_EVENT_SPACING_MS)
        {
            paced.held = Some(kind);
            return None;
        }
        paced.last_sent_ms = Some(now_ms);
        paced.held = None;
        Some(kind)
    }

    /// Every held progress whose second has passed at `now_ms`, taken (a job that goes
    /// quiet after a held report still tells it, on the background loop's next turn).
    fn take_due(&self, now_ms: i64) -> Vec<(String, JobUpdateKind)> {
        let mut jobs = self
            .jobs
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let mut due = Vec::new();
        for (job_id, paced) in jobs.iter_mut() {
            let ready = paced
                .last_sent_ms
                .is_none_or(|last| now_ms.saturating_sub(last) >= PROGRESS_EVENT_SPACING_MS);
            if ready && let Some(held) = paced.held.take() {
                paced.last_sent_ms = Some(now_ms);
                due.push((job_id.clone(), held));
            }
        }
        due
    }

    /// The progress held back for `job_id`, to send before its next other event; a job
    /// that ended is forgotten.
    fn take_held(&self, job_id: &str, now_ms: i64, forget: bool) -> Option<JobUpdateKind> {
        let mut jobs = self
            .jobs
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let held = jobs.get_mut(job_id).and_then(|paced| {
            let held = paced.held.take();
            if held.is_some() {
                paced.last_sent_ms = Some(now_ms);
            }
            held
        });
        if forget {
            jobs.remove(job_id);
        }
        held
    }
}

/// A job update as its log line stores it (`job_log_lines.event`, what a resumed watch
/// replays): the wire's `JobEvent`, encoded. The layer that owns the wire hands it to the
/// scheduler at construction (`Scheduler::new`, `convert::job_update_to_stored_event`),
/// so the scheduler stores events without naming the wire.
pub type EncodeJobEvent = fn(&JobUpdate) -> Vec<u8>;

impl JobUpdate {
    /// Whether the job ended with this update: a watch stops after it.
    pub fn ends_the_job(&self) -> bool {
        matches!(&self.kind, JobUpdateKind::StateChanged { state, .. } if state.is_terminal())
    }
}

impl Scheduler {
    /// Sends an event to watchers, and stores the job log line it makes (worker lines,
    /// and the scheduler's notes on state changes, OOMs, shrinks and placements) — queued
    /// before the event is sent, so a watcher that saw the event and then reads the logs
    /// finds the line.
    ///
    /// A line made from an event other than a log line keeps the event, encoded, so a
    /// watch resumed from the store ([`Scheduler::stored_job_events`]) replays it as it
    /// was sent.
    pub(super) fn emit(&self, job_id: &str, kind: JobUpdateKind) {
        let now = now_ms();
        let kind = if matches!(
            kind,
            JobUpdateKind::Progress { .. } | JobUpdateKind::ImagePull { .. }
        ) {
            match self.progress_pacing.progress(job_id, now, kind) {
                Some(kind) => kind,
                None => return,
            }
        } else {
            let ends =
                matches!(&kind, JobUpdateKind::StateChanged { state, .. } if state.is_terminal());
            if let Some(held) = self.progress_pacing.take_held(job_id, now, ends) {
                self.emit_now(job_id, held);
            }
            kind
        };
        self.emit_now(job_id, kind);
    }

    /// Sends the progress held back for jobs whose second has passed (the background
    /// loop calls it on every turn).
    pub fn release_held_progress(&self) {
        for (job_id, held) in self.progress_pacing.take_due(now_ms()) {
            self.emit_now(&job_id, held);
        }
    }

    /// [`Scheduler::emit`] without the pacing.
    fn emit_now(&self, job_id: &str, kind: JobUpdateKind) {
        let update = JobUpdate {
            job_id: job_id.to_string(),
            sequence: self.event_sequence.fetch_add(1, Ordering::Relaxed),
            time_ms: now_ms(),
            kind,
        };
        if let Some(mut line) = log_line_for_event(job_id, update.time_ms, &update.kind) {
            if !matches!(update.kind, JobUpdateKind::Log { .. }) {
                line.event = Some((self.encode_event)(&update));
            }
            self.logs.append(line);
        }
        let _ = self.events.send(update);
    }

    /// Up to `limit` stored events of a job after `after_sequence` (log sequences),
    /// after writing every line received so far: what a resumable watch sends.
    pub async fn stored_job_events(
        &self,
        job_id: &str,
        after_sequence: i64,
        limit: u32,
    ) -> Result<Vec<crate::store::StoredJobEvent>, SchedulerError> {
        self.logs.flush().await;
        self.store
            .read_job_events(job_id, after_sequence, limit)
            .await
    }

    /// The log sequence of a job's last stored event, after writing every line received
    /// so far: where a resumable watch that starts now begins.
    pub async fn last_job_event_sequence(&self, job_id: &str) -> Result<i64, SchedulerError> {
        self.logs.flush().await;
        self.store.last_log_sequence(job_id).await
    }

    /// Lines of a job the caller may see (NotFound for another tenant's job; the query's
    /// `job_id` may be any reference [`Scheduler::visible_job`] takes), after
    /// writing every line received so far, so a reader sees what the scheduler has.
    pub async fn job_logs(
        &self,
        caller: &Caller,
        query: &crate::store::LogQuery,
    ) -> Result<crate::store::LogPage, SchedulerError> {
        let job = self.visible_job(caller, &query.job_id).await?;
        self.logs.flush().await;
        self.store
            .read_log_lines(&crate::store::LogQuery {
                job_id: job.id,
                ..query.clone()
            })
            .await
    }

    /// Writes the log lines received so far (a graceful shutdown calls it last).
    pub async fn flush_logs(&self) {
        self.logs.flush().await;
    }

    /// A line of the attempt's story that no event of its own makes (where it resumed,
    /// a checkpoint), under the attempt's number.
    pub(super) fn emit_attempt_line(&self, attempt: &AttemptRef, message: String) {
        self.emit(
            &attempt.job_id,
            JobUpdateKind::Log {
                attempt_number: attempt.attempt_number,
                level: "info".into(),
                message,
                stream: String::new(),
            },
        );
    }

    /// The attempt's results as a line of its log, when it reported any.
    pub(super) fn log_results(&self, job_id: &str, attempt_number: u32, results: &AttemptResults) {
        let mut parts = Vec::new();
        if let Some(steps) = results.steps_done {
            parts.push(format!("{steps} steps"));
        }
        if let Some(loss) = results.final_loss {
            parts.push(format!("final loss {loss:.4}"));
        }
        if let Some(accuracy) = results.test_accuracy {
            parts.push(format!("test accuracy {:.2}%", accuracy * 100.0));
        }
        if let Some(rate) = results.samples_per_second {
            parts.push(format!("{rate:.0} samples/s"));
        }
        for metric in &results.metrics {
            parts.push(format!("{} {}", metric.name, metric.value));
        }
        if parts.is_empty() {
            return;
        }
        let attempt = AttemptRef {
            job_id: job_id.to_string(),
            attempt_number,
            lease_epoch: 0,
        };
        self.emit_attempt_line(&attempt, format!("ended: {}", parts.join(", ")));
    }

    pub(super) fn emit_state(&self, job_id: &str, change: StateChange, reason: &str) {
        self.emit(
            job_id,
            JobUpdateKind::StateChanged {
                previous: change.previous,
                state: change.next,
                reason: reason.to_string(),
            },
        );
    }
}

/// The job log line an event makes, if any: a worker's line under its attempt number, or
/// one of the scheduler's notes (attempt 0) telling the job's story — state changes with
/// their reasons, out-of-memory reports, shrink decisions and where attempts run. A
/// progress report is a line of its attempt: [`Scheduler::emit`] lets at most one a
/// second per job through, and the newest lines a job keeps are bounded.
fn log_line_for_event(
    job_id: &str,
    time_ms: i64,
    event: &JobUpdateKind,
) -> Option<crate::store::NewLogLine> {
    use carve_core::bytes::HumanBytes;
    let (attempt_number, level, message) = match event {
        JobUpdateKind::Log {
            attempt_number,
            level,
            message,
            stream,
        } => {
            return Some(
                crate::store::NewLogLine::normalized(
                    job_id,
                    time_ms,
                    i64::from(*attempt_number),
                    level,
                    message,
                )
                .from_stream(stream),
            );
        }
        JobUpdateKind::StateChanged {
            previous,
            state,
            reason,
        } => {
            let level = match (previous, state) {
                (_, JobState::Failed) => "error",
                (_, JobState::Cancelled) => "warn",
                // Back in the queue from a slice: an OOM retry or a lost lease.
                (JobState::Placed | JobState::Running, JobState::Queued) => "warn",
                _ => "info",
            };
            let message = match (previous == state, reason.is_empty()) {
                (true, _) => format!("job {reason}"),
                (false, true) => format!("{previous} -> {state}"),
                (false, false) => format!("{previous} -> {state}: {reason}"),
            };
            (0, level, message)
        }
        JobUpdateKind::OutOfMemory {
            attempt_number,
            report,
            ..
        } => (0, "warn", format!("attempt {attempt_number} ran {report}")),
        JobUpdateKind::Shrink { decision, .. } => {
            let steps: Vec<&str> = decision
                .steps
                .iter()
                .map(|step| step.description.as_str())
                .collect();
            let estimate = decision.estimate.required_bytes;
            (
                0,
                "info",
                format!(
                    "shrink decision: {} (needs {} of a {} budget)",
                    if steps.is_empty() {
                        "no change".to_string()
                    } else {
                        steps.join("; ")
                    },
                    HumanBytes(estimate),
                    HumanBytes(decision.budget_bytes)
                ),
            )
        }
        JobUpdateKind::AttemptStarted(attempt) => {
            let resume = attempt
                .resumed_from
                .as_ref()
                .filter(|location| !location.is_empty())
                .map(|location| format!(", from checkpoint {location}"))
                .unwrap_or_default();
            (
                0,
                "info",
                format!(
                    "attempt {} assigned: a {} slice of {} on {} (estimated need {}){resume}",
                    attempt.attempt_number,
                    HumanBytes(attempt.slice_bytes as u64),
                    attempt.gpu_id,
                    attempt.worker_id,
                    HumanBytes(attempt.estimate_bytes as u64)
                ),
            )
        }
        JobUpdateKind::ImagePull { .. } => return None,
        JobUpdateKind::Progress {
            attempt_number,
            progress,
        } => {
            let progress = progress.as_ref()?;
            (
                *attempt_number,
                "info",
                format!(
                    "step {}/{}: loss {:.4}, {:.0} samples/s, {} in use (peak {})",
                    progress.step,
                    progress.total_steps,
                    progress.loss,
                    progress.samples_per_second,
                    HumanBytes(progress.memory_in_use_bytes),
                    HumanBytes(progress.memory_peak_bytes)
                ),
            )
        }
    };
    Some(crate::store::NewLogLine::normalized(
        job_id,
        time_ms,
        i64::from(attempt_number),
        level,
        &message,
    ))
}
