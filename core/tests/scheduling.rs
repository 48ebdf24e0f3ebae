//! The scheduling pass: worked cases for each rule of the policy (best fit, order within a
//! tenant, weighted fair share, quotas, reservations, draining GPUs, reasons as people read
//! them), and properties over random problems: never oversubscribe, never exceed a quota,
//! one outcome per job, input order does not matter, and a decision is a fixpoint.

use std::collections::{BTreeMap, BTreeSet};

use carve_core::scheduling::{
    GpuState, PendingJob, Placement, SchedulingDecision, SchedulingOptions, SchedulingProblem,
    TenantState, WaitReason, can_ever_fit, solve, solve_with_options,
};
use proptest::prelude::*;

const GIB: u64 = 1 << 30;

fn gpu(gpu_id: &str, total_gib: u64, allocated_gib: u64) -> GpuState {
    GpuState {
        gpu_id: gpu_id.to_string(),
        worker_id: format!("worker-of-{gpu_id}"),
        total_bytes: total_gib * GIB,
        context_bytes: 0,
        allocated_bytes: allocated_gib * GIB,
        schedulable: true,
    }
}

fn tenant(name: &str, weight: u32) -> TenantState {
    TenantState {
        tenant: name.to_string(),
        weight,
        vram_quota_bytes: None,
        running_jobs_quota: None,
        vram_in_use_bytes: 0,
        running_jobs: 0,
        decayed_usage_byte_seconds: 0,
    }
}

fn job(job_id: &str, tenant: &str, priority: i32, submit_sequence: u64, gib: u64) -> PendingJob {
    PendingJob {
        job_id: job_id.to_string(),
        tenant: tenant.to_string(),
        priority,
        submit_sequence,
        slice_bytes: gib * GIB,
    }
}

fn placement<'a>(decision: &'a SchedulingDecision, job_id: &str) -> Option<&'a Placement> {
    decision
        .placements
        .iter()
        .find(|placement| placement.job_id == job_id)
}

fn reason<'a>(decision: &'a SchedulingDecision, job_id: &str) -> Option<&'a WaitReason> {
    decision
        .waiting
        .iter()
        .find(|(waiting_job, _)| waiting_job == job_id)
        .map(|(_, reason)| reason)
}

fn placed_ids(decision: &SchedulingDecision) -> Vec<&str> {
    decision
        .placements
        .iter()
        .map(|placement| placement.job_id.as_str())
        .collect()
}

#[test]
fn best_fit_picks_the_tightest_gpu_and_keeps_large_holes_whole() {
    let problem = SchedulingProblem {
        gpus: vec![
            gpu("gpu-a", 16, 6),
            gpu("gpu-b", 16, 10),
            gpu("gpu-c", 16, 8),
        ],
        tenants: vec![tenant("research", 1)],
        pending: vec![
            job("five", "research", 1, 0, 5),
            job("seven", "research", 0, 1, 7),
            job("ten", "research", 0, 2, 10),
        ],
    };
    let decision = solve(&problem);
    // 5 GiB: free 10, 6 and 8 -> the 6 GiB hole. 7 GiB: free 10, 1, 8 -> 8. 10 GiB: the
    // 10 GiB hole, still whole because neither smaller job took it.
    assert_eq!(placement(&decision, "five").unwrap().gpu_id, "gpu-b");
    assert_eq!(placement(&decision, "seven").unwrap().gpu_id, "gpu-c");
    assert_eq!(placement(&decision, "ten").unwrap().gpu_id, "gpu-a");
    assert_eq!(
        placement(&decision, "ten").unwrap().worker_id,
        "worker-of-gpu-a"
    );
    assert!(decision.waiting.is_empty());
}

#[test]
fn equal_holes_go_to_the_lowest_gpu_id() {
    let problem = SchedulingProblem {
        gpus: vec![
            gpu("gpu-2", 16, 8),
            gpu("gpu-1", 16, 8),
            gpu("gpu-3", 16, 0),
        ],
        tenants: vec![tenant("research", 1)],
        pending: vec![job("job", "research", 0, 0, 4)],
    };
    assert_eq!(solve(&problem).placements[0].gpu_id, "gpu-1");
}

