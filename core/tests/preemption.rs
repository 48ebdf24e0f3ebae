//! Choosing whom to evict: worked cases (lowest priority first, fair-share reclaim, the
//! anti-thrashing limits) and properties over random clusters: never more victims than
//! needed, never an equal or higher priority outside reclaim, the same answer for any
//! input order, and the limits respected.

use carve_core::scheduling::preemption::{
    EvictionGround, FairShareState, GpuOccupancy, PreemptionPlan, PreemptionSettings,
    RunningAttempt, TenantShare, UrgentJob, choose_victims,
};
use proptest::prelude::*;

const GIB: u64 = 1 << 30;

const NO_LIMITS: PreemptionSettings = PreemptionSettings {
    min_run_time_seconds: 0,
    max_preemptions_per_job_per_hour: u32::MAX,
};

fn urgent(tenant: &str, priority: i32, gib: u64) -> UrgentJob {
    UrgentJob {
        job_id: "urgent".to_string(),
        tenant: tenant.to_string(),
        priority,
        slice_bytes: gib * GIB,
    }
}

fn attempt(attempt_id: &str, tenant: &str, priority: i32, gib: u64) -> RunningAttempt {
    RunningAttempt {
        attempt_id: attempt_id.to_string(),
        job_id: format!("job-{attempt_id}"),
        tenant: tenant.to_string(),
        priority,
        slice_bytes: gib * GIB,
        run_time_seconds: 600,
        preemptions_in_last_hour: 0,
    }
}

fn gpu(gpu_id: &str, free_gib: u64, attempts: Vec<RunningAttempt>) -> GpuOccupancy {
    GpuOccupancy {
        gpu_id: gpu_id.to_string(),
        worker_id: format!("worker-of-{gpu_id}"),
        free_bytes: free_gib * GIB,
        attempts,
    }
}

/// The plan for `job` when fair share plays no part.
fn without_shares(
    job: &UrgentJob,
    gpus: &[GpuOccupancy],
    settings: PreemptionSettings,
) -> Option<PreemptionPlan> {
    choose_victims(job, gpus, &FairShareState::default(), settings)
}

fn victim_ids(plan: &PreemptionPlan) -> Vec<&str> {
    plan.victims
        .iter()
        .map(|victim| victim.attempt_id.as_str())
        .collect()
}

#[test]
fn evicts_the_lowest_priority_attempt_that_makes_room() {
    let gpus = vec![gpu(
        "gpu-0",
        2,
        vec![
            attempt("a", "t", 1, 10),
            attempt("b", "t", 0, 10),
            attempt("c", "t", 5, 4),
        ],
    )];
    let plan = without_shares(&urgent("t", 10, 12), &gpus, NO_LIMITS).expect("a plan");
    assert_eq!(plan.gpu_id, "gpu-0");
    assert_eq!(victim_ids(&plan), vec!["b"]);
    assert_eq!(plan.free_bytes_after, 12 * GIB);
    assert_eq!(plan.victims[0].ground, EvictionGround::HigherPriority);
}

#[test]
fn prefers_the_gpu_whose_victims_have_the_lowest_priority() {
    let gpus = vec![
        gpu("gpu-0", 0, vec![attempt("a", "t", 3, 16)]),
        gpu(
            "gpu-1",
            0,
            vec![attempt("b", "t", 1, 8), attempt("c", "t", 1, 8)],
        ),
    ];
    let plan = without_shares(&urgent("t", 10, 16), &gpus, NO_LIMITS).expect("a plan");
    assert_eq!(plan.gpu_id, "gpu-1");
    assert_eq!(victim_ids(&plan), vec!["b", "c"]);
}

#[test]
fn never_evicts_equal_or_higher_priority_without_reclaim() {
    let gpus = vec![gpu(
        "gpu-0",
        0,
        vec![attempt("a", "t", 10, 16), attempt("b", "u", 11, 16)],
    )];
    assert_eq!(without_shares(&urgent("t", 10, 8), &gpus, NO_LIMITS), None);
}

