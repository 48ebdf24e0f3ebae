//! One pure pass of admission and placement: which pending jobs get a slice on which GPU
//! now, and why every other job waits.
//!
//! [`solve`] is a pure function of a [`SchedulingProblem`] (GPUs with their free memory,
//! tenants with their weights, quotas and usage, pending jobs), in the style of quickwit's
//! `solve(problem) -> solution`: the scheduler loop gathers the problem from its store,
//! calls `solve`, and records the decision. It is filter -> score -> plan like the Nomad
//! and Kubernetes schedulers, and every job that is not placed carries a [`WaitReason`],
//! so `carve get JOB` can say why it waits.
//!
//! # The policy, exactly
//!
//! Inputs are sorted first (GPUs by id, tenants by name, jobs by tenant then the order
//! below), so the decision does not depend on the order of the input vectors. A GPU's
//! *usable* bytes are `total - context` (the CUDA context and library handles are not
//! available to slices); its *free* bytes are `usable - allocated`. Only schedulable GPUs
//! (worker ready, not draining) are considered.
//!
//! 1. **Order.** Within a tenant, jobs go by priority (higher first), then age (lower
//!    `submit_sequence` first), then job id. Between tenants, weighted fair share over
//!    time: the next job considered is always the next job of the tenant with the lowest
//!    *effective usage* per weight,
//!    `(decayed_usage_byte_seconds + (vram_in_use_bytes + bytes placed in this pass) * H)
//!    / weight`, where `H` is the usage decay's steady-state seconds (half-life / ln 2,
//!    [`SchedulingOptions::usage_decay`]): what holding those bytes from now on comes to
//!    in decayed usage, so history and holdings are one unit and a tenant that held `b`
//!    bytes steadily weighs like one that holds `b` now. Ties go to the lower
//!    `(vram_in_use_bytes + placed) / weight` (instantaneous fair share), then the tenant
//!    name that sorts first (weight 0 counts as 1). With no history (every decayed usage
//!    0) this is instantaneous fair share exactly. This interleaving is the *global order*.
//! 2. **Filters**, in this order, each giving the reason a job waits:
//!    unknown tenant ([`WaitReason::UnknownTenant`]); no schedulable GPU at all
//!    ([`WaitReason::NoSchedulableGpu`]); larger than the usable bytes of every schedulable
//!    GPU ([`WaitReason::NoGpuLargeEnough`]); over the tenant's VRAM quota or running-jobs
//!    quota, counting what this pass already placed for the tenant and what is *held* for
//!    the tenant's blocked head job (rule 4) ([`WaitReason::TenantVramQuota`],
//!    [`WaitReason::TenantRunningJobsQuota`]).
//! 3. **Best fit.** A job that passes the filters goes to the schedulable, unreserved GPU
//!    with the *smallest* free bytes that still hold its slice (ties: a GPU whose worker
//!    holds the job's image, [`solve_with_cached_images`], then the GPU id that sorts
//!    first), so large holes stay whole for large jobs. The GPU's free bytes and the
//!    tenant's usage are updated before the next job. If no unreserved GPU holds it, the
//!    job waits: [`WaitReason::ReservedForOlderJob`] when a reserved GPU has room for it
//!    (the reserved GPU it would best fit), else [`WaitReason::NoGpuFreeEnough`] with the
//!    largest free bytes of any schedulable GPU.
//! 4. **Reservations (backfill without starvation).** Before anything is placed, each
//!    tenant's *head job* is found: its first job, in the tenant's order, that passes the
//!    filters of rule 2 on the state at the start of the pass. If the head does not fit in
//!    the free bytes of any schedulable GPU at the start of the pass, it is *blocked*:
//!    - its tenant's quotas *hold* its bytes and one running job for it, so the tenant's
//!      own smaller jobs cannot use up the quota it needs;
//!    - blocked heads, taken by priority (higher first), then age, then job id, each
//!      *reserve* the schedulable GPU with the most free bytes among those not yet
//!      reserved whose usable bytes hold the slice (ties: lowest GPU id). So there is at
//!      most one reservation per GPU and one per tenant (per pass). The owner waits with
//!      [`WaitReason::NoGpuFreeEnough`] and appears in
//!      [`SchedulingDecision::reservations`]. A head for which every large-enough GPU is
//!      already reserved waits with [`WaitReason::ReservedForOlderJob`], naming the GPU it
//!      would have taken were nothing reserved and that GPU's owner: it is next in line.
//!
//!    Nothing else is placed on a reserved GPU in the pass, so its free memory only grows
//!    as its jobs finish until the owner fits. Reserving costs capacity (a reserved GPU
//!    idles while it drains), which is why only heads reserve, and only the GPU closest to
//!    holding them. With reservations off
//!    ([`SchedulingOptions::reserve_for_blocked_jobs`]) there are no heads, holds or
//!    reservations, and a stream of small jobs can keep a large one waiting forever.
//!
//! # Why the decision is a fixpoint
//!
//! Applying a decision (adding its placements to the GPUs' allocated bytes and the
//! tenants' usage, removing the placed jobs) and solving again places nothing: GPUs only
//! lose free bytes and tenants only gain usage, so no filter that stopped a job lets it
//! through the second time. The reservations are what needs care, since a reservation that
//! moved would free a GPU that a waiting small job fits. They do not move: a blocked head
//! stays the head (its tenant's placements respected its held quota) and stays blocked,
//! and the heads reserve in a fixed order (priority, age, id), so by induction over that
//! order the GPUs reserved before each head include those reserved before it last time
//! (new heads only take more). A head whose last GPU is still unreserved takes it again:
//! that GPU received nothing, so its free bytes are unchanged, while every other GPU has
//! the same or less free memory than before. This is why the heads are fixed at the start
//! of the pass, before anything is placed.
//!
//! # Cost
//!
//! Free GPUs live in a `BTreeSet` of `(free bytes, GPU index)`, so best fit is one range
//! query; tenants take turns through a binary heap. A pass is `O(J log G + J log T)` after
//! sorting, for `J` jobs, `G` GPUs and `T` tenants (see `benches/placement.rs`).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::fmt;

