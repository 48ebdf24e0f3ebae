//! Preemption: when a pass leaves a job waiting for free memory, core's
//! `scheduling::preemption::choose_victims` says which lower-priority attempts (or which
//! attempts of a tenant over its fair share) to evict; their workers are told to
//! checkpoint and stop within the grace period, the freed bytes are *claimed* for the
//! urgent job (no other job is placed in them), and once every victim has ended the urgent
//! job is placed there before the pass solves the rest. Each victim's job goes back to
//! the queue, keeping its submit sequence (so it is ahead of its younger peers), and
//! resumes from its checkpoint; its attempt ends `preempted`.
//!
//! What is held here is in memory only: a restarted scheduler forgets the claims and the
//! hourly counts, and a victim still stopping across the restart ends as its worker
//! reports it (cancelled).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use carve_core::scheduling::preemption as preemption_defaults;
use carve_core::scheduling::preemption::{
    EvictionGround, FairShareState, GpuOccupancy, PreemptionPlan, RunningAttempt as Occupant,
    TenantShare, UrgentJob, choose_victims,
};
use carve_core::scheduling::{GpuState, PendingJob, TenantState, WaitReason};
use tokio::time::Instant;

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

/// A victim asked to stop: why, for its attempt's outcome and its job's log.
#[derive(Debug, Clone)]
pub(super) struct Eviction {
    pub(super) attempt_number: u32,
    pub(super) message: String,
}

/// Bytes of one GPU held for an urgent job while its victims stop.
#[derive(Debug, Clone)]
struct Claim {
    gpu_id: String,
    worker_id: String,
    slice_bytes: u64,
    /// Jobs whose attempts are still stopping.
    victims: BTreeSet<String>,
}

/// Preemptions under way and the recent ones, by job id.
#[derive(Debug, Default)]
pub(super) struct PreemptionLedger {
    /// Victims still stopping.
    evicting: HashMap<String, Eviction>,
    /// Urgent jobs and the bytes held for them.
    claims: HashMap<String, Claim>,
    /// When each job was preempted, within the last hour.
    recent: HashMap<String, Vec<Instant>>,
}

const HOUR: Duration = Duration::from_secs(3600);

impl PreemptionLedger {
    /// The eviction of this job's attempt, if it is one: forgotten here, and its claim
    /// told that this victim is gone.
    pub(super) fn take_eviction(&mut self, job_id: &str, attempt_number: u32) -> Option<Eviction> {
        let eviction = self
            .evicting
            .remove_entry(job_id)
            .filter(|(_, eviction)| eviction.attempt_number == attempt_number);
        let (job_id, eviction) = eviction?;
        for claim in self.claims.values_mut() {
            claim.victims.remove(&job_id);
        }
        Some(eviction)
    }

    /// Urgent jobs waiting for their victims: the pass leaves them out of `solve`.
    pub(super) fn claimed_jobs(&self) -> BTreeSet<String> {
        self.claims.keys().cloned().collect()
    }

    /// Holds each claim's bytes on its GPU, so no other job is placed in them.
    pub(super) fn hold_claims(&self, gpus: &mut [GpuState]) {
        for claim in self.claims.values() {
            if let Some(gpu) = gpus
                .iter_mut()
                .find(|gpu| gpu.gpu_id == claim.gpu_id && gpu.worker_id == claim.worker_id)
            {
                gpu.allocated_bytes = gpu.allocated_bytes.saturating_add(claim.slice_bytes);
            }
        }
    }
}

