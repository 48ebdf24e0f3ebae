//! Preemptions under way, durable: the claims (an urgent job's bytes held on one GPU),
//! the evictions (victims asked to stop, each with its attempt and the urgent job it
//! stops for) and when each job was preempted in the last hour (the cap per job per
//! hour). The scheduler keeps them in core's preemption book and mirrors each change
//! here, so a restarted scheduler or a new leader loads them and finishes a preemption
//! the last one began (`scheduler/recovery.rs`).
//!
//! A decision is stored ([`Store::record_preemption`]) before any worker is told to stop,
//! so no worker can act on a preemption the store does not know; the urgent job's waiting
//! reason is written in the same transaction. Rows go when the preemption completes or
//! lapses ([`Store::forget_preemptions`]). Every write is FENCED by the leader's epoch,
//! like placement and attempt writes: a deposed leader cannot add or remove any.

use super::Store;
use super::leadership::check_fence;
use crate::error::SchedulerError;

/// An urgent job's claim on one GPU's bytes. Its victims are the evictions that name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredClaim {
    pub urgent_job_id: String,
    pub gpu_id: String,
    pub worker_id: String,
    pub slice_bytes: i64,
    pub claimed_at_ms: i64,
}

/// A victim asked to stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEviction {
    pub victim_job_id: String,
    pub attempt_number: i64,
    pub urgent_job_id: String,
    pub grace_ends_at_ms: i64,
    /// Why: its attempt's outcome message and its job's log line.
    pub message: String,
    pub evicted_at_ms: i64,
}

/// Everything stored of preemptions: what [`Store::preemptions`] reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoredPreemptions {
    /// By urgent job id.
    pub claims: Vec<StoredClaim>,
    /// By victim job id.
    pub evictions: Vec<StoredEviction>,
    /// `(job id, when it was preempted)`, by job id then time.
    pub times: Vec<(String, i64)>,
}

/// How long a preemption counts towards the cap per job per hour.
const HOUR_MS: i64 = 3_600_000;

impl Store {
    /// Stores one preemption decision in one transaction, FENCED: the urgent job's claim,
    /// its victims' evictions, each victim's preemption time (times more than an hour
    /// before the claim are removed) and the urgent job's waiting reason (set while it is
    /// queued). A claim or eviction already stored for the same job is replaced: the
    /// book holds at most one of each per job.
    pub async fn record_preemption(
        &self,
        claim: &StoredClaim,
        evictions: &[StoredEviction],
        urgent_waiting_reason: &str,
    ) -> Result<(), SchedulerError> {
        if let Some(eviction) = evictions
            .iter()
            .find(|eviction| eviction.urgent_job_id != claim.urgent_job_id)
        {
            return Err(SchedulerError::invalid_argument(
                "evictions.urgent_job_id",
                format!(
                    "is {:?} but the claim is {:?}'s",
                    eviction.urgent_job_id, claim.urgent_job_id
                ),
            ));
        }
        with_write_tx!(self, tx => {
            check_fence!(self, tx);
            sqlx::query(
                "INSERT INTO preemption_claims \
                 (urgent_job_id, gpu_id, worker_id, slice_bytes, claimed_at_ms) \
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT (urgent_job_id) DO UPDATE SET \
                 gpu_id = excluded.gpu_id, worker_id = excluded.worker_id, \
                 slice_bytes = excluded.slice_bytes, claimed_at_ms = excluded.claimed_at_ms",
            )
            .bind(&claim.urgent_job_id)
            .bind(&claim.gpu_id)
            .bind(&claim.worker_id)
            .bind(claim.slice_bytes)
            .bind(claim.claimed_at_ms)
            .execute(&mut *tx)
            .await?;
            for eviction in evictions {
                sqlx::query(
                    "INSERT INTO preemption_evictions (victim_job_id, attempt_number, \
                     urgent_job_id, grace_ends_at_ms, message, evicted_at_ms) \
                     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (victim_job_id) DO UPDATE SET \
                     attempt_number = excluded.attempt_number, \
                     urgent_job_id = excluded.urgent_job_id, \
                     grace_ends_at_ms = excluded.grace_ends_at_ms, \
                     message = excluded.message, evicted_at_ms = excluded.evicted_at_ms",
                )
                .bind(&eviction.victim_job_id)
                .bind(eviction.attempt_number)
                .bind(&eviction.urgent_job_id)
                .bind(eviction.grace_ends_at_ms)
                .bind(&eviction.message)
                .bind(eviction.evicted_at_ms)
                .execute(&mut *tx)
                .await?;
                sqlx::query("INSERT INTO preemption_times (job_id, preempted_at_ms) VALUES ($1, $2)")
                    .bind(&eviction.victim_job_id)
                    .bind(eviction.evicted_at_ms)
                    .execute(&mut *tx)
                    .await?;
            }
            sqlx::query("DELETE FROM preemption_times WHERE preempted_at_ms <= $1")
                .bind(claim.claimed_at_ms.saturating_sub(HOUR_MS))
                .execute(&mut *tx)
                .await?;
            sqlx::query("UPDATE jobs SET waiting_reason = $2 WHERE id = $1 AND state = 'queued'")
                .bind(&claim.urgent_job_id)
                .bind(urgent_waiting_reason)
                .execute(&mut *tx)
                .await?;
        });
        Ok(())
    }