use crate::bytes::HumanBytes;
use crate::usage::UsageDecay;

mod gpu_pool;
pub mod image_affinity;
pub mod preemption;
mod reservations;
pub(crate) mod tenants;

use gpu_pool::GpuPool;
pub use image_affinity::CachedImages;
use reservations::{HeadRole, reserve_for_blocked_heads};
use tenants::{FairShareTurn, TenantLedger, jobs_in_tenant_order, tenants_by_name};

/// One GPU as its worker last reported it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GpuState {
    pub gpu_id: String,
    pub worker_id: String,
    pub total_bytes: u64,
    /// The CUDA context and library handles, measured by the worker at start-up; not
    /// usable by slices.
    pub context_bytes: u64,
    /// Bytes of the slices in use.
    pub allocated_bytes: u64,
    /// The worker is ready and not draining.
    pub schedulable: bool,
}

impl GpuState {
    /// Bytes slices can use at all: total minus the context (saturating).
    pub fn usable_bytes(&self) -> u64 {
        self.total_bytes.saturating_sub(self.context_bytes)
    }

    /// Bytes a new slice can use now: usable minus allocated (saturating, so an
    /// oversubscribed report reads as full, never as a huge number).
    pub fn free_bytes(&self) -> u64 {
        self.usable_bytes().saturating_sub(self.allocated_bytes)
    }
}

