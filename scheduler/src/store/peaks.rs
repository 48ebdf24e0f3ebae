//! Measured peaks against their estimates, by job shape: the feedback that raises later
//! estimates of a shape whose attempts peaked above what the estimator said. (Command
//! jobs' memory models are `memory_models.rs`'s.)

use super::Store;
use crate::error::SchedulerError;

impl Store {
    /// Records that an attempt of the job shape `shape_key` estimated at
    /// `estimated_bytes` measured a peak of `measured_bytes`. `InvalidArgument` when the
    /// estimate is not positive or the measurement is negative.
    pub async fn record_peak(
        &self,
        shape_key: &str,
        estimated_bytes: i64,
        measured_bytes: i64,
        at_ms: i64,
    ) -> Result<(), SchedulerError> {
        if estimated_bytes <= 0 {
            return Err(SchedulerError::invalid_argument(
                "estimated_bytes",
                format!("must be positive, got {estimated_bytes}"),
            ));
        }
        if measured_bytes < 0 {
            return Err(SchedulerError::invalid_argument(
                "measured_bytes",
                format!("must not be negative, got {measured_bytes}"),
            ));
        }
        let ratio = measured_bytes as f64 / estimated_bytes as f64;
        with_pool!(self, pool => {
            sqlx::query(
                "INSERT INTO peak_measurements \
                 (shape_key, estimated_bytes, measured_bytes, ratio, recorded_at_ms) \
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(shape_key)
            .bind(estimated_bytes)
            .bind(measured_bytes)
            .bind(ratio)
            .bind(at_ms)
            .execute(pool)
            .await?
            .rows_affected()
        });
        Ok(())
    }

    /// The largest measured / estimated ratio recorded for `shape_key`, by which later
    /// estimates of that shape can be raised; `None` when nothing was recorded. A ratio
    /// below 1 means every attempt peaked below its estimate.
    pub async fn peak_correction(&self, shape_key: &str) -> Result<Option<f64>, SchedulerError> {
        Ok(with_pool!(self, pool => {
            sqlx::query_scalar("SELECT MAX(ratio) FROM peak_measurements WHERE shape_key = $1")
                .bind(shape_key)
                .fetch_one(pool)
                .await?
        }))
    }
}
