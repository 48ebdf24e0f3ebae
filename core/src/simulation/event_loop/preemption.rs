//! The scheduler's preemption step in the simulator: after a pass, each job left waiting
//! because no GPU has its slice free (highest priority first) asks core's
//! [`choose_victims`] whom to evict, with the same limits as the scheduler (minimum run
//! time, cap per job per hour) and the same fair-share state. The victims stop at the
//! end of the grace period and go back to the queue keeping their submit sequence (ahead
//! of their younger peers); the bytes they free are *claimed*: no pass places another job
//! in them, and once the last victim has stopped the urgent job starts there.
//!
//! The simulator has no quotas, so "waiting because no GPU has its slice free" is read
//! from the free bytes after the pass (the solver's `NoGpuFreeEnough`), which also keeps
//! the answer the same whether the pass pruned the queue or not.

use std::collections::{HashMap, HashSet};

use crate::scheduling::GpuState;
use crate::scheduling::preemption::{
    FairShareState, GpuOccupancy, RunningAttempt, TenantShare, UrgentJob, choose_victims,
};

use super::{EventKind, Phase, Simulation};

/// Seconds in the window of the cap on preemptions per job.
const HOUR_S: f64 = 3600.0;

/// Bytes of one GPU held for an urgent job while its victims stop.
#[derive(Debug, Clone)]
pub(super) struct Claim {
    gpu: usize,
    victims_left: usize,
}

/// Preemptions under way and their totals.
#[derive(Debug, Default)]
pub(super) struct PreemptionBook {
    /// By urgent job.
    pub(super) claims: HashMap<usize, Claim>,
    /// Victims still stopping, with the urgent job each stops for.
    evicting: HashMap<usize, usize>,
    pub(super) preemptions: u64,
    pub(super) run_time_lost_s: f64,
    /// The earliest wake-up event queued, if any.
    next_wake_s: Option<f64>,
}

impl PreemptionBook {
    pub(super) fn woken(&mut self, now: f64) {
        if self.next_wake_s.is_some_and(|wake| wake <= now) {
            self.next_wake_s = None;
        }
    }
}