/// One tenant's fair-share weight, quotas and current usage.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TenantState {
    pub tenant: String,
    /// Fair-share weight; 0 is treated as 1.
    pub weight: u32,
    pub vram_quota_bytes: Option<u64>,
    pub running_jobs_quota: Option<u32>,
    /// Slice bytes of the tenant's placed and running jobs.
    pub vram_in_use_bytes: u64,
    /// The tenant's placed and running jobs.
    pub running_jobs: u32,
    /// The tenant's decayed usage in VRAM-byte-seconds (`crate::usage`): its ended
    /// attempts and its running ones up to now. 0 for none (or a policy without history).
    pub decayed_usage_byte_seconds: u128,
}

/// A queued job waiting for a slice.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PendingJob {
    /// Unique among the pending jobs of a problem.
    pub job_id: String,
    pub tenant: String,
    pub priority: i32,
    /// Lower is older.
    pub submit_sequence: u64,
    /// The slice the job's current configuration needs.
    pub slice_bytes: u64,
}

/// Everything one pass decides on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulingProblem {
    pub gpus: Vec<GpuState>,
    /// One entry per tenant name; if a name repeats, the entry that sorts first is used.
    pub tenants: Vec<TenantState>,
    pub pending: Vec<PendingJob>,
}

impl SchedulingProblem {
    /// The problem after `placements` took effect: their bytes are allocated on their
    /// GPUs and counted in their tenants' usage, and the placed jobs are no longer
    /// pending. This is what the next pass sees when nothing else changed. Placements of
    /// jobs that are not pending are ignored.
    pub fn apply_placements(&mut self, placements: &[Placement]) {
        let tenant_of_job: BTreeMap<&str, &str> = self
            .pending
            .iter()
            .map(|job| (job.job_id.as_str(), job.tenant.as_str()))
            .collect();
        let tenant_index: BTreeMap<&str, usize> = self
            .tenants
            .iter()
            .enumerate()
            .map(|(index, tenant)| (tenant.tenant.as_str(), index))
            .collect();
        let gpu_index: BTreeMap<(&str, &str), usize> = self
            .gpus
            .iter()
            .enumerate()
            .map(|(index, gpu)| ((gpu.gpu_id.as_str(), gpu.worker_id.as_str()), index))
            .collect();
        let mut tenant_changes: Vec<(usize, u64)> = Vec::new();
        let mut gpu_changes: Vec<(usize, u64)> = Vec::new();
        for placement in placements {
            let Some(tenant) = tenant_of_job.get(placement.job_id.as_str()) else {
                continue;
            };
            if let Some(&index) = tenant_index.get(tenant) {
                tenant_changes.push((index, placement.slice_bytes));
            }
            let gpu_key = (placement.gpu_id.as_str(), placement.worker_id.as_str());
            if let Some(&index) = gpu_index.get(&gpu_key) {
                gpu_changes.push((index, placement.slice_bytes));
            }
        }
        let placed: BTreeSet<String> = placements
            .iter()
            .filter(|placement| tenant_of_job.contains_key(placement.job_id.as_str()))
            .map(|placement| placement.job_id.clone())
            .collect();
        for (index, bytes) in tenant_changes {
            let tenant = &mut self.tenants[index];
            tenant.vram_in_use_bytes = tenant.vram_in_use_bytes.saturating_add(bytes);
            tenant.running_jobs = tenant.running_jobs.saturating_add(1);
        }
        for (index, bytes) in gpu_changes {
            let gpu = &mut self.gpus[index];
            gpu.allocated_bytes = gpu.allocated_bytes.saturating_add(bytes);
        }
        self.pending.retain(|job| !placed.contains(&job.job_id));
    }
}

/// A job placed in a slice of `slice_bytes` on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Placement {
    pub job_id: String,
    pub gpu_id: String,
    pub worker_id: String,
    pub slice_bytes: u64,
}

/// A GPU kept for a blocked job: nothing else is placed on it until the job fits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reservation {
    pub job_id: String,
    pub gpu_id: String,
    pub worker_id: String,
    /// What the job needs.
    pub slice_bytes: u64,
    /// What the GPU has free now.
    pub free_bytes: u64,
}

