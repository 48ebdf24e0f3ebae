//! Between the scheduler's types and the wire, in one place: jobs and attempts as
//! generated protobuf messages for the handlers (their run configs and estimates read
//! from the store's JSON columns, `store/json_columns.rs`); job updates as watch events,
//! and as the bytes their log lines store (the encoder the server hands the scheduler);
//! what workers send (registration, session reports) into the scheduler's own types
//! (`scheduler/worker_reports.rs`).
//!
//! This module is above the scheduler: it uses the scheduler's types, and the scheduler
//! never names it (`scheduler/tests/module_layers.rs`).
//!
//! A job is read far more often than it is submitted (listings, watches, every poll of
//! `carve status`), so reads show the estimate stored with the job at submit (and at
//! each shrink) and never validate or estimate its spec again: for large specs that
//! cost seconds per job.

use std::time::Duration;

use carve_core::allocator::OutOfMemory;
use carve_core::command::metrics::{Metric, MetricSet};
use carve_core::command::oom::OomSource;
use carve_core::estimator::MemoryEstimate;
use carve_core::job_state::{AttemptOutcome, JobState};
use carve_core::plan::RunConfig;
use carve_proto::ApiError;
use carve_proto::v1;

use crate::error::SchedulerError;
use crate::scheduler::job_images::{MAX_CACHED_IMAGES_READ, is_manifest_digest};
use crate::scheduler::worker_reports::{
    AttemptRef, Checkpoint, Gpu, GpuFreeBytes, ImagePullProgress, Registered, TrainingProgress,
    WorkerCommand, WorkerRegistration, WorkerReport,
};
use crate::scheduler::{JobUpdate, JobUpdateKind, SliceView, SubmittedJob, WorkerView};
use crate::store::{AttemptRecord, AttemptResults, JobRecord, StoredEstimate, WorkerState};

mod usage;
pub use usage::{usage_answer_to_proto, usage_request_from_proto};

pub fn timestamp(milliseconds: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: milliseconds.div_euclid(1000),
        nanos: (milliseconds.rem_euclid(1000) * 1_000_000) as i32,
    }
}

pub fn job_state_to_proto(state: JobState) -> v1::JobState {
    match state {
        JobState::Queued => v1::JobState::Queued,
        JobState::Placed => v1::JobState::Placed,
        JobState::Running => v1::JobState::Running,
        JobState::Succeeded => v1::JobState::Succeeded,
        JobState::Failed => v1::JobState::Failed,
        JobState::Cancelled => v1::JobState::Cancelled,
    }
}

pub fn job_state_from_proto(state: v1::JobState) -> Option<JobState> {
    match state {
        v1::JobState::Queued => Some(JobState::Queued),
        v1::JobState::Placed => Some(JobState::Placed),
        v1::JobState::Running => Some(JobState::Running),
        v1::JobState::Succeeded => Some(JobState::Succeeded),
        v1::JobState::Failed => Some(JobState::Failed),
        v1::JobState::Cancelled => Some(JobState::Cancelled),
        v1::JobState::Unspecified => None,
    }
}

pub fn outcome_to_proto(outcome: AttemptOutcome) -> v1::AttemptOutcome {
    match outcome {
        AttemptOutcome::Running => v1::AttemptOutcome::Running,
        AttemptOutcome::Succeeded => v1::AttemptOutcome::Succeeded,
        AttemptOutcome::OutOfMemory => v1::AttemptOutcome::OutOfMemory,
        AttemptOutcome::Failed => v1::AttemptOutcome::Failed,
        AttemptOutcome::Cancelled => v1::AttemptOutcome::Cancelled,
        AttemptOutcome::Lost => v1::AttemptOutcome::Lost,
        AttemptOutcome::Interrupted => v1::AttemptOutcome::Interrupted,
        AttemptOutcome::Preempted => v1::AttemptOutcome::Preempted,
    }
}