#[test]
fn the_cuda_context_is_not_usable_by_slices() {
    let mut with_context = gpu("gpu-0", 16, 0);
    with_context.context_bytes = GIB;
    assert_eq!(with_context.usable_bytes(), 15 * GIB);
    assert_eq!(with_context.free_bytes(), 15 * GIB);
    with_context.allocated_bytes = 20 * GIB;
    assert_eq!(with_context.free_bytes(), 0, "oversubscribed reads as full");
    with_context.allocated_bytes = 0;

    let problem = SchedulingProblem {
        gpus: vec![with_context],
        tenants: vec![tenant("research", 1)],
        pending: vec![job("whole-gpu", "research", 0, 0, 16)],
    };
    let decision = solve(&problem);
    assert_eq!(
        reason(&decision, "whole-gpu"),
        Some(&WaitReason::NoGpuLargeEnough {
            needs: 16 * GIB,
            largest_gpu: 15 * GIB
        })
    );
}

#[test]
fn within_a_tenant_priority_comes_first_then_age_then_id() {
    let problem = SchedulingProblem {
        gpus: vec![gpu("gpu-0", 12, 0)],
        tenants: vec![tenant("research", 1)],
        pending: vec![
            job("old-low", "research", 0, 1, 4),
            job("new-high", "research", 5, 9, 4),
            job("older-high", "research", 5, 3, 4),
            job("same-age-b", "research", 1, 4, 4),
            job("same-age-a", "research", 1, 4, 4),
        ],
    };
    let decision = solve(&problem);
    assert_eq!(
        placed_ids(&decision),
        vec!["older-high", "new-high", "same-age-a"]
    );
    let free = |needs| WaitReason::NoGpuFreeEnough {
        needs,
        largest_free: 0,
    };
    assert_eq!(reason(&decision, "same-age-b"), Some(&free(4 * GIB)));
    assert_eq!(reason(&decision, "old-low"), Some(&free(4 * GIB)));
}

fn placed_bytes_by_tenant(
    problem: &SchedulingProblem,
    decision: &SchedulingDecision,
) -> BTreeMap<String, u64> {
    let mut bytes = BTreeMap::new();
    for placement in &decision.placements {
        let job = problem
            .pending
            .iter()
            .find(|job| job.job_id == placement.job_id)
            .unwrap();
        *bytes.entry(job.tenant.clone()).or_insert(0) += placement.slice_bytes;
    }
    bytes
}

#[test]
fn weighted_fair_share_gives_one_to_three_by_weight() {
    let mut pending = Vec::new();
    for index in 0..40 {
        pending.push(job(&format!("light-{index:02}"), "light", 0, index, 1));
        pending.push(job(&format!("heavy-{index:02}"), "heavy", 0, index, 1));
    }
    let problem = SchedulingProblem {
        gpus: vec![gpu("gpu-0", 16, 0)],
        tenants: vec![tenant("light", 1), tenant("heavy", 3)],
        pending,
    };
    let decision = solve(&problem);
    let bytes = placed_bytes_by_tenant(&problem, &decision);
    assert_eq!(bytes["light"], 4 * GIB);
    assert_eq!(bytes["heavy"], 12 * GIB);
    // They alternate rather than one tenant going first: both shares are 0, "heavy" wins
    // the tie by name, then light at 0/1 < heavy at 1/3.
    assert_eq!(
        &placed_ids(&decision)[..5],
        &["heavy-00", "light-00", "heavy-01", "heavy-02", "heavy-03"]
    );
}

#[test]
fn fair_share_counts_what_tenants_already_use_and_weight_zero_counts_as_one() {
    let mut busy = tenant("busy", 0);
    busy.vram_in_use_bytes = 8 * GIB;
    let mut pending = Vec::new();
    for index in 0..20 {
        pending.push(job(&format!("busy-{index:02}"), "busy", 0, index, 1));
        pending.push(job(&format!("idle-{index:02}"), "idle", 0, index, 1));
    }
    let problem = SchedulingProblem {
        gpus: vec![gpu("gpu-0", 16, 0)],
        tenants: vec![busy, tenant("idle", 1)],
        pending,
    };
    let bytes = placed_bytes_by_tenant(&problem, &solve(&problem));
    // idle catches up to busy's 8 GiB first, then they share the rest equally.
    assert_eq!(bytes["idle"], 12 * GIB);
    assert_eq!(bytes["busy"], 4 * GIB);
}

#[test]
fn vram_quota_counts_usage_and_this_pass_with_exact_numbers() {
    let mut research = tenant("research", 1);
    research.vram_quota_bytes = Some(32 * GIB);
    research.vram_in_use_bytes = 26 * GIB;
    let problem = SchedulingProblem {
        gpus: vec![gpu("gpu-0", 80, 0)],
        tenants: vec![research],
        pending: vec![
            job("four", "research", 1, 0, 4),
            job("six", "research", 0, 1, 6),
            job("two", "research", 0, 2, 2),
        ],
    };
    let decision = solve(&problem);
    assert_eq!(placed_ids(&decision), vec!["four", "two"]);
    let six = reason(&decision, "six").unwrap();
    assert_eq!(
        six,
        &WaitReason::TenantVramQuota {
            in_use: 30 * GIB,
            quota: 32 * GIB,
            needs: 6 * GIB
        }
    );
    assert_eq!(
        six.to_string(),
        "tenant quota: 30 GiB of 32 GiB vram in use, needs 6 GiB"
    );
}

