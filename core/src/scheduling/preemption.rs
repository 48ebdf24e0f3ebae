//! Choosing whom to evict so an urgent job fits: a pure function of the job, the GPUs
//! with their running attempts, the tenants' fair-share state and the anti-thrashing
//! settings.
//!
//! # The policy, exactly
//!
//! An attempt is *evictable* for the urgent job when all of these hold:
//! - it has run at least [`PreemptionSettings::min_run_time_seconds`];
//! - its job was preempted fewer than [`PreemptionSettings::max_preemptions_per_job_per_hour`]
//!   times in the last hour;
//! - its priority is strictly lower than the urgent job's ([`EvictionGround::HigherPriority`]),
//!   or *fair-share reclaim* applies ([`EvictionGround::FairShareReclaim`]): the attempt
//!   belongs to another tenant that is over its fair share, and the urgent job's tenant
//!   stays within its own fair share with the job placed.
//!
//! A tenant's fair share is the usable bytes of the cluster split by weight among the
//! tenants of [`FairShareState::tenants`] (weight 0 counts as 1): tenant `t` is over its
//! share when `in_use(t) * sum(weights) > usable * weight(t)`.
//!
//! On each GPU, the evictable attempts are taken in *eviction order* (lower priority
//! first, then larger slice, then shorter run time, then attempt id) until the GPU's free
//! bytes plus their slices hold the urgent job; then, from the last taken back to the
//! first, any victim whose slice is not needed is put back. So the victims are *minimal*:
//! without any one of them the job no longer fits. Among the GPUs with a plan, the one
//! chosen has the lowest highest-victim priority, then the fewest victims, then the fewest
//! freed bytes, then the lowest GPU id. GPUs and attempts are sorted first, so the answer
//! does not depend on the order of the input vectors. A GPU on which the job already fits
//! needs no preemption and gives no plan; neither does one too small for it at all.
//!
//! What happens around the choice (the claims, the victims being evicted, when an
//! attempt's end counts as preempted, the cap's history) is the [`book`]'s, which the
//! scheduler and the simulator both keep.

use std::cmp::Ordering;

pub mod book;

/// The job that cannot be placed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UrgentJob {
    pub job_id: String,
    pub tenant: String,
    pub priority: i32,
    pub slice_bytes: u64,
}

/// One attempt running on a GPU, as the scheduler knows it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RunningAttempt {
    pub attempt_id: String,
    pub job_id: String,
    pub tenant: String,
    pub priority: i32,
    pub slice_bytes: u64,
    /// How long the attempt has run so far.
    pub run_time_seconds: u64,
    /// How many times its job was preempted in the last hour.
    pub preemptions_in_last_hour: u32,
}

/// One schedulable GPU and what runs on it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GpuOccupancy {
    pub gpu_id: String,
    pub worker_id: String,
    /// Bytes a new slice can use now (usable minus allocated).
    pub free_bytes: u64,
    pub attempts: Vec<RunningAttempt>,
}

/// One tenant's weight and usage, for fair-share reclaim.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TenantShare {
    pub tenant: String,
    /// Fair-share weight; 0 counts as 1.
    pub weight: u32,
    pub vram_in_use_bytes: u64,
}

/// The tenants sharing the cluster and the bytes they share.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct FairShareState {
    /// Usable bytes of all schedulable GPUs.
    pub usable_bytes: u64,
    pub tenants: Vec<TenantShare>,
}

/// The scheduler's defaults, which `carve sim --preemption` uses too.
pub const DEFAULT_MIN_RUN_TIME_SECONDS: u64 = 5 * 60;
pub const DEFAULT_MAX_PREEMPTIONS_PER_JOB_PER_HOUR: u32 = 2;
pub const DEFAULT_GRACE_PERIOD_SECONDS: u64 = 30;

/// Limits against thrashing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PreemptionSettings {
    /// An attempt younger than this is never evicted.
    pub min_run_time_seconds: u64,
    /// A job preempted this many times in the last hour is not evicted again.
    pub max_preemptions_per_job_per_hour: u32,
}