/// The outcome a worker reports: only those that end an attempt are reports.
pub fn outcome_from_proto(outcome: v1::AttemptOutcome) -> Option<AttemptOutcome> {
    match outcome {
        v1::AttemptOutcome::Succeeded => Some(AttemptOutcome::Succeeded),
        v1::AttemptOutcome::OutOfMemory => Some(AttemptOutcome::OutOfMemory),
        v1::AttemptOutcome::Failed => Some(AttemptOutcome::Failed),
        v1::AttemptOutcome::Cancelled => Some(AttemptOutcome::Cancelled),
        v1::AttemptOutcome::Lost => Some(AttemptOutcome::Lost),
        v1::AttemptOutcome::Interrupted => Some(AttemptOutcome::Interrupted),
        // Only the scheduler decides an attempt was preempted.
        v1::AttemptOutcome::Preempted
        | v1::AttemptOutcome::Running
        | v1::AttemptOutcome::Unspecified => None,
    }
}

fn oom_to_proto(report: &OutOfMemory) -> v1::OutOfMemoryReport {
    v1::OutOfMemoryReport {
        requested_bytes: report.requested,
        in_use_bytes: report.in_use,
        limit_bytes: report.limit,
        largest_free_bytes: report.largest_free,
        peak_bytes: report.peak,
    }
}

pub fn attempt_to_proto(attempt: &AttemptRecord) -> v1::Attempt {
    v1::Attempt {
        number: attempt.attempt_number as u32,
        // A config it cannot read shows none (the attempt's other fields still show).
        config: attempt.config().ok().map(Into::into),
        estimate_bytes: attempt.estimate_bytes as u64,
        slice_bytes: attempt.slice_bytes as u64,
        measured_peak_bytes: attempt.measured_peak_bytes.map(|bytes| bytes as u64),
        worker_id: attempt.worker_id.clone(),
        gpu_uuid: attempt.gpu_id.clone(),
        outcome: outcome_to_proto(attempt.outcome) as i32,
        oom: attempt.oom.as_ref().map(oom_to_proto),
        failure_message: attempt.message.clone(),
        started_at: Some(timestamp(attempt.started_at_ms)),
        finished_at: attempt.finished_at_ms.map(timestamp),
        resumed_from: attempt.resumed_from.clone().map(|location| v1::Checkpoint {
            step: attempt.resumed_from_step.max(0) as u64,
            location,
        }),
        final_loss: attempt.results.final_loss,
        test_accuracy: attempt.results.test_accuracy,
        steps_done: attempt.results.steps_done.map(|steps| steps.max(0) as u64),
        samples_per_second: attempt.results.samples_per_second,
        metrics: attempt
            .results
            .metrics
            .iter()
            .map(|metric| v1::Metric {
                name: metric.name.clone(),
                value: metric.value,
            })
            .collect(),
        progress: None,
        image_pull: None,
        command_argv: attempt.details.command_argv.clone(),
        chosen_because: attempt.details.chosen_because.clone(),
        profile: attempt.details.profile,
        profile_points: attempt
            .details
            .profile_points
            .iter()
            .copied()
            .map(Into::into)
            .collect(),
        oom_detected_by: attempt
            .details
            .oom_detected_by
            .map(|source| source.name().to_string())
            .unwrap_or_default(),
        uncontained: attempt.details.uncontained,
    }
}

/// Puts a running attempt's latest progress (held in the scheduler's memory, not stored)
/// on that attempt of `job`, when it is still running.
pub fn attach_progress(job: &mut v1::Job, attempt_number: u32, progress: &TrainingProgress) {
    if let Some(attempt) = job.attempts.iter_mut().find(|attempt| {
        attempt.number == attempt_number && attempt.outcome == v1::AttemptOutcome::Running as i32
    }) {
        attempt.progress = Some(progress_to_proto(progress));
    }
}

/// Puts what is known of a job's image on it: the digest its first pull resolved, and
/// the pull a placed attempt's worker reports (held in memory, like progress).
pub fn attach_image(
    job: &mut v1::Job,
    digest: Option<&str>,
    pull: Option<&(u32, ImagePullProgress)>,
) {
    if let Some(digest) = digest {
        job.image_digest = digest.to_string();
    }
    if let Some((attempt_number, pull)) = pull
        && let Some(attempt) = job.attempts.iter_mut().find(|attempt| {
            attempt.number == *attempt_number
                && attempt.outcome == v1::AttemptOutcome::Running as i32
        })
    {
        attempt.image_pull = Some(image_pull_to_proto(pull));
    }
}

