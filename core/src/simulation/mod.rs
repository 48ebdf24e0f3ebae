//! A trace-driven, discrete-event simulator of a GPU cluster that compares how three
//! admission policies would have served the same jobs: one whole GPU per job, trusting
//! the memory users declare, and Carve.
//!
//! It drives the real decision code with a simulated clock: placement is
//! [`crate::scheduling::solve_with_options`] (fair share, best fit, reservations) on a
//! [`crate::scheduling::SchedulingProblem`] built the way the scheduler builds it;
//! Carve's admission mirrors the scheduler's `submit` (estimate, measured-peak
//! correction, shrink ahead of time with [`crate::shrink::plan_shrink`] when the largest
//! GPU is smaller, [`crate::scheduling::can_ever_fit`]); and an out-of-memory under Carve
//! goes through `plan_shrink` with the report the attempt would have made, as the
//! scheduler's OOM handler does. Like the rest of core it does no IO and reads no clock:
//! the trace comes in as text ([`trace::parse_trace`]) and job files as texts keyed by
//! their paths ([`workload::Workload::prepare`]).
//!
//! # The truth model
//!
//! Each job really needs `need(config)` bytes to run in configuration `config`:
//! - with a model (`spec` or `model` column) and no `actual_peak_bytes`, the estimator's
//!   `required_bytes` for that config (the estimate *is* the allocator's peak, holes
//!   included, ARCHITECTURE.md);
//! - with `actual_peak_bytes` too, that number at the job's own config, and at any other
//!   config the estimate plus the same difference (memory the estimator does not see,
//!   such as a library's private buffers, does not shrink with the batch);
//! - with `actual_peak_bytes` alone, that number; such a job cannot be shrunk.
//! - a command job (a `spec` with `[command]`) has the fixed + per-sample memory model
//!   its row gives (`command_model`) in place of the estimator, for Carve's decisions
//!   (through [`crate::command::shrink::plan_command_shrink`]) and for the truth alike.
//!
//! An attempt whose slice is smaller than its need runs out of memory after
//! `oom_after_fraction` of the run time it had left (the peak may come late: the first
//! evaluation, a long sequence). Every attempt resumes from the last checkpoint, taken
//! every `checkpoint_interval_s` of its run time. How each policy reacts is in
//! [`policy::Policy`]; how fast a shrunk configuration runs is in
//! [`policy::slowdown_factor`].
//!
//! # The event loop
//!
//! Events are arrivals, attempt ends (success or out-of-memory, known when the attempt
//! starts) and resubmissions. All events at one instant are applied, then one scheduling
//! pass runs if jobs wait. So the solver runs only when something changed, and estimates
//! and shrink plans are memoized per distinct model and configuration
//! ([`workload::MemoryOracle`]).
//!
//! # Gangs
//!
//! A row with `gpus` above 1 is a gang: that many slices of the row's size on distinct
//! GPUs, started and ended together. With gangs (or [`SimulationOptions::gang_reservations`])
//! each pass is [`crate::gang::solve_gangs`], every job a gang (one slice or more), given
//! each queued job's true run time as its expected duration and each running attempt's
//! true end as its expected end (the best case for backfill: the scheduler would pass a
//! bound such as `max_duration`). A gang's attempt ends (succeeds, runs out of memory)
//! as one. The report gives gangs' and single-slice jobs' queueing apart.
//!
//! With [`SimulationOptions::preemption`], each pass is followed by the scheduler's
//! preemption step (core's `choose_victims`, the same limits); see
//! [`SimulatedPreemption`] for what a preempted attempt is assumed to lose.

pub mod event_loop;
pub mod generator;
pub mod policy;
pub mod report;
pub mod trace;
pub mod workload;

#[cfg(test)]
mod preemption_tests;
#[cfg(test)]
mod tests;

use std::fmt;

use crate::bytes::{HumanBytes, parse_byte_size};
use crate::error::{CoreError, FieldError};
use crate::scheduling::preemption::{self, PreemptionSettings};

pub use event_loop::simulate;
pub use generator::{GeneratorOptions, generate_trace};
pub use policy::Policy;
pub use report::{Percentiles, PolicyReport, UtilisationSample, WaitSummary};
pub use trace::{ModelFamilyParameters, Trace, parse_trace};
pub use workload::{MemoryOracle, Workload};