    /// Removes, in one transaction, FENCED, the claims of the urgent jobs `claims` names
    /// and the evictions `evictions` names (`(victim job id, attempt number)`: an
    /// eviction of another attempt of the job is left). Rows that are not there are
    /// skipped.
    pub async fn forget_preemptions(
        &self,
        claims: &[String],
        evictions: &[(String, i64)],
    ) -> Result<(), SchedulerError> {
        if claims.is_empty() && evictions.is_empty() {
            return Ok(());
        }
        with_write_tx!(self, tx => {
            check_fence!(self, tx);
            for urgent_job_id in claims {
                sqlx::query("DELETE FROM preemption_claims WHERE urgent_job_id = $1")
                    .bind(urgent_job_id)
                    .execute(&mut *tx)
                    .await?;
            }
            for (victim_job_id, attempt_number) in evictions {
                sqlx::query(
                    "DELETE FROM preemption_evictions \
                     WHERE victim_job_id = $1 AND attempt_number = $2",
                )
                .bind(victim_job_id)
                .bind(attempt_number)
                .execute(&mut *tx)
                .await?;
            }
        });
        Ok(())
    }

    /// Every stored claim and eviction, and the preemption times after `times_since_ms`.
    pub async fn preemptions(
        &self,
        times_since_ms: i64,
    ) -> Result<StoredPreemptions, SchedulerError> {
        let (claims, evictions, times) = with_pool!(self, pool => {
            let claims: Vec<(String, String, String, i64, i64)> = sqlx::query_as(
                "SELECT urgent_job_id, gpu_id, worker_id, slice_bytes, claimed_at_ms \
                 FROM preemption_claims ORDER BY urgent_job_id",
            )
            .fetch_all(pool)
            .await?;
            let evictions: Vec<(String, i64, String, i64, String, i64)> = sqlx::query_as(
                "SELECT victim_job_id, attempt_number, urgent_job_id, grace_ends_at_ms, \
                 message, evicted_at_ms FROM preemption_evictions ORDER BY victim_job_id",
            )
            .fetch_all(pool)
            .await?;
            let times: Vec<(String, i64)> = sqlx::query_as(
                "SELECT job_id, preempted_at_ms FROM preemption_times \
                 WHERE preempted_at_ms > $1 ORDER BY job_id, preempted_at_ms",
            )
            .bind(times_since_ms)
            .fetch_all(pool)
            .await?;
            (claims, evictions, times)
        });
        Ok(StoredPreemptions {
            claims: claims
                .into_iter()
                .map(
                    |(urgent_job_id, gpu_id, worker_id, slice_bytes, claimed_at_ms)| StoredClaim {
                        urgent_job_id,
                        gpu_id,
                        worker_id,
                        slice_bytes,
                        claimed_at_ms,
                    },
                )
                .collect(),
            evictions: evictions
                .into_iter()
                .map(
                    |(
                        victim_job_id,
                        attempt_number,
                        urgent_job_id,
                        grace_ends_at_ms,
                        message,
                        evicted_at_ms,
                    )| StoredEviction {
                        victim_job_id,
                        attempt_number,
                        urgent_job_id,
                        grace_ends_at_ms,
                        message,
                        evicted_at_ms,
                    },
                )
                .collect(),
            times,
        })
    }
}
