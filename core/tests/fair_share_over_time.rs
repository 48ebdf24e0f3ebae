//! Fair share over time: the scheduling pass orders tenants by decayed usage (their
//! history) plus what they hold now at its steady-state weight, against their weights.
//! At equal shares a tenant with history yields to one without; with no history it is
//! the instantaneous fair share.

use carve_core::scheduling::{
    GpuState, PendingJob, SchedulingOptions, SchedulingProblem, TenantState, solve_with_options,
};
use carve_core::usage::{AttemptUsage, DecayedUsageLedger, UsageDecay, decayed_usage_at};
use proptest::prelude::*;

const GIB: u64 = 1 << 30;
const HOUR_MS: i64 = 3600 * 1000;

fn one_gpu_with_room_for_one(slice_bytes: u64) -> GpuState {
    GpuState {
        gpu_id: "gpu-0".to_string(),
        worker_id: "worker-0".to_string(),
        total_bytes: slice_bytes + slice_bytes / 2,
        context_bytes: 0,
        allocated_bytes: 0,
        schedulable: true,
    }
}

fn tenant(name: &str, weight: u32, history: u128) -> TenantState {
    TenantState {
        tenant: name.to_string(),
        weight,
        vram_quota_bytes: None,
        running_jobs_quota: None,
        vram_in_use_bytes: 0,
        running_jobs: 0,
        decayed_usage_byte_seconds: history,
    }
}

fn job(job_id: &str, tenant: &str, slice_bytes: u64) -> PendingJob {
    PendingJob {
        job_id: job_id.to_string(),
        tenant: tenant.to_string(),
        priority: 0,
        submit_sequence: 0,
        slice_bytes,
    }
}

/// A night (eight hours) of one 40 GiB slice ending at `now`, through the ledger the
/// scheduler and the simulator keep.
fn night_of_usage(now_ms: i64, decay: UsageDecay) -> u128 {
    let mut ledger = DecayedUsageLedger::new(decay, 0);
    ledger.add(&AttemptUsage {
        tenant: "night-owls".to_string(),
        gpu_type: "NVIDIA H100 80GB HBM3".to_string(),
        slice_bytes: 40 * GIB,
        started_at_ms: now_ms - 8 * HOUR_MS,
        ended_at_ms: now_ms,
    });
    ledger.totals_at(now_ms, &[])["night-owls"].vram_byte_seconds
}

#[test]
fn a_tenant_with_a_night_of_usage_yields_to_one_without() {
    let decay = UsageDecay::default();
    let now_ms = 30 * 24 * HOUR_MS;
    let history = night_of_usage(now_ms, decay);
    assert!(history > 0);
    // Both name orders, so the name tie-break is not what decides.
    for (with_history, without) in [("aa-night", "zz-fresh"), ("zz-night", "aa-fresh")] {
        let problem = SchedulingProblem {
            gpus: vec![one_gpu_with_room_for_one(40 * GIB)],
            tenants: vec![tenant(with_history, 1, history), tenant(without, 1, 0)],
            pending: vec![
                job("from-history", with_history, 40 * GIB),
                job("from-fresh", without, 40 * GIB),
            ],
        };
        let decision = solve_with_options(&problem, &SchedulingOptions::default());
        assert_eq!(decision.placements.len(), 1);
        assert_eq!(decision.placements[0].job_id, "from-fresh");
    }
}

#[test]
fn history_weighs_like_holding_its_steady_state_bytes() {
    // A tenant that held 8 GiB steadily for a long time weighs like one holding 8 GiB now:
    // a tenant holding 4 GiB now goes before it, one holding 12 GiB after it.
    let decay = UsageDecay::with_half_life_ms(HOUR_MS).unwrap();
    let now_ms = 100 * HOUR_MS;
    let held = decayed_usage_at(
        &[AttemptUsage {
            tenant: "steady".to_string(),
            gpu_type: "A100".to_string(),
            slice_bytes: 8 * GIB,
            started_at_ms: 0,
            ended_at_ms: now_ms,
        }],
        now_ms,
        decay,
    )["steady"]
        .vram_byte_seconds;
    let options = SchedulingOptions {
        usage_decay: decay,
        ..SchedulingOptions::default()
    };
    for (holding_now, steady_first) in [(4 * GIB, false), (12 * GIB, true)] {
        let mut busy = tenant("busy", 1, 0);
        busy.vram_in_use_bytes = holding_now;
        busy.running_jobs = 1;
        let problem = SchedulingProblem {
            gpus: vec![one_gpu_with_room_for_one(GIB)],
            tenants: vec![tenant("steady", 1, held), busy],
            pending: vec![
                job("steady-job", "steady", GIB),
                job("busy-job", "busy", GIB),
            ],
        };
        let decision = solve_with_options(&problem, &options);
        let first = &decision.placements[0].job_id;
        assert_eq!(first == "steady-job", steady_first, "holding {holding_now}");
    }
}

proptest! {
    #[test]
    fn at_equal_shares_a_tenant_with_history_yields_to_one_without(
        history in 1u128..(1u128 << 80),
        weight in 1u32..1000,
        slice_gib in 1u64..80,
        history_name_first in any::<bool>(),
    ) {
        let (with_history, without) = if history_name_first {
            ("alpha", "beta")
        } else {
            ("beta", "alpha")
        };
        let problem = SchedulingProblem {
            gpus: vec![one_gpu_with_room_for_one(slice_gib * GIB)],
            tenants: vec![tenant(with_history, weight, history), tenant(without, weight, 0)],
            pending: vec![
                job("history-job", with_history, slice_gib * GIB),
                job("fresh-job", without, slice_gib * GIB),
            ],
        };
        let decision = solve_with_options(&problem, &SchedulingOptions::default());
        prop_assert_eq!(decision.placements.len(), 1);
        prop_assert_eq!(&decision.placements[0].job_id, "fresh-job");
    }

    #[test]
    fn more_history_yields_to_less_at_equal_shares(
        less in 0u128..(1u128 << 70),
        extra in 1u128..(1u128 << 70),
        weight in 1u32..1000,
    ) {
        let problem = SchedulingProblem {
            gpus: vec![one_gpu_with_room_for_one(GIB)],
            tenants: vec![tenant("alpha", weight, less + extra), tenant("beta", weight, less)],
            pending: vec![job("alpha-job", "alpha", GIB), job("beta-job", "beta", GIB)],
        };
        let decision = solve_with_options(&problem, &SchedulingOptions::default());
        prop_assert_eq!(&decision.placements[0].job_id, "beta-job");
    }
}
