//! Properties of gang placement and the gang pass on random clusters and queues: never a
//! partial placement, never a double-booked GPU, members of one gang on distinct GPUs,
//! quotas counting every member, no dependence on input order; and a reserved gang
//! starting within its bound under a stream of small jobs.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::super::*;
use super::gpu;
use crate::scheduling::{GpuState, TenantState};
use crate::spec::GangPlacementPolicy;

fn policy_strategy() -> impl Strategy<Value = GangPlacementPolicy> {
    prop_oneof![
        Just(GangPlacementPolicy::Pack),
        Just(GangPlacementPolicy::Spread),
        Just(GangPlacementPolicy::OneNode),
    ]
}

/// 1-4 nodes of 1-4 GPUs of 8-16 GiB, each 0-16 GiB allocated, a few not schedulable,
/// and sometimes a GPU listed twice.
fn cluster_strategy() -> impl Strategy<Value = Vec<GpuState>> {
    prop::collection::vec(
        prop::collection::vec((8u64..=16, 0u64..=16, prop::bool::weighted(0.9)), 1..=4),
        1..=4,
    )
    .prop_flat_map(|nodes| {
        let gpus: Vec<GpuState> = nodes
            .iter()
            .enumerate()
            .flat_map(|(node, gpus)| {
                gpus.iter()
                    .enumerate()
                    .map(move |(index, &(total, allocated, schedulable))| {
                        let mut state =
                            gpu(&format!("n{node}"), &format!("g{index}"), total, allocated);
                        state.schedulable = schedulable;
                        state
                    })
            })
            .collect();
        let count = gpus.len();
        (Just(gpus), prop::option::weighted(0.2, 0..count))
    })
    .prop_map(|(mut gpus, duplicate)| {
        if let Some(index) = duplicate {
            let mut copy = gpus[index].clone();
            copy.allocated_bytes = 0;
            gpus.push(copy);
        }
        gpus
    })
}

fn shape_strategy() -> impl Strategy<Value = GangShape> {
    (1u32..=6, 1u64..=12, policy_strategy()).prop_map(|(members, gib, policy)| GangShape {
        members,
        member_slice_bytes: gib << 30,
        policy,
    })
}

