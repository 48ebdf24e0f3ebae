//! Tests of the whole simulator on traces small enough to check by hand, plus properties
//! of generated traces (determinism, never oversubscribing a GPU, every job accounted for).

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::estimator::estimate_job;
use crate::plan::RunConfig;
use crate::validate::load_job_spec_toml;

const GIB: u64 = 1 << 30;
const HEADER: &str = "submit_time_s,duration_s,tenant,gpus,requested_bytes,model,actual_peak_bytes";

fn workload(trace: &str) -> Workload {
    Workload::prepare(&parse_trace(trace).unwrap(), &BTreeMap::new()).unwrap()
}

fn run(workload: &Workload, cluster: &str, policy: Policy) -> PolicyReport {
    simulate(
        workload,
        &Cluster::parse(cluster).unwrap(),
        policy,
        &SimulationOptions::default(),
        &mut MemoryOracle::default(),
    )
    .unwrap()
}

fn required_bytes(model: &str) -> u64 {
    let job =
        load_job_spec_toml(&ModelFamilyParameters::parse(model).unwrap().job_spec_toml()).unwrap();
    estimate_job(&job, &RunConfig::from_spec(&job.spec))
        .unwrap()
        .required_bytes
}

fn close(left: f64, right: f64) -> bool {
    (left - right).abs() <= 1e-9 * right.abs().max(1.0)
}

#[test]
fn whole_gpu_runs_two_small_jobs_one_after_the_other_and_carve_packs_them() {
    let model = "cnn:width=16:depth=4:batch=32:image=32";
    let need = required_bytes(model);
    let trace = format!("{HEADER}\n0,100,alice,1,4GiB,{model},\n0,100,bob,1,4GiB,{model},\n");
    let workload = workload(&trace);

    let whole = run(&workload, "1x80GiB", Policy::WholeGpu);
    assert_eq!(whole.succeeded_jobs, 2);
    assert_eq!(whole.makespan_s, 200.0);
    // One whole GPU allocated all the time, each job using `need` of it.
    assert!(close(whole.allocated_memory_utilisation, 1.0));
    assert!(close(
        whole.used_memory_utilisation,
        need as f64 / (80 * GIB) as f64
    ));
    assert!(close(whole.jobs_per_busy_gpu, 1.0));
    assert_eq!(whole.queueing_delay_s.p50, 0.0);
    assert_eq!(whole.queueing_delay_s.p99, 100.0);
    assert_eq!(whole.completion_time_s.p99, 200.0);
    assert_eq!(whole.fragmentation, 0.0);

    let carve = run(&workload, "1x80GiB", Policy::Carve);
    assert_eq!(carve.succeeded_jobs, 2);
    assert_eq!(carve.makespan_s, 100.0);
    assert!(close(carve.jobs_per_busy_gpu, 2.0));
    assert!(close(
        carve.allocated_memory_utilisation,
        2.0 * need as f64 / (80 * GIB) as f64
    ));
    assert!(close(
        carve.used_memory_utilisation,
        carve.allocated_memory_utilisation
    ));
    assert_eq!(carve.queueing_delay_s.p99, 0.0);
    assert_eq!(carve.completion_time_s.p99, 100.0);
    assert_eq!(carve.out_of_memory_attempts, 0);

    let declared = run(&workload, "1x80GiB", Policy::Declared);
    assert!(close(declared.allocated_memory_utilisation, 8.0 / 80.0));
    assert!(close(declared.jobs_per_busy_gpu, 2.0));
}