#[test]
fn a_tenant_under_its_share_reclaims_from_one_over_it() {
    let gpus = vec![gpu("gpu-0", 0, vec![attempt("greedy", "big", 5, 32)])];
    let shares = FairShareState {
        usable_bytes: 32 * GIB,
        tenants: vec![
            TenantShare {
                tenant: "big".to_string(),
                weight: 1,
                vram_in_use_bytes: 32 * GIB,
            },
            TenantShare {
                tenant: "small".to_string(),
                weight: 1,
                vram_in_use_bytes: 0,
            },
        ],
    };
    let plan = choose_victims(&urgent("small", 0, 16), &gpus, &shares, NO_LIMITS).expect("reclaim");
    assert_eq!(victim_ids(&plan), vec!["greedy"]);
    assert_eq!(plan.victims[0].ground, EvictionGround::FairShareReclaim);
    // Past its own share, the same tenant may not reclaim.
    assert_eq!(
        choose_victims(&urgent("small", 0, 17), &gpus, &shares, NO_LIMITS),
        None
    );
}

#[test]
fn young_attempts_and_often_preempted_jobs_are_spared() {
    let mut young = attempt("young", "t", 0, 16);
    young.run_time_seconds = 10;
    let mut tired = attempt("tired", "t", 0, 16);
    tired.preemptions_in_last_hour = 2;
    let gpus = vec![gpu("gpu-0", 0, vec![young, tired])];
    let settings = PreemptionSettings {
        min_run_time_seconds: 300,
        max_preemptions_per_job_per_hour: 2,
    };
    assert_eq!(without_shares(&urgent("t", 10, 8), &gpus, settings), None);
}

#[test]
fn no_plan_when_the_job_already_fits_or_never_can() {
    let gpus = vec![gpu("gpu-0", 16, vec![attempt("a", "t", 0, 8)])];
    assert_eq!(without_shares(&urgent("t", 10, 8), &gpus, NO_LIMITS), None);
    assert_eq!(without_shares(&urgent("t", 10, 64), &gpus, NO_LIMITS), None);
}

const TENANTS: [&str; 3] = ["a", "b", "c"];

/// Tenant index, priority, GiB, minutes run, preemptions in the last hour.
type RawAttempt = (usize, i32, u64, u64, u32);
/// Free GiB and the attempts of one GPU.
type RawGpu = (u64, Vec<RawAttempt>);

fn attempt_strategy() -> impl Strategy<Value = RawAttempt> {
    (0..TENANTS.len(), -2i32..4, 1u64..12, 0u64..40, 0u32..4)
}

fn cluster_strategy() -> impl Strategy<Value = Vec<RawGpu>> {
    prop::collection::vec(
        (0u64..6, prop::collection::vec(attempt_strategy(), 0..6)),
        1..4,
    )
}

fn build_cluster(raw: &[RawGpu]) -> Vec<GpuOccupancy> {
    raw.iter()
        .enumerate()
        .map(|(gpu_index, (free_gib, attempts))| {
            let attempts = attempts
                .iter()
                .enumerate()
                .map(
                    |(attempt_index, &(tenant, priority, gib, minutes, preemptions))| {
                        let mut running = attempt(
                            &format!("g{gpu_index}-a{attempt_index}"),
                            TENANTS[tenant],
                            priority,
                            gib,
                        );
                        running.run_time_seconds = minutes * 60;
                        running.preemptions_in_last_hour = preemptions;
                        running
                    },
                )
                .collect();
            gpu(&format!("gpu-{gpu_index}"), *free_gib, attempts)
        })
        .collect()
}

fn shares_of(gpus: &[GpuOccupancy], weights: &[u32]) -> FairShareState {
    let usable: u64 = gpus
        .iter()
        .map(|gpu| gpu.free_bytes + gpu.attempts.iter().map(|a| a.slice_bytes).sum::<u64>())
        .sum();
    FairShareState {
        usable_bytes: usable,
        tenants: TENANTS
            .iter()
            .zip(weights)
            .map(|(tenant, weight)| TenantShare {
                tenant: tenant.to_string(),
                weight: *weight,
                vram_in_use_bytes: gpus
                    .iter()
                    .flat_map(|gpu| &gpu.attempts)
                    .filter(|a| a.tenant == *tenant)
                    .map(|a| a.slice_bytes)
                    .sum(),
            })
            .collect(),
    }
}