/// Each distinct (worker, GPU) once, with the fewest free bytes any of its entries says.
fn distinct_free(gpus: &[GpuState]) -> BTreeMap<(String, String), u64> {
    let mut free: BTreeMap<(String, String), u64> = BTreeMap::new();
    for gpu in gpus.iter().filter(|gpu| gpu.schedulable) {
        let key = (gpu.worker_id.clone(), gpu.gpu_id.clone());
        let bytes = gpu.free_bytes();
        free.entry(key)
            .and_modify(|current| *current = (*current).min(bytes))
            .or_insert(bytes);
    }
    free
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// All members or none, on distinct GPUs with room, by the policy; and a gang is
    /// refused only when no choice of GPUs could hold it.
    #[test]
    fn a_gang_is_placed_whole_on_distinct_gpus_or_not_at_all(
        gpus in cluster_strategy(),
        shape in shape_strategy(),
    ) {
        let free = distinct_free(&gpus);
        let holding: Vec<&(String, String)> = free
            .iter()
            .filter(|(_, bytes)| **bytes >= shape.member_slice_bytes)
            .map(|(key, _)| key)
            .collect();
        let mut per_node: BTreeMap<&str, u32> = BTreeMap::new();
        for (worker, _) in &holding {
            *per_node.entry(worker.as_str()).or_default() += 1;
        }
        let possible = match shape.policy {
            GangPlacementPolicy::OneNode => per_node.values().any(|count| *count >= shape.members),
            _ => holding.len() >= shape.members as usize,
        };
        match place_gang(&shape, &gpus) {
            Ok(members) => {
                prop_assert!(possible);
                prop_assert_eq!(members.len(), shape.members as usize);
                let distinct: BTreeSet<(&str, &str)> = members
                    .iter()
                    .map(|member| (member.worker_id.as_str(), member.gpu_id.as_str()))
                    .collect();
                prop_assert_eq!(distinct.len(), members.len());
                for member in &members {
                    let key = (member.worker_id.clone(), member.gpu_id.clone());
                    prop_assert!(free[&key] >= shape.member_slice_bytes);
                    prop_assert_eq!(member.slice_bytes, shape.member_slice_bytes);
                }
                let nodes: BTreeSet<&str> =
                    members.iter().map(|member| member.worker_id.as_str()).collect();
                if shape.policy == GangPlacementPolicy::OneNode
                    || (shape.policy == GangPlacementPolicy::Pack
                        && per_node.values().any(|count| *count >= shape.members))
                {
                    prop_assert_eq!(nodes.len(), 1);
                }
                if shape.policy == GangPlacementPolicy::Spread {
                    prop_assert_eq!(
                        nodes.len(),
                        per_node.len().min(shape.members as usize)
                    );
                }
                // Ranks 0..n, contiguous per node.
                for (rank, member) in members.iter().enumerate() {
                    prop_assert_eq!(member.rank as usize, rank);
                }
                for pair in members.windows(2) {
                    prop_assert!(pair[1].node_rank >= pair[0].node_rank);
                }
            }
            Err(_) => prop_assert!(!possible),
        }
    }

    /// A whole pass: every placement whole and on distinct GPUs, no GPU given more than
    /// it had free, no VRAM quota exceeded counting every member, each job placed or
    /// waiting once, and the same decision whatever the input order.
    #[test]
    fn a_pass_never_places_part_of_a_gang_nor_double_books_a_gpu(
        gpus in cluster_strategy(),
        jobs in prop::collection::vec(
            (shape_strategy(), 0usize..3, -1i32..=1, prop::option::of(1u64..100)),
            1..10,
        ),
        quotas in prop::collection::vec(prop::option::of(4u64..40), 3),
        reservations in any::<bool>(),
        running_ends in prop::collection::vec(prop::option::of(0u64..200), 0..6),
    ) {
        let tenants: Vec<TenantState> = quotas
            .iter()
            .enumerate()
            .map(|(index, quota)| TenantState {
                tenant: format!("t{index}"),
                weight: 1 + index as u32,
                vram_quota_bytes: quota.map(|gib| gib << 30),
                running_jobs_quota: None,
                vram_in_use_bytes: 0,
                running_jobs: 0,
                decayed_usage_byte_seconds: 0,
            })
            .collect();
        let running: Vec<RunningSlice> = running_ends
            .iter()
            .zip(gpus.iter().filter(|gpu| gpu.allocated_bytes > 0))
            .enumerate()
            .map(|(index, (end, gpu))| RunningSlice {
                job_id: format!("r{index}"),
                worker_id: gpu.worker_id.clone(),
                gpu_id: gpu.gpu_id.clone(),
                slice_bytes: gpu.allocated_bytes,
                expected_end: *end,
            })
            .collect();
        let pending: Vec<PendingGang> = jobs
            .iter()
            .enumerate()
            .map(|(index, (shape, tenant, priority, duration))| PendingGang {
                job_id: format!("j{index}"),
                tenant: format!("t{tenant}"),
                priority: *priority,
                submit_sequence: index as u64,
                shape: *shape,
                queued_at: index as u64,
                expected_duration: *duration,
            })
            .collect();
        let problem = GangProblem { now: 50, gpus: gpus.clone(), running, tenants: tenants.clone(), pending: pending.clone() };
        let options = GangOptions { reservations, max_reservations: 2, max_reservation_wait: 100, ..GangOptions::default() };
        let decision = solve_gangs(&problem, &options);

        let mut free = distinct_free(&gpus);
        let mut used: BTreeMap<String, u128> = BTreeMap::new();
        for placement in &decision.placements {
            let job = pending.iter().find(|job| job.job_id == placement.job_id).unwrap();
            prop_assert_eq!(placement.members.len(), job.shape.members as usize);
            let distinct: BTreeSet<(&str, &str)> = placement
                .members
                .iter()
                .map(|member| (member.worker_id.as_str(), member.gpu_id.as_str()))
                .collect();
            prop_assert_eq!(distinct.len(), placement.members.len());
            for member in &placement.members {
                let slot = free.get_mut(&(member.worker_id.clone(), member.gpu_id.clone())).unwrap();
                prop_assert!(*slot >= member.slice_bytes, "double-booked {:?}", member);
                *slot -= member.slice_bytes;
            }
            *used.entry(job.tenant.clone()).or_default() += placement.total_bytes();
        }
        for tenant in &tenants {
            if let Some(quota) = tenant.vram_quota_bytes {
                prop_assert!(used.get(&tenant.tenant).copied().unwrap_or(0) <= u128::from(quota));
            }
        }
        let mut seen: Vec<&str> = decision.placements.iter().map(|p| p.job_id.as_str())
            .chain(decision.waiting.iter().map(|(id, _)| id.as_str()))
            .collect();
        seen.sort_unstable();
        let mut expected: Vec<&str> = pending.iter().map(|job| job.job_id.as_str()).collect();
        expected.sort_unstable();
        prop_assert_eq!(seen, expected);
        // Reserved GPUs are disjoint.
        let mut reserved = BTreeSet::new();
        for reservation in &decision.reservations {
            for member in &reservation.members {
                prop_assert!(reserved.insert((member.worker_id.clone(), member.gpu_id.clone())));
            }
        }

        let mut reversed = problem.clone();
        reversed.gpus.reverse();
        reversed.pending.reverse();
        reversed.tenants.reverse();
        reversed.running.reverse();
        prop_assert_eq!(solve_gangs(&reversed, &options), decision);
    }
}