#[test]
fn declared_policy_runs_out_of_memory_as_the_trace_implies() {
    // Row 2: needs 10 GiB, declares 4: out of memory at 4 and 8, runs at 16.
    // Row 3: declares more than it needs. Row 4: needs more than a GPU: out of memory at
    // 50 GiB and at the whole 80, then fails.
    let trace = format!(
        "{HEADER}\n0,1000,alice,1,4GiB,,10GiB\n0,1000,bob,1,4GiB,,2GiB\n0,1000,carol,1,50GiB,,100GiB\n"
    );
    let workload = workload(&trace);
    let declared = run(&workload, "2x80GiB", Policy::Declared);
    assert_eq!(declared.out_of_memory_attempts, 4);
    assert_eq!(declared.succeeded_jobs, 2);
    assert_eq!(declared.failed_jobs, 1);
    // Row 2: out of memory at 100 s (10% of 1000 s, before the first checkpoint), back at
    // 700 s, out again at 800 s, back at 1400 s, done at 2400 s.
    assert_eq!(declared.completion_time_s.p99, 2400.0);
    assert_eq!(declared.completion_time_s.p50, 1000.0);

    let whole = run(&workload, "2x80GiB", Policy::WholeGpu);
    assert_eq!(whole.out_of_memory_attempts, 1);
    assert_eq!(whole.failed_jobs, 1);
    assert_eq!(whole.succeeded_jobs, 2);
}

#[test]
fn carve_shrinks_after_a_run_time_out_of_memory_and_retries_from_the_checkpoint() {
    let model = "cnn:width=32:depth=6:batch=128:image=64";
    let estimated = required_bytes(model);
    // The job needs a quarter more than the estimator sees.
    let actual = estimated + estimated / 4;
    let trace = format!("{HEADER}\n0,10000,alice,1,4GiB,{model},{actual}\n");
    let workload = workload(&trace);
    let carve = run(&workload, "1x80GiB", Policy::Carve);
    assert_eq!(carve.out_of_memory_attempts, 1);
    assert_eq!(carve.shrunk_jobs, 1);
    assert_eq!(carve.succeeded_jobs, 1);
    // Out of memory at 1000 s with one checkpoint (600 s) kept: 9400 s of work left, in
    // mixed precision (the first strategy of the default order), which costs no time.
    assert_eq!(carve.completion_time_s.p50, 1000.0 + 9400.0);
    let whole = run(&workload, "1x80GiB", Policy::WholeGpu);
    assert_eq!(
        (whole.out_of_memory_attempts, whole.completion_time_s.p50),
        (0, 10000.0)
    );
}

#[test]
fn carve_shrinks_a_job_larger_than_any_gpu_at_admission() {
    let model = "cnn:width=128:depth=16:batch=192:image=288";
    assert!(required_bytes(model) > 80 * GIB);
    let trace = format!("{HEADER}\n0,3600,alice,1,200GiB,{model},\n");
    let workload = workload(&trace);
    let carve = run(&workload, "1x80GiB", Policy::Carve);
    assert_eq!(
        (
            carve.succeeded_jobs,
            carve.shrunk_jobs,
            carve.out_of_memory_attempts
        ),
        (1, 1, 0)
    );
    assert!(carve.most_allocated_on_one_gpu_bytes <= 80 * GIB);
    let whole = run(&workload, "1x80GiB", Policy::WholeGpu);
    assert_eq!(
        (
            whole.succeeded_jobs,
            whole.failed_jobs,
            whole.out_of_memory_attempts
        ),
        (0, 1, 1)
    );
    // On a 256 MiB GPU not even the smallest allowed configuration fits: refused at submit.
    let small = run(&workload, "1x256MiB", Policy::Carve);
    assert_eq!(small.rejected_jobs, 1);
}

#[test]
fn spec_files_come_in_as_texts_and_their_errors_name_the_row() {
    let trace = parse_trace(&format!("{HEADER},spec\n0,10,alice,1,1GiB,,,jobs/a.toml\n")).unwrap();
    let missing = Workload::prepare(&trace, &BTreeMap::new()).unwrap_err();
    assert!(
        missing
            .to_string()
            .starts_with("row 2 column spec: `jobs/a.toml`"),
        "{missing}"
    );
    let texts = BTreeMap::from([("jobs/a.toml".to_string(), "name = \"a\"\n".to_string())]);
    let invalid = Workload::prepare(&trace, &texts).unwrap_err();
    assert!(
        invalid
            .to_string()
            .starts_with("row 2 column spec: `jobs/a.toml`: model"),
        "{invalid}"
    );
    let model = ModelFamilyParameters::parse("cnn:width=8:depth=2:batch=4:image=8").unwrap();
    let texts = BTreeMap::from([("jobs/a.toml".to_string(), model.job_spec_toml())]);
    let workload = Workload::prepare(&trace, &texts).unwrap();
    assert_eq!(workload.models.len(), 1);
    assert_eq!(run(&workload, "1x1GiB", Policy::Carve).succeeded_jobs, 1);
}

