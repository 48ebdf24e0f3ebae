//! The discrete-event loop: one policy, one workload, one cluster, a simulated clock.
//!
//! The cluster is kept as the [`SchedulingProblem`] the scheduler would build (GPUs with
//! their allocated bytes, tenants with their usage), updated in place as attempts start
//! and end, so each pass hands `solve_with_options` exactly what it would see live.
//! With preemption on, each pass is followed by the scheduler's preemption step
//! ([`preemption`]).

mod attempt_end;
mod gang_pass;
mod preemption;
mod summary;

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeSet, BinaryHeap, HashMap};

use crate::admission::size_slice_at_admission;
use crate::error::CoreError;
use crate::plan::RunConfig;
use crate::scheduling::{
    GpuState, PendingJob, SchedulingOptions, SchedulingProblem, TenantState, can_ever_fit,
    solve_with_options,
};
use crate::simulation::policy::{Policy, slowdown_factor};
use crate::simulation::report::{PolicyReport, TimeIntegrals};
use crate::simulation::workload::{MemoryOracle, SimulatedJob, Workload};
use crate::simulation::{Cluster, SimulationOptions};
use crate::usage::{AttemptUsage, DecayedUsageLedger, UsageDecay};

/// A queued job's place within its tenant: priority (higher first), submit sequence, index.
type QueueKey = (Reverse<i32>, u64, usize);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    NotArrived,
    Queued,
    Running,
    /// Waiting for its user to resubmit it after an out-of-memory.
    Resubmitting,
    Succeeded,
    Failed,
    Rejected,
}

#[derive(Debug, Clone)]
struct Attempt {
    /// One GPU per slice: a gang's members, rank order.
    gpus: Vec<usize>,
    started_s: f64,
    slowdown: f64,
    used_bytes: u64,
    runs_out_of_memory: bool,
}

#[derive(Debug, Clone)]
struct JobRun {
    phase: Phase,
    slice_bytes: u64,
    /// Carve with a model: the configuration the next attempt runs.
    config: Option<RunConfig>,
    /// Run time left at the job's own configuration on a whole GPU.
    remaining_work_s: f64,
    submit_sequence: u64,
    first_start_s: Option<f64>,
    end_s: Option<f64>,
    out_of_memory_attempts: u32,
    attempt: Option<Attempt>,
    /// Attempts started so far: an event made for an earlier attempt is stale.
    attempts_started: u32,
    /// When the job last joined the queue (the gang pass's `queued_at`).
    queued_s: f64,
    /// When the running attempt ends (its `AttemptEnd` event): the gang pass's expected
    /// end of its slices.
    attempt_ends_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventKind {
    Arrival,
    AttemptEnd,
    Resubmission,
    /// A victim of preemption stops at the end of its grace period.
    PreemptionStop,
    /// An attempt becomes evictable (old enough, or under the cap again): a pass runs,
    /// as the scheduler's periodic one would.
    PreemptionWake,
}

#[derive(Debug, Clone, Copy)]
struct Event {
    time_s: f64,
    /// Insertion order: events at one instant are applied in the order they were made.
    order: u64,
    kind: EventKind,
    job: usize,
    /// `attempts_started` of the job when the event was made.
    attempt: u32,
}

impl Ord for Event {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: BinaryHeap pops the greatest, the simulation wants the earliest.
        other
            .time_s
            .total_cmp(&self.time_s)
            .then_with(|| other.order.cmp(&self.order))
    }
}

impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Event {}

/// Simulates `policy` on `workload` and `cluster`. `oracle` may be shared between
/// policies and runs (it only memoizes pure answers).
pub fn simulate(
    workload: &Workload,
    cluster: &Cluster,
    policy: Policy,
    options: &SimulationOptions,
    oracle: &mut MemoryOracle,
) -> Result<PolicyReport, CoreError> {
    simulate_with_pruning(workload, cluster, policy, options, oracle, true)
}

