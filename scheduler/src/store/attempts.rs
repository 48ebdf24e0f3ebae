//! Attempts of jobs: an attempt is written once, at its placement, and ended once, while
//! it runs. (Its `lease_epoch` column is its number, written for older readers: no
//! attempt is ever reassigned under a newer epoch; a job's next try is a new attempt.)

use super::jobs::{UPDATE_JOB_SQL, bind_job_update, update_job_row};
use carve_core::allocator::OutOfMemory;

use super::columns::{json_list_column, oom_detector_column, oom_to_json};
use super::records::attempt_display_id;
use super::usage::{END_USAGE_SQL, INSERT_USAGE_SQL, UsageRecord, bind_usage, check_usage_record};
use super::{
    AttemptOutcome, AttemptRecord, AttemptResults, JobRecord, OomSource, ProfilePoint, Store,
    insert_error,
};

/// What an attempt's start adds to its details (`AttemptDetails`): the argv a command
/// job's worker ran (empty for none), and whether it runs without its container (false
/// when contained, or from a worker too old to say).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttemptStartDetails {
    pub command_argv: Vec<String>,
    pub uncontained: bool,
}

/// What an attempt's end adds to its details (`AttemptDetails`): a profile's points and
/// who detected an out-of-memory; both empty otherwise.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttemptEndDetails {
    pub profile_points: Vec<ProfilePoint>,
    pub oom_detected_by: Option<OomSource>,
}
/// How a running attempt ended, as [`Store::end_attempt`] stores it.
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptEnd {
    pub job_id: String,
    pub attempt_number: i64,
    /// Anything but running.
    pub outcome: AttemptOutcome,
    pub measured_peak_bytes: Option<i64>,
    pub oom: Option<OutOfMemory>,
    pub message: String,
    pub finished_at_ms: i64,
    pub results: AttemptResults,
    pub details: AttemptEndDetails,
}

use super::leadership::{UNFENCED, check_fence};
use crate::error::SchedulerError;

const ATTEMPT_COLUMNS: &str = "job_id, attempt_number, config_json, estimate_bytes, \
     slice_bytes, worker_id, gpu_id, lease_epoch, outcome, measured_peak_bytes, oom_json, \
     message, resumed_from, started_at_ms, finished_at_ms, resumed_from_step, final_loss, \
     test_accuracy, steps_done, samples_per_second, profile, chosen_because, command_argv_json, \
     profile_points_json, oom_detected_by, uncontained, metrics_json";

const INSERT_ATTEMPT_SQL: &str = "INSERT INTO attempts (job_id, attempt_number, config_json, \
     estimate_bytes, slice_bytes, worker_id, gpu_id, lease_epoch, outcome, \
     measured_peak_bytes, oom_json, message, resumed_from, started_at_ms, finished_at_ms, \
     resumed_from_step, final_loss, test_accuracy, steps_done, samples_per_second, profile, \
     chosen_because, command_argv_json, profile_points_json, oom_detected_by, uncontained, \
     metrics_json) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, \
     $19, $20, $21, $22, $23, $24, $25, $26, $27)";

/// Binds an attempt's columns in the order of [`ATTEMPT_COLUMNS`] ($1 to $27).
macro_rules! bind_attempt_columns {
    ($query:expr, $attempt:expr) => {
        $query
            .bind(&$attempt.job_id)
            .bind($attempt.attempt_number)
            .bind(&$attempt.config_json)
            .bind($attempt.estimate_bytes)
            .bind($attempt.slice_bytes)
            .bind(&$attempt.worker_id)
            .bind(&$attempt.gpu_id)
            .bind($attempt.lease_epoch)
            .bind($attempt.outcome.name())
            .bind($attempt.measured_peak_bytes)
            .bind($attempt.oom.as_ref().map(oom_to_json))
            .bind(&$attempt.message)
            .bind(&$attempt.resumed_from)
            .bind($attempt.started_at_ms)
            .bind($attempt.finished_at_ms)
            .bind($attempt.resumed_from_step)
            .bind($attempt.results.final_loss)
            .bind($attempt.results.test_accuracy)
            .bind($attempt.results.steps_done)
            .bind($attempt.results.samples_per_second)
            .bind($attempt.details.profile)
            .bind(&$attempt.details.chosen_because)
            .bind(json_list_column(&$attempt.details.command_argv))
            .bind(json_list_column(&$attempt.details.profile_points))
            .bind(oom_detector_column($attempt.details.oom_detected_by))
            .bind($attempt.details.uncontained)
            .bind(json_list_column(&$attempt.results.metrics))
    };
}

