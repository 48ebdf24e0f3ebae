//! Usage over time, durable (issue 32): one row per attempt from its placement to its
//! end (tenant, GPU type, slice bytes, placement and end times, the measured peak where
//! known), the record fair share's decayed usage is rebuilt from on start or on taking
//! the lead, and the record accounting reads. [`UsageRecord`] is the row; this file is
//! its one encoder (`bind_usage`); it is read back by its column names (`FromRow`).
//!
//! Writes are FENCED by the leader's epoch, like attempt writes. A row's start is
//! written once (a second write for the same attempt is ignored) and its end once (the
//! first end wins), so replayed reports cannot stretch or shrink what was used.

use carve_core::usage::AttemptUsage;

use super::Store;
use super::leadership::check_fence;
use crate::error::SchedulerError;

/// One attempt's use of its slice, as stored (read by its column names).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct UsageRecord {
    pub job_id: String,
    pub attempt_number: i64,
    pub tenant: String,
    /// The worker's GPU model name.
    pub gpu_type: String,
    pub slice_bytes: i64,
    pub placed_at_ms: i64,
    /// `None` while the attempt holds its slice.
    pub ended_at_ms: Option<i64>,
    /// The most the attempt was measured to use, where its worker reported it.
    pub measured_peak_bytes: Option<i64>,
}

impl UsageRecord {
    /// The attempt's use as core counts it; one still running counts up to `now_ms`.
    pub fn attempt_usage(&self, now_ms: i64) -> AttemptUsage {
        AttemptUsage {
            tenant: self.tenant.clone(),
            gpu_type: self.gpu_type.clone(),
            slice_bytes: u64::try_from(self.slice_bytes).unwrap_or(0),
            started_at_ms: self.placed_at_ms,
            ended_at_ms: self.ended_at_ms.unwrap_or(now_ms).max(self.placed_at_ms),
        }
    }
}

const USAGE_COLUMNS: &str = "job_id, attempt_number, tenant, gpu_type, slice_bytes, \
                             placed_at_ms, ended_at_ms, measured_peak_bytes";

/// The one insert of a usage row (bound by [`bind_usage`]); a row already stored for the
/// attempt is kept.
pub(super) const INSERT_USAGE_SQL: &str = "INSERT INTO attempt_usage (job_id, attempt_number, \
     tenant, gpu_type, slice_bytes, placed_at_ms, ended_at_ms, measured_peak_bytes) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (job_id, attempt_number) DO NOTHING";

/// An attempt's end ($1 job, $2 attempt, $3 end, $4 measured peak): only the first is
/// kept, and an end before the placement is the placement.
pub(super) const END_USAGE_SQL: &str = "UPDATE attempt_usage SET \
     ended_at_ms = CASE WHEN $3 < placed_at_ms THEN placed_at_ms ELSE $3 END, \
     measured_peak_bytes = $4 \
     WHERE job_id = $1 AND attempt_number = $2 AND ended_at_ms IS NULL";

/// Binds a [`UsageRecord`] to [`INSERT_USAGE_SQL`]'s parameters: the one encoder.
macro_rules! bind_usage {
    ($query:expr, $record:expr) => {
        $query
            .bind(&$record.job_id)
            .bind($record.attempt_number)
            .bind(&$record.tenant)
            .bind(&$record.gpu_type)
            .bind($record.slice_bytes)
            .bind($record.placed_at_ms)
            .bind($record.ended_at_ms)
            .bind($record.measured_peak_bytes)
    };
}
pub(super) use bind_usage;

impl Store {
    /// Stores attempts' usage rows, FENCED, in one transaction: at placement (no end
    /// yet), or whole for history written by an operator's import or a test. A row
    /// already stored for the same attempt is kept as it is.
    pub async fn record_usage(&self, records: &[UsageRecord]) -> Result<(), SchedulerError> {
        if records.is_empty() {
            return Ok(());
        }
        for record in records {
            check_usage_record(record)?;
        }
        with_write_tx!(self, tx => {
            check_fence!(self, tx);
            for record in records {
                bind_usage!(sqlx::query(INSERT_USAGE_SQL), record)
                    .execute(&mut *tx)
                    .await?;
            }
        });
        Ok(())
    }

    /// Stores an attempt's end, FENCED: when it let go of its slice and the peak it was
    /// measured at. Only the first end is kept; an end before the placement is stored
    /// as the placement. Returns whether a row was ended.
    pub async fn end_usage(
        &self,
        job_id: &str,
        attempt_number: i64,
        ended_at_ms: i64,
        measured_peak_bytes: Option<i64>,
    ) -> Result<bool, SchedulerError> {
        let ended = with_write_tx!(self, tx => {
            check_fence!(self, tx);
            sqlx::query(END_USAGE_SQL)
            .bind(job_id)
            .bind(attempt_number)
            .bind(ended_at_ms)
            .bind(measured_peak_bytes)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        });
        Ok(ended > 0)
    }

    /// The usage rows that held a slice at some moment in `[since_ms, until_ms)`: placed
    /// before `until_ms` and not ended by `since_ms` (running ones included), by
    /// placement time, then job and attempt. `tenant` limits them to one tenant's.
    pub async fn usage_between(
        &self,
        since_ms: i64,
        until_ms: i64,
        tenant: Option<&str>,
    ) -> Result<Vec<UsageRecord>, SchedulerError> {
        let query = format!(
            "SELECT {USAGE_COLUMNS} FROM attempt_usage \
             WHERE placed_at_ms < $2 AND (ended_at_ms IS NULL OR ended_at_ms > $1) \
             AND ($3 IS NULL OR tenant = $3) \
             ORDER BY placed_at_ms, job_id, attempt_number"
        );
        let rows: Vec<UsageRecord> = with_pool!(self, pool => {
            sqlx::query_as(&query)
                .bind(since_ms)
                .bind(until_ms)
                .bind(tenant)
                .fetch_all(pool)
                .await?
        });
        Ok(rows)
    }
}

/// A row must make sense before it is stored: nothing negative, no end before its start.
pub(super) fn check_usage_record(record: &UsageRecord) -> Result<(), SchedulerError> {
    if record.attempt_number < 1 {
        return Err(SchedulerError::invalid_argument(
            "attempt_number",
            format!("is {} but attempts count from 1", record.attempt_number),
        ));
    }
    if record.slice_bytes < 0 {
        return Err(SchedulerError::invalid_argument(
            "slice_bytes",
            format!("is {} but must not be negative", record.slice_bytes),
        ));
    }
    if let Some(ended_at_ms) = record.ended_at_ms
        && ended_at_ms < record.placed_at_ms
    {
        return Err(SchedulerError::invalid_argument(
            "ended_at_ms",
            format!(
                "is {ended_at_ms}, before the placement at {}",
                record.placed_at_ms
            ),
        ));
    }
    if record.measured_peak_bytes.is_some_and(|peak| peak < 0) {
        return Err(SchedulerError::invalid_argument(
            "measured_peak_bytes",
            "must not be negative".to_string(),
        ));
    }
    Ok(())
}
