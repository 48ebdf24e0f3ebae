//! Gangs: a job of `N` slices on `N` distinct GPUs, placed all at once or not at all
//! (issue 31), with reservations so a waiting gang is not starved by a stream of small
//! jobs, backfill around them, and preemption of whole gangs only. Pure, like the rest of
//! core: the scheduler and the simulator call the same functions, time passed in.
//!
//! # What a caller uses
//!
//! - [`GangShape`]: what a job asks for (`resources.gpus` members of `member_slice_bytes`
//!   each, its `resources.placement`); [`crate::workload::Workload::gang_shape`] reads it
//!   from a validated job with its sized slice. A single-slice job is a gang of one.
//! - [`place_gang`]: one gang alone on the cluster view the single-job pass uses
//!   ([`GpuState`]s): every member with its GPU, rank, node rank and local rank, or why
//!   not ([`GangWaitReason::NeverFits`], [`GangWaitReason::NotEnoughFreeGpus`]). Nothing
//!   is held on failure, so there is no partial gang to undo.
//! - [`can_gang_ever_fit`]: the submit-time refusal (quota below `N x` the member's
//!   bytes, a running-jobs quota of 0, or GPUs that even empty cannot hold the gang under
//!   its policy), the gang form of [`crate::scheduling::can_ever_fit`].
//! - [`solve_gangs`]: one scheduling pass over pending jobs of any size ([`GangProblem`]
//!   -> [`GangDecision`]): fair share, quotas, all-or-nothing placement, reservations
//!   with a start time and bounded backfill. The rules are in [`pass`]'s documentation.
//! - [`choose_gang_victims`]: preemption for an urgent job (gang or not) that evicts whole
//!   jobs only: a victim gang's members are all in the plan or none is.
//!
//! # Invariants (property-tested in `tests/properties.rs`)
//!
//! - A placement has exactly `members` members, on distinct GPUs (by worker and GPU id),
//!   each with at least the member's slice free at the time; a pass never places part of
//!   a gang, and never puts more on a GPU than its free bytes.
//! - Quotas and fair share count every member: a gang of `N` uses `N x slice` of its
//!   tenant's VRAM quota and one of its running-jobs quota (it is one job).
//! - A reserved gang starts by its reservation's start when the running jobs end when
//!   they said they would, and, whatever they do, nothing new is placed on its GPUs after
//!   `queued_at + max_reservation_wait`, so it starts once what ran there then has ended.
//!
//! # Time
//!
//! Times (`now`, a running slice's `expected_end`, a job's `queued_at` and
//! `expected_duration`, the options' `max_reservation_wait`) are plain `u64`s in one unit
//! of the caller's choosing: the scheduler's milliseconds, the simulator's milliseconds
//! of simulated time. Core reads no clock.

mod pass;
mod placement;
mod preemption;

#[cfg(test)]
mod tests;

use std::fmt;

use crate::bytes::HumanBytes;
use crate::scheduling::WaitReason;
use crate::spec::GangPlacementPolicy;

pub use pass::{
    GangDecision, GangOptions, GangProblem, GangReservation, PendingGang, RunningSlice, solve_gangs,
};
pub use placement::{can_gang_ever_fit, place_gang};
pub use preemption::{GangPreemptionPlan, GangVictim, UrgentGang, choose_gang_victims};

/// What a job asks for: `members` slices of `member_slice_bytes`, each on a distinct GPU,
/// placed by `policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GangShape {
    /// 1 for a single-slice job; at most [`crate::spec::MAX_GANG_MEMBERS`] from a spec.
    pub members: u32,
    pub member_slice_bytes: u64,
    pub policy: GangPlacementPolicy,
}

impl GangShape {
    /// A single-slice job of `slice_bytes`.
    pub fn single(slice_bytes: u64) -> GangShape {
        GangShape {
            members: 1,
            member_slice_bytes: slice_bytes,
            policy: GangPlacementPolicy::Pack,
        }
    }

    /// Every member's bytes together: what quotas and fair share count.
    pub fn total_bytes(&self) -> u128 {
        u128::from(self.members) * u128::from(self.member_slice_bytes)
    }
}

