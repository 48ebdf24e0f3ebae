//! Tests of preemption in the simulator: a trace built so an urgent job waits behind a
//! long low-priority one, and the invariants of generated traces with mixed priorities;
//! and of fair share over time in it (a tenant with history yields).

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

const HEADER: &str =
    "submit_time_s,duration_s,tenant,gpus,requested_bytes,actual_peak_bytes,priority";

fn workload(trace: &str) -> Workload {
    Workload::prepare(&parse_trace(trace).unwrap(), &BTreeMap::new()).unwrap()
}

fn run(
    workload: &Workload,
    cluster: &str,
    preemption: Option<SimulatedPreemption>,
) -> PolicyReport {
    let options = SimulationOptions {
        preemption,
        urgent_priority: 10,
        ..SimulationOptions::default()
    };
    simulate(
        workload,
        &Cluster::parse(cluster).unwrap(),
        Policy::Declared,
        &options,
        &mut MemoryOracle::default(),
    )
    .unwrap()
}

#[test]
fn an_urgent_job_waits_a_grace_period_instead_of_a_whole_run() {
    // A 60 GiB job of priority 0 holds the only GPU for 10 000 s; at 600 s an urgent
    // 40 GiB job of priority 10 arrives.
    let workload = workload(&format!(
        "{HEADER}\n0,10000,batch,1,60GiB,60GiB,0\n600,100,oncall,1,40GiB,40GiB,10\n"
    ));
    let without = run(&workload, "1x80GiB", None);
    assert_eq!(without.succeeded_jobs, 2);
    assert_eq!(without.preemptions, 0);
    assert_eq!(without.urgent_queueing.jobs, 1);
    assert_eq!(without.urgent_queueing.max_s, 9400.0);

    let with = run(&workload, "1x80GiB", Some(SimulatedPreemption::default()));
    assert_eq!(with.succeeded_jobs, 2);
    assert_eq!(with.preemptions, 1);
    // Evicted at 600 s (it has run the 300 s minimum), stopped 30 s later.
    assert_eq!(with.urgent_queueing.max_s, 30.0);
    assert_eq!(with.urgent_queueing.mean_s, 30.0);
    // It had a checkpoint at 600 s of run time: the 30 s since are done again, after
    // the urgent job's 100 s.
    assert_eq!(with.preempted_run_time_lost_s, 30.0);
    assert_eq!(with.makespan_s, 630.0 + 100.0 + (10_000.0 - 600.0));
}

#[test]
fn the_limits_against_thrashing_are_the_schedulers() {
    let workload = workload(&format!(
        "{HEADER}\n0,10000,batch,1,60GiB,60GiB,0\n100,100,oncall,1,40GiB,40GiB,10\n"
    ));
    // At 100 s the attempt is younger than the 300 s minimum: evicted once it is 300 s old.
    let with = run(&workload, "1x80GiB", Some(SimulatedPreemption::default()));
    assert_eq!(with.preemptions, 1);
    assert_eq!(with.urgent_queueing.max_s, 200.0 + 30.0);
    // Not preempted more than the cap per hour: with a cap of 1, the second urgent job
    // waits until an hour after the first preemption (600 s + 3600 s), plus the grace.
    let workload = self::workload(&format!(
        "{HEADER}\n0,10000,batch,1,60GiB,60GiB,0\n600,100,oncall,1,40GiB,40GiB,10\n\
         1500,100,oncall,1,40GiB,40GiB,10\n"
    ));
    let mut capped = SimulatedPreemption::default();
    capped.limits.max_preemptions_per_job_per_hour = 1;
    let with = run(&workload, "1x80GiB", Some(capped));
    assert_eq!(with.preemptions, 2);
    assert_eq!(with.succeeded_jobs, 3);
    assert_eq!(with.urgent_queueing.max_s, 4200.0 + 30.0 - 1500.0);
}