/// A running small job in the stream test: its GPU, bytes and end.
struct Small {
    gpu: usize,
    bytes: u64,
    /// What the job said: its start plus the ticks it asked for.
    expected_end: u64,
    /// When it really ends.
    end: u64,
}

/// Ticks of a stream of small jobs arriving every tick on 2 nodes x 2 GPUs of 16 GiB
/// while a gang of 4 x 10 GiB waits (queued at tick 0). Each small job asks for
/// `expected` ticks and runs `overrun x expected`. Returns the tick the gang started,
/// or `None` within `horizon`.
fn gang_start_under_stream(
    small_jobs: &[(u64, u64)],
    overrun: u64,
    options: &GangOptions,
    horizon: u64,
) -> Option<u64> {
    let mut gpus: Vec<GpuState> = (0..2)
        .flat_map(|node| {
            (0..2).map(move |index| gpu(&format!("n{node}"), &format!("g{index}"), 16, 0))
        })
        .collect();
    let mut running: Vec<(String, Small)> = Vec::new();
    let mut queue: Vec<PendingGang> = vec![PendingGang {
        job_id: "gang".into(),
        tenant: "big".into(),
        priority: 0,
        submit_sequence: 0,
        shape: GangShape {
            members: 4,
            member_slice_bytes: 10 << 30,
            policy: GangPlacementPolicy::Pack,
        },
        queued_at: 0,
        expected_duration: Some(50),
    }];
    // Something runs on every GPU when the gang arrives.
    for (index, (gib, ticks)) in small_jobs.iter().take(4).enumerate() {
        gpus[index].allocated_bytes += gib << 30;
        running.push((
            format!("first{index}"),
            Small {
                gpu: index,
                bytes: gib << 30,
                expected_end: *ticks,
                end: ticks * overrun,
            },
        ));
    }
    for (sequence, now) in (1..).zip(0..horizon) {
        running.retain(|(_, small)| {
            if small.end <= now {
                gpus[small.gpu].allocated_bytes -= small.bytes;
                false
            } else {
                true
            }
        });
        let (gib, ticks) = small_jobs[(now as usize) % small_jobs.len()];
        queue.push(PendingGang {
            job_id: format!("s{sequence}"),
            tenant: format!("small{}", sequence % 3),
            priority: 0,
            submit_sequence: sequence,
            shape: GangShape {
                members: 1,
                member_slice_bytes: gib << 30,
                policy: GangPlacementPolicy::Pack,
            },
            queued_at: now,
            expected_duration: Some(ticks),
        });
        let tenants = ["big", "small0", "small1", "small2"]
            .iter()
            .map(|name| TenantState {
                tenant: name.to_string(),
                weight: 1,
                vram_quota_bytes: None,
                running_jobs_quota: None,
                vram_in_use_bytes: 0,
                running_jobs: 0,
                decayed_usage_byte_seconds: 0,
            })
            .collect();
        let problem = GangProblem {
            now,
            gpus: gpus.clone(),
            running: running
                .iter()
                .map(|(id, small)| RunningSlice {
                    job_id: id.clone(),
                    worker_id: gpus[small.gpu].worker_id.clone(),
                    gpu_id: gpus[small.gpu].gpu_id.clone(),
                    slice_bytes: small.bytes,
                    expected_end: Some(small.expected_end),
                })
                .collect(),
            tenants,
            pending: queue.clone(),
        };
        let decision = solve_gangs(&problem, options);
        for placement in &decision.placements {
            if placement.job_id == "gang" {
                return Some(now);
            }
            let job = queue
                .iter()
                .find(|job| job.job_id == placement.job_id)
                .unwrap();
            let index = gpus
                .iter()
                .position(|gpu| gpu.gpu_id == placement.members[0].gpu_id)
                .unwrap();
            gpus[index].allocated_bytes += job.shape.member_slice_bytes;
            running.push((
                job.job_id.clone(),
                Small {
                    gpu: index,
                    bytes: job.shape.member_slice_bytes,
                    expected_end: now + job.expected_duration.unwrap_or(1),
                    end: now + job.expected_duration.unwrap_or(1) * overrun,
                },
            ));
        }
        let placed: BTreeSet<&str> = decision
            .placements
            .iter()
            .map(|p| p.job_id.as_str())
            .collect();
        queue.retain(|job| !placed.contains(job.job_id.as_str()));
    }
    None
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Under a stream of small jobs (4-8 GiB, 1-12 ticks, one a tick), the gang starts
    /// by its bound: with true run times by the last first job's end (its reservation's
    /// first expected start) and never later than `max_reservation_wait` plus the
    /// longest small job; with run times 3 times what they said, by the bound plus the
    /// longest true run time.
    #[test]
    fn a_reserved_gang_starts_within_its_bound_under_a_stream_of_small_jobs(
        small_jobs in prop::collection::vec((4u64..=8, 1u64..=12), 4..12),
        max_wait in 5u64..40,
    ) {
        let options = GangOptions { max_reservation_wait: max_wait, ..GangOptions::default() };
        let longest = small_jobs.iter().map(|(_, ticks)| *ticks).max().unwrap_or(1);
        let truthful = gang_start_under_stream(&small_jobs, 1, &options, 400);
        let first_ends = small_jobs.iter().take(4).map(|(_, ticks)| *ticks).max().unwrap_or(0);
        prop_assert!(truthful.is_some_and(|start| start <= first_ends.max(1) && start <= max_wait + longest), "{:?}", truthful);
        let overrun = gang_start_under_stream(&small_jobs, 3, &options, 400);
        prop_assert!(overrun.is_some_and(|start| start <= max_wait + 3 * longest), "{:?}", overrun);
    }
}

/// The protection off: the same stream keeps the gang waiting past every bound above
/// (why the reservation test can fail).
#[test]
fn without_reservations_a_stream_of_small_jobs_starves_the_gang() {
    let small_jobs = [(6, 8), (7, 5), (5, 9), (8, 6)];
    let off = GangOptions {
        reservations: false,
        ..GangOptions::default()
    };
    assert_eq!(gang_start_under_stream(&small_jobs, 1, &off, 400), None);
    let on = GangOptions {
        max_reservation_wait: 20,
        ..GangOptions::default()
    };
    assert!(gang_start_under_stream(&small_jobs, 1, &on, 400).is_some());
}