/// A cluster of identical GPUs: `nodes x gpus_per_node`, each of `gpu_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cluster {
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub gpu_bytes: u64,
}

impl Cluster {
    /// Reads `8x80GiB` (one node of 8 GPUs) or `4x8x80GiB` (4 nodes of 8 GPUs each).
    pub fn parse(text: &str) -> Result<Cluster, CoreError> {
        let error = |reason: String| CoreError::InvalidSpec(FieldError::new("cluster", reason));
        let parse_count = |count: &str| -> Result<u32, CoreError> {
            let number: u32 = count
                .trim()
                .parse()
                .map_err(|_| error(format!("`{count}` is not a whole number of nodes or GPUs")))?;
            if number == 0 || number > 100_000 {
                return Err(error(format!("{number} must be between 1 and 100000")));
            }
            Ok(number)
        };
        let parts: Vec<&str> = text.trim().split(['x', 'X']).collect();
        let (nodes, gpus_per_node, size) = match parts.as_slice() {
            [gpus, size] => (1, parse_count(gpus)?, *size),
            [nodes, gpus, size] => (parse_count(nodes)?, parse_count(gpus)?, *size),
            _ => {
                return Err(error(format!(
                    "`{text}` is not GPUSxSIZE or NODESxGPUSxSIZE, e.g. 8x80GiB or 4x8x80GiB"
                )));
            }
        };
        let gpu_bytes =
            parse_byte_size(size).map_err(|reason| error(format!("GPU size: {reason}")))?;
        if gpu_bytes == 0 {
            return Err(error("GPU size must be more than 0 bytes".to_string()));
        }
        if u64::from(nodes) * u64::from(gpus_per_node) > 100_000 {
            return Err(error("more than 100000 GPUs".to_string()));
        }
        Ok(Cluster {
            nodes,
            gpus_per_node,
            gpu_bytes,
        })
    }

    pub fn gpu_count(&self) -> usize {
        self.nodes as usize * self.gpus_per_node as usize
    }
}

impl fmt::Display for Cluster {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "{} node(s) x {} GPU(s) x {}",
            self.nodes,
            self.gpus_per_node,
            HumanBytes(self.gpu_bytes)
        )
    }
}

/// The knobs of the model that are not in the trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimulationOptions {
    /// Bytes of each GPU taken by the CUDA context and library handles.
    pub gpu_context_bytes: u64,
    /// Share of its remaining run time after which an attempt that does not fit its
    /// slice runs out of memory.
    pub oom_after_fraction: f64,
    /// How long a user takes to resubmit a job that ran out of memory (declared policy,
    /// and Carve for jobs without a model).
    pub resubmit_delay_s: f64,
    /// Run time between checkpoints; an attempt that ends resumes from the last one.
    pub checkpoint_interval_s: f64,
    /// The solver's reservations for blocked jobs (on in the scheduler).
    pub reserve_for_blocked_jobs: bool,
    /// Points of the utilisation-over-time series.
    pub utilisation_samples: usize,
    /// Let urgent jobs evict lower-priority attempts, as the scheduler does (off: `None`).
    pub preemption: Option<SimulatedPreemption>,
    /// Jobs of at least this priority are the *urgent* ones whose queueing the report
    /// gives apart ([`PolicyReport::urgent_queueing`]).
    pub urgent_priority: i32,
    /// Fair share over time: tenants ordered by their decayed usage with this half-life
    /// (`crate::usage`, as the scheduler does); `None` for instantaneous fair share (what
    /// each tenant holds now only).
    pub fair_share_half_life_s: Option<f64>,
    /// Place with the gang pass ([`crate::gang::solve_gangs`]), with its reservations
    /// on (`Some(true)`) or off; `None`: the single-job solver, unless the trace has
    /// gangs (rows with `gpus` above 1), which then get the gang pass with reservations.
    pub gang_reservations: Option<bool>,
    /// The gang pass's `max_reservation_wait`, in seconds: after a job has been queued
    /// this long, nothing new is placed on the GPUs reserved for it.
    pub gang_max_wait_s: f64,
}