impl Simulation<'_> {
    /// Raises each claimed GPU's allocated bytes by what its urgent job will need of the
    /// bytes free now, so the solver places nothing there; returns what to give back.
    pub(super) fn hold_claimed_bytes(&mut self) -> Vec<(usize, u64)> {
        let mut held = Vec::new();
        for (&job, claim) in &self.preemption.claims {
            let gpu = &mut self.problem.gpus[claim.gpu];
            let hold = self.runs[job].slice_bytes.min(gpu.free_bytes());
            gpu.allocated_bytes += hold;
            held.push((claim.gpu, hold));
        }
        held
    }

    pub(super) fn release_claimed_bytes(&mut self, held: &[(usize, u64)]) {
        for &(gpu, hold) in held {
            self.problem.gpus[gpu].allocated_bytes -= hold;
        }
    }

    /// The preemption step after a pass (see the module documentation).
    pub(super) fn preempt_for_waiting_jobs(&mut self, now: f64) {
        let Some(preemption) = self.options.preemption else {
            return;
        };
        let largest_free = self
            .problem
            .gpus
            .iter()
            .map(GpuState::free_bytes)
            .max()
            .unwrap_or(0);
        let mut urgent: Vec<(std::cmp::Reverse<i32>, u64, usize)> = self
            .queue
            .iter()
            .flatten()
            .copied()
            .filter(|&(_, _, job)| {
                self.runs[job].slice_bytes > largest_free
                    && !self.preemption.claims.contains_key(&job)
            })
            .collect();
        if urgent.is_empty() {
            return;
        }
        urgent.sort_unstable();
        let fair_share = self.fair_share_state();
        let mut occupancy = self.gpu_occupancy(now);
        // A job of the same tenant and priority with a slice no smaller than one that found
        // no victims finds none either (fewer GPUs are left, and reclaim only gets harder).
        let mut smallest_failed: HashMap<(usize, i32), u64> = HashMap::new();
        let mut anyone_failed = false;
        for (_, _, job) in urgent {
            if occupancy.is_empty() {
                break;
            }
            let (tenant, priority) = (self.tenant_of_job[job], self.workload.jobs[job].priority);
            let slice_bytes = self.runs[job].slice_bytes;
            if smallest_failed
                .get(&(tenant, priority))
                .is_some_and(|failed| *failed <= slice_bytes)
            {
                continue;
            }
            let request = UrgentJob {
                job_id: self.job_ids[job].clone(),
                tenant: self.workload.jobs[job].tenant.clone(),
                priority,
                slice_bytes,
            };
            let Some(plan) = choose_victims(&request, &occupancy, &fair_share, preemption.limits)
            else {
                smallest_failed.insert((tenant, priority), slice_bytes);
                anyone_failed = true;
                continue;
            };
            occupancy.retain(|gpu| gpu.gpu_id != plan.gpu_id);
            let Some(&gpu) = self.gpu_index.get(&plan.gpu_id) else {
                continue;
            };
            let victims: Vec<usize> = plan
                .victims
                .iter()
                .filter_map(|victim| victim.job_id.parse().ok())
                .collect();
            for &victim in &victims {
                self.preemption.evicting.insert(victim, job);
                self.runs[victim].preempted_at_s.push(now);
                self.preemption.preemptions += 1;
                self.push_event(
                    now + preemption.grace_period_s,
                    EventKind::PreemptionStop,
                    victim,
                );
            }
            self.preemption.claims.insert(
                job,
                Claim {
                    gpu,
                    victims_left: victims.len(),
                },
            );
        }
        if anyone_failed {
            self.wake_when_evictable(&occupancy, now);
        }
    }

    /// The simulator runs a pass only when something happens; the scheduler runs one
    /// every few seconds, so a job that found no victims only because some attempt was
    /// too young, or preempted too often, gets one when that stops being so.
    fn wake_when_evictable(&mut self, occupancy: &[GpuOccupancy], now: f64) {
        let Some(preemption) = self.options.preemption else {
            return;
        };
        let min_run_time_s = preemption.limits.min_run_time_seconds as f64;
        let cap = preemption.limits.max_preemptions_per_job_per_hour as usize;
        let wake = occupancy
            .iter()
            .flat_map(|gpu| &gpu.attempts)
            .filter_map(|attempt| {
                let job: usize = attempt.job_id.parse().ok()?;
                let run = &self.runs[job];
                let started_s = run.attempt.as_ref()?.started_s;
                let old_enough_s = started_s + min_run_time_s;
                let recent: Vec<f64> = run
                    .preempted_at_s
                    .iter()
                    .copied()
                    .filter(|time| now - time < HOUR_S)
                    .collect();
                let under_cap_s = if recent.len() >= cap {
                    recent[recent.len() - cap] + HOUR_S
                } else {
                    now
                };
                Some(old_enough_s.max(under_cap_s))
            })
            .filter(|time| *time > now)
            .min_by(f64::total_cmp);
        if let Some(wake) = wake
            && self
                .preemption
                .next_wake_s
                .is_none_or(|queued| wake < queued)
        {
            self.preemption.next_wake_s = Some(wake);
            self.push_event(wake, EventKind::PreemptionWake, 0);
        }
    }

    /// A victim's grace period is over: it stops, keeps the work up to its last
    /// checkpoint and goes back to the queue in its old place.
    pub(super) fn stop_victim(&mut self, job: usize, now: f64) {
        let Some(attempt) = self.release_attempt(job) else {
            return;
        };
        self.preemption.run_time_lost_s += self.resume_from_checkpoint(job, &attempt, now);
        self.runs[job].phase = Phase::Queued;
        self.push_queue(job);
        self.victim_gone(job, now);
    }

    /// A victim no longer runs (stopped, or ended on its own): once an urgent job's last
    /// victim is gone, it starts on the claimed GPU if it still waits and fits there.
    pub(super) fn victim_gone(&mut self, victim: usize, now: f64) {
        let Some(urgent) = self.preemption.evicting.remove(&victim) else {
            return;
        };
        let Some(claim) = self.preemption.claims.get_mut(&urgent) else {
            return;
        };
        claim.victims_left = claim.victims_left.saturating_sub(1);
        if claim.victims_left > 0 {
            return;
        }
        let gpu = claim.gpu;
        self.preemption.claims.remove(&urgent);
        if self.runs[urgent].phase == Phase::Queued
            && self.problem.gpus[gpu].free_bytes() >= self.runs[urgent].slice_bytes
        {
            self.remove_from_queue(urgent);
            self.start_attempt(urgent, gpu, now);
        }
    }

    /// The tenants with work (running or queued) sharing the cluster, as the scheduler
    /// builds it.
    fn fair_share_state(&self) -> FairShareState {
        FairShareState {
            usable_bytes: self.problem.gpus.iter().map(GpuState::usable_bytes).sum(),
            tenants: self
                .problem
                .tenants
                .iter()
                .zip(&self.queue)
                .filter(|(tenant, queue)| tenant.vram_in_use_bytes > 0 || !queue.is_empty())
                .map(|(tenant, _)| TenantShare {
                    tenant: tenant.tenant.clone(),
                    weight: tenant.weight,
                    vram_in_use_bytes: tenant.vram_in_use_bytes,
                })
                .collect(),
        }
    }

    /// GPUs without a claim, each with its attempts that are not already stopping.
    fn gpu_occupancy(&self, now: f64) -> Vec<GpuOccupancy> {
        let claimed: HashSet<usize> = self
            .preemption
            .claims
            .values()
            .map(|claim| claim.gpu)
            .collect();
        self.problem
            .gpus
            .iter()
            .enumerate()
            .filter(|(index, _)| !claimed.contains(index))
            .map(|(index, gpu)| GpuOccupancy {
                gpu_id: gpu.gpu_id.clone(),
                worker_id: gpu.worker_id.clone(),
                free_bytes: gpu.free_bytes(),
                attempts: self.running_on_gpu[index]
                    .iter()
                    .filter(|job| !self.preemption.evicting.contains_key(job))
                    .filter_map(|&job| self.running_attempt(job, now))
                    .collect(),
            })
            .collect()
    }

    fn running_attempt(&self, job: usize, now: f64) -> Option<RunningAttempt> {
        let run = &self.runs[job];
        let attempt = run.attempt.as_ref()?;
        let recent = run
            .preempted_at_s
            .iter()
            .filter(|time| now - **time < HOUR_S)
            .count();
        Some(RunningAttempt {
            attempt_id: format!("{job}/{}", run.attempts_started),
            job_id: self.job_ids[job].clone(),
            tenant: self.workload.jobs[job].tenant.clone(),
            priority: self.workload.jobs[job].priority,
            slice_bytes: run.slice_bytes,
            run_time_seconds: (now - attempt.started_s).max(0.0) as u64,
            preemptions_in_last_hour: u32::try_from(recent).unwrap_or(u32::MAX),
        })
    }
}