impl Store {
    /// Stores a new attempt. `AlreadyExists` when the job already has an attempt with
    /// that number; `NotFound` when the job does not exist.
    pub async fn create_attempt(&self, attempt: &AttemptRecord) -> Result<(), SchedulerError> {
        let result = with_pool!(self, pool => {
            bind_attempt_columns!(sqlx::query(INSERT_ATTEMPT_SQL), attempt)
                .execute(pool)
                .await
                .map(drop)
        });
        result.map_err(|error| {
            let job = Some(("job", attempt.job_id.as_str()));
            insert_error(error, "attempt", &attempt.display_id(), job)
        })
    }

    /// Every attempt of a job, by number (empty for a job without attempts, or none).
    pub async fn list_attempts(&self, job_id: &str) -> Result<Vec<AttemptRecord>, SchedulerError> {
        let sql = format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE job_id = $1 ORDER BY attempt_number"
        );
        Ok(with_pool!(self, pool => {
            sqlx::query_as(&sql).bind(job_id).fetch_all(pool).await?
        }))
    }

    /// Ends a running attempt as `end` says and, in the same transaction, rewrites its
    /// job as [`Store::update_job`] does when `job` is given (the job's move that the
    /// end decides): both are stored or neither is, so no job is left placed or running
    /// with its attempt ended. The attempt is updated only while it is still running
    /// (the scheduler checks beforehand that the report came from the attempt's worker
    /// on its current session): one that already ended is `Conflict("attempt j/2
    /// already ended (succeeded)")`, and one that does not exist is `NotFound`; a job
    /// that does not exist is `NotFound`. `end.outcome` must not be running.
    pub async fn end_attempt(
        &self,
        end: &AttemptEnd,
        job: Option<&JobRecord>,
    ) -> Result<(), SchedulerError> {
        let AttemptEnd {
            job_id,
            attempt_number,
            outcome,
            measured_peak_bytes,
            oom,
            message,
            finished_at_ms,
            results,
            details: ended,
        } = end;
        let (attempt_number, outcome) = (*attempt_number, *outcome);
        if let Some(job) = job
            && job.id != *job_id
        {
            return Err(SchedulerError::invalid_argument(
                "job.id",
                format!("is {:?} but the attempt is of {job_id:?}", job.id),
            ));
        }
        if outcome == AttemptOutcome::Running {
            return Err(SchedulerError::invalid_argument(
                "outcome",
                "must end the attempt, not be running",
            ));
        }
        with_write_tx!(self, tx => {
            check_fence!(self, tx);
            let updated = sqlx::query(
                "UPDATE attempts SET outcome = $3, measured_peak_bytes = $4, oom_json = $5, \
                 message = $6, finished_at_ms = $7, final_loss = $9, test_accuracy = $10, \
                 steps_done = $11, samples_per_second = $12, profile_points_json = $13, \
                 oom_detected_by = $14, metrics_json = $15 \
                 WHERE job_id = $1 AND attempt_number = $2 AND outcome = $8",
            )
            .bind(job_id)
            .bind(attempt_number)
            .bind(outcome.name())
            .bind(measured_peak_bytes)
            .bind(oom.as_ref().map(oom_to_json))
            .bind(message)
            .bind(finished_at_ms)
            .bind(AttemptOutcome::Running.name())
            .bind(results.final_loss)
            .bind(results.test_accuracy)
            .bind(results.steps_done)
            .bind(results.samples_per_second)
            .bind(json_list_column(&ended.profile_points))
            .bind(oom_detector_column(ended.oom_detected_by))
            .bind(json_list_column(&results.metrics))
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if updated == 0 {
                let stored: Option<String> = sqlx::query_scalar(
                    "SELECT outcome FROM attempts WHERE job_id = $1 AND attempt_number = $2",
                )
                .bind(job_id)
                .bind(attempt_number)
                .fetch_optional(&mut *tx)
                .await?;
                let id = attempt_display_id(job_id, attempt_number);
                return Err(match stored {
                    None => SchedulerError::not_found("attempt", id),
                    Some(stored_outcome) => SchedulerError::Conflict(format!(
                        "attempt {id} already ended ({stored_outcome})"
                    )),
                });
            }
            // The attempt's use of its slice ends with it, in the same write.
            sqlx::query(END_USAGE_SQL)
                .bind(job_id)
                .bind(attempt_number)
                .bind(finished_at_ms)
                .bind(measured_peak_bytes)
                .execute(&mut *tx)
                .await?;
            if let Some(job) = job {
                update_job_row!(tx, job);
            }
        });
        Ok(())
    }

    /// Records that a running attempt started training at `started_at_ms`, only while
    /// it runs, like [`Store::end_attempt`] (an attempt ended meanwhile is left as it
    /// is, and so is an attempt that does not exist: `Ok(false)`). `resumed_from` is the
    /// checkpoint the attempt itself loaded, with its step: it replaces the one the
    /// scheduler expected when set, and leaves it when `None` (a worker that does not
    /// say). `start` is what the worker said of the attempt: its argv, whether it runs
    /// uncontained.
    pub async fn record_attempt_started(
        &self,
        job_id: &str,
        attempt_number: i64,
        started_at_ms: i64,
        resumed_from: Option<(&str, i64)>,
        start: &AttemptStartDetails,
    ) -> Result<bool, SchedulerError> {
        let (location, step) = resumed_from.unzip();
        let updated = with_pool!(self, pool => {
            sqlx::query(
                "UPDATE attempts SET started_at_ms = $3, \
                 resumed_from = COALESCE($4, resumed_from), \
                 resumed_from_step = COALESCE($5, resumed_from_step), \
                 command_argv_json = $7, uncontained = $8 \
                 WHERE job_id = $1 AND attempt_number = $2 AND outcome = $6",
            )
            .bind(job_id)
            .bind(attempt_number)
            .bind(started_at_ms)
            .bind(location)
            .bind(step)
            .bind(AttemptOutcome::Running.name())
            .bind(json_list_column(&start.command_argv))
            .bind(start.uncontained)
            .execute(pool)
            .await?
            .rows_affected()
        });
        Ok(updated > 0)
    }

    /// Writes a job and one of its attempts in one transaction (placing a job: the job
    /// becomes placed and its new attempt appears together, or neither does).
    ///
    /// The job is rewritten as [`Store::update_job`] does (`NotFound` when it does not
    /// exist). The attempt is inserted; when the job already has an attempt with that
    /// number it is `AlreadyExists` and nothing of the call is stored (an attempt is
    /// never placed twice: a job's next try is a new attempt).
    pub async fn record_job_and_attempt(
        &self,
        job: &JobRecord,
        attempt: &AttemptRecord,
    ) -> Result<(), SchedulerError> {
        self.record_placement(job, attempt, None).await
    }

    /// [`Store::record_job_and_attempt`] with the attempt's usage row (issue 32) in the
    /// same transaction, so every placed attempt's use of its slice is recorded from its
    /// placement: both are stored or neither is. A usage row already stored for the
    /// attempt is kept.
    pub async fn record_placement(
        &self,
        job: &JobRecord,
        attempt: &AttemptRecord,
        usage: Option<&UsageRecord>,
    ) -> Result<(), SchedulerError> {
        if let Some(usage) = usage {
            check_usage_record(usage)?;
            if (usage.job_id.as_str(), usage.attempt_number)
                != (attempt.job_id.as_str(), attempt.attempt_number)
            {
                return Err(SchedulerError::invalid_argument(
                    "usage.job_id",
                    format!(
                        "is attempt {} but the attempt is {}",
                        attempt_display_id(&usage.job_id, usage.attempt_number),
                        attempt.display_id()
                    ),
                ));
            }
        }
        if attempt.job_id != job.id {
            return Err(SchedulerError::invalid_argument(
                "attempt.job_id",
                format!("is {:?} but the job is {:?}", attempt.job_id, job.id),
            ));
        }
        let insert =
            format!("{INSERT_ATTEMPT_SQL} ON CONFLICT (job_id, attempt_number) DO NOTHING");
        with_write_tx!(self, tx => {
            check_fence!(self, tx);
            update_job_row!(tx, job);
            let written = bind_attempt_columns!(sqlx::query(&insert), attempt)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if written == 0 {
                return Err(SchedulerError::already_exists("attempt", attempt.display_id()));
            }
            let fence = self.fence_epoch();
            if fence != UNFENCED {
                sqlx::query(
                    "UPDATE attempts SET leader_epoch = $3 \
                     WHERE job_id = $1 AND attempt_number = $2",
                )
                .bind(&attempt.job_id)
                .bind(attempt.attempt_number)
                .bind(fence)
                .execute(&mut *tx)
                .await?;
            }
            if let Some(usage) = usage {
                bind_usage!(sqlx::query(INSERT_USAGE_SQL), usage)
                    .execute(&mut *tx)
                    .await?;
            }
        });
        Ok(())
    }
}
