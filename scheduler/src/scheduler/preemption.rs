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
//! The book is durable (`store/preemptions.rs`), on the wall clock (`now_ms`, as
//! attempts' start times): each decision (its claim, its evictions, the victims'
//! preemption times, the urgent job's waiting reason) is stored in one fenced transaction
//! *before* any worker is told to stop, and rows go when a victim ends (`outcomes.rs`,
//! after its attempt's end is stored), when a victim is lost with its worker and when a
//! claim is placed or lapses (here). A restarted scheduler or a new leader loads them
//! (`recovery.rs`): a victim's "cancelled" report after the restart is read as preempted
//! (never as a user's cancel, which moves the job to CANCELLED itself), the urgent job is
//! placed in the freed bytes, and no second victim is evicted for the same claim. A stop
//! this process has not handed to the victim's worker (the worker had no session, or the
//! scheduler restarted between the decision and the cancel) is sent again at each pass
//! until it is, with the whole grace period.

use std::collections::BTreeSet;
use std::ops::{Deref, DerefMut};
use std::time::Duration;

use carve_core::scheduling::preemption as preemption_defaults;
use carve_core::scheduling::preemption::book::{
    BookSettings, Claim, Eviction, Millis, Occupant, PassInput, Preemption, PreemptionBook,
    WaitingJob, fair_share_state,
};
use carve_core::scheduling::{GpuState, PendingJob, TenantState, WaitReason};

use crate::error::SchedulerError;
use crate::metrics::Metrics;
use crate::store::{StoredClaim, StoredEviction, StoredPreemptions};

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

/// Preemptions under way and the recent ones, by job id, on the wall clock: core's book,
/// and the victims whose stop this process has yet to hand to their workers.
#[derive(Debug, Default)]
pub(super) struct PreemptionLedger {
    book: PreemptionBook<String, Millis>,
    /// Victims (by job id) whose cancel was not handed to a worker session by this
    /// process: their worker had none, or the book was loaded from the store.
    unsent_cancels: BTreeSet<String>,
}

impl Deref for PreemptionLedger {
    type Target = PreemptionBook<String, Millis>;

    fn deref(&self) -> &Self::Target {
        &self.book
    }
}

impl DerefMut for PreemptionLedger {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.book
    }
}

impl PreemptionLedger {
    /// The book as the store kept it; every victim's stop is sent again (its worker may
    /// never have had it).
    pub(super) fn restore(stored: StoredPreemptions) -> PreemptionLedger {
        let book = PreemptionBook::restore(
            stored.claims.into_iter().map(|claim| {
                (
                    claim.urgent_job_id,
                    Claim {
                        gpu_id: claim.gpu_id,
                        worker_id: claim.worker_id,
                        slice_bytes: u64::try_from(claim.slice_bytes).unwrap_or(0),
                        victims: BTreeSet::new(),
                    },
                )
            }),
            stored.evictions.into_iter().map(|eviction| {
                (
                    eviction.victim_job_id,
                    Eviction {
                        urgent: eviction.urgent_job_id,
                        attempt_number: u32::try_from(eviction.attempt_number).unwrap_or(0),
                        grace_ends_at: Millis(eviction.grace_ends_at_ms),
                        message: eviction.message,
                    },
                )
            }),
            stored
                .times
                .into_iter()
                .map(|(job, at_ms)| (job, Millis(at_ms))),
        );
        let unsent_cancels = book.evictions().map(|(job, _)| job.clone()).collect();
        PreemptionLedger {
            book,
            unsent_cancels,
        }
    }

    /// The claims' urgent jobs and the evictions' `(victim, attempt)`s, to tell what a
    /// step of the book removed.
    fn keys(&self) -> (BTreeSet<String>, BTreeSet<(String, i64)>) {
        (
            self.book.claims().map(|(job, _)| job.clone()).collect(),
            self.book
                .evictions()
                .map(|(job, eviction)| (job.clone(), i64::from(eviction.attempt_number)))
                .collect(),
        )
    }
}