/// [`simulate`], optionally handing the solver every queued job in every pass: the tests
/// check that pruning changes nothing.
pub(crate) fn simulate_with_pruning(
    workload: &Workload,
    cluster: &Cluster,
    policy: Policy,
    options: &SimulationOptions,
    oracle: &mut MemoryOracle,
    prune_pending: bool,
) -> Result<PolicyReport, CoreError> {
    options.check(cluster)?;
    if options.preemption.is_some() && workload.jobs.iter().any(|job| job.gpus > 1) {
        return Err(CoreError::InvalidSpec(crate::error::FieldError::new(
            "preemption",
            "the trace has gangs (gpus above 1); the simulator's preemption step evicts \
             for single-slice jobs only",
        )));
    }
    let mut simulation = Simulation::new(workload, cluster, policy, options, oracle);
    simulation.prune_pending = prune_pending;
    simulation.run();
    Ok(simulation.report())
}

struct Simulation<'a> {
    workload: &'a Workload,
    policy: Policy,
    options: &'a SimulationOptions,
    oracle: &'a mut MemoryOracle,
    scheduling_options: SchedulingOptions,
    /// GPUs and tenants as the scheduler would pass them; `pending` is rebuilt per pass.
    problem: SchedulingProblem,
    gpu_index: HashMap<String, usize>,
    usable_bytes: u64,
    total_bytes: f64,
    jobs_on_gpu: Vec<u32>,
    /// The jobs running on each GPU.
    running_on_gpu: Vec<BTreeSet<usize>>,
    preemption: preemption::Preemptions,
    tenant_of_job: Vec<usize>,
    job_ids: Vec<String>,
    runs: Vec<JobRun>,
    /// Queued jobs per tenant (by tenant index), in the solver's order within a tenant:
    /// priority (higher first), then submit sequence (unique per job).
    queue: Vec<BTreeSet<QueueKey>>,
    queued_jobs: usize,
    /// Hand the solver only the jobs that can matter in a pass (see `scheduling_pass`).
    prune_pending: bool,
    events: BinaryHeap<Event>,
    next_event_order: u64,
    next_submit_sequence: u64,
    allocated_bytes: u128,
    used_bytes: u128,
    running_jobs: usize,
    /// Largest measured / estimated ratio per (model, config), learned from successes:
    /// the scheduler's peak correction.
    peak_corrections: HashMap<(usize, RunConfig), f64>,
    integrals: TimeIntegrals,
    out_of_memory_attempts: u64,
    most_allocated_on_one_gpu_bytes: u64,
    /// Fair share over time: every ended attempt's usage, decayed (the scheduler's
    /// ledger); `None` for instantaneous fair share.
    usage: Option<DecayedUsageLedger>,
    /// The time of the events being applied, for the usage of attempts that end.
    clock_s: f64,
    /// Passes go through the gang pass (`gang_pass.rs`) instead of the single-job solver.
    use_gang_pass: bool,
}

