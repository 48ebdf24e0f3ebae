//! The reports that end a command job's attempt: its `AttemptFinished` (with what its
//! run left: loss, accuracy, metrics, steps, peak) and, for an OOM, the `OomReport`
//! before it.

use carve_core::command::oom::CommandRunEnd;
use carve_proto::v1;
use carve_proto::v1::worker_message::Body;

use super::{RunEnd, RunRecord};
use crate::attempt_process::{AttemptControl, WorkerStop};

/// The stop a control message asks for (a profile stopped between two runs).
pub(super) fn stop_of(control: AttemptControl) -> WorkerStop {
    match control {
        AttemptControl::Cancel { reason, .. } => WorkerStop::Cancelled(reason),
        AttemptControl::StopAsFailed { reason, .. } => WorkerStop::Failed(reason),
        AttemptControl::StopWithoutLeader { reason, .. } => WorkerStop::Interrupted(reason),
    }
}

/// The one final report of an attempt that ends without results.
pub(super) fn ended(
    attempt: &v1::AttemptRef,
    outcome: v1::AttemptOutcome,
    message: String,
) -> Vec<Body> {
    vec![Body::AttemptFinished(finished(
        attempt, outcome, message, None,
    ))]
}

pub(super) fn finished(
    attempt: &v1::AttemptRef,
    outcome: v1::AttemptOutcome,
    message: String,
    record: Option<&RunRecord>,
) -> v1::worker_message::AttemptFinished {
    v1::worker_message::AttemptFinished {
        attempt: Some(attempt.clone()),
        outcome: outcome as i32,
        final_loss: record.and_then(|record| record.progress.loss),
        test_accuracy: record.and_then(|record| record.progress.accuracy),
        measured_peak_bytes: record.map_or(0, |record| record.peak_bytes),
        message,
        steps_done: record.and_then(|record| record.progress.step),
        samples_per_second: record.and_then(|record| record.progress.samples_per_second),
        profile_points: Vec::new(),
        metrics: record.map_or_else(Vec::new, |record| {
            record
                .progress
                .metrics
                .metrics()
                .iter()
                .map(|metric| v1::Metric {
                    name: metric.name.clone(),
                    value: metric.value,
                })
                .collect()
        }),
    }
}

/// The final reports of a training attempt's run.
pub fn training_final_reports(attempt: &v1::AttemptRef, record: RunRecord) -> Vec<Body> {
    let end = |outcome, message| {
        Body::AttemptFinished(finished(attempt, outcome, message, Some(&record)))
    };
    match &record.end {
        RunEnd::NotStarted(message) => vec![end(v1::AttemptOutcome::Failed, message.clone())],
        RunEnd::Stopped(stop) => {
            let (outcome, reason) = stop.clone().outcome_and_reason();
            vec![end(outcome, reason)]
        }
        RunEnd::Exited(CommandRunEnd::Succeeded) => {
            vec![end(v1::AttemptOutcome::Succeeded, String::new())]
        }
        RunEnd::Exited(CommandRunEnd::Failed { message }) => {
            vec![end(v1::AttemptOutcome::Failed, message.clone())]
        }
        RunEnd::Exited(CommandRunEnd::Interrupted { message }) => {
            vec![end(v1::AttemptOutcome::Interrupted, message.clone())]
        }
        RunEnd::Exited(CommandRunEnd::OutOfMemory {
            source,
            report,
            evidence,
        }) => vec![
            Body::Oom(v1::worker_message::OomReport {
                attempt: Some(attempt.clone()),
                report: Some(v1::OutOfMemoryReport::from(*report)),
                // Its reported checkpoints went out as `CheckpointWritten` before this
                // (the run's recorder finished first); None keeps the recorded one.
                checkpoint: None,
                detected_by: source.name().to_string(),
                evidence: evidence.clone(),
            }),
            end(v1::AttemptOutcome::OutOfMemory, String::new()),
        ],
    }
}
