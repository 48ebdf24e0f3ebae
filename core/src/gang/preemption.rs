//! Preemption with gangs: whom to evict so an urgent job (a gang or a single slice)
//! fits, evicting whole jobs only, so a victim gang's members are all freed or none.
//!
//! # The policy, exactly
//!
//! The single-job rules of [`crate::scheduling::preemption`] hold per *job*: a job is
//! evictable when every one of its attempts is (each has run at least the minimum run
//! time; its job was preempted fewer times in the last hour than the cap) and its
//! priority is strictly lower than the urgent job's, or fair-share reclaim applies (its
//! tenant is over its share, and the urgent job's tenant stays within its own with every
//! member of the urgent job placed).
//!
//! When the urgent job is a single slice and every attempt listed is the only listed
//! attempt of its job (no gang runs on these GPUs), the answer is
//! [`choose_victims`]'s, unchanged. Otherwise, evictable jobs are taken in eviction order
//! (lower priority first, then more bytes over all their members, then shorter run time,
//! then job id), each freeing every one of its slices on every GPU, until the urgent job
//! fits under its placement policy; then, from the last taken back to the first, any job
//! whose slices the urgent job does not need is put back, so without any one victim the
//! job no longer fits. Nothing is evicted for a job that already fits.
//!
//! The caller evicts each victim *job*: every attempt of it, the ones on GPUs not in the
//! view (a draining worker) too, since a gang with a member stopped is stopped.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use super::placement::{Candidate, choose_members};
use super::{GangMember, GangShape};
use crate::scheduling::GpuState;
use crate::scheduling::preemption::{
    EvictionGround, FairShareState, GpuOccupancy, PreemptionSettings, RunningAttempt, ShareBook,
    choose_victims,
};

/// A job's attempts with the index of the GPU each runs on.
type JobAttempts<'a> = [(usize, &'a RunningAttempt)];

/// The job that cannot be placed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UrgentGang {
    pub job_id: String,
    pub tenant: String,
    pub priority: i32,
    pub shape: GangShape,
}

/// One job to evict, with every attempt of it the view lists.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GangVictim {
    pub job_id: String,
    pub tenant: String,
    pub priority: i32,
    pub ground: EvictionGround,
    /// `(attempt id, worker id, gpu id, slice bytes)`, by worker and GPU.
    pub attempts: Vec<(String, String, String, u64)>,
}

/// The jobs to evict and where the urgent job's members go once they have stopped.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GangPreemptionPlan {
    /// In eviction order.
    pub victims: Vec<GangVictim>,
    /// The urgent job's members on the GPUs the victims free (and others' free bytes).
    pub members: Vec<GangMember>,
}

