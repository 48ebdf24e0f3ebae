//! Gang placement, the pass's reservations and backfill, and whole-gang preemption, by
//! example; random cases in `tests/properties.rs`.

mod properties;

use super::*;
use crate::scheduling::preemption::{
    EvictionGround, FairShareState, GpuOccupancy, PreemptionSettings, RunningAttempt,
};
use crate::scheduling::{GpuState, TenantState, WaitReason};
use crate::spec::GangPlacementPolicy;

const GIB: u64 = 1 << 30;

pub(super) fn gpu(worker: &str, gpu: &str, total_gib: u64, allocated_gib: u64) -> GpuState {
    GpuState {
        gpu_id: format!("{worker}-{gpu}"),
        worker_id: worker.to_string(),
        total_bytes: total_gib * GIB,
        context_bytes: 0,
        allocated_bytes: allocated_gib * GIB,
        schedulable: true,
    }
}

/// `nodes` workers of `per_node` empty 80 GiB GPUs.
fn cluster(nodes: usize, per_node: usize) -> Vec<GpuState> {
    (0..nodes)
        .flat_map(|node| {
            (0..per_node).map(move |index| gpu(&format!("n{node}"), &format!("g{index}"), 80, 0))
        })
        .collect()
}

fn shape(members: u32, gib: u64, policy: GangPlacementPolicy) -> GangShape {
    GangShape {
        members,
        member_slice_bytes: gib * GIB,
        policy,
    }
}

fn tenant(name: &str) -> TenantState {
    TenantState {
        tenant: name.to_string(),
        weight: 1,
        vram_quota_bytes: None,
        running_jobs_quota: None,
        vram_in_use_bytes: 0,
        running_jobs: 0,
        decayed_usage_byte_seconds: 0,
    }
}

fn nodes_of(members: &[GangMember]) -> Vec<(String, u32)> {
    let mut nodes: Vec<(String, u32)> = Vec::new();
    for member in members {
        match nodes.iter_mut().find(|(node, _)| *node == member.worker_id) {
            Some((_, count)) => *count += 1,
            None => nodes.push((member.worker_id.clone(), 1)),
        }
    }
    nodes
}

