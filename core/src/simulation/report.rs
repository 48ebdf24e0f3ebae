//! What one simulated policy measured, and the time integrals behind the averages.
//!
//! Every average is over simulated time, from the first submission to the last job's end:
//! the cluster's state is constant between two events, so each quantity is integrated as
//! a step function, exactly, with no sampling.

use crate::simulation::policy::Policy;

/// Nearest-rank percentiles of a set of durations, in seconds (0 when the set is empty).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
}

impl Percentiles {
    /// `values` need not be sorted.
    pub fn of(values: &mut [f64]) -> Percentiles {
        if values.is_empty() {
            return Percentiles::default();
        }
        values.sort_by(f64::total_cmp);
        let rank = |quantile: f64| {
            let index = (quantile * values.len() as f64).ceil() as usize;
            values[index.clamp(1, values.len()) - 1]
        };
        Percentiles {
            p50: rank(0.50),
            p95: rank(0.95),
            p99: rank(0.99),
        }
    }
}

/// Queueing of a group of jobs: how many, how many started, and their waits (submit to
/// first start) over those that started; all 0 when none did.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WaitSummary {
    pub jobs: usize,
    pub started_jobs: usize,
    pub mean_s: f64,
    pub percentiles: Percentiles,
    pub max_s: f64,
}

impl WaitSummary {
    /// `waits` need not be sorted; `jobs` counts those that never started too.
    pub fn of(jobs: usize, waits: &mut [f64]) -> WaitSummary {
        let started_jobs = waits.len();
        if started_jobs == 0 {
            return WaitSummary {
                jobs,
                ..WaitSummary::default()
            };
        }
        WaitSummary {
            jobs,
            started_jobs,
            mean_s: waits.iter().sum::<f64>() / started_jobs as f64,
            max_s: waits.iter().copied().fold(0.0, f64::max),
            percentiles: Percentiles::of(waits),
        }
    }
}

/// Memory use of the cluster at one moment, as shares of its total bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UtilisationSample {
    pub time_s: f64,
    /// Bytes of the slices in use / total bytes.
    pub allocated: f64,
    /// Bytes the running jobs really use / total bytes.
    pub used: f64,
}

/// The results of one policy on one trace and cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyReport {
    pub policy: Policy,
    /// Whether urgent jobs could evict lower-priority attempts in this run.
    pub preemption: bool,
    pub jobs: usize,
    pub succeeded_jobs: usize,
    /// Jobs that ended without finishing (out of memory with nothing left to try).
    pub failed_jobs: usize,
    /// Jobs refused at submit (Carve: no configuration fits any GPU).
    pub rejected_jobs: usize,
    /// Jobs still waiting when nothing else could happen (a job no GPU could ever take);
    /// 0 unless the solver starves a job.
    pub unfinished_jobs: usize,
    /// Attempts that ran out of memory.
    pub out_of_memory_attempts: u64,
    /// Jobs that ran in a configuration other than their own (Carve only).
    pub shrunk_jobs: usize,
    /// Time-averaged bytes of slices in use / total bytes.
    pub allocated_memory_utilisation: f64,
    /// Time-averaged bytes the running jobs really need / total bytes.
    pub used_memory_utilisation: f64,
    /// Time-averaged running jobs per GPU with at least one job.
    pub jobs_per_busy_gpu: f64,
    /// Time-averaged free bytes that no waiting job fits in / total bytes (0 while
    /// nothing waits: idle memory is not fragmentation).
    pub fragmentation: f64,
    /// From submit to the first start, over the jobs that started.
    pub queueing_delay_s: Percentiles,
    /// From submit to success, over the jobs that succeeded.
    pub completion_time_s: Percentiles,
    /// The jobs of at least `urgent_priority`, from submit to the first start.
    pub urgent_priority: i32,
    pub urgent_queueing: WaitSummary,
    /// The gang pass's reservations in this run: `Some(on)` when passes went through
    /// `crate::gang::solve_gangs`, `None` for the single-job solver.
    pub gang_reservations: Option<bool>,
    /// Jobs of more than one slice (gangs), from submit to the first start.
    pub gang_queueing: WaitSummary,
    /// Jobs of one slice, from submit to the first start.
    pub single_queueing: WaitSummary,
    /// Attempts evicted for an urgent job.
    pub preemptions: u64,
    /// Run time the evicted attempts had done since their last checkpoint, summed: work
    /// done again.
    pub preempted_run_time_lost_s: f64,
    /// From the first submit to the last job's end.
    pub makespan_s: f64,
    /// The most bytes ever allocated on one GPU, and that GPU's usable bytes: the first is
    /// never above the second (the solver never oversubscribes).
    pub most_allocated_on_one_gpu_bytes: u64,
    pub usable_bytes_per_gpu: u64,
    /// Time-averaged utilisation in equal buckets of the makespan.
    pub utilisation_over_time: Vec<UtilisationSample>,
}

/// Integrates the cluster's state over time.
#[derive(Debug, Clone)]
pub(crate) struct TimeIntegrals {
    start_s: f64,
    last_s: f64,
    allocated_fraction: f64,
    used_fraction: f64,
    running_jobs: f64,
    busy_gpus: f64,
    fragmented_fraction: f64,
    pub(crate) allocated_integral: f64,
    pub(crate) used_integral: f64,
    pub(crate) running_integral: f64,
    pub(crate) busy_integral: f64,
    pub(crate) fragmented_integral: f64,
    /// `(time, allocated, used)` each time the state changed.
    changes: Vec<UtilisationSample>,
}

