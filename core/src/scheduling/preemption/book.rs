//! The preemption book: the state of preemptions under way and every decision over it,
//! one pure type that the scheduler (live, `carve-scheduler`'s `scheduler/preemption.rs`)
//! and the simulator (`simulation/event_loop/preemption.rs`) both keep. Time is a value
//! the caller passes in ([`Moment`]: the simulator's seconds, the scheduler's
//! [`Millis`]); nothing here reads a clock, sends a message or writes a log.
//!
//! What the book holds:
//! - *claims*: urgent jobs that asked for room, each with the GPU and bytes held for it and
//!   the victims it waits for ([`Claim`]);
//! - *evictions*: victims asked to stop, each with its attempt, the urgent job it stops
//!   for, when its grace period runs out and why it was asked ([`Eviction`]);
//! - when each job was preempted within the last hour (the cap per job per hour).
//!
//! The decisions:
//! - [`PreemptionBook::preempt`]: after a pass, for the jobs left waiting for free memory
//!   (highest priority first), whom to evict ([`choose_victims`]), at most one plan per GPU
//!   per pass, on schedulable GPUs without a claim, among attempts not already stopping;
//!   each plan becomes a claim and its evictions, with their messages;
//! - [`PreemptionBook::hold_claims`]: what the next pass must not place in (a claim's bytes);
//! - [`PreemptionBook::take_eviction`]: whether an attempt that ended was preempted (it is,
//!   when it was being evicted), and its victim gone from its claim;
//! - [`PreemptionBook::grace_over`]: whether a victim's grace period has run out;
//! - [`PreemptionBook::forget_lost_victims`]: victims that ended without a word (their
//!   worker lost) are gone too;
//! - [`PreemptionBook::take_ready_claims`]: claims whose victims have all stopped: their
//!   urgent jobs are placed in the freed bytes if they still fit there ([`Claim::fits`]);
//! - [`PreemptionBook::drop_claim`] / [`PreemptionBook::retain_claims`]: a claim lapses
//!   when its job is placed elsewhere or leaves the queue.
//!
//! A caller that keeps the book across restarts (the scheduler stores it) reads what to
//! store with [`PreemptionBook::claims`] and [`PreemptionBook::evictions`] and rebuilds
//! it with [`PreemptionBook::restore`]: a claim's victims are the evictions naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use crate::bytes::HumanBytes;
use crate::scheduling::{GpuState, TenantState};

use super::{
    EvictionGround, FairShareState, GpuOccupancy, PreemptionSettings, RunningAttempt, TenantShare,
    UrgentJob, Victim, choose_victims,
};

/// The window of the cap on preemptions per job.
pub const HOUR_SECONDS: u64 = 3600;

/// A moment on the caller's clock.
pub trait Moment: Copy + PartialOrd + fmt::Debug {
    /// Whole seconds from `earlier` to `self`, rounded down; 0 when `earlier` is not
    /// before `self`.
    fn whole_seconds_since(self, earlier: Self) -> u64;
    /// The moment `seconds` after this one.
    fn plus_seconds(self, seconds: f64) -> Self;
}

/// The simulator's clock: seconds.
impl Moment for f64 {
    fn whole_seconds_since(self, earlier: Self) -> u64 {
        (self - earlier).max(0.0) as u64
    }

    fn plus_seconds(self, seconds: f64) -> Self {
        self + seconds
    }
}

/// The scheduler's clock: milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Millis(pub i64);

impl Moment for Millis {
    fn whole_seconds_since(self, earlier: Self) -> u64 {
        u64::try_from(self.0.saturating_sub(earlier.0) / 1000).unwrap_or(0)
    }

    fn plus_seconds(self, seconds: f64) -> Self {
        Millis(self.0.saturating_add((seconds * 1000.0).round() as i64))
    }
}

/// How a job is named in the book: the scheduler's job ids, the simulator's job indexes.
pub trait JobKey: Clone + Ord + fmt::Display + fmt::Debug {}

impl<J: Clone + Ord + fmt::Display + fmt::Debug> JobKey for J {}

/// The limits of [`choose_victims`] and the grace period victims are given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BookSettings {
    pub limits: PreemptionSettings,
    /// How long a victim has to checkpoint and stop.
    pub grace_period_s: f64,
}

