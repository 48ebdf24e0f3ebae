//! Recovery after a start (or on becoming the leader): the live state rebuilt from the
//! store, preemptions under way included, and jobs left placed or running with every
//! attempt ended moved on.

use std::collections::HashMap;

use carve_core::job_state::{AttemptOutcome, JobEvent, JobState, event_for_stranded_job};
use tokio::time::Instant;

use crate::error::SchedulerError;
use crate::metrics::Metrics;
use crate::store::{AttemptRecord, JobRecord};

use super::preemption::PreemptionLedger;
use super::sessions::gpus_from_column;
use super::{LiveWorker, RunningAttempt, Scheduler, WorkerState, now_ms};

/// How far back the preemption times that count towards the cap per job per hour go.
const PREEMPTION_HISTORY_MS: i64 = 3_600_000;

impl Scheduler {
    /// Rebuilds the live state from the store after a start: attempts still running keep
    /// their slices, and their workers get one lease to come back. Preemptions under way
    /// are loaded into the book as the last scheduler left them: a victim's stop is
    /// read as preempted, its claim's bytes stay held for the urgent job, and each
    /// victim's worker is told to stop again (it may never have heard); the first pass
    /// drops evictions whose attempts no longer run. A job placed or running none of
    /// whose attempts runs is moved on (see [`event_for_stranded_job`]).
    pub async fn recover(&self) -> Result<(), SchedulerError> {
        let workers = self.store.list_workers().await?;
        let preemptions = self
            .store
            .preemptions(now_ms().saturating_sub(PREEMPTION_HISTORY_MS))
            .await?;
        let active = self
            .store
            .jobs_in_states(&[JobState::Placed, JobState::Running])
            .await?;
        let mut running = HashMap::new();
        let mut stranded = Vec::new();
        for job in active {
            let attempts = self.store.list_attempts(&job.id).await?;
            let Some(attempt) = attempts
                .iter()
                .rev()
                .find(|attempt| attempt.outcome == AttemptOutcome::Running)
            else {
                stranded.push((job, attempts.last().cloned()));
                continue;
            };
            {
                running.insert(
                    job.id.clone(),
                    RunningAttempt {
                        attempt_number: attempt.attempt_number as u32,
                        lease_epoch: attempt.lease_epoch as u64,
                        worker_id: attempt.worker_id.clone(),
                        gpu_id: attempt.gpu_id.clone(),
                        slice_bytes: attempt.slice_bytes as u64,
                        tenant: job.tenant.clone(),
                        estimate_bytes: attempt.estimate_bytes as u64,
                        measured_peak_bytes: 0,
                        latest_progress: None,
                        priority: job.priority.clamp(i64::from(i32::MIN), i64::from(i32::MAX))
                            as i32,
                        started_at_ms: attempt.started_at_ms,
                    },
                );
            }
        }
        {
            let mut live = self.live();
            for worker in workers {
                if worker.state == WorkerState::Lost {
                    continue;
                }
                let gpus = gpus_from_column(&worker)?;
                let state = worker.state;
                live.workers.insert(
                    worker.id.clone(),
                    LiveWorker {
                        record: worker,
                        gpus,
                        state,
                        last_heartbeat: Instant::now(),
                        session: None,
                    },
                );
            }
            live.running = running;
            live.preemption = PreemptionLedger::restore(preemptions);
        }
        // Fair share over time reads the ended attempts' usage again at the next pass.
        self.forget_usage_history();
        for (job, last_attempt) in stranded {
            self.move_stranded_job(job, last_attempt.as_ref()).await?;
        }
        Ok(())
    }

    /// Moves a job the store shows placed or running, none of whose attempts runs, as
    /// its last attempt (`last_attempt`) ended, and says so in its log.
    async fn move_stranded_job(
        &self,
        mut job: JobRecord,
        last_attempt: Option<&AttemptRecord>,
    ) -> Result<(), SchedulerError> {
        let _guard = self.job_changes.lock().await;
        let event = event_for_stranded_job(
            last_attempt.map(|attempt| attempt.outcome),
            last_attempt.is_some_and(|attempt| attempt.details.profile),
        );
        let what_ended = match last_attempt {
            Some(attempt) => format!(
                "attempt {} ended ({}{})",
                attempt.attempt_number,
                attempt.outcome,
                if attempt.message.is_empty() {
                    String::new()
                } else {
                    format!(": {}", attempt.message)
                }
            ),
            None => "it has no attempt".to_string(),
        };
        let reason = format!(
            "recovered: the job was left {} after {what_ended}; {}",
            job.state,
            match event {
                JobEvent::AttemptLost => "it runs again from its checkpoint",
                _ => "it ends as that attempt did",
            }
        );
        tracing::warn!(job = %job.id, %reason, "a stranded job was moved on");
        if event == JobEvent::AttemptLost {
            job.waiting_reason.clone_from(&reason);
        } else {
            job.finished_at_ms = Some(
                last_attempt
                    .and_then(|attempt| attempt.finished_at_ms)
                    .unwrap_or_else(super::now_ms),
            );
            job.message.clone_from(&reason);
        }
        let change = self.move_job(&mut job, event, &reason).await?;
        self.count_job_change(change);
        Metrics::count(&self.metrics.stranded_jobs_recovered);
        Ok(())
    }
}