/// Why a job is not placed in this pass.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum WaitReason {
    /// The tenant's placed and running jobs (plus the bytes held for its blocked head job)
    /// leave less than the job needs under its VRAM quota.
    TenantVramQuota { in_use: u64, quota: u64, needs: u64 },
    /// The tenant already has as many placed and running jobs (plus its blocked head job)
    /// as its quota allows.
    TenantRunningJobsQuota { running: u32, quota: u32 },
    /// No schedulable GPU has that many usable bytes, even empty.
    NoGpuLargeEnough { needs: u64, largest_gpu: u64 },
    /// Some GPU is large enough, but none has that much free now.
    NoGpuFreeEnough { needs: u64, largest_free: u64 },
    /// The job would fit on `gpu_id`, but that GPU is reserved for `job_id`, which is
    /// ahead in the queue and waiting for the GPU to drain.
    ReservedForOlderJob { job_id: String, gpu_id: String },
    /// Every worker is draining or not ready (or there are none).
    NoSchedulableGpu,
    /// The job's tenant is not among the problem's tenants.
    UnknownTenant,
}

impl WaitReason {
    /// A short, stable name for logs and metrics labels.
    pub fn name(&self) -> &'static str {
        match self {
            WaitReason::TenantVramQuota { .. } => "tenant_vram_quota",
            WaitReason::TenantRunningJobsQuota { .. } => "tenant_running_jobs_quota",
            WaitReason::NoGpuLargeEnough { .. } => "no_gpu_large_enough",
            WaitReason::NoGpuFreeEnough { .. } => "no_gpu_free_enough",
            WaitReason::ReservedForOlderJob { .. } => "reserved_for_older_job",
            WaitReason::NoSchedulableGpu => "no_schedulable_gpu",
            WaitReason::UnknownTenant => "unknown_tenant",
        }
    }
}

impl fmt::Display for WaitReason {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitReason::TenantVramQuota {
                in_use,
                quota,
                needs,
            } => write!(
                formatter,
                "tenant quota: {} of {} vram in use, needs {}",
                HumanBytes(*in_use),
                HumanBytes(*quota),
                HumanBytes(*needs)
            ),
            WaitReason::TenantRunningJobsQuota { running, quota } => write!(
                formatter,
                "tenant quota: {running} of {quota} running jobs in use"
            ),
            WaitReason::NoGpuLargeEnough { needs, largest_gpu } => write!(
                formatter,
                "no gpu is large enough for {} (the largest holds {} after its cuda context)",
                HumanBytes(*needs),
                HumanBytes(*largest_gpu)
            ),
            WaitReason::NoGpuFreeEnough {
                needs,
                largest_free,
            } => write!(
                formatter,
                "no gpu has {} free (largest free {})",
                HumanBytes(*needs),
                HumanBytes(*largest_free)
            ),
            WaitReason::ReservedForOlderJob { job_id, gpu_id } => write!(
                formatter,
                "waiting for gpu {gpu_id}, reserved for job {job_id} which is ahead in the queue"
            ),
            WaitReason::NoSchedulableGpu => {
                formatter.write_str("no schedulable gpu: every worker is draining or not ready")
            }
            WaitReason::UnknownTenant => formatter.write_str("the job's tenant is unknown"),
        }
    }
}

/// What one pass decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulingDecision {
    /// In the order they were decided (the global order).
    pub placements: Vec<Placement>,
    /// Every pending job that was not placed, with its reason: jobs of unknown tenants
    /// first, then the others in the global order.
    pub waiting: Vec<(String, WaitReason)>,
    /// GPUs kept for blocked jobs (at most one per GPU and one per tenant), by the
    /// owners' priority, then age, then job id.
    pub reservations: Vec<Reservation>,
}

