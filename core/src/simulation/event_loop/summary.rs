//! What a finished (or ongoing) simulation reports: the cluster's levels at an instant and
//! the policy's report at the end.

use super::{Phase, Simulation};
use crate::scheduling::GpuState;
use crate::simulation::report::{ClusterLevels, Percentiles, PolicyReport, WaitSummary};

impl Simulation<'_> {
    pub(super) fn levels(&self) -> ClusterLevels {
        let fragmented_bytes: u64 = match self.smallest_queued_slice() {
            Some(smallest_waiting) => self
                .problem
                .gpus
                .iter()
                .map(GpuState::free_bytes)
                .filter(|free| *free < smallest_waiting)
                .sum(),
            None => 0,
        };
        ClusterLevels {
            allocated_fraction: self.allocated_bytes as f64 / self.total_bytes,
            used_fraction: self.used_bytes as f64 / self.total_bytes,
            running_jobs: self.running_jobs,
            busy_gpus: self.jobs_on_gpu.iter().filter(|count| **count > 0).count(),
            fragmented_fraction: fragmented_bytes as f64 / self.total_bytes,
        }
    }

    pub(super) fn report(&self) -> PolicyReport {
        let count = |phase: Phase| self.runs.iter().filter(|run| run.phase == phase).count();
        let mut queueing: Vec<f64> = self
            .runs
            .iter()
            .zip(&self.workload.jobs)
            .filter_map(|(run, job)| run.first_start_s.map(|start| start - job.submit_time_s))
            .collect();
        let mut completion: Vec<f64> = self
            .runs
            .iter()
            .zip(&self.workload.jobs)
            .filter(|(run, _)| run.phase == Phase::Succeeded)
            .filter_map(|(run, job)| run.end_s.map(|end| end - job.submit_time_s))
            .collect();
        let elapsed = self.integrals.elapsed_s();
        let average = |integral: f64| {
            if elapsed > 0.0 {
                integral / elapsed
            } else {
                0.0
            }
        };
        let shrunk_jobs = self
            .runs
            .iter()
            .zip(&self.workload.jobs)
            .filter(|(run, job)| match (run.config, job.model) {
                (Some(config), Some(model)) => config != self.workload.models[model].own_config,
                _ => false,
            })
            .count();
        let mut urgent_waits: Vec<f64> = self
            .runs
            .iter()
            .zip(&self.workload.jobs)
            .filter(|(_, job)| job.priority >= self.options.urgent_priority)
            .filter_map(|(run, job)| run.first_start_s.map(|start| start - job.submit_time_s))
            .collect();
        let urgent_jobs = self
            .workload
            .jobs
            .iter()
            .filter(|job| job.priority >= self.options.urgent_priority)
            .count();
        let waits_where = |gang: bool| {
            let mut waits: Vec<f64> = self
                .runs
                .iter()
                .zip(&self.workload.jobs)
                .filter(|(_, job)| (job.gpus > 1) == gang)
                .filter_map(|(run, job)| run.first_start_s.map(|start| start - job.submit_time_s))
                .collect();
            let jobs = self
                .workload
                .jobs
                .iter()
                .filter(|job| (job.gpus > 1) == gang)
                .count();
            WaitSummary::of(jobs, &mut waits)
        };
        PolicyReport {
            policy: self.policy,
            gang_reservations: self
                .use_gang_pass
                .then(|| self.options.gang_reservations.unwrap_or(true)),
            gang_queueing: waits_where(true),
            single_queueing: waits_where(false),
            preemption: self.options.preemption.is_some(),
            jobs: self.runs.len(),
            succeeded_jobs: count(Phase::Succeeded),
            failed_jobs: count(Phase::Failed),
            rejected_jobs: count(Phase::Rejected),
            unfinished_jobs: self.runs.len()
                - count(Phase::Succeeded)
                - count(Phase::Failed)
                - count(Phase::Rejected),
            out_of_memory_attempts: self.out_of_memory_attempts,
            shrunk_jobs,
            allocated_memory_utilisation: average(self.integrals.allocated_integral),
            used_memory_utilisation: average(self.integrals.used_integral),
            jobs_per_busy_gpu: if self.integrals.busy_integral > 0.0 {
                self.integrals.running_integral / self.integrals.busy_integral
            } else {
                0.0
            },
            fragmentation: average(self.integrals.fragmented_integral),
            queueing_delay_s: Percentiles::of(&mut queueing),
            completion_time_s: Percentiles::of(&mut completion),
            urgent_priority: self.options.urgent_priority,
            urgent_queueing: WaitSummary::of(urgent_jobs, &mut urgent_waits),
            preemptions: self.preemption.preemptions,
            preempted_run_time_lost_s: self.preemption.run_time_lost_s,
            makespan_s: elapsed,
            most_allocated_on_one_gpu_bytes: self.most_allocated_on_one_gpu_bytes,
            usable_bytes_per_gpu: self.usable_bytes,
            utilisation_over_time: self
                .integrals
                .utilisation_buckets(self.options.utilisation_samples),
        }
    }
}