/// Bytes of one GPU held for an urgent job while its victims stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim<J> {
    pub gpu_id: String,
    pub worker_id: String,
    /// The urgent job's slice.
    pub slice_bytes: u64,
    /// Victims still stopping.
    pub victims: BTreeSet<J>,
}

impl<J> Claim<J> {
    /// Whether the urgent job fits on the claimed GPU now: it is among `gpus`,
    /// schedulable, with the job's slice free.
    pub fn fits(&self, gpus: &[GpuState]) -> bool {
        gpus.iter().any(|gpu| {
            gpu.gpu_id == self.gpu_id
                && gpu.worker_id == self.worker_id
                && gpu.schedulable
                && gpu.free_bytes() >= self.slice_bytes
        })
    }
}

/// A victim asked to stop.
#[derive(Debug, Clone, PartialEq)]
pub struct Eviction<J, T> {
    /// The urgent job it stops for.
    pub urgent: J,
    /// The attempt asked to stop.
    pub attempt_number: u32,
    /// When its grace period runs out.
    pub grace_ends_at: T,
    /// Why, for its attempt's outcome and its job's log.
    pub message: String,
}

/// A queued job the pass left waiting because no GPU has its slice free.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitingJob<J> {
    pub job: J,
    pub tenant: String,
    pub priority: i32,
    /// Lower is older.
    pub submit_sequence: u64,
    pub slice_bytes: u64,
}

/// An attempt that holds a slice now.
#[derive(Debug, Clone, PartialEq)]
pub struct Occupant<J, T> {
    pub job: J,
    pub attempt_number: u32,
    /// Its GPU: an index into [`PassInput::gpus`].
    pub gpu: usize,
    pub tenant: String,
    pub priority: i32,
    pub slice_bytes: u64,
    pub started_at: T,
}

/// What one preemption step decides from.
#[derive(Debug, Clone)]
pub struct PassInput<'a, J, T> {
    pub now: T,
    pub settings: BookSettings,
    /// The GPUs after the pass (claimed bytes held or not: claimed GPUs are left out).
    pub gpus: &'a [GpuState],
    /// Every attempt holding a slice.
    pub running: Vec<Occupant<J, T>>,
    /// The jobs the pass left waiting for free memory, in any order.
    pub waiting: Vec<WaitingJob<J>>,
    /// See [`fair_share_state`].
    pub fair_share: FairShareState,
}

/// One victim of a preemption, as its caller tells it to stop.
#[derive(Debug, Clone, PartialEq)]
pub struct Evicted<J, T> {
    pub job: J,
    pub attempt_number: u32,
    pub priority: i32,
    pub ground: EvictionGround,
    pub grace_ends_at: T,
    /// The cancel's reason, the attempt's outcome message and the victim's log line.
    pub message: String,
}

/// One urgent job's preemption: its claim and its victims.
#[derive(Debug, Clone, PartialEq)]
pub struct Preemption<J, T> {
    pub urgent: J,
    pub gpu_id: String,
    pub worker_id: String,
    pub slice_bytes: u64,
    /// In eviction order.
    pub victims: Vec<Evicted<J, T>>,
    /// The urgent job's waiting reason and log line.
    pub reason: String,
}

/// What one preemption step decided.
#[derive(Debug, Clone, PartialEq)]
pub struct PassOutcome<J, T> {
    pub preemptions: Vec<Preemption<J, T>>,
    /// When some waiting job found no victims: the earliest moment after `now` at which
    /// an attempt it could not evict becomes old enough, or falls under the cap again.
    /// A caller that runs passes only when something happens (the simulator) runs one
    /// then; the scheduler's periodic pass needs no reminder.
    pub retry_at: Option<T>,
}

impl<J, T> Default for PassOutcome<J, T> {
    fn default() -> Self {
        PassOutcome {
            preemptions: Vec::new(),
            retry_at: None,
        }
    }
}

/// Preemptions under way and the recent ones, by job (see the module documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct PreemptionBook<J, T> {
    /// By urgent job.
    claims: BTreeMap<J, Claim<J>>,
    /// By victim.
    evicting: BTreeMap<J, Eviction<J, T>>,
    /// When each job was preempted, in order; only the last hour is kept.
    recent: BTreeMap<J, Vec<T>>,
}

impl<J, T> Default for PreemptionBook<J, T> {
    fn default() -> Self {
        PreemptionBook {
            claims: BTreeMap::new(),
            evicting: BTreeMap::new(),
            recent: BTreeMap::new(),
        }
    }
}