/// A pull's progress as the API shows it.
pub fn image_pull_to_proto(pull: &ImagePullProgress) -> v1::ImagePull {
    v1::ImagePull {
        image: pull.image.clone(),
        done_bytes: pull.done_bytes,
        total_bytes: pull.total_bytes,
    }
}

/// A job's stored estimate (`JobRecord::estimate`), for the configuration `config` (the
/// row's own), as the API shows it.
pub fn estimate_to_proto(stored: StoredEstimate, config: Option<RunConfig>) -> v1::MemoryEstimate {
    v1::MemoryEstimate {
        config: config.map(Into::into),
        peak_bytes: stored.peak_bytes,
        required_bytes: stored.required_bytes,
        persistent_bytes: stored.persistent_bytes,
        fragmentation_at_peak: stored.fragmentation_at_peak,
        by_category: stored
            .by_category
            .into_iter()
            .map(|entry| v1::CategoryBytes {
                category: entry.category,
                bytes: entry.bytes,
            })
            .collect(),
        by_layer: stored
            .by_layer
            .into_iter()
            .map(|entry| v1::LayerBytes {
                layer: entry.layer,
                bytes: entry.bytes,
            })
            .collect(),
        fragmentation_bytes_at_peak: stored.fragmentation_bytes_at_peak,
        peak_during: stored.peak_during,
    }
}

/// A job with its attempts and the estimate stored with it: nothing is validated or
/// estimated, whatever the spec's size. `Internal` when the stored configuration or
/// estimate cannot be read (a corrupt row must not read as a job that needs no memory).
pub fn job_to_proto(
    job: &JobRecord,
    attempts: &[AttemptRecord],
) -> Result<v1::Job, SchedulerError> {
    let config = job.config()?;
    let estimate = estimate_to_proto(job.estimate()?, Some(config));
    let mut message = job_proto_from_parts(job, attempts, Some(config), None);
    message.estimate = Some(estimate);
    Ok(message)
}

/// A job whose current configuration and its estimate the caller already holds (admission
/// just computed them), so nothing is parsed or estimated again.
pub fn job_proto_from_parts(
    job: &JobRecord,
    attempts: &[AttemptRecord],
    config: Option<RunConfig>,
    estimate: Option<&MemoryEstimate>,
) -> v1::Job {
    v1::Job {
        id: job.id.clone(),
        tenant: job.tenant.clone(),
        name: job.name.clone(),
        spec_json: job.spec_json.clone(),
        state: job_state_to_proto(job.state) as i32,
        priority: job.priority as i32,
        created_at: Some(timestamp(job.created_at_ms)),
        estimate: estimate.map(Into::into),
        waiting_reason: job.waiting_reason.clone(),
        attempts: attempts.iter().map(attempt_to_proto).collect(),
        current_config: config.map(Into::into),
        finished_at: job.finished_at_ms.map(timestamp),
        message: job.message.clone(),
        memory_model: None,
        // Set by reads that know it (`attach_image`).
        image_digest: String::new(),
    }
}

/// A GPU a worker offers, as it registered it (its slices are empty).
fn gpu_from_proto(gpu: v1::Gpu) -> Gpu {
    Gpu {
        uuid: gpu.uuid,
        index: gpu.index,
        model_name: gpu.model_name,
        total_bytes: gpu.total_bytes,
        context_bytes: gpu.context_bytes,
        free_bytes: gpu.free_bytes,
        simulated: gpu.simulated,
        compute_capability: gpu.compute_capability,
    }
}

/// A GPU as the API shows it, with the slices running on it.
pub fn gpu_to_proto(gpu: &Gpu, slices: Vec<v1::Slice>) -> v1::Gpu {
    v1::Gpu {
        uuid: gpu.uuid.clone(),
        index: gpu.index,
        model_name: gpu.model_name.clone(),
        total_bytes: gpu.total_bytes,
        context_bytes: gpu.context_bytes,
        free_bytes: gpu.free_bytes,
        simulated: gpu.simulated,
        slices,
        compute_capability: gpu.compute_capability.clone(),
    }
}