impl<'a> Simulation<'a> {
    fn new(
        workload: &'a Workload,
        cluster: &Cluster,
        policy: Policy,
        options: &'a SimulationOptions,
        oracle: &'a mut MemoryOracle,
    ) -> Self {
        let mut gpus = Vec::with_capacity(cluster.gpu_count());
        for node in 0..cluster.nodes {
            for gpu in 0..cluster.gpus_per_node {
                gpus.push(GpuState {
                    gpu_id: format!("node{node:03}-gpu{gpu:02}"),
                    worker_id: format!("node{node:03}"),
                    total_bytes: cluster.gpu_bytes,
                    context_bytes: options.gpu_context_bytes,
                    allocated_bytes: 0,
                    schedulable: true,
                });
            }
        }
        let gpu_index = gpus
            .iter()
            .enumerate()
            .map(|(index, gpu)| (gpu.gpu_id.clone(), index))
            .collect();
        let tenants: Vec<TenantState> = workload
            .tenants
            .iter()
            .map(|tenant| TenantState {
                tenant: tenant.clone(),
                weight: 1,
                vram_quota_bytes: None,
                running_jobs_quota: None,
                vram_in_use_bytes: 0,
                running_jobs: 0,
                decayed_usage_byte_seconds: 0,
            })
            .collect();
        let tenant_of_job = workload
            .jobs
            .iter()
            .map(|job| workload.tenants.binary_search(&job.tenant).unwrap_or(0))
            .collect();
        let mut events = BinaryHeap::with_capacity(workload.jobs.len() * 2);
        for (index, job) in workload.jobs.iter().enumerate() {
            events.push(Event {
                time_s: job.submit_time_s,
                order: index as u64,
                kind: EventKind::Arrival,
                job: index,
                attempt: 0,
            });
        }
        let start_s = workload.jobs.first().map_or(0.0, |job| job.submit_time_s);
        let usage = options
            .fair_share_half_life_s
            .and_then(|half_life_s| UsageDecay::with_half_life_ms(seconds_to_ms(half_life_s)));
        let mut scheduling_options = SchedulingOptions {
            reserve_for_blocked_jobs: options.reserve_for_blocked_jobs,
            ..SchedulingOptions::default()
        };
        if let Some(decay) = usage {
            scheduling_options.usage_decay = decay;
        }
        Simulation {
            workload,
            policy,
            options,
            oracle,
            scheduling_options,
            usage: usage.map(|decay| DecayedUsageLedger::new(decay, seconds_to_ms(start_s))),
            clock_s: start_s,
            use_gang_pass: options.gang_reservations.is_some()
                || workload.jobs.iter().any(|job| job.gpus > 1),
            usable_bytes: cluster.gpu_bytes - options.gpu_context_bytes,
            total_bytes: cluster.gpu_bytes as f64 * cluster.gpu_count() as f64,
            jobs_on_gpu: vec![0; gpus.len()],
            running_on_gpu: vec![BTreeSet::new(); gpus.len()],
            preemption: preemption::Preemptions::default(),
            problem: SchedulingProblem {
                gpus,
                tenants,
                pending: Vec::new(),
            },
            gpu_index,
            tenant_of_job,
            job_ids: (0..workload.jobs.len())
                .map(|index| index.to_string())
                .collect(),
            runs: workload
                .jobs
                .iter()
                .map(|job| JobRun {
                    phase: Phase::NotArrived,
                    slice_bytes: 0,
                    config: None,
                    remaining_work_s: job.duration_s,
                    submit_sequence: 0,
                    first_start_s: None,
                    end_s: None,
                    out_of_memory_attempts: 0,
                    attempt: None,
                    attempts_started: 0,
                    queued_s: job.submit_time_s,
                    attempt_ends_s: 0.0,
                })
                .collect(),
            queue: vec![BTreeSet::new(); workload.tenants.len()],
            queued_jobs: 0,
            prune_pending: true,
            next_event_order: workload.jobs.len() as u64,
            events,
            next_submit_sequence: 0,
            allocated_bytes: 0,
            used_bytes: 0,
            running_jobs: 0,
            peak_corrections: HashMap::new(),
            integrals: TimeIntegrals::new(start_s),
            out_of_memory_attempts: 0,
            most_allocated_on_one_gpu_bytes: 0,
        }
    }

    fn push_event(&mut self, time_s: f64, kind: EventKind, job: usize) {
        self.events.push(Event {
            time_s,
            order: self.next_event_order,
            kind,
            job,
            attempt: self.runs[job].attempts_started,
        });
        self.next_event_order += 1;
    }

    fn run(&mut self) {
        while let Some(first) = self.events.pop() {
            let now = first.time_s;
            self.clock_s = now;
            self.integrals.advance_to(now);
            self.apply(first);
            while self.events.peek().is_some_and(|event| event.time_s == now) {
                if let Some(event) = self.events.pop() {
                    self.apply(event);
                }
            }
            if self.queued_jobs > 0 {
                self.scheduling_pass(now);
            }
            self.integrals.set_levels(self.levels());
        }
    }

    fn apply(&mut self, event: Event) {
        let run = &self.runs[event.job];
        let stale = run.attempt.is_none() || run.attempts_started != event.attempt;
        match event.kind {
            EventKind::Arrival => self.arrive(event.job, event.time_s),
            EventKind::AttemptEnd if !stale => self.end_attempt(event.job, event.time_s),
            EventKind::PreemptionStop if !stale => self.stop_victim(event.job, event.time_s),
            EventKind::AttemptEnd | EventKind::PreemptionStop => {}
            EventKind::PreemptionWake => self.preemption.woken(event.time_s),
            EventKind::Resubmission => self.enqueue(event.job),
        }
    }

    fn enqueue(&mut self, job: usize) {
        self.runs[job].phase = Phase::Queued;
        self.runs[job].submit_sequence = self.next_submit_sequence;
        self.next_submit_sequence += 1;
        self.push_queue(job);
    }