fn mixed_priorities(jobs: usize, seed: u64) -> Workload {
    let mut workload = workload_from_generator(jobs, seed);
    for (index, job) in workload.jobs.iter_mut().enumerate() {
        job.priority = [0, 0, 0, 5, 10][(index as u64 ^ seed) as usize % 5];
    }
    workload
}

fn workload_from_generator(jobs: usize, seed: u64) -> Workload {
    let options = GeneratorOptions {
        jobs,
        seed,
        tenants: 3,
        mean_interarrival_s: 30.0,
        ..GeneratorOptions::default()
    };
    Workload::prepare(
        &parse_trace(&generate_trace(&options).unwrap()).unwrap(),
        &BTreeMap::new(),
    )
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4, ..ProptestConfig::default() })]

    #[test]
    fn with_preemption_no_gpu_is_oversubscribed_every_job_ends_and_pruning_changes_nothing(
        seed in 0u64..1_000_000
    ) {
        let workload = mixed_priorities(60, seed);
        let cluster = Cluster::parse("1x3x80GiB").unwrap();
        let options = SimulationOptions {
            preemption: Some(SimulatedPreemption::default()),
            urgent_priority: 10,
            ..SimulationOptions::default()
        };
        let mut oracle = MemoryOracle::default();
        for policy in Policy::ALL {
            let pruned = event_loop::simulate_with_pruning(&workload, &cluster, policy, &options, &mut oracle, true).unwrap();
            let whole = event_loop::simulate_with_pruning(&workload, &cluster, policy, &options, &mut oracle, false).unwrap();
            prop_assert!(pruned.most_allocated_on_one_gpu_bytes <= pruned.usable_bytes_per_gpu);
            prop_assert_eq!(pruned.succeeded_jobs + pruned.failed_jobs + pruned.rejected_jobs, 60);
            prop_assert!(pruned.preempted_run_time_lost_s >= 0.0);
            prop_assert_eq!(pruned, whole);
        }
    }
}

#[test]
fn a_rows_priority_overrides_the_specs_and_must_be_a_whole_number() {
    let workload = workload(&format!(
        "{HEADER}\n0,10,a,1,1GiB,1GiB,-3\n0,10,a,1,1GiB,1GiB,\n"
    ));
    let priorities: Vec<i32> = workload.jobs.iter().map(|job| job.priority).collect();
    assert_eq!(priorities, [-3, 0]);
    let error = parse_trace(&format!("{HEADER}\n0,10,a,1,1GiB,1GiB,high\n"))
        .unwrap_err()
        .to_string();
    assert!(
        error.starts_with("row 2 column priority: `high` is not a whole number"),
        "{error}"
    );
}

#[test]
fn fair_share_over_time_places_the_tenant_without_history_first() {
    // "aa" ran a 60 GiB job for 1000 s; at 2000 s "aa" and "zz" each submit one job into
    // the one 80 GiB GPU, which holds one of them. Instantaneous fair share sees two idle
    // tenants and takes "aa" by name; with decayed usage "zz" goes first. The queueing
    // delays tell which: "aa"'s job lasts 100 s, "zz"'s 500 s.
    let workload = workload(&format!(
        "{HEADER}\n0,1000,aa,1,60GiB,60GiB,0\n2000,100,aa,1,60GiB,60GiB,0\n\
         2000,500,zz,1,60GiB,60GiB,0\n"
    ));
    let cluster = Cluster::parse("1x80GiB").unwrap();
    let report = |fair_share_half_life_s| {
        let options = SimulationOptions {
            fair_share_half_life_s,
            ..SimulationOptions::default()
        };
        simulate(
            &workload,
            &cluster,
            Policy::Declared,
            &options,
            &mut MemoryOracle::default(),
        )
        .unwrap()
    };
    let instantaneous = report(None);
    assert_eq!(instantaneous.succeeded_jobs, 3);
    assert_eq!(instantaneous.queueing_delay_s.p99, 100.0);
    let decayed = report(Some(7.0 * 24.0 * 3600.0));
    assert_eq!(decayed.succeeded_jobs, 3);
    assert_eq!(decayed.queueing_delay_s.p99, 500.0);
}