impl<J: JobKey, T: Moment> PreemptionBook<J, T> {
    /// A book holding what a caller kept of an earlier one: `claims` by urgent job (their
    /// `victims` are ignored), `evictions` by victim, and `recent` preemption times by
    /// job (in any order). Each claim waits for the evictions that name its job; an
    /// eviction whose urgent job has no claim (placed elsewhere, or gone) still makes its
    /// attempt's end a preemption.
    pub fn restore(
        claims: impl IntoIterator<Item = (J, Claim<J>)>,
        evictions: impl IntoIterator<Item = (J, Eviction<J, T>)>,
        recent: impl IntoIterator<Item = (J, T)>,
    ) -> Self {
        let mut claims: BTreeMap<J, Claim<J>> = claims
            .into_iter()
            .map(|(job, mut claim)| {
                claim.victims.clear();
                (job, claim)
            })
            .collect();
        let evicting: BTreeMap<J, Eviction<J, T>> = evictions.into_iter().collect();
        for (victim, eviction) in &evicting {
            if let Some(claim) = claims.get_mut(&eviction.urgent) {
                claim.victims.insert(victim.clone());
            }
        }
        let mut by_job: BTreeMap<J, Vec<T>> = BTreeMap::new();
        for (job, time) in recent {
            by_job.entry(job).or_default().push(time);
        }
        for times in by_job.values_mut() {
            times.sort_by(|left, right| {
                left.partial_cmp(right).unwrap_or(std::cmp::Ordering::Equal)
            });
        }
        PreemptionBook {
            claims,
            evicting,
            recent: by_job,
        }
    }

    /// The victims asked to stop, by victim job.
    pub fn evictions(&self) -> impl Iterator<Item = (&J, &Eviction<J, T>)> {
        self.evicting.iter()
    }

    /// The urgent jobs waiting for their victims and the bytes held for them.
    pub fn claims(&self) -> impl Iterator<Item = (&J, &Claim<J>)> {
        self.claims.iter()
    }

    /// Urgent jobs waiting for their victims: a pass leaves them out of `solve`.
    pub fn claimed_jobs(&self) -> BTreeSet<J> {
        self.claims.keys().cloned().collect()
    }

    pub fn is_claimed(&self, job: &J) -> bool {
        self.claims.contains_key(job)
    }

    /// The eviction of this job's attempt under way, if any.
    pub fn eviction(&self, job: &J) -> Option<&Eviction<J, T>> {
        self.evicting.get(job)
    }

    /// How many times the job was preempted in the hour before `now`.
    pub fn preemptions_in_last_hour(&self, job: &J, now: T) -> u32 {
        self.recent.get(job).map_or(0, |times| {
            let count = times.iter().filter(|time| within_hour(now, **time)).count();
            u32::try_from(count).unwrap_or(u32::MAX)
        })
    }

    /// Raises each claimed GPU's allocated bytes by what its urgent job needs of the
    /// bytes free now, so a pass places nothing there; returns what was added, by index
    /// into `gpus`, for [`Self::release_claims`].
    pub fn hold_claims(&self, gpus: &mut [GpuState]) -> Vec<(usize, u64)> {
        let mut held = Vec::new();
        for claim in self.claims.values() {
            let Some(index) = gpus
                .iter()
                .position(|gpu| gpu.gpu_id == claim.gpu_id && gpu.worker_id == claim.worker_id)
            else {
                continue;
            };
            let gpu = &mut gpus[index];
            let hold = claim.slice_bytes.min(gpu.free_bytes());
            gpu.allocated_bytes += hold;
            held.push((index, hold));
        }
        held
    }

    /// Gives back what [`Self::hold_claims`] held.
    pub fn release_claims(gpus: &mut [GpuState], held: &[(usize, u64)]) {
        for &(index, hold) in held {
            gpus[index].allocated_bytes -= hold;
        }
    }