/// Switches of the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulingOptions {
    /// Reserve GPUs for blocked head jobs (rule 4 of the module docs). On by default;
    /// off, a large job can be starved by a stream of small ones.
    pub reserve_for_blocked_jobs: bool,
    /// The decay whose steady-state seconds weigh what a tenant holds now against its
    /// decayed usage (rule 1). Slurm's 7-day half-life by default.
    pub usage_decay: UsageDecay,
}

impl Default for SchedulingOptions {
    fn default() -> Self {
        SchedulingOptions {
            reserve_for_blocked_jobs: true,
            usage_decay: UsageDecay::default(),
        }
    }
}

/// One pass of admission and placement with the default options. See the module docs
/// for the policy.
pub fn solve(problem: &SchedulingProblem) -> SchedulingDecision {
    solve_with_options(problem, &SchedulingOptions::default())
}

/// One pass of admission and placement. See the module docs for the policy.
pub fn solve_with_options(
    problem: &SchedulingProblem,
    options: &SchedulingOptions,
) -> SchedulingDecision {
    solve_with_cached_images(problem, options, &CachedImages::default())
}

/// [`solve_with_options`], best fit's ties broken toward the workers that hold each
/// job's image (`image_affinity.rs`); with nothing cached it decides the same.
pub fn solve_with_cached_images(
    problem: &SchedulingProblem,
    options: &SchedulingOptions,
    images: &CachedImages,
) -> SchedulingDecision {
    let jobs = jobs_in_tenant_order(&problem.pending);
    let tenants = tenants_by_name(&problem.tenants);
    let mut decision = SchedulingDecision::default();

    // Jobs are sorted by tenant first, so each tenant's jobs are one contiguous run.
    let mut ledgers: Vec<TenantLedger<'_>> = Vec::new();
    let mut run_start = 0;
    while run_start < jobs.len() {
        let tenant_name = jobs[run_start].tenant.as_str();
        let run_end = run_start
            + jobs[run_start..]
                .iter()
                .take_while(|job| job.tenant == tenant_name)
                .count();
        match tenants.binary_search_by(|tenant| tenant.tenant.as_str().cmp(tenant_name)) {
            Ok(position) => ledgers.push(TenantLedger::new(tenants[position], run_start..run_end)),
            Err(_) => decision.waiting.extend(
                jobs[run_start..run_end]
                    .iter()
                    .map(|job| (job.job_id.clone(), WaitReason::UnknownTenant)),
            ),
        }
        run_start = run_end;
    }

    let mut pool = GpuPool::new(&problem.gpus);
    let Some(largest_usable_bytes) = pool.largest_usable_bytes else {
        for ledger in &ledgers {
            decision.waiting.extend(
                jobs[ledger.jobs.clone()]
                    .iter()
                    .map(|job| (job.job_id.clone(), WaitReason::NoSchedulableGpu)),
            );
        }
        return decision;
    };

    if options.reserve_for_blocked_jobs {
        let owners =
            reserve_for_blocked_heads(&jobs, &mut ledgers, &mut pool, largest_usable_bytes);
        for (job_index, gpu_index) in owners {
            let gpu = pool.gpus[gpu_index];
            decision.reservations.push(Reservation {
                job_id: jobs[job_index].job_id.clone(),
                gpu_id: gpu.gpu_id.clone(),
                worker_id: gpu.worker_id.clone(),
                slice_bytes: jobs[job_index].slice_bytes,
                free_bytes: pool.free_bytes[gpu_index],
            });
        }
    }

    let holding_seconds = options.usage_decay.steady_state_byte_seconds(1).max(1);
    let mut turns: BinaryHeap<Reverse<FairShareTurn>> = ledgers
        .iter()
        .enumerate()
        .filter(|(_, ledger)| !ledger.jobs.is_empty())
        .map(|(ledger_index, ledger)| Reverse(ledger.turn(ledger_index, holding_seconds)))
        .collect();
    while let Some(Reverse(turn)) = turns.pop() {
        let ledger = &mut ledgers[turn.ledger_index];
        let job_index = ledger.next_job;
        ledger.next_job += 1;
        let job = jobs[job_index];
        let needs = job.slice_bytes;

        let outcome = if needs > largest_usable_bytes {
            Err(WaitReason::NoGpuLargeEnough {
                needs,
                largest_gpu: largest_usable_bytes,
            })
        } else if let Some(reason) = ledger.quota_reason(job_index, needs) {
            Err(reason)
        } else if let Some(head) = ledger
            .blocked_head
            .filter(|head| head.job_index == job_index)
        {
            // A blocked head did not fit anywhere at the start and GPUs only fill up.
            Err(match head.role {
                HeadRole::Owner => WaitReason::NoGpuFreeEnough {
                    needs,
                    largest_free: pool.largest_free_bytes(),
                },
                HeadRole::BehindOwner {
                    owner_job_index,
                    gpu_index,
                } => WaitReason::ReservedForOlderJob {
                    job_id: jobs[owner_job_index].job_id.clone(),
                    gpu_id: pool.gpus[gpu_index].gpu_id.clone(),
                },
            })
        } else if let Some(gpu_index) =
            pool.best_fit_unreserved_for_image(needs, images.job_image(&job.job_id), images)
        {
            Ok(gpu_index)
        } else if let Some((gpu_index, owner_job_index)) = pool.best_fit_reserved(needs) {
            Err(WaitReason::ReservedForOlderJob {
                job_id: jobs[owner_job_index].job_id.clone(),
                gpu_id: pool.gpus[gpu_index].gpu_id.clone(),
            })
        } else {
            Err(WaitReason::NoGpuFreeEnough {
                needs,
                largest_free: pool.largest_free_bytes(),
            })
        };

        match outcome {
            Ok(gpu_index) => {
                pool.allocate(gpu_index, needs);
                ledger.vram_in_use_bytes += u128::from(needs);
                ledger.running_jobs += 1;
                let gpu = pool.gpus[gpu_index];
                decision.placements.push(Placement {
                    job_id: job.job_id.clone(),
                    gpu_id: gpu.gpu_id.clone(),
                    worker_id: gpu.worker_id.clone(),
                    slice_bytes: needs,
                });
            }
            Err(reason) => decision.waiting.push((job.job_id.clone(), reason)),
        }
        if ledger.next_job < ledger.jobs.end {
            turns.push(Reverse(ledger.turn(turn.ledger_index, holding_seconds)));
        }
    }
    decision
}