#[test]
fn clusters_and_options_are_checked() {
    assert_eq!(
        Cluster::parse("4x8x80GiB").unwrap(),
        Cluster {
            nodes: 4,
            gpus_per_node: 8,
            gpu_bytes: 80 * GIB
        }
    );
    assert_eq!(Cluster::parse("8x80GiB").unwrap().gpu_count(), 8);
    for (text, expected) in [
        ("80GiB", "cluster: `80GiB` is not"),
        ("0x80GiB", "cluster: 0 must be"),
        ("2xax80GiB", "cluster: `a` is not"),
        ("2x8x80 parsecs", "cluster: GPU size: unknown unit"),
    ] {
        let message = Cluster::parse(text).unwrap_err().to_string();
        assert!(message.starts_with(expected), "{message}");
    }
    let options = SimulationOptions {
        oom_after_fraction: 0.0,
        ..SimulationOptions::default()
    };
    let error = simulate(
        &Workload::default(),
        &Cluster::parse("1x8GiB").unwrap(),
        Policy::Carve,
        &options,
        &mut MemoryOracle::default(),
    )
    .unwrap_err();
    assert!(
        error.to_string().starts_with("oom_after_fraction"),
        "{error}"
    );
}

fn generated(jobs: usize, seed: u64) -> Workload {
    generated_with_gaps(jobs, seed, 120.0)
}

fn generated_with_gaps(jobs: usize, seed: u64, mean_interarrival_s: f64) -> Workload {
    let options = GeneratorOptions {
        jobs,
        seed,
        tenants: 3,
        mean_interarrival_s,
        ..GeneratorOptions::default()
    };
    workload(&generate_trace(&options).unwrap())
}