proptest! {
    #[test]
    fn choices_are_minimal_allowed_and_order_independent(
        raw in cluster_strategy(),
        weights in prop::collection::vec(0u32..4, TENANTS.len()),
        job_tenant in 0..TENANTS.len(),
        job_priority in -1i32..5,
        job_gib in 1u64..20,
        min_minutes in 0u64..20,
        max_per_hour in 0u32..4,
        seed in any::<u64>(),
    ) {
        let gpus = build_cluster(&raw);
        let shares = shares_of(&gpus, &weights);
        let job = urgent(TENANTS[job_tenant], job_priority, job_gib);
        let settings = PreemptionSettings {
            min_run_time_seconds: min_minutes * 60,
            max_preemptions_per_job_per_hour: max_per_hour,
        };
        let plan = choose_victims(&job, &gpus, &shares, settings);

        // Order independence: shuffle GPUs, attempts and tenants deterministically.
        let mut shuffled = gpus.clone();
        let mut state = seed;
        let mut next = || { state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); (state >> 33) as usize };
        for index in (1..shuffled.len()).rev() { let other = next() % (index + 1); shuffled.swap(index, other); }
        for gpu in &mut shuffled {
            for index in (1..gpu.attempts.len()).rev() { let other = next() % (index + 1); gpu.attempts.swap(index, other); }
        }
        let mut shuffled_shares = shares.clone();
        shuffled_shares.tenants.reverse();
        prop_assert_eq!(&choose_victims(&job, &shuffled, &shuffled_shares, settings), &plan);

        let Some(plan) = plan else { return Ok(()); };
        let gpu = gpus.iter().find(|gpu| gpu.gpu_id == plan.gpu_id).expect("plan names a GPU");
        prop_assert!(gpu.free_bytes < job.slice_bytes);
        prop_assert!(!plan.victims.is_empty());
        let freed: u64 = plan.victims.iter().map(|victim| victim.slice_bytes).sum();
        prop_assert_eq!(plan.free_bytes_after, gpu.free_bytes + freed);
        prop_assert!(plan.free_bytes_after >= job.slice_bytes);
        // Never more than needed: without any one victim the job no longer fits.
        for victim in &plan.victims {
            prop_assert!(plan.free_bytes_after - victim.slice_bytes < job.slice_bytes);
        }
        for victim in &plan.victims {
            let running = gpu.attempts.iter().find(|a| a.attempt_id == victim.attempt_id).expect("victim runs on the GPU");
            prop_assert!(running.run_time_seconds >= settings.min_run_time_seconds);
            prop_assert!(running.preemptions_in_last_hour < settings.max_preemptions_per_job_per_hour);
            match victim.ground {
                EvictionGround::HigherPriority => prop_assert!(victim.priority < job.priority),
                EvictionGround::FairShareReclaim => {
                    prop_assert!(victim.priority >= job.priority);
                    prop_assert_ne!(&victim.tenant, &job.tenant);
                    let total_weight: u128 = weights.iter().map(|w| u128::from((*w).max(1))).sum();
                    let share = |tenant: &str| shares.tenants.iter().find(|t| t.tenant == tenant).unwrap();
                    let victim_share = share(&victim.tenant);
                    prop_assert!(u128::from(victim_share.vram_in_use_bytes) * total_weight
                        > u128::from(shares.usable_bytes) * u128::from(victim_share.weight.max(1)));
                    let job_share = share(&job.tenant);
                    prop_assert!(u128::from(job_share.vram_in_use_bytes + job.slice_bytes) * total_weight
                        <= u128::from(shares.usable_bytes) * u128::from(job_share.weight.max(1)));
                }
            }
        }
    }
}