#[test]
fn pack_fills_one_node_when_one_holds_the_gang_and_the_fewest_nodes_otherwise() {
    let gpus = cluster(3, 4);
    let four = place_gang(&shape(4, 20, GangPlacementPolicy::Pack), &gpus).unwrap();
    assert_eq!(nodes_of(&four), vec![("n0".to_string(), 4)]);
    let six = place_gang(&shape(6, 20, GangPlacementPolicy::Pack), &gpus).unwrap();
    assert_eq!(nodes_of(&six).len(), 2);
    // Ranks are contiguous per node, node ranks in order, local ranks from 0.
    for (rank, member) in six.iter().enumerate() {
        assert_eq!(member.rank as usize, rank);
    }
    assert_eq!(
        six.iter()
            .map(|member| (member.node_rank, member.local_rank))
            .collect::<Vec<_>>(),
        vec![(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    );
    // With n1 fuller, pack picks the node with the fewest GPUs that still holds it.
    let mut uneven = cluster(2, 4);
    uneven[4].allocated_bytes = 70 * GIB; // n1-g0 full for a 20 GiB member
    let three = place_gang(&shape(3, 20, GangPlacementPolicy::Pack), &uneven).unwrap();
    assert_eq!(nodes_of(&three), vec![("n1".to_string(), 3)]);
}

#[test]
fn spread_puts_members_on_as_many_nodes_as_there_are_and_one_node_on_one_or_none() {
    let gpus = cluster(3, 4);
    let spread = place_gang(&shape(6, 20, GangPlacementPolicy::Spread), &gpus).unwrap();
    let mut counts: Vec<u32> = nodes_of(&spread)
        .into_iter()
        .map(|(_, count)| count)
        .collect();
    counts.sort();
    assert_eq!(counts, vec![2, 2, 2]);
    let one = place_gang(&shape(4, 20, GangPlacementPolicy::OneNode), &gpus).unwrap();
    assert_eq!(nodes_of(&one).len(), 1);
    // Five on one node of four: never, however empty.
    let error = place_gang(&shape(5, 20, GangPlacementPolicy::OneNode), &gpus).unwrap_err();
    assert_eq!(error.name(), "gang_never_fits");
    assert!(
        error.to_string().contains("one node must hold them all"),
        "{error}"
    );
    // Spread over the same GPUs does fit.
    assert!(place_gang(&shape(5, 20, GangPlacementPolicy::Spread), &gpus).is_ok());
}

#[test]
fn a_gang_that_does_not_fit_now_gets_nothing_and_says_how_many_gpus_have_room() {
    let mut gpus = cluster(2, 2);
    gpus[0].allocated_bytes = 70 * GIB;
    gpus[3].allocated_bytes = 70 * GIB;
    let error = place_gang(&shape(4, 20, GangPlacementPolicy::Pack), &gpus).unwrap_err();
    assert_eq!(
        error,
        GangWaitReason::NotEnoughFreeGpus {
            members: 4,
            member_slice_bytes: 20 * GIB,
            policy: GangPlacementPolicy::Pack,
            gpus_free_enough: 2,
        }
    );
    // Unschedulable GPUs do not count; a GPU listed twice is one GPU.
    let mut listed_twice = cluster(1, 2);
    listed_twice.push(listed_twice[0].clone());
    assert_eq!(
        place_gang(&shape(3, 20, GangPlacementPolicy::Pack), &listed_twice)
            .unwrap_err()
            .name(),
        "gang_never_fits"
    );
    let mut draining = cluster(1, 3);
    draining[2].schedulable = false;
    assert!(place_gang(&shape(3, 20, GangPlacementPolicy::Pack), &draining).is_err());
}

#[test]
fn quotas_count_every_member_at_submit() {
    let gpus = cluster(2, 4);
    let mut limited = tenant("t");
    limited.vram_quota_bytes = Some(70 * GIB);
    let error =
        can_gang_ever_fit(&shape(4, 20, GangPlacementPolicy::Pack), &gpus, &limited).unwrap_err();
    assert_eq!(
        error,
        GangWaitReason::Scheduling(WaitReason::TenantVramQuota {
            in_use: 0,
            quota: 70 * GIB,
            needs: 80 * GIB
        })
    );
    assert!(can_gang_ever_fit(&shape(3, 20, GangPlacementPolicy::Pack), &gpus, &limited).is_ok());
    assert!(
        can_gang_ever_fit(
            &shape(9, 20, GangPlacementPolicy::Spread),
            &gpus,
            &tenant("t")
        )
        .is_err()
    );
    assert!(
        can_gang_ever_fit(
            &shape(9, 20, GangPlacementPolicy::Spread),
            &[],
            &tenant("t")
        )
        .is_ok()
    );
}

fn pending(
    job_id: &str,
    members: u32,
    gib: u64,
    queued_at: u64,
    duration: Option<u64>,
) -> PendingGang {
    PendingGang {
        job_id: job_id.to_string(),
        tenant: "t".to_string(),
        priority: 0,
        submit_sequence: queued_at,
        shape: shape(members, gib, GangPlacementPolicy::Pack),
        queued_at,
        expected_duration: duration,
    }
}

fn running(job_id: &str, gpu: &GpuState, gib: u64, end: Option<u64>) -> RunningSlice {
    RunningSlice {
        job_id: job_id.to_string(),
        worker_id: gpu.worker_id.clone(),
        gpu_id: gpu.gpu_id.clone(),
        slice_bytes: gib * GIB,
        expected_end: end,
    }
}

/// One node of two 80 GiB GPUs, each half full until t=100 (g0) and t=200 (g1); a gang
/// of two 60 GiB members waits for both.
fn blocked_gang_problem(now: u64) -> GangProblem {
    let gpus = vec![gpu("n0", "g0", 80, 40), gpu("n0", "g1", 80, 40)];
    GangProblem {
        now,
        running: vec![
            running("a", &gpus[0], 40, Some(100)),
            running("b", &gpus[1], 40, Some(200)),
        ],
        gpus,
        tenants: vec![tenant("t")],
        pending: vec![pending("gang", 2, 60, 0, Some(1000))],
    }
}

#[test]
fn a_blocked_gang_reserves_its_gpus_from_the_running_jobs_expected_ends() {
    let options = GangOptions {
        max_reservation_wait: 500,
        ..GangOptions::default()
    };
    let decision = solve_gangs(&blocked_gang_problem(10), &options);
    assert!(decision.placements.is_empty());
    assert_eq!(decision.reservations.len(), 1);
    let reservation = &decision.reservations[0];
    assert_eq!(reservation.job_id, "gang");
    assert_eq!(reservation.expected_start, Some(200));
    assert_eq!(reservation.backfill_until, 500);
    assert_eq!(reservation.members.len(), 2);
    assert_eq!(
        decision.waiting,
        vec![(
            "gang".to_string(),
            GangWaitReason::Reserved {
                expected_start: Some(200)
            }
        )]
    );
}

#[test]
fn small_jobs_backfill_only_where_they_do_not_delay_the_reservation() {
    let options = GangOptions {
        max_reservation_wait: 500,
        ..GangOptions::default()
    };
    let mut problem = blocked_gang_problem(10);
    // Ends at 110, before the gang's start at 200: backfills.
    problem.pending.push(pending("short", 1, 30, 5, Some(100)));
    // Would end at 310, after it, and 30 GiB beside a 60 GiB member do not fit 80: waits.
    problem.pending.push(pending("long", 1, 30, 6, Some(300)));
    // Unknown run time, but 20 GiB fit beside the member on a GPU: backfills "around".
    problem.pending.push(pending("around", 1, 20, 7, None));
    let decision = solve_gangs(&problem, &options);
    let placed: Vec<&str> = decision
        .placements
        .iter()
        .map(|placement| placement.job_id.as_str())
        .collect();
    assert_eq!(placed, vec!["short", "around"]);
    assert!(decision.waiting.contains(&(
        "long".to_string(),
        GangWaitReason::ReservedForJob {
            job_id: "gang".to_string()
        }
    )));

    // Without reservations the long job takes the room and the gang is pushed back.
    let off = GangOptions {
        reservations: false,
        ..options
    };
    let decision = solve_gangs(&problem, &off);
    assert!(decision.reservations.is_empty());
    assert!(
        decision
            .placements
            .iter()
            .any(|placement| placement.job_id == "long")
    );

    // Past the bound nothing new lands on the reserved GPUs, not even the short job.
    let mut late = problem.clone();
    late.now = 500;
    late.running
        .iter_mut()
        .for_each(|slice| slice.expected_end = Some(900));
    let decision = solve_gangs(&late, &options);
    assert!(decision.placements.is_empty(), "{:?}", decision.placements);
}

#[test]
fn a_gang_counts_every_member_against_its_tenants_quota_in_the_pass() {
    let mut problem = GangProblem {
        now: 0,
        gpus: cluster(1, 4),
        running: Vec::new(),
        tenants: vec![tenant("t")],
        pending: vec![pending("gang", 4, 20, 0, None)],
    };
    problem.tenants[0].vram_quota_bytes = Some(90 * GIB);
    problem.tenants[0].vram_in_use_bytes = 20 * GIB;
    let decision = solve_gangs(&problem, &GangOptions::default());
    assert!(decision.placements.is_empty());
    assert_eq!(
        decision.waiting[0].1,
        GangWaitReason::Scheduling(WaitReason::TenantVramQuota {
            in_use: 20 * GIB,
            quota: 90 * GIB,
            needs: 80 * GIB
        })
    );
    problem.tenants[0].vram_in_use_bytes = 10 * GIB;
    let decision = solve_gangs(&problem, &GangOptions::default());
    assert_eq!(decision.placements.len(), 1);
    assert_eq!(decision.placements[0].members.len(), 4);
    assert_eq!(decision.placements[0].total_bytes(), 80 * u128::from(GIB));
}

fn attempt(id: &str, job: &str, priority: i32, gib: u64) -> RunningAttempt {
    RunningAttempt {
        attempt_id: id.to_string(),
        job_id: job.to_string(),
        tenant: "low".to_string(),
        priority,
        slice_bytes: gib * GIB,
        run_time_seconds: 3600,
        preemptions_in_last_hour: 0,
    }
}

fn occupancy(
    worker: &str,
    gpu: &str,
    free_gib: u64,
    attempts: Vec<RunningAttempt>,
) -> GpuOccupancy {
    GpuOccupancy {
        gpu_id: format!("{worker}-{gpu}"),
        worker_id: worker.to_string(),
        free_bytes: free_gib * GIB,
        attempts,
    }
}

const NO_LIMITS: PreemptionSettings = PreemptionSettings {
    min_run_time_seconds: 0,
    max_preemptions_per_job_per_hour: u32::MAX,
};

#[test]
fn preemption_evicts_a_victim_gang_whole_or_not_at_all() {
    // A gang of two (g0 and g2) and a single job (g1), all low priority, 60 GiB each.
    let gpus = vec![
        occupancy("n0", "g0", 20, vec![attempt("gang-0", "gang", 0, 60)]),
        occupancy("n0", "g1", 20, vec![attempt("single-0", "single", 0, 60)]),
        occupancy("n1", "g2", 20, vec![attempt("gang-1", "gang", 0, 60)]),
    ];
    // An urgent single job of 50 GiB: evicting the single job is one victim of one
    // attempt; evicting the gang would be two. Either way no member is left running.
    let urgent = |members, policy| UrgentGang {
        job_id: "urgent".to_string(),
        tenant: "high".to_string(),
        priority: 10,
        shape: shape(members, 50, policy),
    };
    let plan = choose_gang_victims(
        &urgent(1, GangPlacementPolicy::Pack),
        &gpus,
        &FairShareState::default(),
        NO_LIMITS,
    )
    .expect("a plan");
    for victim in &plan.victims {
        let expected = if victim.job_id == "gang" { 2 } else { 1 };
        assert_eq!(victim.attempts.len(), expected, "{victim:?}");
        assert_eq!(victim.ground, EvictionGround::HigherPriority);
    }
    // An urgent gang of two across nodes: the gang's eviction frees g0 and g2 at once,
    // and its plan lists both of its attempts.
    let plan = choose_gang_victims(
        &urgent(2, GangPlacementPolicy::Spread),
        &gpus,
        &FairShareState::default(),
        NO_LIMITS,
    )
    .expect("a plan");
    assert_eq!(plan.members.len(), 2);
    assert_eq!(plan.victims.len(), 1);
    assert_eq!(plan.victims[0].job_id, "gang");
    assert_eq!(plan.victims[0].attempts.len(), 2);
    // A gang with one member too young is not evictable at all.
    let mut young = gpus.clone();
    young[2].attempts[0].run_time_seconds = 0;
    let limits = PreemptionSettings {
        min_run_time_seconds: 60,
        ..NO_LIMITS
    };
    let plan = choose_gang_victims(
        &urgent(2, GangPlacementPolicy::Pack),
        &young,
        &FairShareState::default(),
        limits,
    );
    // Only the single job is evictable, and one GPU more is not enough for two members.
    assert_eq!(plan, None);
}
