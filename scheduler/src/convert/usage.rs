//! GetUsage's request and answer (issue 32's accounting) between the wire and the
//! scheduler's types (`scheduler/usage_report.rs`, core's `UsageFigures`).

use carve_core::usage::report::UsageFigures;
use carve_proto::ApiError;
use carve_proto::v1;

use super::timestamp;
use crate::scheduler::{UsageAnswer, UsageRequest};

/// A request's period and filters; `from` is required, and a timestamp must be one.
pub fn usage_request_from_proto(request: v1::GetUsageRequest) -> Result<UsageRequest, ApiError> {
    let from = request
        .from
        .ok_or_else(|| ApiError::invalid_argument("from", "is required: the period's start"))?;
    Ok(UsageRequest {
        from_ms: timestamp_to_ms("from", &from)?,
        to_ms: request
            .to
            .map(|to| timestamp_to_ms("to", &to))
            .transpose()?,
        tenant: request.tenant,
        user: request.user,
    })
}

fn timestamp_to_ms(field: &str, value: &prost_types::Timestamp) -> Result<i64, ApiError> {
    if !(0..1_000_000_000).contains(&value.nanos) {
        return Err(ApiError::invalid_argument(
            field,
            format!(
                "has {} nanoseconds; a timestamp has 0 to 999,999,999",
                value.nanos
            ),
        ));
    }
    value
        .seconds
        .checked_mul(1000)
        .and_then(|ms| ms.checked_add(i64::from(value.nanos / 1_000_000)))
        .ok_or_else(|| {
            ApiError::invalid_argument(field, format!("{} seconds is out of range", value.seconds))
        })
}

pub fn usage_answer_to_proto(answer: &UsageAnswer) -> v1::GetUsageResponse {
    v1::GetUsageResponse {
        from: Some(timestamp(answer.period.from_ms)),
        to: Some(timestamp(answer.period.to_ms)),
        tenants: answer
            .report
            .tenants
            .iter()
            .map(usage_figures_to_proto)
            .collect(),
        users: answer
            .report
            .users
            .iter()
            .map(usage_figures_to_proto)
            .collect(),
    }
}

fn usage_figures_to_proto(figures: &UsageFigures) -> v1::UsageFigures {
    v1::UsageFigures {
        tenant: figures.tenant.clone(),
        user_token_id: figures.submitter.token_id.clone(),
        user: figures.submitter.description.clone(),
        gpu_type: figures.gpu_type.clone(),
        jobs: figures.jobs,
        attempts: figures.attempts,
        gpu_milliseconds: figures.gpu_milliseconds,
        vram_requested_byte_milliseconds: figures.vram_requested_byte_milliseconds.to_string(),
        vram_used_byte_milliseconds: figures.vram_used_byte_milliseconds.to_string(),
        vram_requested_measured_byte_milliseconds: figures
            .vram_requested_measured_byte_milliseconds
            .to_string(),
        measured_attempts: figures.measured_attempts,
        oom_retries: figures.oom_retries,
        preemptions: figures.preemptions,
        queued_attempts: figures.queued_attempts,
        queue_time_p50_ms: figures.queue_time_p50_ms,
        queue_time_p90_ms: figures.queue_time_p90_ms,
        queue_time_p99_ms: figures.queue_time_p99_ms,
    }
}
