//! Between store records and the wire: run configs as JSON in the store, jobs and
//! attempts as generated protobuf messages in the handlers.

use carve_core::estimator::{MemoryEstimate, estimate_job};
use carve_core::plan::RunConfig;
use carve_core::spec::Precision;
use carve_proto::v1;
use serde_json::{Value, json};

use crate::error::SchedulerError;
use crate::store::{AttemptRecord, JobRecord};

pub fn config_to_json(config: &RunConfig) -> String {
    json!({
        "batch_size": config.batch_size,
        "micro_batch_size": config.micro_batch_size,
        "precision": config.precision.name(),
        "recompute_segment_layers": config.recompute_segment_layers,
        "workspace_limit_bytes": config.workspace_limit_bytes,
        "prefetch_batches": config.prefetch_batches,
    })
    .to_string()
}

pub fn config_from_json(text: &str) -> Result<RunConfig, SchedulerError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|error| SchedulerError::Internal(format!("stored run config: {error}")))?;
    let number = |field: &str| {
        value[field]
            .as_u64()
            .ok_or_else(|| SchedulerError::Internal(format!("stored run config has no {field}")))
    };
    Ok(RunConfig {
        batch_size: number("batch_size")?,
        micro_batch_size: number("micro_batch_size")?,
        precision: value["precision"]
            .as_str()
            .and_then(Precision::from_name)
            .ok_or_else(|| SchedulerError::Internal("stored run config has no precision".into()))?,
        recompute_segment_layers: value["recompute_segment_layers"].as_u64(),
        workspace_limit_bytes: number("workspace_limit_bytes")?,
        prefetch_batches: number("prefetch_batches")?,
    })
}

pub fn timestamp(milliseconds: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: milliseconds.div_euclid(1000),
        nanos: (milliseconds.rem_euclid(1000) * 1_000_000) as i32,
    }
}

pub fn job_state_to_proto(state: &str) -> v1::JobState {
    match state {
        "queued" => v1::JobState::Queued,
        "placed" => v1::JobState::Placed,
        "running" => v1::JobState::Running,
        "succeeded" => v1::JobState::Succeeded,
        "failed" => v1::JobState::Failed,
        "cancelled" => v1::JobState::Cancelled,
        _ => v1::JobState::Unspecified,
    }
}

pub fn job_state_from_proto(state: v1::JobState) -> Option<&'static str> {
    match state {
        v1::JobState::Queued => Some("queued"),
        v1::JobState::Placed => Some("placed"),
        v1::JobState::Running => Some("running"),
        v1::JobState::Succeeded => Some("succeeded"),
        v1::JobState::Failed => Some("failed"),
        v1::JobState::Cancelled => Some("cancelled"),
        v1::JobState::Unspecified => None,
    }
}

pub fn outcome_to_proto(outcome: &str) -> v1::AttemptOutcome {
    match outcome {
        "running" => v1::AttemptOutcome::Running,
        "succeeded" => v1::AttemptOutcome::Succeeded,
        "out_of_memory" => v1::AttemptOutcome::OutOfMemory,
        "failed" => v1::AttemptOutcome::Failed,
        "cancelled" => v1::AttemptOutcome::Cancelled,
        "lost" => v1::AttemptOutcome::Lost,
        "interrupted" => v1::AttemptOutcome::Interrupted,
        _ => v1::AttemptOutcome::Unspecified,
    }
}

pub fn attempt_to_proto(attempt: &AttemptRecord) -> v1::Attempt {
    v1::Attempt {
        number: attempt.attempt_number as u32,
        config: config_from_json(&attempt.config_json).ok().map(Into::into),
        estimate_bytes: attempt.estimate_bytes as u64,
        slice_bytes: attempt.slice_bytes as u64,
        measured_peak_bytes: attempt.measured_peak_bytes.map(|bytes| bytes as u64),
        worker_id: attempt.worker_id.clone(),
        gpu_uuid: attempt.gpu_id.clone(),
        outcome: outcome_to_proto(&attempt.outcome) as i32,
        oom: attempt
            .oom_json
            .as_deref()
            .and_then(|text| serde_json::from_str::<Value>(text).ok())
            .map(|value| v1::OutOfMemoryReport {
                requested_bytes: value["requested_bytes"].as_u64().unwrap_or(0),
                in_use_bytes: value["in_use_bytes"].as_u64().unwrap_or(0),
                limit_bytes: value["limit_bytes"].as_u64().unwrap_or(0),
                largest_free_bytes: value["largest_free_bytes"].as_u64().unwrap_or(0),
                peak_bytes: value["peak_bytes"].as_u64().unwrap_or(0),
            }),
        failure_message: attempt.message.clone(),
        started_at: Some(timestamp(attempt.started_at_ms)),
        finished_at: attempt.finished_at_ms.map(timestamp),
        resumed_from: attempt
            .resumed_from
            .clone()
            .map(|location| v1::Checkpoint { step: 0, location }),
    }
}

pub fn oom_to_json(report: &carve_core::allocator::OutOfMemory) -> String {
    json!({
        "requested_bytes": report.requested,
        "in_use_bytes": report.in_use,
        "limit_bytes": report.limit,
        "largest_free_bytes": report.largest_free,
        "peak_bytes": report.peak,
    })
    .to_string()
}

/// A job with its attempts and its estimate (recomputed: the estimator is pure and fast).
pub fn job_to_proto(job: &JobRecord, attempts: &[AttemptRecord]) -> v1::Job {
    let config = config_from_json(&job.config_json).ok();
    let estimate = config.and_then(|config| {
        let validated = carve_proto::convert::validated_job_from_json(&job.spec_json).ok()?;
        estimate_job(&validated, &config).ok()
    });
    job_proto_from_parts(job, attempts, config, estimate.as_ref())
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
        state: job_state_to_proto(&job.state) as i32,
        priority: job.priority as i32,
        created_at: Some(timestamp(job.created_at_ms)),
        estimate: estimate.map(Into::into),
        waiting_reason: job.waiting_reason.clone(),
        attempts: attempts.iter().map(attempt_to_proto).collect(),
        current_config: config.map(Into::into),
        finished_at: job.finished_at_ms.map(timestamp),
        message: job.message.clone(),
    }
}