/// Whether a job of `slice_bytes` could ever run for `tenant` on a cluster of `gpus`
/// (empty or not, draining or not), for rejecting it at submit rather than letting it wait
/// forever: a VRAM quota smaller than the job gives `TenantVramQuota` with `in_use` 0, a
/// running-jobs quota of 0 gives `TenantRunningJobsQuota`, and a job larger than every
/// GPU's usable bytes gives `NoGpuLargeEnough`. An empty GPU list is accepted: the
/// cluster is unknown (no worker registered yet), not too small.
pub fn can_ever_fit(
    slice_bytes: u64,
    gpus: &[GpuState],
    tenant: &TenantState,
) -> Result<(), WaitReason> {
    if let Some(quota) = tenant.vram_quota_bytes
        && slice_bytes > quota
    {
        return Err(WaitReason::TenantVramQuota {
            in_use: 0,
            quota,
            needs: slice_bytes,
        });
    }
    if tenant.running_jobs_quota == Some(0) {
        return Err(WaitReason::TenantRunningJobsQuota {
            running: 0,
            quota: 0,
        });
    }
    if let Some(largest_gpu) = gpus.iter().map(GpuState::usable_bytes).max()
        && slice_bytes > largest_gpu
    {
        return Err(WaitReason::NoGpuLargeEnough {
            needs: slice_bytes,
            largest_gpu,
        });
    }
    Ok(())
}