    /// The preemption step after a pass (see the module documentation): the jobs of
    /// `input.waiting` without a claim, highest priority first (then older first), each
    /// ask [`choose_victims`] whom to evict on the GPUs no earlier job of this step
    /// claimed. Each plan is recorded (its claim, its evictions, the victims' preemption
    /// times) and returned for the caller to carry out.
    pub fn preempt(&mut self, input: PassInput<'_, J, T>) -> PassOutcome<J, T> {
        let PassInput {
            now,
            settings,
            gpus,
            running,
            waiting,
            fair_share,
        } = input;
        self.forget_old_preemptions(now);
        let mut waiting: Vec<WaitingJob<J>> = waiting
            .into_iter()
            .filter(|job| !self.claims.contains_key(&job.job))
            .collect();
        if waiting.is_empty() {
            return PassOutcome::default();
        }
        waiting.sort_by(|left, right| {
            right
                .priority
                .cmp(&left.priority)
                .then_with(|| left.submit_sequence.cmp(&right.submit_sequence))
                .then_with(|| left.job.cmp(&right.job))
        });
        let (mut occupancy, mut occupants) = self.occupancy(gpus, running, now);
        let mut outcome = PassOutcome::default();
        // A job of the same tenant and priority with a slice no smaller than one that
        // found no victims, when that one was larger than every GPU's free bytes, finds
        // none either: fewer GPUs are left, and reclaim only gets harder.
        let mut smallest_failed: BTreeMap<(&str, i32), u64> = BTreeMap::new();
        let mut anyone_failed = false;
        for job in &waiting {
            if occupancy.is_empty() {
                break;
            }
            let key = (job.tenant.as_str(), job.priority);
            if smallest_failed
                .get(&key)
                .is_some_and(|failed| *failed <= job.slice_bytes)
            {
                continue;
            }
            let request = UrgentJob {
                job_id: job.job.to_string(),
                tenant: job.tenant.clone(),
                priority: job.priority,
                slice_bytes: job.slice_bytes,
            };
            let Some(plan) = choose_victims(&request, &occupancy, &fair_share, settings.limits)
            else {
                if occupancy.iter().all(|gpu| gpu.free_bytes < job.slice_bytes) {
                    smallest_failed.insert(key, job.slice_bytes);
                }
                anyone_failed = true;
                continue;
            };
            let Some(index) = occupancy
                .iter()
                .position(|gpu| gpu.gpu_id == plan.gpu_id && gpu.worker_id == plan.worker_id)
            else {
                continue;
            };
            occupancy.remove(index);
            let on_gpu = occupants.remove(index);
            let victims: Vec<(&Victim, &Occupant<J, T>)> = plan
                .victims
                .iter()
                .filter_map(|victim| {
                    let occupant = on_gpu
                        .iter()
                        .find(|occupant| occupant.job.to_string() == victim.job_id)?;
                    Some((victim, occupant))
                })
                .collect();
            if victims.is_empty() {
                continue;
            }
            let preemption =
                self.record(job, &plan.gpu_id, &plan.worker_id, &victims, now, settings);
            outcome.preemptions.push(preemption);
        }
        if anyone_failed {
            outcome.retry_at = self.next_evictable_at(&occupants, now, settings.limits);
        }
        outcome
    }

    /// Schedulable GPUs without a claim, each with its attempts that are not already
    /// stopping, as [`choose_victims`] sees them, and beside each its occupants.
    fn occupancy(
        &self,
        gpus: &[GpuState],
        running: Vec<Occupant<J, T>>,
        now: T,
    ) -> (Vec<GpuOccupancy>, Vec<Vec<Occupant<J, T>>>) {
        let mut by_gpu: Vec<Vec<Occupant<J, T>>> = vec![Vec::new(); gpus.len()];
        for occupant in running {
            if occupant.gpu < gpus.len() && !self.evicting.contains_key(&occupant.job) {
                by_gpu[occupant.gpu].push(occupant);
            }
        }
        let mut occupancy = Vec::new();
        let mut occupants = Vec::new();
        for (gpu, on_gpu) in gpus.iter().zip(by_gpu) {
            let claimed = self
                .claims
                .values()
                .any(|claim| claim.gpu_id == gpu.gpu_id && claim.worker_id == gpu.worker_id);
            if !gpu.schedulable || claimed {
                continue;
            }
            occupancy.push(GpuOccupancy {
                gpu_id: gpu.gpu_id.clone(),
                worker_id: gpu.worker_id.clone(),
                free_bytes: gpu.free_bytes(),
                attempts: on_gpu
                    .iter()
                    .map(|occupant| RunningAttempt {
                        attempt_id: format!("{}/{}", occupant.job, occupant.attempt_number),
                        job_id: occupant.job.to_string(),
                        tenant: occupant.tenant.clone(),
                        priority: occupant.priority,
                        slice_bytes: occupant.slice_bytes,
                        run_time_seconds: now.whole_seconds_since(occupant.started_at),
                        preemptions_in_last_hour: self.preemptions_in_last_hour(&occupant.job, now),
                    })
                    .collect(),
            });
            occupants.push(on_gpu);
        }
        (occupancy, occupants)
    }

