//! The cost of admitting a job is bounded by its spec: a model at the layer limit is
//! validated, estimated and shrink-planned in bounded time, and the shrink planner stops
//! with a clear error once its work budget is spent instead of searching on.

use std::time::{Duration, Instant};

use carve_core::CoreError;
use carve_core::estimator::estimate_job;
use carve_core::plan::{RunConfig, compile_step_plan};
use carve_core::shrink::{SHRINK_BUDGET_PLAN_STEPS, plan_shrink, plan_shrink_with_budget};
use carve_core::validate::{MAX_MODEL_LAYERS, ValidatedJob, load_job_spec_toml};

/// `layers` dense layers of 64 units ending in 10 classes, the deep and cheap shape that
/// makes admission cost a matter of plan length.
fn deep_dense(layers: usize, batch_size: u64, strategies: &str) -> ValidatedJob {
    let mut list = "{ dense = { units = 64 } },".repeat(layers - 1);
    list.push_str("{ dense = { units = 10 } }");
    let text = format!(
        "name = \"deep\"\n[model]\ninput_shape = [64]\nloss = \"softmax_cross_entropy\"\nlayers = [{list}]\n[training]\nbatch_size = {batch_size}\nsteps = 1\noptimizer = {{ adam = {{ learning_rate = 0.001 }} }}\n[data]\nformat = \"synthetic\"\nsamples = 64\n[oom]\nstrategies = [{strategies}]\n"
    );
    load_job_spec_toml(&text).unwrap_or_else(|error| panic!("{error}"))
}

fn plan_steps(job: &ValidatedJob, config: &RunConfig) -> u64 {
    let plan = compile_step_plan(job, config).unwrap();
    (plan.setup.len() + plan.micro_batch.len() + plan.update.len() + plan.evaluation.len()) as u64
}

#[test]
fn a_model_at_the_layer_limit_is_estimated_and_searched_in_bounded_time() {
    let started = Instant::now();
    let job = deep_dense(
        MAX_MODEL_LAYERS,
        32,
        "\"mixed_precision\", \"accumulate\", \"recompute\", \"workspace\"",
    );
    let config = RunConfig::from_spec(&job.spec);
    let estimate = estimate_job(&job, &config).unwrap();
    assert!(estimate.required_bytes > 1 << 20);
    // The whole default search fits the budget at the limit: the answer is the real one
    // (nothing fits 1 MiB), not the planner giving up.
    let error = plan_shrink(&job, &config, None, 1 << 20).unwrap_err();
    assert!(
        matches!(error, CoreError::DoesNotFit { .. }),
        "expected DoesNotFit, got {error}"
    );
    // Quadratic replays took over a minute here (the issue-13 report: 33.7 s at 2,000
    // layers); linear ones take about a second in release, a few at the test profile.
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(30),
        "admitting a {MAX_MODEL_LAYERS}-layer model took {elapsed:?}"
    );
}

#[test]
fn the_shrink_planner_gives_up_when_its_budget_is_spent() {
    let job = deep_dense(8, 32, "\"mixed_precision\", \"accumulate\", \"recompute\"");
    let config = RunConfig::from_spec(&job.spec);
    let current_steps = plan_steps(&job, &config);
    // A budget the current config alone spends: the first candidate is refused.
    let error = plan_shrink_with_budget(&job, &config, None, 1 << 16, 1).unwrap_err();
    let CoreError::ShrinkBudgetExhausted {
        candidate_replays,
        plan_steps_replayed,
        budget_plan_steps,
        available_bytes,
        smallest_required_bytes,
        ref smallest_config,
    } = error
    else {
        panic!("expected ShrinkBudgetExhausted, got {error:?}");
    };
    assert_eq!(candidate_replays, 1);
    assert_eq!(plan_steps_replayed, 3 * current_steps);
    assert_eq!(budget_plan_steps, 1);
    assert_eq!(available_bytes, 1 << 16);
    assert_eq!(
        smallest_required_bytes,
        estimate_job(&job, &config).unwrap().required_bytes
    );
    assert_eq!(*smallest_config, config.to_string());
    let message = error.to_string();
    assert!(
        message.starts_with("the shrink planner gave up after 1 candidate replays"),
        "{message}"
    );
    assert!(message.contains("fits in 64 KiB"), "{message}");
    // The same search with the default budget runs to its real answer.
    let error = plan_shrink(&job, &config, None, 1 << 16).unwrap_err();
    assert!(matches!(error, CoreError::DoesNotFit { .. }), "{error}");
}

#[test]
fn a_search_with_many_levels_stops_within_one_candidate_of_its_budget() {
    // 720,720 has 240 divisors: the accumulate strategy alone has 239 levels.
    let job = deep_dense(64, 720_720, "\"accumulate\"");
    let config = RunConfig::from_spec(&job.spec);
    let unbounded = plan_shrink_with_budget(&job, &config, None, 1 << 20, u64::MAX).unwrap_err();
    assert!(
        matches!(unbounded, CoreError::DoesNotFit { .. }),
        "{unbounded}"
    );
    let budget = 200 * plan_steps(&job, &config);
    let error = plan_shrink_with_budget(&job, &config, None, 1 << 20, budget).unwrap_err();
    let CoreError::ShrinkBudgetExhausted {
        candidate_replays,
        plan_steps_replayed,
        ..
    } = error
    else {
        panic!("expected ShrinkBudgetExhausted, got {error:?}");
    };
    assert!(candidate_replays < 239, "{candidate_replays}");
    // Every plan of this job has the same steps whatever its micro-batch, and a candidate
    // costs three of them (compile, replay, confirming replay): the search overran its
    // budget by less than one candidate.
    assert!(plan_steps_replayed >= budget);
    assert!(
        plan_steps_replayed < budget + 3 * plan_steps(&job, &config),
        "{plan_steps_replayed} steps for a budget of {budget}"
    );
    assert!(SHRINK_BUDGET_PLAN_STEPS > budget);
}
