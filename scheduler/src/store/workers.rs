//! Worker nodes.

use super::{Store, WorkerRecord, WorkerState};
use crate::error::SchedulerError;

const WORKER_COLUMNS: &str = "id, hostname, gpus_json, state, last_heartbeat_ms, \
     registered_at_ms, version, token_id, drain_reason";

impl Store {
    /// Inserts a worker, or replaces the stored one with the same id (a worker that
    /// registers again) while keeping its first `registered_at_ms`. Returns the worker as
    /// stored.
    pub async fn upsert_worker(
        &self,
        worker: &WorkerRecord,
    ) -> Result<WorkerRecord, SchedulerError> {
        let sql = format!(
            "INSERT INTO workers ({WORKER_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (id) DO UPDATE SET hostname = excluded.hostname, \
             gpus_json = excluded.gpus_json, state = excluded.state, \
             last_heartbeat_ms = excluded.last_heartbeat_ms, version = excluded.version, \
             token_id = excluded.token_id, drain_reason = excluded.drain_reason \
             RETURNING {WORKER_COLUMNS}"
        );
        Ok(with_pool!(self, pool => {
            sqlx::query_as(&sql)
                .bind(&worker.id)
                .bind(&worker.hostname)
                .bind(&worker.gpus_json)
                .bind(worker.state.name())
                .bind(worker.last_heartbeat_ms)
                .bind(worker.registered_at_ms)
                .bind(&worker.version)
                .bind(&worker.token_id)
                .bind(&worker.drain_reason)
                .fetch_one(pool)
                .await?
        }))
    }

    /// The worker with this id; `NotFound` when there is none.
    pub async fn get_worker(&self, id: &str) -> Result<WorkerRecord, SchedulerError> {
        let sql = format!("SELECT {WORKER_COLUMNS} FROM workers WHERE id = $1");
        let worker: Option<WorkerRecord> = with_pool!(self, pool => {
            sqlx::query_as(&sql).bind(id).fetch_optional(pool).await?
        });
        worker.ok_or_else(|| SchedulerError::not_found("worker", id))
    }

    /// Every worker, by hostname (then id).
    pub async fn list_workers(&self) -> Result<Vec<WorkerRecord>, SchedulerError> {
        let sql = format!("SELECT {WORKER_COLUMNS} FROM workers ORDER BY hostname, id");
        Ok(with_pool!(self, pool => sqlx::query_as(&sql).fetch_all(pool).await?))
    }

    /// Sets a worker's state and returns the worker. `NotFound` when there is no such
    /// worker.
    pub async fn set_worker_state(
        &self,
        id: &str,
        state: WorkerState,
    ) -> Result<WorkerRecord, SchedulerError> {
        let sql = format!("UPDATE workers SET state = $2 WHERE id = $1 RETURNING {WORKER_COLUMNS}");
        let worker: Option<WorkerRecord> = with_pool!(self, pool => {
            sqlx::query_as(&sql).bind(id).bind(state.name()).fetch_optional(pool).await?
        });
        worker.ok_or_else(|| SchedulerError::not_found("worker", id))
    }

    /// Drains a worker with `reason` (empty: none given), or takes the drain back
    /// (`Ready`, the reason cleared), and returns the worker. `NotFound` when there is no
    /// such worker.
    pub async fn set_worker_draining(
        &self,
        id: &str,
        draining: bool,
        reason: &str,
    ) -> Result<WorkerRecord, SchedulerError> {
        let (state, reason) = if draining {
            (WorkerState::Draining, reason)
        } else {
            (WorkerState::Ready, "")
        };
        let sql = format!(
            "UPDATE workers SET state = $2, drain_reason = $3 WHERE id = $1 \
             RETURNING {WORKER_COLUMNS}"
        );
        let worker: Option<WorkerRecord> = with_pool!(self, pool => {
            sqlx::query_as(&sql)
                .bind(id)
                .bind(state.name())
                .bind(reason)
                .fetch_optional(pool)
                .await?
        });
        worker.ok_or_else(|| SchedulerError::not_found("worker", id))
    }

    /// Deletes a worker's record (its attempts keep its id in their history). `NotFound`
    /// when there is no such worker.
    pub async fn delete_worker(&self, id: &str) -> Result<(), SchedulerError> {
        let done = with_pool!(self, pool => {
            sqlx::query("DELETE FROM workers WHERE id = $1")
                .bind(id)
                .execute(pool)
                .await?
                .rows_affected()
        });
        found_worker(done, id)
    }

    /// Records a heartbeat: sets `last_heartbeat_ms`. `NotFound` when there is no such
    /// worker.
    pub async fn record_heartbeat(&self, id: &str, at_ms: i64) -> Result<(), SchedulerError> {
        let done = with_pool!(self, pool => {
            sqlx::query("UPDATE workers SET last_heartbeat_ms = $2 WHERE id = $1")
                .bind(id)
                .bind(at_ms)
                .execute(pool)
                .await?
                .rows_affected()
        });
        found_worker(done, id)
    }
}

/// `NotFound` for `id` when a statement on it touched no row.
fn found_worker(rows_affected: u64, id: &str) -> Result<(), SchedulerError> {
    if rows_affected == 0 {
        return Err(SchedulerError::not_found("worker", id));
    }
    Ok(())
}
