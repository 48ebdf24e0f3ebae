//! `cargo bench -p carve-core`: how long the estimator and the shrink planner take, since
//! the scheduler estimates on every submit and the planner estimates in a search.
//!
//! Prints a table (model, layers, plan steps, microseconds per call). Compare across
//! commits on the same machine.

use std::hint::black_box;
use std::time::{Duration, Instant};

use carve_core::estimator::estimate_job;
use carve_core::plan::{RunConfig, compile_step_plan};
use carve_core::shrink::plan_shrink;
use carve_core::validate::{ValidatedJob, load_job_spec_toml};

fn deep_cnn(blocks: usize) -> ValidatedJob {
    let mut layers = String::new();
    for block in 0..blocks {
        let filters = 64 << (block / 4).min(3);
        layers.push_str(&format!(
            "{{ conv2d = {{ filters = {filters}, kernel = 3, padding = \"same\" }} }}, {{ batch_norm = {{}} }}, {{ relu = {{}} }},\n"
        ));
        if block % 4 == 3 {
            layers.push_str("{ max_pool = { size = 2 } },\n");
        }
    }
    let text = format!(
        "name = \"bench\"\n[model]\ninput_shape = [224, 224, 3]\nloss = \"softmax_cross_entropy\"\nlayers = [\n{layers}{{ global_avg_pool = {{}} }}, {{ dense = {{ units = 1000 }} }}]\n[training]\nbatch_size = 64\nsteps = 1\noptimizer = {{ adam = {{ learning_rate = 0.001 }} }}\n[data]\nformat = \"synthetic\"\nsamples = 64\n[oom]\nstrategies = [\"accumulate\", \"recompute\", \"workspace\"]\n"
    );
    load_job_spec_toml(&text).expect("the bench model is valid")
}

/// Runs `work` repeatedly for about `budget` and returns the mean time per call.
fn time_per_call(budget: Duration, mut work: impl FnMut()) -> Duration {
    work();
    let start = Instant::now();
    let mut calls = 0u32;
    while start.elapsed() < budget {
        work();
        calls += 1;
    }
    start.elapsed() / calls.max(1)
}

fn main() {
    let budget = Duration::from_millis(500);
    println!(
        "{:<22} {:>7} {:>11} {:>14} {:>14} {:>16}",
        "model", "layers", "plan steps", "compile (us)", "estimate (us)", "shrink to 1/3 (us)"
    );
    for blocks in [4, 12, 16] {
        let job = deep_cnn(blocks);
        let config = RunConfig::from_spec(&job.spec);
        let plan = compile_step_plan(&job, &config).expect("compiles");
        let steps = plan.setup.len() + plan.micro_batch.len() + plan.update.len();
        let compile = time_per_call(budget, || {
            black_box(compile_step_plan(black_box(&job), &config).expect("compiles"));
        });
        let estimate = time_per_call(budget, || {
            black_box(estimate_job(black_box(&job), &config).expect("estimates"));
        });
        let full = estimate_job(&job, &config)
            .expect("estimates")
            .required_bytes;
        let shrink = time_per_call(budget, || {
            let _ = black_box(plan_shrink(black_box(&job), &config, None, full / 3));
        });
        println!(
            "{:<22} {:>7} {:>11} {:>14.1} {:>14.1} {:>16.1}",
            format!("cnn-224px-{blocks}-blocks"),
            job.graph.layers.len(),
            steps,
            compile.as_secs_f64() * 1e6,
            estimate.as_secs_f64() * 1e6,
            shrink.as_secs_f64() * 1e6,
        );
    }
}