    /// Admission: the slice (and under Carve the configuration) a job asks for.
    fn arrive(&mut self, job_index: usize, now: f64) {
        let job = &self.workload.jobs[job_index];
        let usable = self.usable_bytes;
        if job.gpus as usize > self.problem.gpus.len() {
            // A gang larger than the cluster: refused at submit, as can_gang_ever_fit does.
            let run = &mut self.runs[job_index];
            run.phase = Phase::Rejected;
            run.end_s = Some(now);
            return;
        }
        let admitted = match (self.policy, job.model) {
            (Policy::WholeGpu, _) => Some((usable, None)),
            // Users cannot ask for more than a GPU: such a declaration means "all of it".
            (Policy::Declared, _) | (Policy::Carve, None) => {
                Some((job.requested_bytes.min(usable), None))
            }
            (Policy::Carve, Some(model)) => self.carve_admission(job, model),
        };
        match admitted {
            Some((slice_bytes, config)) => {
                self.runs[job_index].slice_bytes = slice_bytes;
                self.runs[job_index].config = config;
                self.enqueue(job_index);
            }
            None => {
                let run = &mut self.runs[job_index];
                run.phase = Phase::Rejected;
                run.end_s = Some(now);
            }
        }
    }

    /// The scheduler's `submit`, step for step: estimate, raise by the measured-peak
    /// correction of the same shape, shrink ahead of time when the slice the job asks for
    /// (or the largest GPU) is smaller, honour an explicit slice, and refuse what can
    /// never fit.
    fn carve_admission(
        &mut self,
        job: &SimulatedJob,
        model: usize,
    ) -> Option<(u64, Option<RunConfig>)> {
        let entry = &self.workload.models[model];
        let usable = self.usable_bytes;
        let config = entry.own_config;
        let correction = self
            .peak_corrections
            .get(&(model, config))
            .copied()
            .unwrap_or(1.0);
        let (oracle, workload) = (&mut self.oracle, self.workload);
        let admitted = size_slice_at_admission(
            entry.job.vram(),
            config,
            entry.own_required_bytes,
            correction,
            Some(usable),
            |config, limit| {
                oracle
                    .shrink(workload, model, config, None, limit)
                    .map(|shrunk| (shrunk.config, shrunk.required_bytes))
                    .ok_or(())
            },
        )
        .ok()?;
        let (config, slice_bytes) = (admitted.config, admitted.slice_bytes);
        let tenant = TenantState {
            tenant: job.tenant.clone(),
            weight: 1,
            vram_quota_bytes: None,
            running_jobs_quota: None,
            vram_in_use_bytes: 0,
            running_jobs: 0,
            decayed_usage_byte_seconds: 0,
        };
        can_ever_fit(slice_bytes, &self.problem.gpus, &tenant).ok()?;
        Some((slice_bytes, Some(config)))
    }

    /// What the job really needs in `config` (its own configuration when `None`); see
    /// the truth model in the module docs.
    fn need_bytes(&mut self, job_index: usize, config: Option<RunConfig>) -> u64 {
        let job = &self.workload.jobs[job_index];
        let Some(model) = job.model else {
            return job.actual_peak_bytes.unwrap_or(job.requested_bytes);
        };
        let entry = &self.workload.models[model];
        let config = config.unwrap_or(entry.own_config);
        let estimated = self.oracle.required_bytes(self.workload, model, &config);
        match job.actual_peak_bytes {
            None => estimated,
            Some(actual) => {
                let missed = i128::from(actual) - i128::from(entry.own_required_bytes);
                u64::try_from((i128::from(estimated) + missed).max(1)).unwrap_or(u64::MAX)
            }
        }
    }

    fn queue_key(&self, job: usize) -> QueueKey {
        (
            Reverse(self.workload.jobs[job].priority),
            self.runs[job].submit_sequence,
            job,
        )
    }

    fn push_queue(&mut self, job: usize) {
        let key = self.queue_key(job);
        if self.queue[self.tenant_of_job[job]].insert(key) {
            self.queued_jobs += 1;
            self.runs[job].queued_s = self.clock_s;
        }
    }

    fn remove_from_queue(&mut self, job: usize) {
        let key = self.queue_key(job);
        if self.queue[self.tenant_of_job[job]].remove(&key) {
            self.queued_jobs -= 1;
        }
    }

