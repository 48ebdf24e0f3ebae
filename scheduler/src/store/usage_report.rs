//! Accounting's read (issue 32): the attempts that held a slice in a period, each as
//! core's [`AccountedAttempt`], from its usage row (`usage.rs`) with what the rest of the
//! store says of it: its job's submitter and submit time (`jobs`), its outcome and its
//! previous attempt's (`attempts`). One query, whichever the database; the figures are
//! core's (`carve_core::usage::report`).
//!
//! A usage row outlives its job (the tenant is named, not referenced): such an attempt
//! counts with an unknown submitter and no queue time. So does a row whose job was
//! submitted before submitters were kept (`submitted_by_token_id` is '').

use carve_core::usage::report::{AccountedAttempt, Submitter};
use carve_proto::ApiError;

use super::Store;
use super::records::{AttemptOutcome, attempt_display_id};
use crate::error::SchedulerError;

/// Which attempts to read: those holding a slice at some moment of `[from_ms, to_ms)`
/// (or placed in it), of one tenant and of one submitter (its token's id or
/// description) when set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageQuery {
    pub from_ms: i64,
    pub to_ms: i64,
    pub tenant: Option<String>,
    pub submitter: Option<String>,
}

type AccountedRow = (
    String,
    i64,
    String,
    String,
    i64,
    i64,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<i64>,
);

/// `$1` from, `$2` to, `$3` tenant or NULL, `$4` submitter or NULL.
const ACCOUNTED_ATTEMPTS_SQL: &str = "SELECT u.job_id, u.attempt_number, u.tenant, u.gpu_type, \
     u.slice_bytes, u.placed_at_ms, u.ended_at_ms, u.measured_peak_bytes, \
     j.submitted_by_token_id, j.submitted_by, j.created_at_ms, \
     a.outcome, previous.outcome, previous.finished_at_ms \
     FROM attempt_usage u \
     LEFT JOIN jobs j ON j.id = u.job_id \
     LEFT JOIN attempts a ON a.job_id = u.job_id AND a.attempt_number = u.attempt_number \
     LEFT JOIN attempts previous ON previous.job_id = u.job_id \
     AND previous.attempt_number = u.attempt_number - 1 \
     WHERE u.placed_at_ms < $2 \
     AND (u.ended_at_ms IS NULL OR u.ended_at_ms > $1 OR u.placed_at_ms >= $1) \
     AND ($3 IS NULL OR u.tenant = $3) \
     AND ($4 IS NULL OR j.submitted_by_token_id = $4 OR j.submitted_by = $4) \
     ORDER BY u.placed_at_ms, u.job_id, u.attempt_number";

impl Store {
    /// The attempts `query` names, as accounting reads them, by placement, then job and
    /// attempt.
    pub async fn accounted_attempts(
        &self,
        query: &UsageQuery,
    ) -> Result<Vec<AccountedAttempt>, SchedulerError> {
        let rows: Vec<AccountedRow> = with_pool!(self, pool => {
            sqlx::query_as(ACCOUNTED_ATTEMPTS_SQL)
                .bind(query.from_ms)
                .bind(query.to_ms)
                .bind(query.tenant.as_deref())
                .bind(query.submitter.as_deref())
                .fetch_all(pool)
                .await?
        });
        rows.into_iter().map(accounted_attempt_from_row).collect()
    }
}

fn accounted_attempt_from_row(row: AccountedRow) -> Result<AccountedAttempt, SchedulerError> {
    let (
        job_id,
        attempt_number,
        tenant,
        gpu_type,
        slice_bytes,
        placed_at_ms,
        ended_at_ms,
        measured_peak_bytes,
        submitted_by_token_id,
        submitted_by,
        job_created_at_ms,
        outcome,
        previous_outcome,
        previous_finished_at_ms,
    ) = row;
    let outcome = read_outcome(outcome, &job_id, attempt_number)?;
    let previous_outcome = read_outcome(previous_outcome, &job_id, attempt_number - 1)?;
    let queued_since_ms = if attempt_number == 1 {
        job_created_at_ms
    } else {
        previous_finished_at_ms
    };
    Ok(AccountedAttempt {
        submitter: Submitter {
            token_id: submitted_by_token_id.unwrap_or_default(),
            description: submitted_by.unwrap_or_default(),
        },
        tenant,
        gpu_type,
        slice_bytes: u64::try_from(slice_bytes).unwrap_or(0),
        placed_at_ms,
        ended_at_ms,
        measured_peak_bytes: measured_peak_bytes.and_then(|peak| u64::try_from(peak).ok()),
        queued_since_ms,
        retries_out_of_memory: previous_outcome == Some(AttemptOutcome::OutOfMemory),
        preempted: outcome == Some(AttemptOutcome::Preempted),
        job_id,
        attempt_number,
    })
}

/// An outcome column as read through a join: NULL when the attempt row is gone, else a
/// name this build must know (a "corrupt row" error otherwise, never a default).
fn read_outcome(
    text: Option<String>,
    job_id: &str,
    attempt_number: i64,
) -> Result<Option<AttemptOutcome>, SchedulerError> {
    let Some(text) = text else {
        return Ok(None);
    };
    AttemptOutcome::from_name(&text).map(Some).ok_or_else(|| {
        SchedulerError::Api(ApiError::Internal(format!(
            "corrupt row: column \"outcome\" of attempt {:?}: {text:?} is not an attempt outcome",
            attempt_display_id(job_id, attempt_number)
        )))
    })
}
