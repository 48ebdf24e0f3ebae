//! How a simulated attempt ends: success (its peak feeds the memory model's
//! corrections), an out-of-memory end (Carve's one-shot smaller retry, or a person's
//! resubmission with twice the memory under the other policies), or failure; and the
//! run time an attempt keeps from its last checkpoint.

use super::{Attempt, EventKind, Phase, Simulation};
use crate::plan::RunConfig;
use crate::simulation::policy::{Policy, oom_observation};

impl Simulation<'_> {
    /// Keeps the run time up to the attempt's last checkpoint and returns the run time
    /// lost since.
    pub(super) fn resume_from_checkpoint(
        &mut self,
        job: usize,
        attempt: &Attempt,
        now: f64,
    ) -> f64 {
        let checkpoint = self.options.checkpoint_interval_s;
        let run_time = now - attempt.started_s;
        let kept_run_time = (run_time / checkpoint).floor() * checkpoint;
        let run = &mut self.runs[job];
        run.remaining_work_s = (run.remaining_work_s - kept_run_time / attempt.slowdown).max(0.0);
        run_time - kept_run_time
    }

    pub(super) fn end_attempt(&mut self, job: usize, now: f64) {
        let Some(attempt) = self.release_attempt(job) else {
            return;
        };
        self.end_without_preemption(job, now, attempt);
        // A victim that ended on its own before its grace period was over.
        self.victim_gone(job, now);
    }

    pub(super) fn end_without_preemption(&mut self, job: usize, now: f64, attempt: Attempt) {
        let slice = self.runs[job].slice_bytes;
        if !attempt.runs_out_of_memory {
            self.succeed(job, now, attempt);
            return;
        }
        self.out_of_memory_attempts += 1;
        self.runs[job].out_of_memory_attempts += 1;
        self.resume_from_checkpoint(job, &attempt, now);
        match (
            self.policy,
            self.workload.jobs[job].model,
            self.runs[job].config,
        ) {
            (Policy::WholeGpu, _, _) => self.fail(job, now),
            (Policy::Carve, Some(model), Some(config)) => self.carve_retry(job, model, config, now),
            _ => {
                // A person reads the error and resubmits with twice the memory, up to a
                // whole GPU; at a whole GPU there is nothing left to ask for.
                if slice >= self.usable_bytes {
                    self.fail(job, now);
                } else {
                    let run = &mut self.runs[job];
                    run.slice_bytes = slice.saturating_mul(2).min(self.usable_bytes);
                    run.phase = Phase::Resubmitting;
                    self.push_event(
                        now + self.options.resubmit_delay_s,
                        EventKind::Resubmission,
                        job,
                    );
                }
            }
        }
    }

    /// The scheduler's OOM handler: plan a smaller configuration for the same slice with
    /// the report the attempt made, within the job's retry limit, and requeue it at once.
    pub(super) fn carve_retry(&mut self, job: usize, model: usize, config: RunConfig, now: f64) {
        let slice = self.runs[job].slice_bytes;
        let need = self.need_bytes(job, Some(config));
        let estimated = self.oracle.required_bytes(self.workload, model, &config);
        let observation = oom_observation(need, slice, estimated);
        let max_retries = self.workload.models[model].job.max_retries();
        let retries_left = self.runs[job].out_of_memory_attempts <= max_retries;
        let shrunk = self
            .oracle
            .shrink(self.workload, model, &config, Some(&observation), slice);
        match shrunk {
            Some(shrunk) if retries_left && shrunk.config != config => {
                let run = &mut self.runs[job];
                run.config = Some(shrunk.config);
                run.slice_bytes = slice.max(shrunk.required_bytes);
                // The same job goes back to the queue: it keeps its place in line.
                run.phase = Phase::Queued;
                self.push_queue(job);
            }
            _ => self.fail(job, now),
        }
    }

    pub(super) fn succeed(&mut self, job: usize, now: f64, attempt: Attempt) {
        let run = &mut self.runs[job];
        run.phase = Phase::Succeeded;
        run.end_s = Some(now);
        run.remaining_work_s = 0.0;
        if let (Policy::Carve, Some(model), Some(config)) =
            (self.policy, self.workload.jobs[job].model, run.config)
        {
            let estimated = self.oracle.required_bytes(self.workload, model, &config);
            if estimated > 0 {
                let ratio = attempt.used_bytes as f64 / estimated as f64;
                let entry = self
                    .peak_corrections
                    .entry((model, config))
                    .or_insert(ratio);
                *entry = entry.max(ratio);
            }
        }
    }

    pub(super) fn fail(&mut self, job: usize, now: f64) {
        let run = &mut self.runs[job];
        run.phase = Phase::Failed;
        run.end_s = Some(now);
    }
}
