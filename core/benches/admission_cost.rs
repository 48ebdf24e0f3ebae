//! `cargo bench -p carve-core --bench admission_cost [-- N N ...]`: what admitting one job
//! costs as its model grows, since the scheduler validates and estimates every submitted
//! spec and a user chooses the layer count.
//!
//! The model is N dense layers of 64 units (the shape of the issue-13 report: deep, cheap
//! layers, so the cost is the plan's length, not its tensors). For each N it times
//! parsing + validating the JSON spec, compiling the step plan, estimating it, and the
//! shrink planner in a 1 MiB slice (nothing fits, so every strategy and level is tried):
//! the mean over calls adding up to 200 ms or more, in the thread's CPU time so that other
//! load on a shared machine does not count. N defaults to 500, 1000, 2000, 4000; a
//! model over the validation limit is reported as refused. A last line times the longest
//! search the shrink planner's budget allows: a model at the layer limit whose batch has
//! 240 divisors, every strategy allowed.

use std::hint::black_box;
use std::time::{Duration, Instant};

use carve_core::estimator::estimate_plan;
use carve_core::plan::{RunConfig, compile_step_plan};
use carve_core::shrink::plan_shrink;
use carve_core::validate::{MAX_MODEL_LAYERS, parse_job_spec_json, validate_job_spec};

fn dense_spec_json(layers: usize) -> String {
    dense_spec_json_with(layers, 32, "")
}

/// The same model with another batch size and, when `oom` is not empty, an `oom` table.
fn dense_spec_json_with(layers: usize, batch_size: u64, oom: &str) -> String {
    let mut layer_list = Vec::with_capacity(layers);
    for _ in 0..layers - 1 {
        layer_list.push(r#"{"dense": {"units": 64}}"#.to_string());
    }
    layer_list.push(r#"{"dense": {"units": 10}}"#.to_string());
    format!(
        r#"{{"name": "deep-dense", "model": {{"input_shape": [64], "loss": "softmax_cross_entropy", "layers": [{}]}},
"training": {{"batch_size": {batch_size}, "steps": 1, "optimizer": {{"adam": {{"learning_rate": 0.001}}}}}},
"data": {{"format": "synthetic", "samples": 64}}{oom}}}"#,
        layer_list.join(",")
    )
}

/// CPU time this thread has run, from the kernel's scheduler statistics: unlike wall time
/// it does not count the time other work on a shared machine held the core. `None` where
/// the file is missing (not Linux).
fn thread_cpu_time() -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let nanoseconds = text.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(nanoseconds))
}

/// The mean time per call of `work`, called until about 200 ms of thread CPU time have
/// passed (the kernel updates that count at scheduler ticks, so one short call cannot be
/// timed alone; at least one call), with the last call's result. Wall time where the CPU
/// time cannot be read.
fn time_per_call<T>(mut work: impl FnMut() -> T) -> (Duration, T) {
    let cpu_started = thread_cpu_time();
    let wall_started = Instant::now();
    let mut calls = 0u32;
    loop {
        let result = black_box(work());
        calls += 1;
        let elapsed = match (cpu_started, thread_cpu_time()) {
            (Some(started), Some(now)) => now.saturating_sub(started),
            _ => wall_started.elapsed(),
        };
        if elapsed >= Duration::from_millis(200) {
            return (elapsed / calls, result);
        }
    }
}

fn milliseconds(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|argument| argument.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![500, 1000, 2000, 4000]
    } else {
        sizes
    };
    println!(
        "{:>7} {:>11} {:>15} {:>13} {:>14} {:>20}  shrink answer",
        "layers",
        "plan steps",
        "validate (ms)",
        "compile (ms)",
        "estimate (ms)",
        "shrink 1 MiB (ms)"
    );
    for layers in sizes {
        let text = dense_spec_json(layers);
        let (validate_time, job) = time_per_call(|| {
            validate_job_spec(parse_job_spec_json(&text).expect("the bench spec parses"))
        });
        let job = match job {
            Ok(job) => job,
            Err(error) => {
                println!("{layers:>7} refused: {error}");
                continue;
            }
        };
        let config = RunConfig::from_spec(&job.spec);
        let (compile_time, plan) =
            time_per_call(|| compile_step_plan(&job, &config).expect("the bench plan compiles"));
        let steps = plan.setup.len() + plan.micro_batch.len() + plan.update.len();
        let (estimate_time, _) = time_per_call(|| estimate_plan(&plan));
        let (shrink_time, answer) = time_per_call(|| plan_shrink(&job, &config, None, 1 << 20));
        let answer = match answer {
            Ok(decision) => format!("fits: {}", decision.config),
            Err(error) => error.to_string(),
        };
        println!(
            "{layers:>7} {steps:>11} {:>15.1} {:>13.1} {:>14.1} {:>20.1}  {answer}",
            milliseconds(validate_time),
            milliseconds(compile_time),
            milliseconds(estimate_time),
            milliseconds(shrink_time),
        );
    }

    // The longest search the budget allows: a model at the layer limit whose batch has 240
    // divisors, every strategy allowed, in a slice nothing fits.
    let text = dense_spec_json_with(
        MAX_MODEL_LAYERS,
        720_720,
        r#", "oom": {"strategies": ["mixed_precision", "accumulate", "recompute", "workspace", "shrink_batch"]}"#,
    );
    let job = validate_job_spec(parse_job_spec_json(&text).expect("the bench spec parses"))
        .expect("the bench spec is valid");
    let config = RunConfig::from_spec(&job.spec);
    let (shrink_time, answer) = time_per_call(|| plan_shrink(&job, &config, None, 1 << 20));
    let answer = match answer {
        Ok(decision) => format!("fits: {}", decision.config),
        Err(error) => error.to_string(),
    };
    println!(
        "\nshrink of {MAX_MODEL_LAYERS} layers at batch 720720, every strategy, 1 MiB: {:.1} ms: {answer}",
        milliseconds(shrink_time)
    );
}