    fn smallest_queued_slice(&self) -> Option<u64> {
        self.queue
            .iter()
            .flatten()
            .map(|&(_, _, job)| self.runs[job].slice_bytes)
            .min()
    }

    /// One pass of the solver over the queued jobs, starting the attempts it places.
    ///
    /// With `prune_pending`, jobs that provably cannot be placed in this pass are left out
    /// of the problem, which gives the same placements (the simulator has no quotas, and
    /// every slice fits an empty GPU, so each tenant's head is its first job):
    /// - a job the solver does not place changes nothing for the jobs after it (no GPU
    ///   bytes, no tenant usage), so leaving it out changes no other decision, as long as
    ///   each tenant's first job stays, since heads make reservations;
    /// - a job larger than every GPU's free bytes at the start cannot be placed (free
    ///   bytes only shrink during a pass);
    /// - at most `M = sum over GPUs of free / smallest queued slice` jobs are placed in a
    ///   pass. If `M + 1` earlier jobs of the same tenant have slices no larger than a
    ///   job's, one of them was not placed, so when it was considered no unreserved GPU
    ///   had room for it, and so none has for the later, larger job.
    ///
    /// An overloaded cluster queues thousands of jobs; this keeps each pass small.
    fn scheduling_pass(&mut self, now: f64) {
        if self.use_gang_pass {
            self.gang_scheduling_pass(now);
            return;
        }
        let Some(smallest_slice) = self.smallest_queued_slice() else {
            return;
        };
        let free_bytes: Vec<u64> = self.problem.gpus.iter().map(GpuState::free_bytes).collect();
        let largest_free = free_bytes.iter().copied().max().unwrap_or(0);
        let most_placements: u64 = free_bytes
            .iter()
            .map(|free| free / smallest_slice.max(1))
            .sum();
        let mut pending = Vec::new();
        for tenant_queue in &self.queue {
            // The slices of up to `most_placements + 1` kept jobs, largest on top.
            let mut smallest_kept: BinaryHeap<u64> = BinaryHeap::new();
            for (position, &(_, _, job)) in tenant_queue.iter().enumerate() {
                let slice_bytes = self.runs[job].slice_bytes;
                let keep = !self.prune_pending
                    || position == 0
                    || (slice_bytes <= largest_free
                        && !(smallest_kept.len() as u64 > most_placements
                            && smallest_kept
                                .peek()
                                .is_some_and(|largest| *largest <= slice_bytes)));
                if !keep {
                    continue;
                }
                smallest_kept.push(slice_bytes);
                if smallest_kept.len() as u64 > most_placements + 1 {
                    smallest_kept.pop();
                }
                pending.push(PendingJob {
                    job_id: self.job_ids[job].clone(),
                    tenant: self.workload.jobs[job].tenant.clone(),
                    priority: self.workload.jobs[job].priority,
                    submit_sequence: self.runs[job].submit_sequence,
                    slice_bytes,
                });
            }
        }
        self.problem.pending = pending;
        self.set_decayed_usage(now);
        let held = self.hold_claimed_bytes();
        let decision = solve_with_options(&self.problem, &self.scheduling_options);
        self.release_claimed_bytes(&held);
        self.problem.pending.clear();
        for placement in &decision.placements {
            let (Ok(job), Some(&gpu)) = (
                placement.job_id.parse::<usize>(),
                self.gpu_index.get(&placement.gpu_id),
            ) else {
                continue;
            };
            self.remove_from_queue(job);
            self.start_attempt(job, gpu, now);
        }
        if self.options.preemption.is_some() {
            self.preempt_for_waiting_jobs(now);
        }
    }

    fn start_attempt(&mut self, job: usize, gpu: usize, now: f64) {
        self.start_attempt_on(job, vec![gpu], now);
    }