    /// Records one plan: its evictions with their messages, the victims' preemption
    /// times and the urgent job's claim.
    fn record(
        &mut self,
        job: &WaitingJob<J>,
        gpu_id: &str,
        worker_id: &str,
        victims: &[(&Victim, &Occupant<J, T>)],
        now: T,
        settings: BookSettings,
    ) -> Preemption<J, T> {
        let grace_ends_at = now.plus_seconds(settings.grace_period_s);
        let mut evicted = Vec::with_capacity(victims.len());
        for (victim, occupant) in victims {
            let message = eviction_message(job, gpu_id, victim, settings.grace_period_s);
            self.evicting.insert(
                occupant.job.clone(),
                Eviction {
                    urgent: job.job.clone(),
                    attempt_number: occupant.attempt_number,
                    grace_ends_at,
                    message: message.clone(),
                },
            );
            self.recent
                .entry(occupant.job.clone())
                .or_default()
                .push(now);
            evicted.push(Evicted {
                job: occupant.job.clone(),
                attempt_number: occupant.attempt_number,
                priority: victim.priority,
                ground: victim.ground,
                grace_ends_at,
                message,
            });
        }
        let named: Vec<String> = evicted
            .iter()
            .map(|victim| format!("{} (priority {})", victim.job, victim.priority))
            .collect();
        let reason = format!(
            "preempting {} on {gpu_id} to make room: placed once they have stopped",
            named.join(", ")
        );
        self.claims.insert(
            job.job.clone(),
            Claim {
                gpu_id: gpu_id.to_string(),
                worker_id: worker_id.to_string(),
                slice_bytes: job.slice_bytes,
                victims: evicted.iter().map(|victim| victim.job.clone()).collect(),
            },
        );
        Preemption {
            urgent: job.job.clone(),
            gpu_id: gpu_id.to_string(),
            worker_id: worker_id.to_string(),
            slice_bytes: job.slice_bytes,
            victims: evicted,
            reason,
        }
    }

    /// The earliest moment after `now` at which one of `occupants` (attempts no plan of
    /// this step took) is old enough and under the cap per hour.
    fn next_evictable_at(
        &self,
        occupants: &[Vec<Occupant<J, T>>],
        now: T,
        limits: PreemptionSettings,
    ) -> Option<T> {
        let cap = limits.max_preemptions_per_job_per_hour as usize;
        let mut earliest: Option<T> = None;
        for occupant in occupants.iter().flatten() {
            let old_enough = occupant
                .started_at
                .plus_seconds(limits.min_run_time_seconds as f64);
            let recent: &[T] = self.recent.get(&occupant.job).map_or(&[], Vec::as_slice);
            let under_cap = if cap == 0 {
                // Never under a cap of 0.
                continue;
            } else if recent.len() >= cap {
                recent[recent.len() - cap].plus_seconds(HOUR_SECONDS as f64)
            } else {
                now
            };
            let evictable = if under_cap > old_enough {
                under_cap
            } else {
                old_enough
            };
            if evictable > now && earliest.is_none_or(|earliest| evictable < earliest) {
                earliest = Some(evictable);
            }
        }
        earliest
    }

    /// Forgets preemptions more than an hour before `now`.
    fn forget_old_preemptions(&mut self, now: T) {
        for times in self.recent.values_mut() {
            times.retain(|time| within_hour(now, *time));
        }
        self.recent.retain(|_, times| !times.is_empty());
    }

    /// The eviction of this job's attempt, if it is one: an attempt that ends while
    /// being evicted ends preempted. The job's eviction is forgotten either way; when it
    /// was this attempt's, its claim no longer waits for it.
    pub fn take_eviction(&mut self, job: &J, attempt_number: u32) -> Option<Eviction<J, T>> {
        let eviction = self
            .evicting
            .remove(job)
            .filter(|eviction| eviction.attempt_number == attempt_number)?;
        for claim in self.claims.values_mut() {
            claim.victims.remove(job);
        }
        Some(eviction)
    }