pub fn registration_from_proto(request: v1::RegisterWorkerRequest) -> WorkerRegistration {
    WorkerRegistration {
        gpus: request.gpus.into_iter().map(gpu_from_proto).collect(),
        hostname: request.hostname,
        version: request.version,
        previous_worker_id: request.previous_worker_id,
    }
}

fn duration_to_proto(duration: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: duration.as_secs() as i64,
        nanos: duration.subsec_nanos() as i32,
    }
}

pub fn registered_to_proto(registered: Registered) -> v1::RegisterWorkerResponse {
    v1::RegisterWorkerResponse {
        worker_id: registered.worker_id,
        heartbeat_interval: Some(duration_to_proto(registered.heartbeat_interval)),
        lease_duration: Some(duration_to_proto(registered.lease_duration)),
    }
}

/// An attempt a worker names; an unset one names no attempt (and is fenced).
pub fn attempt_ref_from_proto(attempt: Option<v1::AttemptRef>) -> AttemptRef {
    let attempt = attempt.unwrap_or_default();
    AttemptRef {
        job_id: attempt.job_id,
        attempt_number: attempt.attempt_number,
        lease_epoch: attempt.lease_epoch,
    }
}

pub fn attempt_ref_to_proto(attempt: &AttemptRef) -> v1::AttemptRef {
    v1::AttemptRef {
        job_id: attempt.job_id.clone(),
        attempt_number: attempt.attempt_number,
        lease_epoch: attempt.lease_epoch,
        // Gang members (issue 31) are named by the scheduler's gang wiring, not yet here.
        gang_rank: None,
    }
}

fn checkpoint_from_proto(checkpoint: v1::Checkpoint) -> Checkpoint {
    Checkpoint {
        location: checkpoint.location,
        step: checkpoint.step,
    }
}

fn progress_from_proto(progress: v1::TrainingProgress) -> TrainingProgress {
    TrainingProgress {
        step: progress.step,
        total_steps: progress.total_steps,
        loss: progress.loss,
        samples_per_second: progress.samples_per_second,
        memory_in_use_bytes: progress.memory_in_use_bytes,
        memory_peak_bytes: progress.memory_peak_bytes,
        seconds_left: progress
            .seconds_left
            .filter(|seconds| seconds.is_finite() && *seconds >= 0.0),
    }
}

pub fn progress_to_proto(progress: &TrainingProgress) -> v1::TrainingProgress {
    v1::TrainingProgress {
        step: progress.step,
        total_steps: progress.total_steps,
        loss: progress.loss,
        samples_per_second: progress.samples_per_second,
        memory_in_use_bytes: progress.memory_in_use_bytes,
        memory_peak_bytes: progress.memory_peak_bytes,
        seconds_left: progress.seconds_left,
    }
}

