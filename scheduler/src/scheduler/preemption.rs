//! Preemption, live: a thin adapter over core's preemption book
//! (`carve_core::scheduling::preemption::book`), which holds the claims, the evictions
//! and the hourly counts and makes every decision over them. When a pass leaves a job
//! waiting for free memory, the book says which lower-priority attempts (or which
//! attempts of a tenant over its fair share) to evict; here their workers are told to
//! checkpoint and stop within the grace period, and the logs, the waiting reason and the
//! metrics say so. The freed bytes are *claimed* for the urgent job (no other job is
//! placed in them), and once every victim has ended the urgent job is placed there before
//! the pass solves the rest. Each victim's job goes back to the queue, keeping its submit
//! sequence (so it is ahead of its younger peers), and resumes from its checkpoint; its
//! attempt ends `preempted` (`outcomes.rs` asks the book with `take_eviction`).
//!
//! The book is kept in memory only, on the wall clock (`now_ms`, as attempts' start
//! times): a restarted scheduler forgets the claims and the hourly counts, and a victim
//! still stopping across the restart ends as its worker reports it (cancelled).

use std::time::Duration;

use carve_core::scheduling::preemption as preemption_defaults;
use carve_core::scheduling::preemption::book::{
    BookSettings, Millis, Occupant, PassInput, Preemption, PreemptionBook, WaitingJob,
    fair_share_state,
};
use carve_core::scheduling::{GpuState, PendingJob, TenantState, WaitReason};

use crate::error::SchedulerError;
use crate::metrics::Metrics;

use super::worker_reports::{AttemptRef, WorkerCommand};
use super::{Scheduler, now_ms};

/// When and how urgent jobs may evict lower-priority attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreemptionSettings {
    pub enabled: bool,
    /// An attempt younger than this is never evicted.
    pub min_run_time: Duration,
    /// A job preempted this many times in the last hour is not evicted again.
    pub max_per_job_per_hour: u32,
    /// How long a victim has to checkpoint and exit before its worker kills it.
    pub grace_period: Duration,
}

impl Default for PreemptionSettings {
    fn default() -> Self {
        PreemptionSettings {
            enabled: true,
            min_run_time: Duration::from_secs(preemption_defaults::DEFAULT_MIN_RUN_TIME_SECONDS),
            max_per_job_per_hour: preemption_defaults::DEFAULT_MAX_PREEMPTIONS_PER_JOB_PER_HOUR,
            grace_period: Duration::from_secs(preemption_defaults::DEFAULT_GRACE_PERIOD_SECONDS),
        }
    }
}

impl PreemptionSettings {
    /// The book's settings: the limits, and the grace period in seconds.
    fn book_settings(&self) -> BookSettings {
        BookSettings {
            limits: carve_core::scheduling::preemption::PreemptionSettings {
                min_run_time_seconds: self.min_run_time.as_secs(),
                max_preemptions_per_job_per_hour: self.max_per_job_per_hour,
            },
            grace_period_s: self.grace_period.as_secs_f64(),
        }
    }
}

/// Preemptions under way and the recent ones, by job id, on the wall clock: core's book.
pub(super) type PreemptionLedger = PreemptionBook<String, Millis>;

impl Scheduler {
    /// Places each urgent job whose victims have all ended in the bytes they freed; a
    /// claim whose job left the queue is dropped. Called by the pass, under
    /// `job_changes`, before it solves; returns how many it placed.
    pub(super) async fn place_claimed_jobs(&self) -> Result<usize, SchedulerError> {
        let ready = {
            let mut live = self.live();
            let live = &mut *live;
            // A victim lost with its worker (its lease expired) ends without a report:
            // it is gone as far as its claim is concerned.
            let running = &live.running;
            live.preemption
                .forget_lost_victims(|job_id, attempt_number| {
                    running
                        .get(job_id)
                        .is_some_and(|attempt| attempt.attempt_number == attempt_number)
                });
            live.preemption.take_ready_claims()
        };
        let mut placed = 0;
        let now = now_ms();
        for (job_id, claim) in ready {
            if !claim.fits(&self.gpu_states()) {
                continue;
            }
            let placement = carve_core::scheduling::Placement {
                job_id,
                gpu_id: claim.gpu_id,
                worker_id: claim.worker_id,
                slice_bytes: claim.slice_bytes,
            };
            if self.place(&placement, now).await? {
                placed += 1;
                Metrics::count(&self.metrics.placements);
            }
        }
        // A claim whose job was cancelled (or placed elsewhere) holds nothing any more.
        let queue = self.queue();
        self.live()
            .preemption
            .retain_claims(|job_id| queue.contains(job_id));
        Ok(placed)
    }