#[test]
fn running_jobs_quota_counts_this_pass() {
    let mut research = tenant("research", 1);
    research.running_jobs_quota = Some(2);
    research.running_jobs = 1;
    let problem = SchedulingProblem {
        gpus: vec![gpu("gpu-0", 80, 0)],
        tenants: vec![research],
        pending: vec![
            job("first", "research", 0, 0, 1),
            job("second", "research", 0, 1, 1),
            job("third", "research", 0, 2, 1),
        ],
    };
    let decision = solve(&problem);
    assert_eq!(placed_ids(&decision), vec!["first"]);
    for waiting in ["second", "third"] {
        assert_eq!(
            reason(&decision, waiting),
            Some(&WaitReason::TenantRunningJobsQuota {
                running: 2,
                quota: 2
            })
        );
    }
    assert_eq!(
        reason(&decision, "second").unwrap().to_string(),
        "tenant quota: 2 of 2 running jobs in use"
    );
}

/// One GPU full of 4 GiB jobs, a 12 GiB job waiting, and a stream of 4 GiB jobs: every
/// pass, the two oldest running small jobs finish and two new ones arrive.
fn run_small_job_stream(options: &SchedulingOptions, passes: u64) -> (Option<u64>, usize) {
    let mut problem = SchedulingProblem {
        gpus: vec![gpu("gpu-0", 16, 16), gpu("gpu-1", 16, 16)],
        tenants: vec![tenant("research", 1)],
        pending: vec![job("large", "research", 0, 0, 12)],
    };
    problem.tenants[0].vram_in_use_bytes = 32 * GIB;
    problem.tenants[0].running_jobs = 8;
    // (job id, gpu id), oldest first.
    let mut running: Vec<(String, String)> = (0..8)
        .map(|index| (format!("initial-{index}"), format!("gpu-{}", index % 2)))
        .collect();
    let mut next_sequence = 1;
    let mut small_jobs_placed = 0;
    for pass in 1..=passes {
        let decision = solve_with_options(&problem, options);
        if placement(&decision, "large").is_some() {
            return (Some(pass), small_jobs_placed);
        }
        if pass > 1 {
            // From the second pass on there is free memory, so the large job holds a
            // reservation and the small jobs that would fit it are told why they wait.
            if options.reserve_for_blocked_jobs {
                assert_eq!(decision.reservations.len(), 1);
                assert_eq!(decision.reservations[0].job_id, "large");
                assert_eq!(decision.reservations[0].gpu_id, "gpu-0");
                assert!(decision.waiting.iter().any(|(_, reason)| reason
                    == &WaitReason::ReservedForOlderJob {
                        job_id: "large".to_string(),
                        gpu_id: "gpu-0".to_string()
                    }));
            } else {
                assert!(decision.reservations.is_empty());
            }
        }
        small_jobs_placed += decision.placements.len();
        problem.apply_placements(&decision.placements);
        running.extend(
            decision
                .placements
                .iter()
                .map(|placement| (placement.job_id.clone(), placement.gpu_id.clone())),
        );
        for (_, gpu_id) in running.drain(..2) {
            let gpu = problem
                .gpus
                .iter_mut()
                .find(|gpu| gpu.gpu_id == gpu_id)
                .unwrap();
            gpu.allocated_bytes -= 4 * GIB;
            problem.tenants[0].vram_in_use_bytes -= 4 * GIB;
            problem.tenants[0].running_jobs -= 1;
        }
        for _ in 0..2 {
            problem.pending.push(job(
                &format!("small-{next_sequence}"),
                "research",
                0,
                next_sequence,
                4,
            ));
            next_sequence += 1;
        }
    }
    (None, small_jobs_placed)
}