/// One message of a worker's session as the scheduler takes it. `InvalidArgument` for a
/// message without a body.
pub fn worker_report_from_proto(message: v1::WorkerMessage) -> Result<WorkerReport, ApiError> {
    use v1::worker_message::Body;
    let Some(body) = message.body else {
        return Err(ApiError::InvalidArgument {
            field: "body".into(),
            reason: "a worker message needs a body".into(),
        });
    };
    Ok(match body {
        Body::Hello(_) => WorkerReport::Hello,
        Body::Heartbeat(heartbeat) => WorkerReport::Heartbeat {
            // A bounded list: more than the scheduler reads is dropped, not refused.
            cached_image_digests: heartbeat
                .cached_image_digests
                .into_iter()
                .filter(|digest| is_manifest_digest(digest))
                .take(MAX_CACHED_IMAGES_READ)
                .collect(),
            gpus: heartbeat
                .gpus
                .into_iter()
                .map(|gpu| GpuFreeBytes {
                    gpu_uuid: gpu.gpu_uuid,
                    free_bytes: gpu.free_bytes,
                })
                .collect(),
        },
        Body::AttemptStarted(started) => WorkerReport::AttemptStarted {
            attempt: attempt_ref_from_proto(started.attempt),
            resumed_from: started.resumed_from.map(checkpoint_from_proto),
            command_argv: started.command_argv,
            uncontained: started.uncontained,
            image_digest: if started.image_digest.is_empty() {
                None
            } else if is_manifest_digest(&started.image_digest) {
                Some(started.image_digest)
            } else {
                return Err(ApiError::invalid_argument(
                    "attempt_started.image_digest",
                    "not a manifest digest (sha256: and 64 lowercase hex digits)",
                ));
            },
        },
        Body::ImagePull(pull) => WorkerReport::ImagePull {
            attempt: attempt_ref_from_proto(pull.attempt),
            pull: pull
                .pull
                .map(|pull| ImagePullProgress {
                    image: pull.image,
                    done_bytes: pull.done_bytes,
                    total_bytes: pull.total_bytes,
                })
                .unwrap_or_default(),
        },
        Body::Progress(progress) => WorkerReport::Progress {
            attempt: attempt_ref_from_proto(progress.attempt),
            progress: progress.progress.map(progress_from_proto),
        },
        Body::Log(line) => WorkerReport::Log {
            attempt: attempt_ref_from_proto(line.attempt),
            level: line.level,
            // Only the two names a line may carry; anything else is no stream.
            stream: match line.stream.as_str() {
                "stdout" | "stderr" => line.stream,
                _ => String::new(),
            },
            message: line.message,
        },
        Body::CheckpointWritten(written) => WorkerReport::CheckpointWritten {
            attempt: attempt_ref_from_proto(written.attempt),
            checkpoint: written.checkpoint.map(checkpoint_from_proto),
        },
        Body::Oom(oom) => WorkerReport::OutOfMemory {
            attempt: attempt_ref_from_proto(oom.attempt),
            report: oom.report.unwrap_or_default().into(),
            checkpoint: oom.checkpoint.map(checkpoint_from_proto),
            // Empty from a worker older than the field: its engine's allocator.
            detected_by: if oom.detected_by.is_empty() {
                OomSource::Allocator
            } else {
                OomSource::from_name(&oom.detected_by)
                    .map_err(|error| ApiError::invalid_argument("oom.detected_by", error.reason))?
            },
            evidence: oom.evidence,
        },
        Body::AttemptFinished(finished) => WorkerReport::AttemptFinished {
            attempt: attempt_ref_from_proto(finished.attempt),
            outcome: v1::AttemptOutcome::try_from(finished.outcome)
                .ok()
                .and_then(outcome_from_proto),
            measured_peak_bytes: finished.measured_peak_bytes,
            message: finished.message,
            results: AttemptResults {
                final_loss: finished.final_loss.filter(|loss| loss.is_finite()),
                test_accuracy: finished
                    .test_accuracy
                    .filter(|accuracy| accuracy.is_finite()),
                steps_done: finished
                    .steps_done
                    .map(|steps| i64::try_from(steps).unwrap_or(i64::MAX)),
                samples_per_second: finished
                    .samples_per_second
                    .filter(|rate| rate.is_finite() && *rate >= 0.0),
                // A worker's report is held to the bounds its program was: a count of
                // names, their length and characters, finite values.
                metrics: MetricSet::bounded(finished.metrics.into_iter().map(|metric| Metric {
                    name: metric.name,
                    value: metric.value,
                }))
                .into_metrics(),
            },
            profile_points: finished
                .profile_points
                .into_iter()
                .map(Into::into)
                .collect(),
        },
    })
}