/// What is in `before` and not in `after`.
fn removed<K: Ord + Clone>(before: &BTreeSet<K>, after: &BTreeSet<K>) -> Vec<K> {
    before.difference(after).cloned().collect()
}

impl Scheduler {
    /// Sends again each victim's stop this process has not handed to its worker; places
    /// each urgent job whose victims have all ended in the bytes they freed; a claim whose
    /// job left the queue is dropped. What the book drops here goes from the store too.
    /// Called by the pass, under `job_changes`, before it solves; returns how many it
    /// placed.
    pub(super) async fn place_claimed_jobs(&self) -> Result<usize, SchedulerError> {
        self.send_unsent_cancels();
        let (ready, lost_victims) = {
            let mut live = self.live();
            let live = &mut *live;
            let (_, evictions_before) = live.preemption.keys();
            // A victim lost with its worker (its lease expired) ends without a report:
            // it is gone as far as its claim is concerned.
            let running = &live.running;
            live.preemption
                .forget_lost_victims(|job_id, attempt_number| {
                    running
                        .get(job_id)
                        .is_some_and(|attempt| attempt.attempt_number == attempt_number)
                });
            let (_, evictions_after) = live.preemption.keys();
            let lost_victims = removed(&evictions_before, &evictions_after);
            for (job_id, _) in &lost_victims {
                live.preemption.unsent_cancels.remove(job_id);
            }
            (live.preemption.take_ready_claims(), lost_victims)
        };
        // Forgotten before the urgent jobs are placed: a scheduler that stops in between
        // finds them queued without a claim, and places them as any other.
        let ready_jobs: Vec<String> = ready.iter().map(|(job_id, _)| job_id.clone()).collect();
        self.store
            .forget_preemptions(&ready_jobs, &lost_victims)
            .await?;
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
        let lapsed = {
            let queue = self.queue();
            let mut live = self.live();
            let (claims_before, _) = live.preemption.keys();
            live.preemption
                .retain_claims(|job_id| queue.contains(job_id));
            let (claims_after, _) = live.preemption.keys();
            removed(&claims_before, &claims_after)
        };
        self.store.forget_preemptions(&lapsed, &[]).await?;
        Ok(placed)
    }

    /// Hands each victim's stop that this process has not handed to its worker's session
    /// (see [`PreemptionLedger`]) to it now, with the whole grace period: a worker that
    /// never had it gets all of it to checkpoint, and one already stopping ignores it.
    fn send_unsent_cancels(&self) {
        let grace_period = self.settings.preemption.grace_period;
        let unsent: Vec<(AttemptRef, String, String)> = {
            let live = self.live();
            live.preemption
                .unsent_cancels
                .iter()
                .filter_map(|job_id| {
                    let eviction = live.preemption.eviction(job_id)?;
                    let running = live.running.get(job_id)?;
                    (running.attempt_number == eviction.attempt_number).then(|| {
                        (
                            AttemptRef {
                                job_id: job_id.clone(),
                                attempt_number: running.attempt_number,
                                lease_epoch: running.lease_epoch,
                            },
                            running.worker_id.clone(),
                            eviction.message.clone(),
                        )
                    })
                })
                .collect()
        };
        for (attempt, worker_id, reason) in unsent {
            let job_id = attempt.job_id.clone();
            let sent = self.send_to_worker(
                &worker_id,
                WorkerCommand::Cancel {
                    attempt,
                    grace_period,
                    reason,
                },
            );
            if sent {
                self.live().preemption.unsent_cancels.remove(&job_id);
            }
        }
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
        let mut preemptions = preemptions.into_iter();
        while let Some(preemption) = preemptions.next() {
            evicted += preemption.victims.len();
            if let Err(error) = self.evict(preemption).await {
                // Nobody was told of the decisions not yet stored: the book forgets them.
                for undone in preemptions {
                    self.forget_decision(&undone);
                }
                return Err(error);
            }
        }
        Ok(evicted)
    }