/// The cluster's state between two events.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClusterLevels {
    pub allocated_fraction: f64,
    pub used_fraction: f64,
    pub running_jobs: usize,
    pub busy_gpus: usize,
    pub fragmented_fraction: f64,
}

impl TimeIntegrals {
    pub(crate) fn new(start_s: f64) -> Self {
        TimeIntegrals {
            start_s,
            last_s: start_s,
            allocated_fraction: 0.0,
            used_fraction: 0.0,
            running_jobs: 0.0,
            busy_gpus: 0.0,
            fragmented_fraction: 0.0,
            allocated_integral: 0.0,
            used_integral: 0.0,
            running_integral: 0.0,
            busy_integral: 0.0,
            fragmented_integral: 0.0,
            changes: vec![UtilisationSample {
                time_s: start_s,
                allocated: 0.0,
                used: 0.0,
            }],
        }
    }

    /// Adds the current levels over `[last, time]`.
    pub(crate) fn advance_to(&mut self, time_s: f64) {
        let span = time_s - self.last_s;
        if span > 0.0 {
            self.allocated_integral += self.allocated_fraction * span;
            self.used_integral += self.used_fraction * span;
            self.running_integral += self.running_jobs * span;
            self.busy_integral += self.busy_gpus * span;
            self.fragmented_integral += self.fragmented_fraction * span;
            self.last_s = time_s;
        }
    }

    /// The levels from now on.
    pub(crate) fn set_levels(&mut self, levels: ClusterLevels) {
        self.allocated_fraction = levels.allocated_fraction;
        self.used_fraction = levels.used_fraction;
        self.running_jobs = levels.running_jobs as f64;
        self.busy_gpus = levels.busy_gpus as f64;
        self.fragmented_fraction = levels.fragmented_fraction;
        let sample = UtilisationSample {
            time_s: self.last_s,
            allocated: levels.allocated_fraction,
            used: levels.used_fraction,
        };
        match self.changes.last_mut() {
            Some(last) if last.time_s == sample.time_s => *last = sample,
            _ => self.changes.push(sample),
        }
    }

    pub(crate) fn elapsed_s(&self) -> f64 {
        self.last_s - self.start_s
    }

    /// The step function of utilisation averaged over `buckets` equal spans of
    /// `[start, last]`, each sample at its bucket's end.
    pub(crate) fn utilisation_buckets(&self, buckets: usize) -> Vec<UtilisationSample> {
        let elapsed = self.elapsed_s();
        if buckets == 0 || elapsed <= 0.0 {
            return Vec::new();
        }
        let width = elapsed / buckets as f64;
        let mut samples = Vec::with_capacity(buckets);
        let mut change = 0;
        for bucket in 0..buckets {
            let from = self.start_s + width * bucket as f64;
            let to = if bucket + 1 == buckets {
                self.last_s
            } else {
                from + width
            };
            let (mut allocated, mut used) = (0.0, 0.0);
            // The change in force at `from` is the last one at or before it.
            while change + 1 < self.changes.len() && self.changes[change + 1].time_s <= from {
                change += 1;
            }
            let mut index = change;
            while index < self.changes.len() && self.changes[index].time_s < to {
                let segment_start = self.changes[index].time_s.max(from);
                let segment_end = self
                    .changes
                    .get(index + 1)
                    .map_or(to, |next| next.time_s.min(to));
                let span = (segment_end - segment_start).max(0.0);
                allocated += self.changes[index].allocated * span;
                used += self.changes[index].used * span;
                index += 1;
            }
            let span = (to - from).max(f64::MIN_POSITIVE);
            samples.push(UtilisationSample {
                time_s: to - self.start_s,
                allocated: allocated / span,
                used: used / span,
            });
        }
        samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let mut values: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let percentiles = Percentiles::of(&mut values);
        assert_eq!(
            (percentiles.p50, percentiles.p95, percentiles.p99),
            (50.0, 95.0, 99.0)
        );
        assert_eq!(Percentiles::of(&mut []), Percentiles::default());
        assert_eq!(Percentiles::of(&mut [7.0]).p99, 7.0);
    }

    #[test]
    fn integrals_and_buckets_follow_the_step_function() {
        let mut integrals = TimeIntegrals::new(0.0);
        let levels = |allocated: f64| ClusterLevels {
            allocated_fraction: allocated,
            used_fraction: allocated / 2.0,
            running_jobs: 1,
            busy_gpus: 1,
            fragmented_fraction: 0.0,
        };
        integrals.set_levels(levels(1.0));
        integrals.advance_to(10.0);
        integrals.set_levels(levels(0.5));
        integrals.advance_to(30.0);
        assert_eq!(integrals.allocated_integral, 20.0);
        assert_eq!(integrals.used_integral, 10.0);
        let buckets = integrals.utilisation_buckets(2);
        assert_eq!(buckets.len(), 2);
        // [0, 15): 10 s at 1.0 and 5 s at 0.5.
        assert!((buckets[0].allocated - 12.5 / 15.0).abs() < 1e-12);
        assert!((buckets[1].allocated - 0.5).abs() < 1e-12);
        assert_eq!(buckets[1].time_s, 30.0);
    }
}