    /// Whether this attempt is being evicted and its grace period has run out by `now`:
    /// it is stopped (the simulator) or killed (the worker).
    pub fn grace_over(&self, job: &J, attempt_number: u32, now: T) -> bool {
        self.evicting.get(job).is_some_and(|eviction| {
            eviction.attempt_number == attempt_number && eviction.grace_ends_at <= now
        })
    }

    /// Forgets the evictions of attempts that no longer run (`still_running(job,
    /// attempt)` is false: lost with their worker, without a report), and takes them
    /// out of their claims.
    pub fn forget_lost_victims(&mut self, mut still_running: impl FnMut(&J, u32) -> bool) {
        self.evicting
            .retain(|job, eviction| still_running(job, eviction.attempt_number));
        let evicting = &self.evicting;
        for claim in self.claims.values_mut() {
            claim.victims.retain(|job| evicting.contains_key(job));
        }
    }

    /// Removes and returns the claims whose victims have all stopped, by urgent job: the
    /// caller places each job on its claim's GPU if it still waits and [`Claim::fits`].
    pub fn take_ready_claims(&mut self) -> Vec<(J, Claim<J>)> {
        let ready: Vec<J> = self
            .claims
            .iter()
            .filter(|(_, claim)| claim.victims.is_empty())
            .map(|(job, _)| job.clone())
            .collect();
        ready
            .into_iter()
            .filter_map(|job| {
                let claim = self.claims.remove(&job)?;
                Some((job, claim))
            })
            .collect()
    }

    /// The job was placed (on its claim's GPU or elsewhere): its claim holds nothing any
    /// more. Its victims still stop.
    pub fn drop_claim(&mut self, job: &J) -> Option<Claim<J>> {
        self.claims.remove(job)
    }

    /// Keeps the claims of the jobs `keep` says still wait (the others were cancelled or
    /// placed elsewhere).
    pub fn retain_claims(&mut self, mut keep: impl FnMut(&J) -> bool) {
        self.claims.retain(|job, _| keep(job));
    }
}

/// The tenants with work (running, or queued: the `bool` beside each) sharing the
/// schedulable GPUs' usable bytes.
pub fn fair_share_state<'a>(
    gpus: &[GpuState],
    tenants: impl IntoIterator<Item = (&'a TenantState, bool)>,
) -> FairShareState {
    FairShareState {
        usable_bytes: gpus
            .iter()
            .filter(|gpu| gpu.schedulable)
            .map(GpuState::usable_bytes)
            .sum(),
        tenants: tenants
            .into_iter()
            .filter(|(tenant, queued)| tenant.vram_in_use_bytes > 0 || *queued)
            .map(|(tenant, _)| TenantShare {
                tenant: tenant.tenant.clone(),
                weight: tenant.weight,
                vram_in_use_bytes: tenant.vram_in_use_bytes,
            })
            .collect(),
    }
}

/// Whether `time` is less than an hour before `now`.
fn within_hour<T: Moment>(now: T, time: T) -> bool {
    now.whole_seconds_since(time) < HOUR_SECONDS
}

/// Why `victim` is asked to stop for `job`.
fn eviction_message<J: JobKey>(
    job: &WaitingJob<J>,
    gpu_id: &str,
    victim: &Victim,
    grace_period_s: f64,
) -> String {
    let why = match victim.ground {
        EvictionGround::HigherPriority => format!(
            "job {} (priority {}) needs {} on {gpu_id} and this job's priority is {}",
            job.job,
            job.priority,
            HumanBytes(job.slice_bytes),
            victim.priority
        ),
        EvictionGround::FairShareReclaim => format!(
            "job {} of tenant {} (under its fair share) reclaims {} on {gpu_id} from \
             tenant {} (over its fair share)",
            job.job,
            job.tenant,
            HumanBytes(job.slice_bytes),
            victim.tenant
        ),
    };
    let grace = match Duration::try_from_secs_f64(grace_period_s) {
        Ok(grace) => format!("{grace:?}"),
        Err(_) => format!("{grace_period_s}s"),
    };
    format!(
        "preempted by job {} (priority {}): {why}; it checkpoints, stops within {grace} and \
         resumes from its checkpoint",
        job.job, job.priority
    )
}

#[cfg(test)]
mod tests;