#[test]
fn a_reservation_keeps_a_stream_of_small_jobs_from_starving_a_large_one() {
    let (placed_in_pass, small_jobs_placed) =
        run_small_job_stream(&SchedulingOptions::default(), 20);
    // gpu-0 drains: 0, 4, 8, then 12 GiB free in the fourth pass. Small jobs keep running
    // on gpu-1 meanwhile (backfill).
    assert_eq!(placed_in_pass, Some(4));
    assert_eq!(small_jobs_placed, 2);

    let without_reservations = SchedulingOptions {
        reserve_for_blocked_jobs: false,
        ..SchedulingOptions::default()
    };
    let (placed_in_pass, small_jobs_placed) = run_small_job_stream(&without_reservations, 20);
    assert_eq!(placed_in_pass, None, "small jobs take every hole first");
    assert!(small_jobs_placed >= 30);
}

#[test]
fn a_blocked_head_job_holds_its_tenants_quota() {
    let mut research = tenant("research", 1);
    research.vram_quota_bytes = Some(16 * GIB);
    let problem = SchedulingProblem {
        gpus: vec![gpu("gpu-0", 16, 8), gpu("gpu-1", 16, 10)],
        tenants: vec![research],
        pending: vec![
            job("large", "research", 1, 0, 12),
            job("small-1", "research", 0, 1, 4),
            job("small-2", "research", 0, 2, 4),
        ],
    };
    let decision = solve(&problem);
    // "large" reserves gpu-0 (most free) and holds 12 GiB of the 16 GiB quota, so only
    // one small job runs, on gpu-1.
    assert_eq!(decision.reservations.len(), 1);
    assert_eq!(decision.reservations[0].gpu_id, "gpu-0");
    assert_eq!(decision.reservations[0].free_bytes, 8 * GIB);
    assert_eq!(
        reason(&decision, "large"),
        Some(&WaitReason::NoGpuFreeEnough {
            needs: 12 * GIB,
            largest_free: 8 * GIB
        })
    );
    assert_eq!(placement(&decision, "small-1").unwrap().gpu_id, "gpu-1");
    assert_eq!(
        reason(&decision, "small-2"),
        Some(&WaitReason::TenantVramQuota {
            in_use: 16 * GIB,
            quota: 16 * GIB,
            needs: 4 * GIB
        })
    );
}

#[test]
fn blocked_heads_of_different_tenants_drain_different_gpus() {
    let problem = SchedulingProblem {
        gpus: vec![
            gpu("gpu-0", 16, 10),
            gpu("gpu-1", 16, 12),
            gpu("gpu-2", 16, 14),
        ],
        tenants: vec![tenant("alpha", 1), tenant("beta", 1)],
        pending: vec![
            job("alpha-large", "alpha", 0, 5, 12),
            job("beta-large", "beta", 0, 2, 10),
            job("alpha-small", "alpha", 0, 6, 2),
        ],
    };
    let decision = solve(&problem);
    // beta's head is older, so it reserves first: gpu-0, the most free; alpha's takes the
    // next, gpu-1. The small job goes to the one GPU left.
    let reserved: Vec<(&str, &str)> = decision
        .reservations
        .iter()
        .map(|reservation| (reservation.job_id.as_str(), reservation.gpu_id.as_str()))
        .collect();
    assert_eq!(
        reserved,
        vec![("beta-large", "gpu-0"), ("alpha-large", "gpu-1")]
    );
    assert_eq!(placement(&decision, "alpha-small").unwrap().gpu_id, "gpu-2");
    assert!(solve(&applied(&problem, &decision)).placements.is_empty());
}

#[test]
fn a_blocked_head_with_no_gpu_left_to_reserve_queues_behind_the_owner() {
    let problem = SchedulingProblem {
        gpus: vec![gpu("gpu-0", 16, 10), gpu("gpu-1", 8, 4)],
        tenants: vec![tenant("alpha", 1), tenant("beta", 1)],
        pending: vec![
            job("alpha-large", "alpha", 0, 5, 12),
            job("beta-large", "beta", 0, 2, 10),
            job("alpha-small", "alpha", 0, 6, 4),
        ],
    };
    let decision = solve(&problem);
    // Only gpu-0 can ever hold either large job; beta's is older, so it owns it.
    assert_eq!(decision.reservations.len(), 1);
    assert_eq!(decision.reservations[0].job_id, "beta-large");
    assert_eq!(
        reason(&decision, "alpha-large"),
        Some(&WaitReason::ReservedForOlderJob {
            job_id: "beta-large".to_string(),
            gpu_id: "gpu-0".to_string()
        })
    );
    assert_eq!(placement(&decision, "alpha-small").unwrap().gpu_id, "gpu-1");
    assert!(solve(&applied(&problem, &decision)).placements.is_empty());
}