    /// Starts the job's attempt with one slice on each of `gpus` (a gang's members).
    fn start_attempt_on(&mut self, job: usize, gpus: Vec<usize>, now: f64) {
        let config = self.runs[job].config;
        let need = self.need_bytes(job, config);
        let slowdown = match (config, self.workload.jobs[job].model) {
            (Some(config), Some(model)) => {
                slowdown_factor(&self.workload.models[model].own_config, &config)
            }
            _ => 1.0,
        };
        let run = &mut self.runs[job];
        let slice = run.slice_bytes;
        let runs_out_of_memory = need > slice;
        let run_time_left = run.remaining_work_s * slowdown;
        let ends_at = now
            + if runs_out_of_memory {
                self.options.oom_after_fraction * run_time_left
            } else {
                run_time_left
            };
        let used_bytes = need.min(slice);
        let members = gpus.len() as u64;
        run.phase = Phase::Running;
        run.attempts_started += 1;
        run.first_start_s.get_or_insert(now);
        run.attempt_ends_s = ends_at;
        for &gpu in &gpus {
            let gpu_state = &mut self.problem.gpus[gpu];
            gpu_state.allocated_bytes += slice;
            self.most_allocated_on_one_gpu_bytes = self
                .most_allocated_on_one_gpu_bytes
                .max(gpu_state.allocated_bytes);
            self.jobs_on_gpu[gpu] += 1;
            self.running_on_gpu[gpu].insert(job);
        }
        self.runs[job].attempt = Some(Attempt {
            gpus,
            started_s: now,
            slowdown,
            used_bytes,
            runs_out_of_memory,
        });
        let tenant = &mut self.problem.tenants[self.tenant_of_job[job]];
        tenant.vram_in_use_bytes += slice * members;
        tenant.running_jobs += 1;
        // Placed, here or elsewhere: the bytes held for it are free again.
        self.preemption.placed(job);
        self.allocated_bytes += u128::from(slice) * u128::from(members);
        self.used_bytes += u128::from(used_bytes) * u128::from(members);
        self.running_jobs += 1;
        self.push_event(ends_at, EventKind::AttemptEnd, job);
    }

    /// Each tenant's decayed usage at `now` (ended attempts and running ones so far),
    /// for fair share over time.
    fn set_decayed_usage(&mut self, now: f64) {
        let Some(ledger) = self.usage.as_mut() else {
            return;
        };
        let now_ms = seconds_to_ms(now);
        let mut running = Vec::with_capacity(self.running_jobs);
        for jobs in &self.running_on_gpu {
            for &job in jobs {
                if let Some(attempt) = &self.runs[job].attempt {
                    running.push(simulated_usage(
                        &self.workload.jobs[job].tenant,
                        self.runs[job].slice_bytes,
                        attempt.started_s,
                        now,
                    ));
                }
            }
        }
        let totals = ledger.totals_at(now_ms, &running);
        for tenant in &mut self.problem.tenants {
            tenant.decayed_usage_byte_seconds = totals
                .get(&tenant.tenant)
                .map_or(0, |usage| usage.vram_byte_seconds);
        }
    }

    /// Takes the job's attempt off its GPU and its tenant.
    fn release_attempt(&mut self, job: usize) -> Option<Attempt> {
        let attempt = self.runs[job].attempt.take()?;
        let slice = self.runs[job].slice_bytes;
        let members = attempt.gpus.len() as u64;
        if let Some(ledger) = self.usage.as_mut() {
            ledger.add(&simulated_usage(
                &self.workload.jobs[job].tenant,
                slice * members,
                attempt.started_s,
                self.clock_s,
            ));
        }
        for &gpu in &attempt.gpus {
            self.problem.gpus[gpu].allocated_bytes -= slice;
            self.jobs_on_gpu[gpu] -= 1;
            self.running_on_gpu[gpu].remove(&job);
        }
        let tenant = &mut self.problem.tenants[self.tenant_of_job[job]];
        tenant.vram_in_use_bytes -= slice * members;
        tenant.running_jobs -= 1;
        self.allocated_bytes -= u128::from(slice) * u128::from(members);
        self.used_bytes -= u128::from(attempt.used_bytes) * u128::from(members);
        self.running_jobs -= 1;
        Some(attempt)
    }
}

/// Simulated seconds as the usage ledger's milliseconds.
fn seconds_to_ms(seconds: f64) -> i64 {
    (seconds * 1000.0).round() as i64
}

/// A simulated attempt's usage: the simulator's GPUs are of one type.
fn simulated_usage(tenant: &str, slice_bytes: u64, started_s: f64, ended_s: f64) -> AttemptUsage {
    AttemptUsage {
        tenant: tenant.to_string(),
        gpu_type: "simulated".to_string(),
        slice_bytes,
        started_at_ms: seconds_to_ms(started_s),
        ended_at_ms: seconds_to_ms(ended_s),
    }
}