    /// The end of attempt `attempt_number` of `job_id` was stored: the book forgets the
    /// job's eviction (a stale one of another attempt too; see `take_eviction`) and,
    /// when it was this attempt's, so does the store. A failure to remove the row is only
    /// logged: the row is stale (its attempt ended), and the first pass after the next
    /// recovery drops it.
    pub(super) async fn end_eviction(&self, job_id: &str, attempt_number: u32) {
        let eviction = {
            let mut live = self.live();
            live.preemption.unsent_cancels.remove(job_id);
            live.preemption
                .take_eviction(&job_id.to_string(), attempt_number)
        };
        if eviction.is_none() {
            return;
        }
        let eviction = [(job_id.to_string(), i64::from(attempt_number))];
        if let Err(error) = self.store.forget_preemptions(&[], &eviction).await {
            tracing::warn!(job = %job_id, %error, "could not remove a preemption's stored eviction");
        }
    }

    /// Takes a decision that was not stored (and so carried out) out of the book.
    fn forget_decision(&self, preemption: &Preemption<String, Millis>) {
        let mut live = self.live();
        live.preemption.drop_claim(&preemption.urgent);
        for victim in &preemption.victims {
            live.preemption
                .take_eviction(&victim.job, victim.attempt_number);
        }
    }

    /// Carries out one of the book's preemptions: it is stored first (so no worker acts
    /// on a preemption a restarted scheduler would not know of), then each victim's
    /// worker is told to stop within the grace period, and both jobs' logs (and the
    /// urgent job's waiting reason) say who preempted whom and why. A decision the store
    /// refused (this replica was deposed) is taken out of the book and nobody is told.
    async fn evict(&self, preemption: Preemption<String, Millis>) -> Result<(), SchedulerError> {
        let grace_period = self.settings.preemption.grace_period;
        let now = now_ms();
        let claim = StoredClaim {
            urgent_job_id: preemption.urgent.clone(),
            gpu_id: preemption.gpu_id.clone(),
            worker_id: preemption.worker_id.clone(),
            slice_bytes: i64::try_from(preemption.slice_bytes).unwrap_or(i64::MAX),
            claimed_at_ms: now,
        };
        let evictions: Vec<StoredEviction> = preemption
            .victims
            .iter()
            .map(|victim| StoredEviction {
                victim_job_id: victim.job.clone(),
                attempt_number: i64::from(victim.attempt_number),
                urgent_job_id: preemption.urgent.clone(),
                grace_ends_at_ms: victim.grace_ends_at.0,
                message: victim.message.clone(),
                evicted_at_ms: now,
            })
            .collect();
        let reason = preemption.reason.clone();
        if let Err(error) = self
            .store
            .record_preemption(&claim, &evictions, &reason)
            .await
        {
            self.forget_decision(&preemption);
            return Err(error);
        }
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
            let sent = self.send_to_worker(
                &running.worker_id,
                WorkerCommand::Cancel {
                    attempt: attempt.clone(),
                    grace_period,
                    reason: victim.message.clone(),
                },
            );
            if !sent {
                self.live()
                    .preemption
                    .unsent_cancels
                    .insert(attempt.job_id.clone());
            }
            self.emit_attempt_line(&attempt, victim.message);
            Metrics::count(&self.metrics.preemptions);
        }
        self.emit_attempt_line(
            &AttemptRef {
                job_id: preemption.urgent.clone(),
                attempt_number: 0,
                lease_epoch: 0,
            },
            reason.clone(),
        );
        if let Some(mirrored) = self.queue().get_mut(&preemption.urgent) {
            mirrored.stored_reason = reason;
            mirrored.decided = None;
        }
        Ok(())
    }
}