/// A job's update as the watch stream sends it.
pub fn job_update_to_proto(update: &JobUpdate) -> v1::JobEvent {
    use v1::job_event::Event;
    let event = match &update.kind {
        JobUpdateKind::StateChanged {
            previous,
            state,
            reason,
        } => Event::StateChanged(v1::job_event::StateChanged {
            previous_state: job_state_to_proto(*previous) as i32,
            state: job_state_to_proto(*state) as i32,
            reason: reason.clone(),
        }),
        JobUpdateKind::Progress {
            attempt_number,
            progress,
        } => Event::Progress(v1::job_event::Progress {
            attempt_number: *attempt_number,
            progress: progress.as_ref().map(progress_to_proto),
        }),
        JobUpdateKind::ImagePull {
            attempt_number,
            pull,
        } => Event::ImagePull(v1::job_event::ImagePullProgress {
            attempt_number: *attempt_number,
            pull: Some(image_pull_to_proto(pull)),
        }),
        JobUpdateKind::OutOfMemory {
            attempt_number,
            config,
            report,
        } => Event::Oom(v1::job_event::OutOfMemory {
            attempt_number: *attempt_number,
            config: Some((*config).into()),
            report: Some((*report).into()),
        }),
        JobUpdateKind::Shrink {
            old_config,
            decision,
        } => Event::Shrink(carve_proto::convert::shrink_decision_to_proto(
            old_config, decision,
        )),
        JobUpdateKind::AttemptStarted(attempt) => Event::AttemptStarted(attempt_to_proto(attempt)),
        JobUpdateKind::Log {
            attempt_number,
            level,
            message,
            stream,
        } => Event::Log(v1::job_event::LogLine {
            attempt_number: *attempt_number,
            level: level.clone(),
            message: message.clone(),
            stream: stream.clone(),
        }),
    };
    v1::JobEvent {
        job_id: update.job_id.clone(),
        sequence: update.sequence,
        // Set by a resumable watch, which reads the event back from the store.
        log_sequence: 0,
        time: Some(timestamp(update.time_ms)),
        event: Some(event),
    }
}

/// A job's update as its log line stores it (`job_log_lines.event`): the watch stream's
/// event, encoded, which a resumed watch decodes and replays. The scheduler is handed
/// this at construction ([`crate::scheduler::EncodeJobEvent`]).
pub fn job_update_to_stored_event(update: &JobUpdate) -> Vec<u8> {
    carve_proto::encode_job_event(&job_update_to_proto(update))
}

/// A command for a worker as its session stream carries it.
pub fn worker_command_to_proto(command: WorkerCommand) -> v1::SchedulerMessage {
    use v1::scheduler_message::Body;
    let body = match command {
        WorkerCommand::Assignment(assignment) => {
            let assignment = *assignment;
            Body::Assignment(v1::scheduler_message::Assignment {
                attempt: Some(attempt_ref_to_proto(&assignment.attempt)),
                spec_json: assignment.spec_json,
                config: Some(assignment.config.into()),
                gpu_uuid: assignment.gpu_uuid,
                slice_bytes: assignment.slice_bytes,
                resume_from: assignment.resume_from.map(|checkpoint| v1::Checkpoint {
                    step: checkpoint.step,
                    location: checkpoint.location,
                }),
                profile: assignment.profile,
                tenant: assignment.tenant,
                kind: assignment.kind.name().to_string(),
                image_digest: assignment.image_digest.unwrap_or_default(),
                image_pull_credential: assignment.image_pull_credential.map(|credential| {
                    v1::scheduler_message::RegistryCredential {
                        username: credential.username,
                        password: credential.password,
                    }
                }),
                // Every assignment is one process until the gang wiring (issue 31).
                gang: None,
            })
        }
        WorkerCommand::Cancel {
            attempt,
            grace_period,
            reason,
        } => Body::Cancel(v1::scheduler_message::Cancel {
            attempt: Some(attempt_ref_to_proto(&attempt)),
            grace_period: Some(duration_to_proto(grace_period)),
            reason,
        }),
        WorkerCommand::Drain => Body::Drain(v1::scheduler_message::Drain {}),
        WorkerCommand::Ack { sequence } => Body::Ack(v1::scheduler_message::Ack { sequence }),
        WorkerCommand::HeartbeatAck { sequence } => {
            Body::HeartbeatAck(v1::scheduler_message::HeartbeatAck { sequence })
        }
        WorkerCommand::CheckpointRecorded {
            attempt,
            checkpoint,
        } => Body::CheckpointRecorded(v1::scheduler_message::CheckpointRecorded {
            attempt: Some(attempt_ref_to_proto(&attempt)),
            checkpoint: Some(v1::Checkpoint {
                step: checkpoint.step,
                location: checkpoint.location,
            }),
        }),
    };
    v1::SchedulerMessage { body: Some(body) }
}

pub fn worker_state_to_proto(state: WorkerState) -> v1::WorkerState {
    match state {
        WorkerState::Ready => v1::WorkerState::Ready,
        WorkerState::Draining => v1::WorkerState::Draining,
        WorkerState::Lost => v1::WorkerState::Lost,
    }
}

