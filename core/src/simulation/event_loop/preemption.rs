//! The scheduler's preemption step in the simulator, over the same [`PreemptionBook`] the
//! scheduler keeps: after a pass, each job left waiting because no GPU has its slice free
//! (highest priority first) asks the book whom to evict, with the same limits as the
//! scheduler (minimum run time, cap per job per hour) and the same fair-share state. The
//! victims stop at the end of the grace period and go back to the queue keeping their
//! submit sequence (ahead of their younger peers); the bytes they free are *claimed*: no
//! pass places another job in them, and once the last victim has stopped the urgent job
//! starts there.
//!
//! The simulator has no quotas, so "waiting because no GPU has its slice free" is read
//! from the free bytes after the pass (the solver's `NoGpuFreeEnough`), which also keeps
//! the answer the same whether the pass pruned the queue or not.

use crate::scheduling::GpuState;
use crate::scheduling::preemption::book::{
    BookSettings, Occupant, PassInput, PreemptionBook, WaitingJob, fair_share_state,
};

use super::{EventKind, Phase, Simulation};

/// The simulator's preemptions: the book (by job index, in seconds) and the totals.
#[derive(Debug, Default)]
pub(super) struct Preemptions {
    book: PreemptionBook<usize, f64>,
    pub(super) preemptions: u64,
    pub(super) run_time_lost_s: f64,
    /// The earliest wake-up event queued, if any.
    next_wake_s: Option<f64>,
}

impl Preemptions {
    pub(super) fn woken(&mut self, now: f64) {
        if self.next_wake_s.is_some_and(|wake| wake <= now) {
            self.next_wake_s = None;
        }
    }

    /// The job started an attempt, on its claimed GPU or elsewhere: its claim lapses.
    pub(super) fn placed(&mut self, job: usize) {
        self.book.drop_claim(&job);
    }
}

impl Simulation<'_> {
    /// Raises each claimed GPU's allocated bytes by what its urgent job will need of the
    /// bytes free now, so the solver places nothing there; returns what to give back.
    pub(super) fn hold_claimed_bytes(&mut self) -> Vec<(usize, u64)> {
        self.preemption.book.hold_claims(&mut self.problem.gpus)
    }

    pub(super) fn release_claimed_bytes(&mut self, held: &[(usize, u64)]) {
        PreemptionBook::<usize, f64>::release_claims(&mut self.problem.gpus, held);
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
        let waiting: Vec<WaitingJob<usize>> = self
            .queue
            .iter()
            .flatten()
            .map(|&(_, _, job)| job)
            .filter(|&job| {
                self.runs[job].slice_bytes > largest_free && !self.preemption.book.is_claimed(&job)
            })
            .map(|job| WaitingJob {
                job,
                tenant: self.workload.jobs[job].tenant.clone(),
                priority: self.workload.jobs[job].priority,
                submit_sequence: self.runs[job].submit_sequence,
                slice_bytes: self.runs[job].slice_bytes,
            })
            .collect();
        if waiting.is_empty() {
            return;
        }
        let fair_share = fair_share_state(
            &self.problem.gpus,
            self.problem
                .tenants
                .iter()
                .zip(&self.queue)
                .map(|(tenant, queue)| (tenant, !queue.is_empty())),
        );
        let running = self.occupants();
        let outcome = self.preemption.book.preempt(PassInput {
            now,
            settings: BookSettings {
                limits: preemption.limits,
                grace_period_s: preemption.grace_period_s,
            },
            gpus: &self.problem.gpus,
            running,
            waiting,
            fair_share,
        });
        for victim in outcome
            .preemptions
            .iter()
            .flat_map(|preemption| &preemption.victims)
        {
            self.preemption.preemptions += 1;
            self.push_event(victim.grace_ends_at, EventKind::PreemptionStop, victim.job);
        }
        // The simulator runs a pass only when something happens; the scheduler runs one
        // every few seconds, so a job that found no victims only because some attempt was
        // too young, or preempted too often, gets one when that stops being so.
        if let Some(wake) = outcome.retry_at
            && self
                .preemption
                .next_wake_s
                .is_none_or(|queued| wake < queued)
        {
            self.preemption.next_wake_s = Some(wake);
            self.push_event(wake, EventKind::PreemptionWake, 0);
        }
    }

    /// Every attempt holding a slice, as the book sees it.
    fn occupants(&self) -> Vec<Occupant<usize, f64>> {
        self.running_on_gpu
            .iter()
            .enumerate()
            .flat_map(|(gpu, jobs)| jobs.iter().map(move |&job| (gpu, job)))
            .filter_map(|(gpu, job)| {
                let run = &self.runs[job];
                let attempt = run.attempt.as_ref()?;
                Some(Occupant {
                    job,
                    attempt_number: run.attempts_started,
                    gpu,
                    tenant: self.workload.jobs[job].tenant.clone(),
                    priority: self.workload.jobs[job].priority,
                    slice_bytes: run.slice_bytes,
                    started_at: attempt.started_s,
                })
            })
            .collect()
    }

    /// A victim's grace period is over: it stops, keeps the work up to its last
    /// checkpoint and goes back to the queue in its old place.
    pub(super) fn stop_victim(&mut self, job: usize, now: f64) {
        if !self
            .preemption
            .book
            .grace_over(&job, self.runs[job].attempts_started, now)
        {
            return;
        }
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
        let attempt = self.runs[victim].attempts_started;
        if self
            .preemption
            .book
            .take_eviction(&victim, attempt)
            .is_none()
        {
            return;
        }
        for (urgent, claim) in self.preemption.book.take_ready_claims() {
            let Some(&gpu) = self.gpu_index.get(&claim.gpu_id) else {
                continue;
            };
            if self.runs[urgent].phase == Phase::Queued && claim.fits(&self.problem.gpus) {
                self.remove_from_queue(urgent);
                self.start_attempt(urgent, gpu, now);
            }
        }
    }
}
