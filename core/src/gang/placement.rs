//! Choosing a gang's GPUs: all of its members at once, on distinct GPUs, by its placement
//! policy, or none ([`place_gang`]); and whether it could ever fit
//! ([`can_gang_ever_fit`]).
//!
//! The chooser works on *candidates*, the GPUs a member may take now with the bytes each
//! has for it, so the pass (which hides reserved GPUs), the reservation (which looks at
//! the future), preemption (which frees victims' bytes) and the never-fits check (empty
//! GPUs) all place through the one function, [`choose_members`].

use std::collections::BTreeMap;

use super::{GangMember, GangShape, GangWaitReason};
use crate::scheduling::{GpuState, TenantState, WaitReason};
use crate::spec::GangPlacementPolicy;

/// A node's GPUs that hold a member: `(free bytes, gpu id, candidate index)`, best fit
/// first.
type NodeGpus<'a> = Vec<(u64, &'a str, usize)>;

/// A GPU a member could take: its index in the caller's list, its node (the worker) and
/// the bytes a member may use on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Candidate<'a> {
    pub(crate) index: usize,
    pub(crate) node: &'a str,
    pub(crate) gpu_id: &'a str,
    pub(crate) free_bytes: u64,
}

/// The GPUs, by candidate index, that `shape`'s members get, rank 0 first; `None` when
/// the candidates cannot hold every member. Members go to distinct GPUs, each with at
/// least `member_slice_bytes` free:
/// - `one_node`: the node with the fewest GPUs that hold a member among those with at
///   least `members` of them (best fit, so large nodes stay whole for large gangs; ties:
///   the node id that sorts first);
/// - `pack`: one node as `one_node` when one can hold the gang; else the nodes with the
///   most such GPUs, whole, and for the rest the node that holds it with the fewest spare
///   (as few nodes as can hold the gang);
/// - `spread`: one member per node per round, nodes by most such GPUs first, so members
///   are as evenly spread over as many nodes as there are.
///
/// Within a node, members take the GPUs with the fewest free bytes that hold them (best
/// fit; ties: the lower index). Ranks are contiguous per node, the nodes in the order
/// chosen, so rank 0's node holds the most members under `pack`.
pub(crate) fn choose_members(
    shape: &GangShape,
    candidates: &[Candidate<'_>],
) -> Option<Vec<usize>> {
    let members = usize::try_from(shape.members).ok()?;
    if members == 0 {
        return None;
    }
    // Each node's GPUs that hold a member, best fit first.
    let mut nodes: BTreeMap<&str, NodeGpus<'_>> = BTreeMap::new();
    for candidate in candidates {
        if candidate.free_bytes >= shape.member_slice_bytes {
            nodes.entry(candidate.node).or_default().push((
                candidate.free_bytes,
                candidate.gpu_id,
                candidate.index,
            ));
        }
    }
    let total: usize = nodes.values().map(Vec::len).sum();
    if total < members {
        return None;
    }
    for gpus in nodes.values_mut() {
        gpus.sort_unstable();
    }
    let one_node = || {
        nodes
            .iter()
            .filter(|(_, gpus)| gpus.len() >= members)
            .min_by_key(|(node, gpus)| (gpus.len(), **node))
            .map(|(_, gpus)| gpus[..members].iter().map(|gpu| gpu.2).collect::<Vec<_>>())
    };
    match shape.policy {
        GangPlacementPolicy::OneNode => one_node(),
        GangPlacementPolicy::Pack => one_node().or_else(|| {
            let mut remaining: Vec<(&str, &NodeGpus<'_>)> =
                nodes.iter().map(|(node, gpus)| (*node, gpus)).collect();
            remaining.sort_unstable_by_key(|(node, gpus)| (std::cmp::Reverse(gpus.len()), *node));
            let mut chosen = Vec::with_capacity(members);
            let mut position = 0;
            while chosen.len() < members && position < remaining.len() {
                let left = members - chosen.len();
                // The node that holds the rest with the fewest spare GPUs, if one does.
                let closing = remaining[position..]
                    .iter()
                    .filter(|(_, gpus)| gpus.len() >= left)
                    .min_by_key(|(node, gpus)| (gpus.len(), *node));
                if let Some((_, gpus)) = closing {
                    chosen.extend(gpus[..left].iter().map(|gpu| gpu.2));
                    break;
                }
                chosen.extend(remaining[position].1.iter().map(|gpu| gpu.2));
                position += 1;
            }
            (chosen.len() == members).then_some(chosen)
        }),
        GangPlacementPolicy::Spread => {
            let mut order: Vec<(&str, &NodeGpus<'_>)> =
                nodes.iter().map(|(node, gpus)| (*node, gpus)).collect();
            order.sort_unstable_by_key(|(node, gpus)| (std::cmp::Reverse(gpus.len()), *node));
            let mut per_node: Vec<Vec<usize>> = vec![Vec::new(); order.len()];
            let mut taken = 0;
            let mut round = 0;
            while taken < members {
                let mut took_any = false;
                for (slot, (_, gpus)) in order.iter().enumerate() {
                    if taken == members {
                        break;
                    }
                    if let Some(gpu) = gpus.get(round) {
                        per_node[slot].push(gpu.2);
                        taken += 1;
                        took_any = true;
                    }
                }
                if !took_any {
                    return None;
                }
                round += 1;
            }
            Some(per_node.into_iter().flatten().collect())
        }
    }
}

/// Members with their ranks for `chosen` (candidate indices of `gpus`, rank order): node
/// rank by first appearance, local rank within the node.
pub(crate) fn members_on(
    chosen: &[usize],
    gpus: &[&GpuState],
    member_slice_bytes: u64,
) -> Vec<GangMember> {
    let mut node_ranks: Vec<&str> = Vec::new();
    let mut local_counts: Vec<u32> = Vec::new();
    chosen
        .iter()
        .enumerate()
        .map(|(rank, &index)| {
            let gpu = gpus[index];
            let node_rank = match node_ranks.iter().position(|node| *node == gpu.worker_id) {
                Some(position) => position,
                None => {
                    node_ranks.push(&gpu.worker_id);
                    local_counts.push(0);
                    node_ranks.len() - 1
                }
            };
            let local_rank = local_counts[node_rank];
            local_counts[node_rank] += 1;
            GangMember {
                rank: rank as u32,
                node_rank: node_rank as u32,
                local_rank,
                worker_id: gpu.worker_id.clone(),
                gpu_id: gpu.gpu_id.clone(),
                slice_bytes: member_slice_bytes,
            }
        })
        .collect()
}

/// Every member of `shape` on the schedulable `gpus` as they are now (their free bytes),
/// or why not: [`GangWaitReason::NeverFits`] when the gang could not fit even on these
/// GPUs empty, [`GangWaitReason::NotEnoughFreeGpus`] when it could but not now. Nothing
/// is held either way: the caller records all of the members or none. The answer does
/// not depend on the order of `gpus`.
///
/// This is the placement of one gang alone; a pass over many jobs (fair share, quotas,
/// reservations) is [`super::solve_gangs`].
pub fn place_gang(shape: &GangShape, gpus: &[GpuState]) -> Result<Vec<GangMember>, GangWaitReason> {
    let sorted = sorted_schedulable(gpus);
    let now: Vec<Candidate<'_>> = candidates(&sorted, |gpu| gpu.free_bytes());
    if let Some(chosen) = choose_members(shape, &now) {
        return Ok(members_on(&chosen, &sorted, shape.member_slice_bytes));
    }
    Err(misfit(shape, &sorted, &now))
}

/// Why `shape` does not fit `now` (candidates with the bytes a member may use now) on
/// `gpus` (the schedulable ones, sorted).
pub(crate) fn misfit(
    shape: &GangShape,
    gpus: &[&GpuState],
    now: &[Candidate<'_>],
) -> GangWaitReason {
    let empty = candidates(gpus, GpuState::usable_bytes);
    let holding = |list: &[Candidate<'_>]| {
        list.iter()
            .filter(|candidate| candidate.free_bytes >= shape.member_slice_bytes)
            .count() as u32
    };
    if choose_members(shape, &empty).is_none() {
        GangWaitReason::NeverFits {
            members: shape.members,
            member_slice_bytes: shape.member_slice_bytes,
            policy: shape.policy,
            gpus_large_enough: holding(&empty),
        }
    } else {
        GangWaitReason::NotEnoughFreeGpus {
            members: shape.members,
            member_slice_bytes: shape.member_slice_bytes,
            policy: shape.policy,
            gpus_free_enough: holding(now),
        }
    }
}

/// The schedulable GPUs sorted by (gpu id, worker id), so the choice does not depend on
/// the input order; a GPU listed twice (the same ids) is one GPU, its first entry in that
/// order, so two members can never be given the same GPU under two entries.
pub(crate) fn sorted_schedulable(gpus: &[GpuState]) -> Vec<&GpuState> {
    let mut sorted: Vec<&GpuState> = gpus.iter().filter(|gpu| gpu.schedulable).collect();
    sorted.sort_unstable_by(|left, right| {
        // The most allocated entry of a GPU listed twice first: the one kept.
        (
            &left.gpu_id,
            &left.worker_id,
            std::cmp::Reverse(left.allocated_bytes),
            left.total_bytes,
            left.context_bytes,
        )
            .cmp(&(
                &right.gpu_id,
                &right.worker_id,
                std::cmp::Reverse(right.allocated_bytes),
                right.total_bytes,
                right.context_bytes,
            ))
    });
    sorted.dedup_by(|later, earlier| {
        later.gpu_id == earlier.gpu_id && later.worker_id == earlier.worker_id
    });
    sorted
}

pub(crate) fn candidates<'a>(
    gpus: &[&'a GpuState],
    bytes: impl Fn(&GpuState) -> u64,
) -> Vec<Candidate<'a>> {
    gpus.iter()
        .enumerate()
        .map(|(index, gpu)| Candidate {
            index,
            node: &gpu.worker_id,
            gpu_id: &gpu.gpu_id,
            free_bytes: bytes(gpu),
        })
        .collect()
}

/// Whether a gang of `shape` could ever run for `tenant` on a cluster of `gpus` (empty or
/// not, draining or not), for refusing it at submit rather than letting it wait forever:
/// the tenant's VRAM quota must hold every member (`members x member_slice_bytes`), its
/// running-jobs quota must not be 0 (a gang is one job), and the GPUs, empty, must hold
/// the gang under its policy. An empty GPU list is accepted, as
/// [`crate::scheduling::can_ever_fit`] does: the cluster is unknown, not too small.
pub fn can_gang_ever_fit(
    shape: &GangShape,
    gpus: &[GpuState],
    tenant: &TenantState,
) -> Result<(), GangWaitReason> {
    let needs = shape.total_bytes();
    if let Some(quota) = tenant.vram_quota_bytes
        && u128::from(quota) < needs
    {
        return Err(GangWaitReason::Scheduling(WaitReason::TenantVramQuota {
            in_use: 0,
            quota,
            needs: u64::try_from(needs).unwrap_or(u64::MAX),
        }));
    }
    if tenant.running_jobs_quota == Some(0) {
        return Err(GangWaitReason::Scheduling(
            WaitReason::TenantRunningJobsQuota {
                running: 0,
                quota: 0,
            },
        ));
    }
    if gpus.is_empty() {
        return Ok(());
    }
    let mut all: Vec<&GpuState> = gpus.iter().collect();
    all.sort_unstable_by(|left, right| {
        (
            &left.gpu_id,
            &left.worker_id,
            left.total_bytes,
            left.context_bytes,
        )
            .cmp(&(
                &right.gpu_id,
                &right.worker_id,
                right.total_bytes,
                right.context_bytes,
            ))
    });
    all.dedup_by(|later, earlier| {
        later.gpu_id == earlier.gpu_id && later.worker_id == earlier.worker_id
    });
    let empty = candidates(&all, GpuState::usable_bytes);
    if choose_members(shape, &empty).is_some() {
        Ok(())
    } else {
        Err(GangWaitReason::NeverFits {
            members: shape.members,
            member_slice_bytes: shape.member_slice_bytes,
            policy: shape.policy,
            gpus_large_enough: empty
                .iter()
                .filter(|candidate| candidate.free_bytes >= shape.member_slice_bytes)
                .count() as u32,
        })
    }
}
