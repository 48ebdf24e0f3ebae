//! Job events and job logs: every event is sent to watchers and, but for progress, makes
//! a log line telling the job's story.

use std::sync::atomic::Ordering;

use carve_core::allocator::OutOfMemory;
use carve_core::job_state::JobState;
use carve_proto::v1;

use crate::auth::Caller;
use crate::convert::{job_state_to_proto, timestamp};
use crate::error::SchedulerError;

use super::{Scheduler, StateChange, now_ms};

impl Scheduler {
    /// Sends an event to watchers, and stores the job log line it makes (worker lines,
    /// and the scheduler's notes on state changes, OOMs, shrinks and placements) — queued
    /// before the event is sent, so a watcher that saw the event and then reads the logs
    /// finds the line.
    pub(super) fn emit(&self, job_id: &str, event: v1::job_event::Event) {
        let time_ms = now_ms();
        if let Some(line) = log_line_for_event(job_id, time_ms, &event) {
            self.logs.append(line);
        }
        let _ = self.events.send(v1::JobEvent {
            job_id: job_id.to_string(),
            sequence: self.event_sequence.fetch_add(1, Ordering::Relaxed),
            time: Some(timestamp(time_ms)),
            event: Some(event),
        });
    }

    /// Lines of a job the caller may see (NotFound for another tenant's job), after
    /// writing every line received so far, so a reader sees what the scheduler has.
    pub async fn job_logs(
        &self,
        caller: &Caller,
        query: &crate::store::LogQuery,
    ) -> Result<crate::store::LogPage, SchedulerError> {
        self.visible_job(caller, &query.job_id).await?;
        self.logs.flush().await;
        self.store.read_log_lines(query).await
    }

    /// Writes the log lines received so far (a graceful shutdown calls it last).
    pub async fn flush_logs(&self) {
        self.logs.flush().await;
    }

    pub(super) fn emit_state(&self, job_id: &str, change: StateChange, reason: &str) {
        self.emit(
            job_id,
            v1::job_event::Event::StateChanged(v1::job_event::StateChanged {
                previous_state: job_state_to_proto(change.previous) as i32,
                state: job_state_to_proto(change.next) as i32,
                reason: reason.to_string(),
            }),
        );
    }
}

/// The job log line an event makes, if any: a worker's line under its attempt number, or
/// one of the scheduler's notes (attempt 0) telling the job's story — state changes with
/// their reasons, out-of-memory reports, shrink decisions and where attempts run.
/// Progress is left out: it is frequent and `carve get` shows the latest.
fn log_line_for_event(
    job_id: &str,
    time_ms: i64,
    event: &v1::job_event::Event,
) -> Option<crate::store::NewLogLine> {
    use carve_core::bytes::HumanBytes;
    use v1::job_event::Event;
    let (attempt_number, level, message) = match event {
        Event::Log(line) => (
            line.attempt_number,
            line.level.as_str(),
            line.message.clone(),
        ),
        Event::StateChanged(changed) => {
            let name = |state: i32| {
                v1::JobState::try_from(state)
                    .ok()
                    .and_then(crate::convert::job_state_from_proto)
                    .map_or("unknown", JobState::name)
            };
            let (previous, state) = (name(changed.previous_state), name(changed.state));
            let level = match (previous, state) {
                (_, "failed") => "error",
                (_, "cancelled") => "warn",
                // Back in the queue from a slice: an OOM retry or a lost lease.
                ("placed" | "running", "queued") => "warn",
                _ => "info",
            };
            let message = match (previous == state, changed.reason.is_empty()) {
                (true, _) => format!("job {}", changed.reason),
                (false, true) => format!("{previous} -> {state}"),
                (false, false) => format!("{previous} -> {state}: {}", changed.reason),
            };
            (0, level, message)
        }
        Event::Oom(oom) => {
            let report: OutOfMemory = oom.report.unwrap_or_default().into();
            (
                0,
                "warn",
                format!("attempt {} ran {report}", oom.attempt_number),
            )
        }
        Event::Shrink(decision) => {
            let steps: Vec<&str> = decision
                .steps
                .iter()
                .map(|step| step.description.as_str())
                .collect();
            let estimate = decision
                .estimate
                .as_ref()
                .map_or(0, |estimate| estimate.required_bytes);
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
        Event::AttemptStarted(attempt) => {
            let resume = attempt
                .resumed_from
                .as_ref()
                .filter(|checkpoint| !checkpoint.location.is_empty())
                .map(|checkpoint| format!(", from checkpoint {}", checkpoint.location))
                .unwrap_or_default();
            (
                0,
                "info",
                format!(
                    "attempt {} assigned: a {} slice of {} on {} (estimated need {}){resume}",
                    attempt.number,
                    HumanBytes(attempt.slice_bytes),
                    attempt.gpu_uuid,
                    attempt.worker_id,
                    HumanBytes(attempt.estimate_bytes)
                ),
            )
        }
        Event::AttemptFinished(attempt) => {
            let outcome = v1::AttemptOutcome::try_from(attempt.outcome)
                .map_or("unknown", |outcome| outcome.as_str_name());
            (
                0,
                "info",
                format!("attempt {} ended: {outcome}", attempt.number),
            )
        }
        Event::Progress(_) => return None,
    };
    Some(crate::store::NewLogLine::normalized(
        job_id,
        time_ms,
        i64::from(attempt_number),
        level,
        &message,
    ))
}