impl Scheduler {
    /// Places each urgent job whose victims have all ended in the bytes they freed; a
    /// claim whose job left the queue is dropped. Called by the pass, under
    /// `job_changes`, before it solves; returns how many it placed.
    pub(super) async fn place_claimed_jobs(&self) -> Result<usize, SchedulerError> {
        let ready: Vec<(String, Claim)> = {
            let mut live = self.live();
            let live = &mut *live;
            // A victim lost with its worker (its lease expired) ends without a report:
            // it is gone as far as its claim is concerned.
            let running = &live.running;
            live.preemption.evicting.retain(|job_id, eviction| {
                running
                    .get(job_id)
                    .is_some_and(|attempt| attempt.attempt_number == eviction.attempt_number)
            });
            let evicting = &live.preemption.evicting;
            for claim in live.preemption.claims.values_mut() {
                claim.victims.retain(|job_id| evicting.contains_key(job_id));
            }
            let ready: Vec<String> = live
                .preemption
                .claims
                .iter()
                .filter(|(_, claim)| claim.victims.is_empty())
                .map(|(job_id, _)| job_id.clone())
                .collect();
            ready
                .into_iter()
                .filter_map(|job_id| {
                    let claim = live.preemption.claims.remove(&job_id)?;
                    Some((job_id, claim))
                })
                .collect()
        };
        let mut placed = 0;
        let now = now_ms();
        for (job_id, claim) in ready {
            let fits = self.gpu_states().iter().any(|gpu| {
                gpu.gpu_id == claim.gpu_id
                    && gpu.worker_id == claim.worker_id
                    && gpu.schedulable
                    && gpu.free_bytes() >= claim.slice_bytes
            });
            if !fits {
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
            .claims
            .retain(|job_id, _| queue.contains(job_id));
        Ok(placed)
    }

    /// For each job the pass left waiting for free memory, highest priority first: asks
    /// core whom to evict and, if anyone, tells their workers to stop and claims the
    /// freed bytes. One plan per GPU per pass. Called under `job_changes`.
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
        let mut urgent: Vec<&PendingJob> = pending
            .iter()
            .filter(|job| {
                waiting.iter().any(|(job_id, reason)| {
                    *job_id == job.job_id && matches!(reason, WaitReason::NoGpuFreeEnough { .. })
                })
            })
            .collect();
        if urgent.is_empty() {
            return Ok(0);
        }
        urgent.sort_by(|left, right| {
            right
                .priority
                .cmp(&left.priority)
                .then_with(|| left.submit_sequence.cmp(&right.submit_sequence))
                .then_with(|| left.job_id.cmp(&right.job_id))
        });
        let fair_share = fair_share_state(gpus, tenants, pending);
        let core_settings = carve_core::scheduling::preemption::PreemptionSettings {
            min_run_time_seconds: settings.min_run_time.as_secs(),
            max_preemptions_per_job_per_hour: settings.max_per_job_per_hour,
        };
        let mut occupancy = self.gpu_occupancy(gpus);
        let mut preempted = 0;
        for job in urgent {
            let request = UrgentJob {
                job_id: job.job_id.clone(),
                tenant: job.tenant.clone(),
                priority: job.priority,
                slice_bytes: job.slice_bytes,
            };
            let Some(plan) = choose_victims(&request, &occupancy, &fair_share, core_settings)
            else {
                continue;
            };
            occupancy.retain(|gpu| !(gpu.gpu_id == plan.gpu_id && gpu.worker_id == plan.worker_id));
            preempted += plan.victims.len();
            self.evict(job, plan).await?;
        }
        Ok(preempted)
    }

    /// Schedulable GPUs without a claim, each with its attempts that are not already
    /// stopping, as core's preemption sees them.
    fn gpu_occupancy(&self, gpus: &[GpuState]) -> Vec<GpuOccupancy> {
        let now = now_ms();
        let hour_ago = Instant::now().checked_sub(HOUR);
        let mut live = self.live();
        for times in live.preemption.recent.values_mut() {
            times.retain(|time| hour_ago.is_none_or(|hour_ago| *time > hour_ago));
        }
        live.preemption.recent.retain(|_, times| !times.is_empty());
        gpus.iter()
            .filter(|gpu| gpu.schedulable)
            .filter(|gpu| {
                !live
                    .preemption
                    .claims
                    .values()
                    .any(|claim| claim.gpu_id == gpu.gpu_id && claim.worker_id == gpu.worker_id)
            })
            .map(|gpu| GpuOccupancy {
                gpu_id: gpu.gpu_id.clone(),
                worker_id: gpu.worker_id.clone(),
                free_bytes: gpu.free_bytes(),
                attempts: live
                    .running
                    .iter()
                    .filter(|(job_id, running)| {
                        running.gpu_id == gpu.gpu_id
                            && running.worker_id == gpu.worker_id
                            && !live.preemption.evicting.contains_key(*job_id)
                    })
                    .map(|(job_id, running)| Occupant {
                        attempt_id: format!("{job_id}/{}", running.attempt_number),
                        job_id: job_id.clone(),
                        tenant: running.tenant.clone(),
                        priority: running.priority,
                        slice_bytes: running.slice_bytes,
                        run_time_seconds: u64::try_from((now - running.started_at_ms) / 1000)
                            .unwrap_or(0),
                        preemptions_in_last_hour: live
                            .preemption
                            .recent
                            .get(job_id)
                            .map_or(0, |times| u32::try_from(times.len()).unwrap_or(u32::MAX)),
                    })
                    .collect(),
            })
            .collect()
    }

    /// Carries out one plan: each victim's worker is told to stop, the freed bytes are
    /// claimed for `job`, and both jobs' logs say who preempted whom and why.
    async fn evict(&self, job: &PendingJob, plan: PreemptionPlan) -> Result<(), SchedulerError> {
        let grace_period = self.settings.preemption.grace_period;
        let mut victims = BTreeSet::new();
        let mut named = Vec::new();
        for victim in &plan.victims {
            let Some(running) = self.live().running.get(&victim.job_id).cloned() else {
                continue;
            };
            let why = match victim.ground {
                EvictionGround::HigherPriority => format!(
                    "job {} (priority {}) needs {} on {} and this job's priority is {}",
                    job.job_id,
                    job.priority,
                    carve_core::bytes::HumanBytes(job.slice_bytes),
                    plan.gpu_id,
                    victim.priority
                ),
                EvictionGround::FairShareReclaim => format!(
                    "job {} of tenant {} (under its fair share) reclaims {} on {} from \
                     tenant {} (over its fair share)",
                    job.job_id,
                    job.tenant,
                    carve_core::bytes::HumanBytes(job.slice_bytes),
                    plan.gpu_id,
                    victim.tenant
                ),
            };
            let message = format!(
                "preempted by job {} (priority {}): {why}; it checkpoints, stops within \
                 {grace_period:?} and resumes from its checkpoint",
                job.job_id, job.priority
            );
            let attempt = AttemptRef {
                job_id: victim.job_id.clone(),
                attempt_number: running.attempt_number,
                lease_epoch: running.lease_epoch,
            };
            self.send_to_worker(
                &running.worker_id,
                WorkerCommand::Cancel {
                    attempt: attempt.clone(),
                    grace_period,
                    reason: message.clone(),
                },
            );
            self.emit_attempt_line(&attempt, message.clone());
            {
                let mut live = self.live();
                live.preemption.evicting.insert(
                    victim.job_id.clone(),
                    super::preemption::Eviction {
                        attempt_number: running.attempt_number,
                        message,
                    },
                );
                live.preemption
                    .recent
                    .entry(victim.job_id.clone())
                    .or_default()
                    .push(Instant::now());
            }
            Metrics::count(&self.metrics.preemptions);
            victims.insert(victim.job_id.clone());
            named.push(format!("{} (priority {})", victim.job_id, victim.priority));
        }
        if victims.is_empty() {
            return Ok(());
        }
        let reason = format!(
            "preempting {} on {} to make room: placed once they have stopped",
            named.join(", "),
            plan.gpu_id
        );
        self.emit_attempt_line(
            &AttemptRef {
                job_id: job.job_id.clone(),
                attempt_number: 0,
                lease_epoch: 0,
            },
            reason.clone(),
        );
        self.store
            .set_waiting_reasons(&[(job.job_id.clone(), reason.clone())])
            .await?;
        if let Some(mirrored) = self.queue().get_mut(&job.job_id) {
            mirrored.stored_reason = reason;
            mirrored.decided = None;
        }
        self.live().preemption.claims.insert(
            job.job_id.clone(),
            Claim {
                gpu_id: plan.gpu_id,
                worker_id: plan.worker_id,
                slice_bytes: job.slice_bytes,
                victims,
            },
        );
        Ok(())
    }
}

/// The tenants with work (running or queued) sharing the schedulable GPUs' usable bytes.
fn fair_share_state(
    gpus: &[GpuState],
    tenants: &[TenantState],
    pending: &[PendingJob],
) -> FairShareState {
    FairShareState {
        usable_bytes: gpus
            .iter()
            .filter(|gpu| gpu.schedulable)
            .map(GpuState::usable_bytes)
            .sum(),
        tenants: tenants
            .iter()
            .filter(|tenant| {
                tenant.vram_in_use_bytes > 0
                    || pending.iter().any(|job| job.tenant == tenant.tenant)
            })
            .map(|tenant| TenantShare {
                tenant: tenant.tenant.clone(),
                weight: tenant.weight,
                vram_in_use_bytes: tenant.vram_in_use_bytes,
            })
            .collect(),
    }
}
