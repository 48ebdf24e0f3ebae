//! `cargo bench -p carve-core --bench placement`: how long one scheduling pass takes on a
//! large cluster, since the scheduler loop runs a pass whenever jobs arrive or finish.
//!
//! 5,000 nodes x 8 GPUs (80 GiB and 40 GiB models, 512 MiB CUDA context each), 100,000
//! pending jobs of mixed sizes (1 to 78 GiB, mostly small) from 64 tenants with weights
//! 1 to 4, some with quotas. Prints a table (scenario, jobs placed and waiting, the median
//! time of a full pass, placements per second). Compare across commits on one machine.

use std::hint::black_box;
use std::time::{Duration, Instant};

use carve_core::scheduling::{
    GpuState, PendingJob, SchedulingDecision, SchedulingProblem, TenantState, solve,
};

const GIB: u64 = 1 << 30;
const NODES: usize = 5_000;
const GPUS_PER_NODE: usize = 8;
const PENDING_JOBS: usize = 100_000;
const TENANTS: usize = 64;

/// SplitMix64: the bench's inputs are the same on every run.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut mixed = self.0;
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        mixed ^ (mixed >> 31)
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound
    }
}

#[derive(Clone, Copy)]
enum Occupancy {
    Empty,
    /// A random share of each GPU is allocated, in whole GiB.
    Busy,
    /// At most 8 GiB free on each GPU, so most tenants' head jobs are blocked and reserve.
    NearlyFull,
}

fn cluster(random: &mut SplitMix64, occupancy: Occupancy) -> Vec<GpuState> {
    let mut gpus = Vec::with_capacity(NODES * GPUS_PER_NODE);
    for node in 0..NODES {
        let total_gib = if node % 5 < 3 { 80 } else { 40 };
        for device in 0..GPUS_PER_NODE {
            let context_bytes = 512 << 20;
            let usable_gib = (total_gib * GIB - context_bytes) / GIB;
            let allocated_gib = match occupancy {
                Occupancy::Empty => 0,
                Occupancy::Busy => random.below(usable_gib + 1),
                Occupancy::NearlyFull => usable_gib - random.below(9),
            };
            gpus.push(GpuState {
                gpu_id: format!("node-{node:04}-gpu-{device}"),
                worker_id: format!("node-{node:04}"),
                total_bytes: total_gib * GIB,
                context_bytes,
                allocated_bytes: allocated_gib * GIB,
                schedulable: node % 100 != 99,
            });
        }
    }
    gpus
}

fn tenants() -> Vec<TenantState> {
    (0..TENANTS)
        .map(|index| TenantState {
            tenant: format!("tenant-{index:02}"),
            weight: 1 + (index % 4) as u32,
            vram_quota_bytes: (index % 4 == 0).then_some(20_000 * GIB),
            running_jobs_quota: (index % 5 == 0).then_some(1_000),
            vram_in_use_bytes: 0,
            running_jobs: 0,
            decayed_usage_byte_seconds: 0,
        })
        .collect()
}

fn pending_jobs(random: &mut SplitMix64) -> Vec<PendingJob> {
    // Mostly small jobs, a tail of whole-GPU ones.
    const SIZES_GIB: [u64; 16] = [1, 1, 2, 2, 2, 4, 4, 4, 6, 8, 8, 12, 16, 24, 40, 78];
    (0..PENDING_JOBS)
        .map(|index| PendingJob {
            job_id: format!("job-{index:06}"),
            tenant: format!("tenant-{:02}", random.below(TENANTS as u64)),
            priority: random.below(3) as i32 - 1,
            submit_sequence: index as u64,
            slice_bytes: SIZES_GIB[random.below(SIZES_GIB.len() as u64) as usize] * GIB,
        })
        .collect()
}

/// The median time of `runs` passes, and the last decision.
fn time_pass(problem: &SchedulingProblem, runs: usize) -> (Duration, SchedulingDecision) {
    let mut times = Vec::with_capacity(runs);
    let mut decision = SchedulingDecision::default();
    for _ in 0..runs {
        let start = Instant::now();
        decision = black_box(solve(black_box(problem)));
        times.push(start.elapsed());
    }
    times.sort();
    (times[times.len() / 2], decision)
}

fn main() {
    let mut random = SplitMix64(7);
    let empty = SchedulingProblem {
        gpus: cluster(&mut random, Occupancy::Empty),
        tenants: tenants(),
        pending: pending_jobs(&mut random),
    };
    let busy = SchedulingProblem {
        gpus: cluster(&mut random, Occupancy::Busy),
        ..empty.clone()
    };
    let nearly_full = SchedulingProblem {
        gpus: cluster(&mut random, Occupancy::NearlyFull),
        ..empty.clone()
    };

    println!(
        "{:<34} {:>6} {:>8} {:>8} {:>8} {:>9} {:>10} {:>13}",
        "scenario", "gpus", "pending", "placed", "waiting", "reserved", "pass (ms)", "placements/s"
    );
    let mut rows: Vec<(&str, SchedulingProblem)> = vec![
        ("empty cluster", empty),
        ("busy cluster", busy),
        ("nearly full cluster", nearly_full),
    ];
    // The pass after a decision took effect: everything waits, nothing new is placed.
    let mut after_busy = rows[1].1.clone();
    after_busy.apply_placements(&solve(&after_busy).placements);
    rows.push(("busy cluster, pass after (fixpoint)", after_busy));
    for (scenario, problem) in &rows {
        let (median, decision) = time_pass(problem, 7);
        let placements_per_second = decision.placements.len() as f64 / median.as_secs_f64();
        println!(
            "{:<34} {:>6} {:>8} {:>8} {:>8} {:>9} {:>10.1} {:>13.0}",
            scenario,
            problem.gpus.len(),
            problem.pending.len(),
            decision.placements.len(),
            decision.waiting.len(),
            decision.reservations.len(),
            median.as_secs_f64() * 1e3,
            placements_per_second,
        );
    }
}
