//! The simulator's pass when the trace has gangs: core's [`solve_gangs`] on the problem
//! the scheduler would build (every job a gang of one slice or more), each queued job's
//! true run time as its expected duration and each running attempt's true end as its
//! expected end (the best case for backfill; see the module docs of `simulation`).

use std::collections::BTreeMap;

use super::Simulation;
use crate::gang::{GangOptions, GangProblem, GangShape, PendingGang, RunningSlice, solve_gangs};
use crate::spec::GangPlacementPolicy;

/// Simulated seconds as the pass's time unit, milliseconds.
fn millis(seconds: f64) -> u64 {
    (seconds.max(0.0) * 1000.0).round() as u64
}

impl Simulation<'_> {
    pub(super) fn gang_scheduling_pass(&mut self, now: f64) {
        let free: Vec<u64> = self
            .problem
            .gpus
            .iter()
            .map(|gpu| gpu.free_bytes())
            .collect();
        let mut free_descending = free.clone();
        free_descending.sort_unstable_by(|left, right| right.cmp(left));
        // A job that does not fit the GPUs as they are at the start of the pass cannot be
        // placed in it (GPUs only fill up); it is left out unless it is its tenant's
        // first job, which may reserve.
        let fits_at_start = |members: u32, bytes: u64| {
            free_descending
                .get(members.saturating_sub(1) as usize)
                .is_some_and(|free| *free >= bytes)
        };
        let mut pending = Vec::new();
        for tenant_queue in &self.queue {
            for (position, &(_, _, job)) in tenant_queue.iter().enumerate() {
                let members = self.workload.jobs[job].gpus.max(1);
                let slice_bytes = self.runs[job].slice_bytes;
                if position > 0 && !fits_at_start(members, slice_bytes) {
                    continue;
                }
                let run = &self.runs[job];
                pending.push(PendingGang {
                    job_id: self.job_ids[job].clone(),
                    tenant: self.workload.jobs[job].tenant.clone(),
                    priority: self.workload.jobs[job].priority,
                    submit_sequence: run.submit_sequence,
                    shape: GangShape {
                        members,
                        member_slice_bytes: slice_bytes,
                        policy: GangPlacementPolicy::Pack,
                    },
                    queued_at: millis(run.queued_s),
                    expected_duration: Some(millis(run.remaining_work_s).max(1)),
                });
            }
        }
        let mut running = Vec::with_capacity(self.running_jobs);
        for (gpu, jobs) in self.running_on_gpu.iter().enumerate() {
            for &job in jobs {
                running.push(RunningSlice {
                    job_id: self.job_ids[job].clone(),
                    worker_id: self.problem.gpus[gpu].worker_id.clone(),
                    gpu_id: self.problem.gpus[gpu].gpu_id.clone(),
                    slice_bytes: self.runs[job].slice_bytes,
                    expected_end: Some(millis(self.runs[job].attempt_ends_s)),
                });
            }
        }
        self.set_decayed_usage(now);
        let problem = GangProblem {
            now: millis(now),
            gpus: self.problem.gpus.clone(),
            running,
            tenants: self.problem.tenants.clone(),
            pending,
        };
        let options = GangOptions {
            reservations: self.options.gang_reservations.unwrap_or(true),
            max_reservations: 1,
            max_reservation_wait: millis(self.options.gang_max_wait_s),
            usage_decay: self.scheduling_options.usage_decay,
        };
        let decision = solve_gangs(&problem, &options);
        let gpu_of: BTreeMap<&str, usize> = self
            .problem
            .gpus
            .iter()
            .enumerate()
            .map(|(index, gpu)| (gpu.gpu_id.as_str(), index))
            .collect();
        let starts: Vec<(usize, Vec<usize>)> = decision
            .placements
            .iter()
            .filter_map(|placement| {
                let job = placement.job_id.parse::<usize>().ok()?;
                let gpus = placement
                    .members
                    .iter()
                    .map(|member| gpu_of.get(member.gpu_id.as_str()).copied())
                    .collect::<Option<Vec<usize>>>()?;
                Some((job, gpus))
            })
            .collect();
        for (job, gpus) in starts {
            self.remove_from_queue(job);
            self.start_attempt_on(job, gpus, now);
        }
    }
}