    /// For the jobs the pass left waiting for free memory: asks the book whom to evict
    /// (see core's `scheduling::preemption::book`) and carries out each of its
    /// preemptions. Called under `job_changes`; returns how many attempts it evicts.
    pub(super) async fn preempt_for_waiting_jobs(
        &self,
        waiting: &[(String, WaitReason)],
        pending: &[PendingJob],
        gpus: &[GpuState],
        tenants: &[TenantState],
    ) -> Result<usize, SchedulerError> {
        let settings = self.settings.preemption;
        if !settings.enabled {
            return Ok(0);
        }
        let waiting: Vec<WaitingJob<String>> = pending
            .iter()
            .filter(|job| {
                waiting.iter().any(|(job_id, reason)| {
                    *job_id == job.job_id && matches!(reason, WaitReason::NoGpuFreeEnough { .. })
                })
            })
            .map(|job| WaitingJob {
                job: job.job_id.clone(),
                tenant: job.tenant.clone(),
                priority: job.priority,
                submit_sequence: job.submit_sequence,
                slice_bytes: job.slice_bytes,
            })
            .collect();
        if waiting.is_empty() {
            return Ok(0);
        }
        let fair_share = fair_share_state(
            gpus,
            tenants.iter().map(|tenant| {
                let queued = pending.iter().any(|job| job.tenant == tenant.tenant);
                (tenant, queued)
            }),
        );
        let preemptions = {
            let mut live = self.live();
            let live = &mut *live;
            let running = live
                .running
                .iter()
                .filter_map(|(job_id, running)| {
                    let gpu = gpus.iter().position(|gpu| {
                        gpu.gpu_id == running.gpu_id && gpu.worker_id == running.worker_id
                    })?;
                    Some(Occupant {
                        job: job_id.clone(),
                        attempt_number: running.attempt_number,
                        gpu,
                        tenant: running.tenant.clone(),
                        priority: running.priority,
                        slice_bytes: running.slice_bytes,
                        started_at: Millis(running.started_at_ms),
                    })
                })
                .collect();
            live.preemption
                .preempt(PassInput {
                    now: Millis(now_ms()),
                    settings: settings.book_settings(),
                    gpus,
                    running,
                    waiting,
                    fair_share,
                })
                .preemptions
        };
        let mut evicted = 0;
        for preemption in preemptions {
            evicted += preemption.victims.len();
            self.evict(preemption).await?;
        }
        Ok(evicted)
    }

    /// Carries out one of the book's preemptions: each victim's worker is told to stop
    /// within the grace period, and both jobs' logs (and the urgent job's waiting
    /// reason) say who preempted whom and why.
    async fn evict(&self, preemption: Preemption<String, Millis>) -> Result<(), SchedulerError> {
        let grace_period = self.settings.preemption.grace_period;
        for victim in preemption.victims {
            let running = self.live().running.get(&victim.job).cloned();
            let Some(running) =
                running.filter(|running| running.attempt_number == victim.attempt_number)
            else {
                // Gone since the book decided: the next pass forgets it.
                continue;
            };
            let attempt = AttemptRef {
                job_id: victim.job,
                attempt_number: victim.attempt_number,
                lease_epoch: running.lease_epoch,
            };
            self.send_to_worker(
                &running.worker_id,
                WorkerCommand::Cancel {
                    attempt: attempt.clone(),
                    grace_period,
                    reason: victim.message.clone(),
                },
            );
            self.emit_attempt_line(&attempt, victim.message);
            Metrics::count(&self.metrics.preemptions);
        }
        let reason = preemption.reason;
        self.emit_attempt_line(
            &AttemptRef {
                job_id: preemption.urgent.clone(),
                attempt_number: 0,
                lease_epoch: 0,
            },
            reason.clone(),
        );
        self.store
            .set_waiting_reasons(&[(preemption.urgent.clone(), reason.clone())])
            .await?;
        if let Some(mirrored) = self.queue().get_mut(&preemption.urgent) {
            mirrored.stored_reason = reason;
            mirrored.decided = None;
        }
        Ok(())
    }
}