/// Why an attempt may be evicted for the urgent job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EvictionGround {
    /// The urgent job has a strictly higher priority.
    HigherPriority,
    /// The urgent job's tenant is under its fair share and the attempt's tenant over it.
    FairShareReclaim,
}

/// One attempt to evict.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Victim {
    pub attempt_id: String,
    pub job_id: String,
    pub tenant: String,
    pub priority: i32,
    pub slice_bytes: u64,
    pub ground: EvictionGround,
}

/// The attempts to evict, all on one GPU, and what that frees.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PreemptionPlan {
    pub gpu_id: String,
    pub worker_id: String,
    /// In eviction order.
    pub victims: Vec<Victim>,
    /// The GPU's free bytes once the victims have stopped.
    pub free_bytes_after: u64,
}

/// The smallest set of attempts on one GPU whose eviction frees enough for `job`, or
/// `None` when no GPU can make room under the policy (see the module documentation).
pub fn choose_victims(
    job: &UrgentJob,
    gpus: &[GpuOccupancy],
    fair_share: &FairShareState,
    settings: PreemptionSettings,
) -> Option<PreemptionPlan> {
    let shares = ShareBook::new(fair_share);
    let reclaim_allowed = shares.within_share_with(&job.tenant, job.slice_bytes);
    let mut sorted_gpus: Vec<&GpuOccupancy> = gpus.iter().collect();
    sorted_gpus.sort_unstable_by(|left, right| compare_gpus(left, right));
    let mut best: Option<PreemptionPlan> = None;
    for gpu in sorted_gpus {
        let Some(plan) = plan_on_gpu(job, gpu, &shares, reclaim_allowed, settings) else {
            continue;
        };
        if best
            .as_ref()
            .is_none_or(|current| compare_plans(&plan, current) == Ordering::Less)
        {
            best = Some(plan);
        }
    }
    best
}

fn plan_on_gpu(
    job: &UrgentJob,
    gpu: &GpuOccupancy,
    shares: &ShareBook,
    reclaim_allowed: bool,
    settings: PreemptionSettings,
) -> Option<PreemptionPlan> {
    if gpu.free_bytes >= job.slice_bytes {
        return None;
    }
    let mut evictable: Vec<(&RunningAttempt, EvictionGround)> = gpu
        .attempts
        .iter()
        .filter(|attempt| {
            attempt.run_time_seconds >= settings.min_run_time_seconds
                && attempt.preemptions_in_last_hour < settings.max_preemptions_per_job_per_hour
        })
        .filter_map(|attempt| {
            if attempt.priority < job.priority {
                Some((attempt, EvictionGround::HigherPriority))
            } else if reclaim_allowed
                && attempt.tenant != job.tenant
                && shares.over_share(&attempt.tenant)
            {
                Some((attempt, EvictionGround::FairShareReclaim))
            } else {
                None
            }
        })
        .collect();
    evictable.sort_unstable_by(|(left, _), (right, _)| compare_eviction_order(left, right));

    let mut free = u128::from(gpu.free_bytes);
    let needed = u128::from(job.slice_bytes);
    let mut taken = Vec::new();
    for (attempt, ground) in evictable {
        if free >= needed {
            break;
        }
        free += u128::from(attempt.slice_bytes);
        taken.push((attempt, ground));
    }
    if free < needed {
        return None;
    }
    // Put back, from the last taken to the first, every victim the job does not need.
    let mut index = taken.len();
    while index > 0 {
        index -= 1;
        let slice = u128::from(taken[index].0.slice_bytes);
        if free - slice >= needed {
            free -= slice;
            taken.remove(index);
        }
    }
    Some(PreemptionPlan {
        gpu_id: gpu.gpu_id.clone(),
        worker_id: gpu.worker_id.clone(),
        victims: taken
            .into_iter()
            .map(|(attempt, ground)| Victim {
                attempt_id: attempt.attempt_id.clone(),
                job_id: attempt.job_id.clone(),
                tenant: attempt.tenant.clone(),
                priority: attempt.priority,
                slice_bytes: attempt.slice_bytes,
                ground,
            })
            .collect(),
        free_bytes_after: u64::try_from(free).unwrap_or(u64::MAX),
    })
}