/// Preemption in the simulator: core's [`choose_victims`] with the scheduler's limits.
///
/// A victim stops at the end of the grace period (the worst case: a real one may exit
/// sooner) and resumes from its last periodic checkpoint, losing the run time since
/// ([`SimulationOptions::checkpoint_interval_s`]): the simulator does not model the
/// checkpoint a well-behaved job writes when asked to stop.
///
/// [`choose_victims`]: crate::scheduling::preemption::choose_victims
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimulatedPreemption {
    pub limits: PreemptionSettings,
    pub grace_period_s: f64,
}

impl Default for SimulatedPreemption {
    fn default() -> Self {
        SimulatedPreemption {
            limits: PreemptionSettings {
                min_run_time_seconds: preemption::DEFAULT_MIN_RUN_TIME_SECONDS,
                max_preemptions_per_job_per_hour:
                    preemption::DEFAULT_MAX_PREEMPTIONS_PER_JOB_PER_HOUR,
            },
            grace_period_s: preemption::DEFAULT_GRACE_PERIOD_SECONDS as f64,
        }
    }
}

impl Default for SimulationOptions {
    fn default() -> Self {
        SimulationOptions {
            gpu_context_bytes: 0,
            oom_after_fraction: 0.1,
            resubmit_delay_s: 600.0,
            checkpoint_interval_s: 600.0,
            reserve_for_blocked_jobs: true,
            utilisation_samples: 200,
            preemption: None,
            urgent_priority: 1,
            fair_share_half_life_s: None,
            gang_reservations: None,
            gang_max_wait_s: 3600.0,
        }
    }
}

impl SimulationOptions {
    /// Checks the options against the cluster.
    pub fn check(&self, cluster: &Cluster) -> Result<(), CoreError> {
        let error =
            |field: &str, reason: String| CoreError::InvalidSpec(FieldError::new(field, reason));
        if self.gpu_context_bytes >= cluster.gpu_bytes {
            return Err(error(
                "gpu_context_bytes",
                format!(
                    "{} leaves nothing of a {} GPU",
                    HumanBytes(self.gpu_context_bytes),
                    HumanBytes(cluster.gpu_bytes)
                ),
            ));
        }
        if !(self.oom_after_fraction > 0.0 && self.oom_after_fraction <= 1.0) {
            return Err(error(
                "oom_after_fraction",
                format!("{} must be in (0, 1]", self.oom_after_fraction),
            ));
        }
        if !(self.resubmit_delay_s.is_finite() && self.resubmit_delay_s >= 0.0) {
            return Err(error(
                "resubmit_delay_s",
                format!(
                    "{} must be a number of seconds, at least 0",
                    self.resubmit_delay_s
                ),
            ));
        }
        if !(self.checkpoint_interval_s.is_finite() && self.checkpoint_interval_s > 0.0) {
            return Err(error(
                "checkpoint_interval_s",
                format!("{} must be more than 0 seconds", self.checkpoint_interval_s),
            ));
        }
        if let Some(half_life_s) = self.fair_share_half_life_s
            && !(half_life_s.is_finite() && half_life_s >= 0.001)
        {
            return Err(error(
                "fair_share_half_life_s",
                format!("{half_life_s} must be a number of seconds, at least 0.001"),
            ));
        }
        if !(self.gang_max_wait_s.is_finite() && self.gang_max_wait_s >= 0.0) {
            return Err(error(
                "gang_max_wait_s",
                format!(
                    "{} must be a number of seconds, at least 0",
                    self.gang_max_wait_s
                ),
            ));
        }
        if self.preemption.is_some() && self.gang_reservations.is_some() {
            return Err(error(
                "gang_reservations",
                "the simulator's preemption step evicts for single-slice jobs only; run \
                 gangs without --preemption"
                    .to_string(),
            ));
        }
        if let Some(preemption) = &self.preemption
            && !(preemption.grace_period_s.is_finite() && preemption.grace_period_s >= 0.0)
        {
            return Err(error(
                "preemption_grace_period_s",
                format!(
                    "{} must be a number of seconds, at least 0",
                    preemption.grace_period_s
                ),
            ));
        }
        Ok(())
    }
}