#[test]
fn draining_gpus_get_nothing() {
    let mut draining = gpu("gpu-big", 80, 0);
    draining.schedulable = false;
    let problem = SchedulingProblem {
        gpus: vec![draining.clone(), gpu("gpu-small", 16, 12)],
        tenants: vec![tenant("research", 1)],
        pending: vec![
            job("fits-small", "research", 2, 0, 2),
            job("too-big", "research", 1, 1, 40),
            job("needs-free", "research", 0, 2, 8),
        ],
    };
    let decision = solve(&problem);
    assert_eq!(
        placement(&decision, "fits-small").unwrap().gpu_id,
        "gpu-small"
    );
    assert_eq!(
        reason(&decision, "too-big"),
        Some(&WaitReason::NoGpuLargeEnough {
            needs: 40 * GIB,
            largest_gpu: 16 * GIB
        })
    );
    // The draining GPU's 80 free GiB are not counted.
    assert_eq!(
        reason(&decision, "needs-free"),
        Some(&WaitReason::NoGpuFreeEnough {
            needs: 8 * GIB,
            largest_free: 2 * GIB
        })
    );

    let all_draining = SchedulingProblem {
        gpus: vec![draining],
        ..problem
    };
    let decision = solve(&all_draining);
    assert!(decision.placements.is_empty());
    assert_eq!(decision.waiting.len(), 3);
    assert!(
        decision
            .waiting
            .iter()
            .all(|(_, reason)| reason == &WaitReason::NoSchedulableGpu)
    );
}

#[test]
fn jobs_of_unknown_tenants_wait_and_take_nothing() {
    let problem = SchedulingProblem {
        gpus: vec![gpu("gpu-0", 16, 0)],
        tenants: vec![tenant("research", 1)],
        pending: vec![
            job("stranger", "nobody", 9, 0, 4),
            job("member", "research", 0, 1, 16),
        ],
    };
    let decision = solve(&problem);
    assert_eq!(
        reason(&decision, "stranger"),
        Some(&WaitReason::UnknownTenant)
    );
    assert_eq!(placement(&decision, "member").unwrap().gpu_id, "gpu-0");
}

#[test]
fn reasons_read_well() {
    let cases = [
        (
            WaitReason::TenantVramQuota {
                in_use: 30 * GIB,
                quota: 32 * GIB,
                needs: 6 * GIB,
            },
            "tenant quota: 30 GiB of 32 GiB vram in use, needs 6 GiB",
        ),
        (
            WaitReason::TenantRunningJobsQuota {
                running: 4,
                quota: 4,
            },
            "tenant quota: 4 of 4 running jobs in use",
        ),
        (
            WaitReason::NoGpuLargeEnough {
                needs: 96 * GIB,
                largest_gpu: 79 * GIB + 512 * (1 << 20),
            },
            "no gpu is large enough for 96 GiB (the largest holds 79.50 GiB after its cuda context)",
        ),
        (
            WaitReason::NoGpuFreeEnough {
                needs: 6 * GIB,
                largest_free: 4 * GIB,
            },
            "no gpu has 6 GiB free (largest free 4 GiB)",
        ),
        (
            WaitReason::ReservedForOlderJob {
                job_id: "job-7".to_string(),
                gpu_id: "gpu-3".to_string(),
            },
            "waiting for gpu gpu-3, reserved for job job-7 which is ahead in the queue",
        ),
        (
            WaitReason::NoSchedulableGpu,
            "no schedulable gpu: every worker is draining or not ready",
        ),
        (WaitReason::UnknownTenant, "the job's tenant is unknown"),
    ];
    for (reason, text) in cases {
        assert_eq!(reason.to_string(), text);
        assert_eq!(reason.name(), reason.name().to_lowercase());
    }
}

#[test]
fn can_ever_fit_checks_quota_then_gpu_sizes() {
    let mut research = tenant("research", 1);
    let gpus = [gpu("gpu-0", 16, 16), gpu("gpu-1", 40, 40)];
    assert_eq!(can_ever_fit(40 * GIB, &gpus, &research), Ok(()));
    assert_eq!(
        can_ever_fit(41 * GIB, &gpus, &research),
        Err(WaitReason::NoGpuLargeEnough {
            needs: 41 * GIB,
            largest_gpu: 40 * GIB
        })
    );
    assert_eq!(
        can_ever_fit(1 << 50, &[], &research),
        Ok(()),
        "unknown cluster"
    );

    research.vram_quota_bytes = Some(8 * GIB);
    research.vram_in_use_bytes = 8 * GIB;
    assert_eq!(
        can_ever_fit(8 * GIB, &gpus, &research),
        Ok(()),
        "usage passes"
    );
    assert_eq!(
        can_ever_fit(9 * GIB, &gpus, &research),
        Err(WaitReason::TenantVramQuota {
            in_use: 0,
            quota: 8 * GIB,
            needs: 9 * GIB
        })
    );
    research.vram_quota_bytes = None;
    research.running_jobs_quota = Some(0);
    assert_eq!(
        can_ever_fit(GIB, &gpus, &research),
        Err(WaitReason::TenantRunningJobsQuota {
            running: 0,
            quota: 0
        })
    );
}