/// One member of a placed gang: its ranks and its slice. What the worker launch needs:
/// `RANK` = `rank`, `WORLD_SIZE` = the gang's member count, `NODE_RANK` = `node_rank`,
/// `LOCAL_RANK` = `local_rank`, and `MASTER_ADDR` the worker of rank 0.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GangMember {
    /// 0..members, contiguous per node (a node's members have consecutive ranks).
    pub rank: u32,
    /// The node's place among the gang's nodes, rank 0's node first.
    pub node_rank: u32,
    /// The member's place among its node's members.
    pub local_rank: u32,
    pub worker_id: String,
    pub gpu_id: String,
    pub slice_bytes: u64,
}

/// A gang placed: every member, by rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GangPlacement {
    pub job_id: String,
    pub members: Vec<GangMember>,
}

impl GangPlacement {
    /// Members on each node, in node rank order: `(worker id, its members' ranks)`.
    pub fn nodes(&self) -> Vec<(&str, Vec<u32>)> {
        let mut nodes: Vec<(&str, Vec<u32>)> = Vec::new();
        for member in &self.members {
            match nodes.get_mut(member.node_rank as usize) {
                Some((_, ranks)) => ranks.push(member.rank),
                None => nodes.push((&member.worker_id, vec![member.rank])),
            }
        }
        nodes
    }

    /// Bytes of every member together.
    pub fn total_bytes(&self) -> u128 {
        self.members
            .iter()
            .map(|member| u128::from(member.slice_bytes))
            .sum()
    }
}

/// Why a job (gang or not) is not placed now.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GangWaitReason {
    /// A reason the single-job pass gives too: quotas (counting every member), an unknown
    /// tenant, no schedulable GPU.
    Scheduling(WaitReason),
    /// The schedulable GPUs, even empty, cannot hold the gang under its policy (fewer
    /// than `members` GPUs with the member's bytes usable, or, for `one_node`, no node
    /// with that many). It waits for larger or more workers; at submit it is refused.
    NeverFits {
        members: u32,
        member_slice_bytes: u64,
        policy: GangPlacementPolicy,
        gpus_large_enough: u32,
    },
    /// It would fit an emptier cluster; `gpus_free_enough` GPUs have the member's bytes
    /// free now (and are not reserved for another job).
    NotEnoughFreeGpus {
        members: u32,
        member_slice_bytes: u64,
        policy: GangPlacementPolicy,
        gpus_free_enough: u32,
    },
    /// The job holds a reservation: these GPUs are kept for it, expected free at
    /// `expected_start` (`None`: a job running there has no expected end).
    Reserved { expected_start: Option<u64> },
    /// It would fit now but for GPUs reserved for `job_id`, ahead of it, which it would
    /// delay (it would not end before that job's start, nor fit beside it).
    ReservedForJob { job_id: String },
}

impl GangWaitReason {
    /// A short, stable name for logs and metrics labels.
    pub fn name(&self) -> &'static str {
        match self {
            GangWaitReason::Scheduling(reason) => reason.name(),
            GangWaitReason::NeverFits { .. } => "gang_never_fits",
            GangWaitReason::NotEnoughFreeGpus { .. } => "gang_not_enough_free_gpus",
            GangWaitReason::Reserved { .. } => "gang_reserved",
            GangWaitReason::ReservedForJob { .. } => "reserved_for_older_job",
        }
    }
}

impl fmt::Display for GangWaitReason {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GangWaitReason::Scheduling(reason) => reason.fmt(formatter),
            GangWaitReason::NeverFits {
                members,
                member_slice_bytes,
                policy,
                gpus_large_enough,
            } => write!(
                formatter,
                "{members} GPUs of {} each ({}) never fit: {gpus_large_enough} schedulable GPU(s) \
                 are large enough{}",
                HumanBytes(*member_slice_bytes),
                policy.name(),
                if *policy == GangPlacementPolicy::OneNode {
                    ", and one node must hold them all"
                } else {
                    ""
                }
            ),
            GangWaitReason::NotEnoughFreeGpus {
                members,
                member_slice_bytes,
                policy,
                gpus_free_enough,
            } => write!(
                formatter,
                "needs {members} GPUs with {} free each ({}); {gpus_free_enough} have that now",
                HumanBytes(*member_slice_bytes),
                policy.name()
            ),
            GangWaitReason::Reserved {
                expected_start: Some(start),
            } => write!(formatter, "GPUs reserved for it, expected free at {start}"),
            GangWaitReason::Reserved {
                expected_start: None,
            } => {
                formatter.write_str("GPUs reserved for it; a job running there has no expected end")
            }
            GangWaitReason::ReservedForJob { job_id } => write!(
                formatter,
                "would delay job {job_id}, ahead in the queue, whose GPUs are reserved"
            ),
        }
    }
}