#[test]
fn a_seed_gives_the_same_results_every_time() {
    let workload = generated(120, 7);
    for policy in Policy::ALL {
        let first = run(&workload, "2x2x80GiB", policy);
        let again = run(&generated(120, 7), "2x2x80GiB", policy);
        assert_eq!(first, again, "{policy}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    #[test]
    fn leaving_out_jobs_that_cannot_be_placed_changes_nothing(seed in 0u64..1_000_000) {
        // Arrivals far faster than the cluster drains, so queues are long.
        let workload = generated_with_gaps(80, seed, 10.0);
        let cluster = Cluster::parse("1x3x80GiB").unwrap();
        let mut oracle = MemoryOracle::default();
        for policy in Policy::ALL {
            let options = SimulationOptions::default();
            let pruned = event_loop::simulate_with_pruning(&workload, &cluster, policy, &options, &mut oracle, true).unwrap();
            let whole = event_loop::simulate_with_pruning(&workload, &cluster, policy, &options, &mut oracle, false).unwrap();
            prop_assert!(whole.queueing_delay_s.p95 > 0.0, "the queue must build up for the test to mean anything");
            prop_assert_eq!(pruned, whole);
        }
    }

    #[test]
    fn no_gpu_is_ever_oversubscribed_and_every_job_ends(seed in 0u64..1_000_000) {
        let workload = generated(60, seed);
        for policy in Policy::ALL {
            let report = run(&workload, "2x2x80GiB", policy);
            prop_assert!(report.most_allocated_on_one_gpu_bytes <= report.usable_bytes_per_gpu);
            prop_assert_eq!(report.succeeded_jobs + report.failed_jobs + report.rejected_jobs, 60);
            prop_assert!(report.used_memory_utilisation <= report.allocated_memory_utilisation + 1e-9);
            prop_assert!(report.allocated_memory_utilisation <= 1.0 + 1e-9);
            prop_assert!(report.fragmentation <= 1.0 - report.allocated_memory_utilisation + 1e-9);
        }
    }
}

/// A command job of a global batch of 64 that may accumulate, declared at 8 GiB.
const COMMAND_JOB: &str = r#"
name = "standin"
[command]
argv = ["python3", "standin_train.py", "--micro-batch", "{micro_batch}"]
global_batch = 64
[resources]
vram = "8GiB"
[oom]
strategies = ["accumulate"]
"#;

fn command_trace(rows: &str) -> Result<Workload, CoreError> {
    let header =
        "submit_time_s,duration_s,tenant,gpus,requested_bytes,spec,actual_peak_bytes,command_model";
    let texts = BTreeMap::from([("jobs/standin.toml".to_string(), COMMAND_JOB.to_string())]);
    Workload::prepare(&parse_trace(&format!("{header}\n{rows}")).unwrap(), &texts)
}

#[test]
fn a_command_job_runs_by_the_memory_model_its_row_gives() {
    // 1 GiB + 64 MiB x 64 = 5 GiB: fits its 8 GiB slice as it is.
    let workload =
        command_trace("0,100,alice,1,8GiB,jobs/standin.toml,,fixed=1GiB:per_sample=64MiB\n")
            .unwrap();
    assert_eq!(workload.models.len(), 1);
    assert_eq!(workload.models[0].own_required_bytes, 5 * GIB);
    assert_eq!(workload.models[0].own_config.micro_batch_size, 64);
    let carve = run(&workload, "1x80GiB", Policy::Carve);
    assert_eq!((carve.succeeded_jobs, carve.failed_jobs), (1, 0));
    // 1 GiB + 160 MiB x 64 = 11 GiB does not fit the 8 GiB it asks for: shrunk ahead of
    // time to micro-batches of 32 (6 GiB).
    let workload =
        command_trace("0,100,alice,1,8GiB,jobs/standin.toml,,fixed=1GiB:per_sample=160MiB\n")
            .unwrap();
    let carve = run(&workload, "1x80GiB", Policy::Carve);
    assert_eq!((carve.succeeded_jobs, carve.failed_jobs), (1, 0));
    assert_eq!((carve.out_of_memory_attempts, carve.shrunk_jobs), (0, 1));
}

#[test]
fn a_command_job_that_needs_more_than_its_profile_saw_is_shrunk_after_its_oom() {
    // The profile saw 1 GiB + 64 MiB x 64 = 5 GiB; the run needs 9 GiB, more than its
    // 8 GiB slice: it runs out, and accumulation brings it under.
    let workload =
        command_trace("0,100,alice,1,8GiB,jobs/standin.toml,9GiB,fixed=1GiB:per_sample=64MiB\n")
            .unwrap();
    let whole = run(&workload, "1x8GiB", Policy::WholeGpu);
    assert_eq!(whole.failed_jobs, 1);
    let carve = run(&workload, "1x8GiB", Policy::Carve);
    assert_eq!((carve.succeeded_jobs, carve.failed_jobs), (1, 0));
    // Exactly one retry: the planner's raised model put it at micro-batches of 32.
    assert_eq!((carve.out_of_memory_attempts, carve.shrunk_jobs), (1, 1));
}

#[test]
fn command_models_are_checked_with_their_row_and_column() {
    for (rows, expected) in [
        (
            "0,100,alice,1,8GiB,jobs/standin.toml,,\n",
            "row 2 column command_model: `jobs/standin.toml` is a command job",
        ),
        (
            "0,100,alice,1,8GiB,jobs/standin.toml,,fixed=1GiB\n",
            "row 2 column command_model: needs fixed and per_sample",
        ),
        (
            "0,100,alice,1,8GiB,jobs/standin.toml,,fixed=1GiB:per_sample=3 parsecs\n",
            "row 2 column command_model: per_sample: unknown unit",
        ),
        (
            "0,100,alice,1,8GiB,,1GiB,fixed=1GiB:per_sample=1MiB\n",
            "row 2 column command_model: needs a spec",
        ),
    ] {
        let header = "submit_time_s,duration_s,tenant,gpus,requested_bytes,spec,actual_peak_bytes,command_model";
        let texts = BTreeMap::from([("jobs/standin.toml".to_string(), COMMAND_JOB.to_string())]);
        let error = parse_trace(&format!("{header}\n{rows}"))
            .and_then(|trace| Workload::prepare(&trace, &texts))
            .unwrap_err()
            .to_string();
        assert!(error.starts_with(expected), "{error}");
    }
    let model = ModelFamilyParameters::parse("cnn:width=8:depth=2:batch=4:image=8").unwrap();
    let trace = parse_trace(&format!(
        "{HEADER},spec,command_model\n0,10,alice,1,1GiB,,,jobs/a.toml,fixed=1GiB:per_sample=1MiB\n"
    ))
    .unwrap();
    let texts = BTreeMap::from([("jobs/a.toml".to_string(), model.job_spec_toml())]);
    let error = Workload::prepare(&trace, &texts).unwrap_err().to_string();
    assert!(
        error.starts_with("row 2 column command_model: `jobs/a.toml` is a model job"),
        "{error}"
    );
    let error = parse_trace(&format!(
        "{HEADER},command_model\n0,10,alice,1,1GiB,{},,fixed=1GiB:per_sample=1MiB\n",
        "cnn:width=8:depth=2:batch=4:image=8"
    ))
    .unwrap_err()
    .to_string();
    assert!(error.starts_with("row 2 column command_model"), "{error}");
}

/// A gang of four in a stream of single-slice jobs that keeps every GPU busy: without
/// reservations the stream starves it until the stream is over; with them it starts
/// once the jobs queued before it have, and its four members start and end together.
#[test]
fn a_gang_in_a_stream_of_small_jobs_waits_far_less_with_reservations() {
    let mut trace = format!("{HEADER}\n");
    for index in 0..200 {
        let time = index * 100;
        trace.push_str(&format!("{time},600,small-{},1,50GiB,,50GiB\n", index % 3));
    }
    trace.push_str("1000,600,big,4,40GiB,,40GiB\n");
    let workload = workload(&trace);
    let cluster = Cluster::parse("1x4x80GiB").unwrap();
    let report = |reservations: bool| {
        simulate(
            &workload,
            &cluster,
            Policy::Declared,
            &SimulationOptions {
                gang_reservations: Some(reservations),
                ..SimulationOptions::default()
            },
            &mut MemoryOracle::default(),
        )
        .unwrap()
    };
    let (on, off) = (report(true), report(false));
    for run in [&on, &off] {
        assert_eq!(run.succeeded_jobs, 201);
        assert_eq!(run.gang_queueing.jobs, 1);
        assert_eq!(run.single_queueing.jobs, 200);
        assert!(run.most_allocated_on_one_gpu_bytes <= run.usable_bytes_per_gpu);
    }
    assert_eq!(on.gang_reservations, Some(true));
    assert_eq!(off.gang_reservations, Some(false));
    // Off: the gang waits for the stream (20,000 s of arrivals) to end.
    assert!(
        off.gang_queueing.max_s > 20_000.0,
        "{:?}",
        off.gang_queueing
    );
    // On: the ten jobs queued before it and one round of 600 s jobs, roughly.
    assert!(on.gang_queueing.max_s < 3_000.0, "{:?}", on.gang_queueing);
    // A trace with a gang uses the gang pass even without the option; preemption with
    // gangs is refused rather than half simulated.
    let default = run(&workload, "1x4x80GiB", Policy::Declared);
    assert_eq!(default.gang_reservations, Some(true));
    assert_eq!(default.gang_queueing, on.gang_queueing);
    let error = simulate(
        &workload,
        &cluster,
        Policy::Declared,
        &SimulationOptions {
            preemption: Some(SimulatedPreemption::default()),
            ..SimulationOptions::default()
        },
        &mut MemoryOracle::default(),
    )
    .unwrap_err();
    assert!(error.to_string().contains("gangs"), "{error}");
}