/// The fewest whole jobs whose eviction lets `job` fit, or `None` (see the module
/// documentation).
pub fn choose_gang_victims(
    job: &UrgentGang,
    gpus: &[GpuOccupancy],
    fair_share: &FairShareState,
    settings: PreemptionSettings,
) -> Option<GangPreemptionPlan> {
    let mut sorted: Vec<&GpuOccupancy> = gpus.iter().collect();
    sorted.sort_unstable_by(|left, right| {
        (&left.gpu_id, &left.worker_id, left.free_bytes).cmp(&(
            &right.gpu_id,
            &right.worker_id,
            right.free_bytes,
        ))
    });
    sorted.dedup_by(|later, earlier| {
        later.gpu_id == earlier.gpu_id && later.worker_id == earlier.worker_id
    });
    let mut attempts_of_job: BTreeMap<&str, Vec<(usize, &RunningAttempt)>> = BTreeMap::new();
    for (gpu, occupancy) in sorted.iter().enumerate() {
        for attempt in &occupancy.attempts {
            attempts_of_job
                .entry(attempt.job_id.as_str())
                .or_default()
                .push((gpu, attempt));
        }
    }
    if job.shape.members == 1 && attempts_of_job.values().all(|attempts| attempts.len() == 1) {
        let single = crate::scheduling::preemption::UrgentJob {
            job_id: job.job_id.clone(),
            tenant: job.tenant.clone(),
            priority: job.priority,
            slice_bytes: job.shape.member_slice_bytes,
        };
        let plan = choose_victims(&single, gpus, fair_share, settings)?;
        return Some(GangPreemptionPlan {
            members: vec![GangMember {
                rank: 0,
                node_rank: 0,
                local_rank: 0,
                worker_id: plan.worker_id.clone(),
                gpu_id: plan.gpu_id.clone(),
                slice_bytes: job.shape.member_slice_bytes,
            }],
            victims: plan
                .victims
                .into_iter()
                .map(|victim| GangVictim {
                    attempts: vec![(
                        victim.attempt_id,
                        plan.worker_id.clone(),
                        plan.gpu_id.clone(),
                        victim.slice_bytes,
                    )],
                    job_id: victim.job_id,
                    tenant: victim.tenant,
                    priority: victim.priority,
                    ground: victim.ground,
                })
                .collect(),
        });
    }

    let mut projected: Vec<Candidate<'_>> = sorted
        .iter()
        .enumerate()
        .map(|(index, gpu)| Candidate {
            index,
            node: &gpu.worker_id,
            gpu_id: &gpu.gpu_id,
            free_bytes: gpu.free_bytes,
        })
        .collect();
    if choose_members(&job.shape, &projected).is_some() {
        return None;
    }
    let shares = ShareBook::new(fair_share);
    let needs = u64::try_from(job.shape.total_bytes()).unwrap_or(u64::MAX);
    let reclaim_allowed = shares.within_share_with(&job.tenant, needs);
    let mut evictable: Vec<(&str, &JobAttempts<'_>, EvictionGround)> = attempts_of_job
        .iter()
        .filter(|(_, attempts)| {
            attempts.iter().all(|(_, attempt)| {
                attempt.run_time_seconds >= settings.min_run_time_seconds
                    && attempt.preemptions_in_last_hour < settings.max_preemptions_per_job_per_hour
            })
        })
        .filter_map(|(job_id, attempts)| {
            let first = attempts[0].1;
            let ground = if first.priority < job.priority {
                EvictionGround::HigherPriority
            } else if reclaim_allowed
                && first.tenant != job.tenant
                && shares.over_share(&first.tenant)
            {
                EvictionGround::FairShareReclaim
            } else {
                return None;
            };
            Some((*job_id, attempts.as_slice(), ground))
        })
        .collect();
    evictable
        .sort_unstable_by(|left, right| compare_jobs(left.1, right.1).then(left.0.cmp(right.0)));

    let free =
        |projected: &mut Vec<Candidate<'_>>, attempts: &[(usize, &RunningAttempt)], add: bool| {
            for &(gpu, attempt) in attempts {
                let slot = &mut projected[gpu].free_bytes;
                *slot = if add {
                    slot.saturating_add(attempt.slice_bytes)
                } else {
                    slot.saturating_sub(attempt.slice_bytes)
                };
            }
        };
    let mut taken = Vec::new();
    for victim in &evictable {
        if choose_members(&job.shape, &projected).is_some() {
            break;
        }
        free(&mut projected, victim.1, true);
        taken.push(victim);
    }
    choose_members(&job.shape, &projected)?;
    let mut index = taken.len();
    while index > 0 {
        index -= 1;
        free(&mut projected, taken[index].1, false);
        if choose_members(&job.shape, &projected).is_some() {
            taken.remove(index);
        } else {
            free(&mut projected, taken[index].1, true);
        }
    }
    let chosen = choose_members(&job.shape, &projected)?;
    let states: Vec<GpuState> = sorted
        .iter()
        .map(|gpu| GpuState {
            gpu_id: gpu.gpu_id.clone(),
            worker_id: gpu.worker_id.clone(),
            total_bytes: 0,
            context_bytes: 0,
            allocated_bytes: 0,
            schedulable: true,
        })
        .collect();
    let references: Vec<&GpuState> = states.iter().collect();
    Some(GangPreemptionPlan {
        members: super::placement::members_on(&chosen, &references, job.shape.member_slice_bytes),
        victims: taken
            .into_iter()
            .map(|(job_id, attempts, ground)| GangVictim {
                job_id: job_id.to_string(),
                tenant: attempts[0].1.tenant.clone(),
                priority: attempts[0].1.priority,
                ground: *ground,
                attempts: attempts
                    .iter()
                    .map(|(gpu, attempt)| {
                        (
                            attempt.attempt_id.clone(),
                            sorted[*gpu].worker_id.clone(),
                            sorted[*gpu].gpu_id.clone(),
                            attempt.slice_bytes,
                        )
                    })
                    .collect(),
            })
            .collect(),
    })
}

/// Lower priority first, then more bytes over all members (fewer victims), then shorter
/// run time (less work lost).
fn compare_jobs(left: &[(usize, &RunningAttempt)], right: &[(usize, &RunningAttempt)]) -> Ordering {
    let key = |attempts: &[(usize, &RunningAttempt)]| {
        let priority = attempts.iter().map(|(_, a)| a.priority).min().unwrap_or(0);
        let bytes: u128 = attempts
            .iter()
            .map(|(_, a)| u128::from(a.slice_bytes))
            .sum();
        let run_time = attempts
            .iter()
            .map(|(_, a)| a.run_time_seconds)
            .min()
            .unwrap_or(0);
        (priority, std::cmp::Reverse(bytes), run_time)
    };
    key(left).cmp(&key(right))
}