fn applied(problem: &SchedulingProblem, decision: &SchedulingDecision) -> SchedulingProblem {
    let mut next = problem.clone();
    next.apply_placements(&decision.placements);
    next
}

// ---- properties over random problems ----

/// Sizes in half-GiB units so that exact fits and ties are common.
const UNIT: u64 = GIB / 2;

fn gpu_strategy(index: usize) -> impl Strategy<Value = GpuState> {
    // Allocated is a share (in sixteenths) of the total, so that some GPUs are empty,
    // some full and most in between, whatever their size.
    (1u64..=16, 0u64..=2, 0u64..=16, prop::bool::weighted(0.85)).prop_map(
        move |(total, context, allocated_sixteenths, schedulable)| GpuState {
            gpu_id: format!("gpu-{index}"),
            worker_id: format!("worker-{}", index / 2),
            total_bytes: total * UNIT,
            context_bytes: context * UNIT,
            allocated_bytes: total * allocated_sixteenths / 16 * UNIT,
            schedulable,
        },
    )
}

const TENANT_NAMES: [&str; 5] = ["alpha", "beta", "gamma", "delta", "unknown"];

fn tenant_strategy(name: &'static str) -> impl Strategy<Value = TenantState> {
    (
        0u32..4,
        prop::option::weighted(0.5, 0u64..=24),
        prop::option::weighted(0.4, 0u32..=5),
        0u64..=8,
        0u32..=3,
        prop::option::weighted(0.3, 0u128..=(1u128 << 60)),
    )
        .prop_map(
            move |(weight, vram_quota, running_quota, in_use, running, history)| TenantState {
                tenant: name.to_string(),
                weight,
                vram_quota_bytes: vram_quota.map(|units| units * UNIT),
                running_jobs_quota: running_quota,
                vram_in_use_bytes: in_use * UNIT,
                running_jobs: running,
                decayed_usage_byte_seconds: history.unwrap_or(0),
            },
        )
}

fn problem_strategy() -> impl Strategy<Value = SchedulingProblem> {
    let gpus = (0usize..9).prop_flat_map(|count| (0..count).map(gpu_strategy).collect::<Vec<_>>());
    // "unknown" is never among the tenants; the others are each present or not.
    let tenants = (
        prop::option::weighted(0.95, tenant_strategy(TENANT_NAMES[0])),
        prop::option::weighted(0.9, tenant_strategy(TENANT_NAMES[1])),
        prop::option::weighted(0.8, tenant_strategy(TENANT_NAMES[2])),
        prop::option::weighted(0.8, tenant_strategy(TENANT_NAMES[3])),
    )
        .prop_map(|(alpha, beta, gamma, delta)| {
            [alpha, beta, gamma, delta].into_iter().flatten().collect()
        });
    let pending = prop::collection::vec(
        (
            prop::sample::select(vec![0usize, 0, 1, 1, 2, 3, 4]),
            -1i32..=1,
            0u64..40,
            1u64..=18,
        ),
        0..36,
    )
    .prop_map(|jobs| {
        jobs.into_iter()
            .enumerate()
            .map(
                |(index, (tenant, priority, submit_sequence, units))| PendingJob {
                    job_id: format!("job-{index:02}"),
                    tenant: TENANT_NAMES[tenant].to_string(),
                    priority,
                    submit_sequence,
                    slice_bytes: units * UNIT,
                },
            )
            .collect()
    });
    (gpus, tenants, pending).prop_map(|(gpus, tenants, pending)| SchedulingProblem {
        gpus,
        tenants,
        pending,
    })
}

fn options_strategy() -> impl Strategy<Value = SchedulingOptions> {
    prop::bool::weighted(0.7).prop_map(|reserve_for_blocked_jobs| SchedulingOptions {
        reserve_for_blocked_jobs,
        ..SchedulingOptions::default()
    })
}