/// Lower priority first, then larger slice (fewer victims), then shorter run time (less
/// work lost), then the remaining fields so the order is total.
fn compare_eviction_order(left: &RunningAttempt, right: &RunningAttempt) -> Ordering {
    left.priority
        .cmp(&right.priority)
        .then_with(|| right.slice_bytes.cmp(&left.slice_bytes))
        .then_with(|| left.run_time_seconds.cmp(&right.run_time_seconds))
        .then_with(|| left.attempt_id.cmp(&right.attempt_id))
        .then_with(|| left.job_id.cmp(&right.job_id))
        .then_with(|| left.tenant.cmp(&right.tenant))
        .then_with(|| {
            left.preemptions_in_last_hour
                .cmp(&right.preemptions_in_last_hour)
        })
}

fn compare_gpus(left: &GpuOccupancy, right: &GpuOccupancy) -> Ordering {
    left.gpu_id
        .cmp(&right.gpu_id)
        .then_with(|| left.worker_id.cmp(&right.worker_id))
        .then_with(|| left.free_bytes.cmp(&right.free_bytes))
}

fn compare_plans(left: &PreemptionPlan, right: &PreemptionPlan) -> Ordering {
    let highest = |plan: &PreemptionPlan| plan.victims.iter().map(|victim| victim.priority).max();
    let freed = |plan: &PreemptionPlan| {
        plan.victims
            .iter()
            .map(|victim| u128::from(victim.slice_bytes))
            .sum::<u128>()
    };
    highest(left)
        .cmp(&highest(right))
        .then_with(|| left.victims.len().cmp(&right.victims.len()))
        .then_with(|| freed(left).cmp(&freed(right)))
        .then_with(|| left.gpu_id.cmp(&right.gpu_id))
        .then_with(|| left.worker_id.cmp(&right.worker_id))
        .then_with(|| {
            let ids = |plan: &PreemptionPlan| {
                plan.victims
                    .iter()
                    .map(|victim| victim.attempt_id.clone())
                    .collect::<Vec<_>>()
            };
            ids(left).cmp(&ids(right))
        })
}

/// The fair-share arithmetic, in u128 so sums and products of u64 cannot overflow (the
/// gang form of preemption, `crate::gang::choose_gang_victims`, shares it).
pub(crate) struct ShareBook<'a> {
    state: &'a FairShareState,
    total_weight: u128,
}

impl<'a> ShareBook<'a> {
    pub(crate) fn new(state: &'a FairShareState) -> Self {
        let mut names: Vec<&TenantShare> = state.tenants.iter().collect();
        names.sort_unstable_by(|left, right| left.tenant.cmp(&right.tenant));
        names.dedup_by(|later, earlier| later.tenant == earlier.tenant);
        let total_weight = names
            .iter()
            .map(|tenant| u128::from(tenant.weight.max(1)))
            .sum();
        ShareBook {
            state,
            total_weight,
        }
    }

    /// The tenant's weight and usage; duplicates resolve to the largest usage, so the
    /// answer does not depend on input order.
    fn lookup(&self, tenant: &str) -> Option<(u128, u128)> {
        self.state
            .tenants
            .iter()
            .filter(|share| share.tenant == tenant)
            .map(|share| {
                (
                    u128::from(share.weight.max(1)),
                    u128::from(share.vram_in_use_bytes),
                )
            })
            .max()
    }

    pub(crate) fn over_share(&self, tenant: &str) -> bool {
        let Some((weight, in_use)) = self.lookup(tenant) else {
            return false;
        };
        in_use * self.total_weight > u128::from(self.state.usable_bytes) * weight
    }

    pub(crate) fn within_share_with(&self, tenant: &str, extra_bytes: u64) -> bool {
        let Some((weight, in_use)) = self.lookup(tenant) else {
            return false;
        };
        (in_use + u128::from(extra_bytes)) * self.total_weight
            <= u128::from(self.state.usable_bytes) * weight
    }
}