pub fn slice_to_proto(slice: &SliceView) -> v1::Slice {
    let owner = slice.owner.as_ref();
    v1::Slice {
        id: slice.id(),
        gpu_uuid: slice.gpu_id.clone(),
        bytes: slice.bytes,
        job_id: owner.map(|owner| owner.job_id.clone()).unwrap_or_default(),
        attempt_number: owner.map_or(0, |owner| owner.attempt_number),
        worker_id: slice.worker_id.clone(),
        tenant: owner.map(|owner| owner.tenant.clone()).unwrap_or_default(),
    }
}

pub fn worker_to_proto(worker: &WorkerView) -> v1::Worker {
    v1::Worker {
        id: worker.id.clone(),
        hostname: worker.hostname.clone(),
        state: worker_state_to_proto(worker.state) as i32,
        gpus: worker
            .gpus
            .iter()
            .map(|gpu| gpu_to_proto(&gpu.gpu, gpu.slices.iter().map(slice_to_proto).collect()))
            .collect(),
        last_heartbeat_at: Some(timestamp(worker.last_heartbeat_ms)),
        registered_at: Some(timestamp(worker.registered_at_ms)),
        version: worker.version.clone(),
        drain_reason: worker.drain_reason.clone(),
    }
}

/// A submit's answer: a new job from what admission computed, an earlier one (same
/// idempotency key) as stored.
pub fn submitted_job_to_proto(submitted: &SubmittedJob) -> Result<v1::Job, SchedulerError> {
    match &submitted.admitted {
        Some(admitted) => Ok(job_proto_from_parts(
            &submitted.job,
            &submitted.attempts,
            Some(admitted.config),
            Some(&admitted.estimate),
        )),
        None => job_to_proto(&submitted.job, &submitted.attempts),
    }
}

#[cfg(test)]
mod tests {
    use carve_core::estimator::estimate_job;
    use carve_core::validate::load_job_spec_toml;

    use super::*;
    use crate::store::{estimate_from_json, estimate_to_json};

    /// What a read shows is exactly what the estimator said at submit, breakdowns
    /// included: the stored form loses nothing the API carries.
    #[test]
    fn a_stored_estimate_reads_back_as_the_estimate_it_was() {
        let job = load_job_spec_toml(include_str!("../../examples/resnet-cifar.toml")).unwrap();
        let config = RunConfig::from_spec(&job.spec);
        let estimate = estimate_job(&job, &config).unwrap();
        assert!(!estimate.by_layer.is_empty() && estimate.persistent_bytes > 0);
        let stored = estimate_from_json(&estimate_to_json(&estimate)).unwrap();
        let read = estimate_to_proto(stored, Some(config));
        assert_eq!(read, v1::MemoryEstimate::from(&estimate));
    }

    /// An out-of-memory report names its detector by one of core's names; none (a worker
    /// older than the field) is the engine's allocator, and any other name is refused
    /// naming the field, not stored as whatever text a worker sent.
    #[test]
    fn an_oom_reports_detector_is_read_by_name_and_an_unknown_one_is_refused() {
        let report = |detected_by: &str| {
            worker_report_from_proto(v1::WorkerMessage {
                sequence: 1,
                body: Some(v1::worker_message::Body::Oom(
                    v1::worker_message::OomReport {
                        attempt: None,
                        report: None,
                        checkpoint: None,
                        detected_by: detected_by.into(),
                        evidence: String::new(),
                    },
                )),
            })
        };
        let detector = |detected_by: &str| match report(detected_by) {
            Ok(WorkerReport::OutOfMemory { detected_by, .. }) => detected_by,
            other => panic!("{other:?}"),
        };
        assert_eq!(detector(""), OomSource::Allocator);
        assert_eq!(detector("pytorch"), OomSource::PyTorch);
        match report("'; DROP TABLE attempts; --") {
            Err(ApiError::InvalidArgument { field, reason }) => {
                assert_eq!(field, "oom.detected_by");
                assert!(
                    reason.contains("is not an out-of-memory detector"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