/// Checks (1) capacity, (2) quotas, (3) one outcome per job, (6) slices fit their GPU,
/// plus reservations and the truth of every reason, against the state after the decision.
fn check_decision_is_sound(problem: &SchedulingProblem, decision: &SchedulingDecision) {
    let jobs: BTreeMap<&str, &PendingJob> = problem
        .pending
        .iter()
        .map(|job| (job.job_id.as_str(), job))
        .collect();
    let gpus: BTreeMap<&str, &GpuState> = problem
        .gpus
        .iter()
        .map(|gpu| (gpu.gpu_id.as_str(), gpu))
        .collect();
    let tenants: BTreeMap<&str, &TenantState> = problem
        .tenants
        .iter()
        .map(|tenant| (tenant.tenant.as_str(), tenant))
        .collect();

    // (3) every job exactly once, placed or waiting.
    let mut seen = BTreeSet::new();
    for job_id in decision
        .placements
        .iter()
        .map(|placement| placement.job_id.as_str())
        .chain(decision.waiting.iter().map(|(job_id, _)| job_id.as_str()))
    {
        assert!(seen.insert(job_id), "{job_id} has two outcomes");
    }
    assert_eq!(
        seen,
        jobs.keys().copied().collect::<BTreeSet<_>>(),
        "a job has no outcome"
    );

    let reserved_gpus: BTreeMap<&str, &str> = decision
        .reservations
        .iter()
        .map(|reservation| (reservation.gpu_id.as_str(), reservation.job_id.as_str()))
        .collect();
    assert_eq!(
        reserved_gpus.len(),
        decision.reservations.len(),
        "two reservations on one gpu"
    );

    let mut placed_on_gpu: BTreeMap<&str, u64> = BTreeMap::new();
    let mut placed_for_tenant: BTreeMap<&str, (u64, u32)> = BTreeMap::new();
    for placement in &decision.placements {
        let job = jobs[placement.job_id.as_str()];
        let gpu = gpus[placement.gpu_id.as_str()];
        assert_eq!(placement.slice_bytes, job.slice_bytes);
        assert_eq!(placement.worker_id, gpu.worker_id);
        assert!(gpu.schedulable, "placed on a draining gpu");
        assert!(
            !reserved_gpus.contains_key(gpu.gpu_id.as_str()),
            "placed on a reserved gpu"
        );
        // (6) the slice fits its GPU at all.
        assert!(placement.slice_bytes <= gpu.usable_bytes());
        *placed_on_gpu.entry(gpu.gpu_id.as_str()).or_insert(0) += placement.slice_bytes;
        let entry = placed_for_tenant
            .entry(job.tenant.as_str())
            .or_insert((0, 0));
        entry.0 += placement.slice_bytes;
        entry.1 += 1;
    }
    // (1) never oversubscribed.
    for (gpu_id, placed) in &placed_on_gpu {
        let gpu = gpus[gpu_id];
        assert!(
            gpu.allocated_bytes + placed <= gpu.usable_bytes(),
            "{gpu_id} oversubscribed"
        );
    }
    // (2) never over a quota.
    for (tenant_name, (bytes, count)) in &placed_for_tenant {
        let tenant = tenants
            .get(tenant_name)
            .expect("placed a job of an unknown tenant");
        if let Some(quota) = tenant.vram_quota_bytes {
            assert!(
                tenant.vram_in_use_bytes + bytes <= quota,
                "{tenant_name} vram"
            );
        }
        if let Some(quota) = tenant.running_jobs_quota {
            assert!(tenant.running_jobs + count <= quota, "{tenant_name} jobs");
        }
    }
    let mut reservations_per_tenant: BTreeMap<&str, usize> = BTreeMap::new();
    for reservation in &decision.reservations {
        let job = jobs[reservation.job_id.as_str()];
        *reservations_per_tenant
            .entry(job.tenant.as_str())
            .or_insert(0) += 1;
        assert!(gpus[reservation.gpu_id.as_str()].schedulable);
        assert!(job.slice_bytes > reservation.free_bytes);
        assert!(job.slice_bytes <= gpus[reservation.gpu_id.as_str()].usable_bytes());
    }
    assert!(reservations_per_tenant.values().all(|&count| count == 1));

    // Every reason is true of the state after the decision.
    let schedulable: Vec<&GpuState> = problem.gpus.iter().filter(|gpu| gpu.schedulable).collect();
    let final_free = |gpu: &GpuState| {
        gpu.free_bytes() - placed_on_gpu.get(gpu.gpu_id.as_str()).copied().unwrap_or(0)
    };
    for (job_id, reason) in &decision.waiting {
        let job = jobs[job_id.as_str()];
        match reason {
            WaitReason::UnknownTenant => assert!(!tenants.contains_key(job.tenant.as_str())),
            WaitReason::NoSchedulableGpu => assert!(schedulable.is_empty()),
            WaitReason::NoGpuLargeEnough { needs, largest_gpu } => {
                assert_eq!(*needs, job.slice_bytes);
                assert_eq!(
                    Some(*largest_gpu),
                    schedulable.iter().map(|gpu| gpu.usable_bytes()).max()
                );
                assert!(needs > largest_gpu);
            }
            WaitReason::TenantVramQuota {
                in_use,
                quota,
                needs,
            } => {
                assert_eq!(*needs, job.slice_bytes);
                assert_eq!(Some(*quota), tenants[job.tenant.as_str()].vram_quota_bytes);
                assert!(in_use + needs > *quota);
            }
            WaitReason::TenantRunningJobsQuota { running, quota } => {
                assert_eq!(
                    Some(*quota),
                    tenants[job.tenant.as_str()].running_jobs_quota
                );
                assert!(running >= quota);
            }
            WaitReason::NoGpuFreeEnough {
                needs,
                largest_free,
            } => {
                assert_eq!(*needs, job.slice_bytes);
                assert!(needs > largest_free);
                assert!(schedulable.iter().all(|gpu| final_free(gpu) < *needs));
            }
            WaitReason::ReservedForOlderJob {
                job_id: owner,
                gpu_id,
            } => {
                assert_eq!(
                    reserved_gpus.get(gpu_id.as_str()),
                    Some(&owner.as_str()),
                    "{job_id} names a gpu that is not reserved for {owner}"
                );
                assert_ne!(owner, job_id);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn decisions_are_sound(problem in problem_strategy(), options in options_strategy()) {
        let decision = solve_with_options(&problem, &options);
        check_decision_is_sound(&problem, &decision);
    }

    #[test]
    fn input_order_does_not_matter(
        (problem, gpus, tenants, pending) in problem_strategy().prop_flat_map(|problem| {
            let gpus = Just(problem.gpus.clone()).prop_shuffle();
            let tenants = Just(problem.tenants.clone()).prop_shuffle();
            let pending = Just(problem.pending.clone()).prop_shuffle();
            (Just(problem), gpus, tenants, pending)
        }),
        options in options_strategy(),
    ) {
        let shuffled = SchedulingProblem { gpus, tenants, pending };
        prop_assert_eq!(
            solve_with_options(&problem, &options),
            solve_with_options(&shuffled, &options)
        );
    }

    #[test]
    fn a_decision_is_a_fixpoint(problem in problem_strategy(), options in options_strategy()) {
        let decision = solve_with_options(&problem, &options);
        let next = applied(&problem, &decision);
        let again = solve_with_options(&next, &options);
        prop_assert!(
            again.placements.is_empty(),
            "placed {:?} after applying {:?}",
            again.placements,
            decision.placements
        );
        // Reservations do not move: every GPU reserved before is reserved again.
        let reserved_again: BTreeSet<&str> =
            again.reservations.iter().map(|reservation| reservation.gpu_id.as_str()).collect();
        for reservation in &decision.reservations {
            prop_assert!(reserved_again.contains(reservation.gpu_id.as_str()));
        }
        check_decision_is_sound(&next, &again);
    }

    #[test]
    fn can_ever_fit_agrees_with_an_empty_cluster(problem in problem_strategy(), units in 1u64..=20) {
        // A job that can ever fit is placed on an empty cluster of the same GPUs, all
        // schedulable, for its tenant with nothing in use; one that cannot never is.
        let Some(tenant) = problem.tenants.first() else { return Ok(()) };
        let mut empty = problem.clone();
        for gpu in &mut empty.gpus {
            gpu.allocated_bytes = 0;
            gpu.schedulable = true;
        }
        let mut idle_tenant = tenant.clone();
        idle_tenant.vram_in_use_bytes = 0;
        idle_tenant.running_jobs = 0;
        empty.tenants = vec![idle_tenant];
        empty.pending = vec![PendingJob {
            job_id: "probe".to_string(),
            tenant: tenant.tenant.clone(),
            priority: 0,
            submit_sequence: 0,
            slice_bytes: units * UNIT,
        }];
        let admitted = can_ever_fit(units * UNIT, &problem.gpus, tenant).is_ok();
        let placed = !solve(&empty).placements.is_empty();
        if problem.gpus.is_empty() {
            // An unknown cluster is not too small; only the quotas can refuse.
            let quotas_allow = tenant.vram_quota_bytes.is_none_or(|quota| quota >= units * UNIT)
                && tenant.running_jobs_quota != Some(0);
            prop_assert_eq!(admitted, quotas_allow);
        } else {
            prop_assert_eq!(admitted, placed);
        }
    }
}
