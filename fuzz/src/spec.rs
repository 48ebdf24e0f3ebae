//! The job spec targets: a job file (TOML) and the API's `spec_json`, through the parser,
//! the validator, the estimate of the spec's own configuration and the shrink planner into
//! half of that; and the path a submit takes (TOML read by `carve`, sent as JSON, read
//! back by the scheduler), which must give back the same spec and the same estimate.

use carve_core::command::memory_model::CommandMemoryModel;
use carve_core::command::render::render_command;
use carve_core::command::shrink::plan_command_shrink;
use carve_core::command::validate::{
    ValidatedCommandJob, ValidatedSpec, load_spec_toml, parse_spec_json,
};
use carve_core::estimator::{estimate_job, try_plan_in_slice};
use carve_core::plan::{RunConfig, compile_step_plan};
use carve_core::shrink::plan_shrink;
use carve_core::validate::{ValidatedJob, load_job_spec_toml};
use carve_proto::ApiError;
use carve_proto::convert::{
    is_command_spec_json, job_spec_to_json, validated_job_from_json, validated_spec_from_json,
};

use carve_core::spec::{JobSpec, ShrinkStrategy};
use serde_json::Value;

use crate::{MAX_INPUT_BYTES, floats_close};

/// Keys and values of the spec format, for the CI mutator.
pub const SPEC_DICTIONARY: &[&[u8]] = &[
    b"layers",
    b"input_shape",
    b"conv2d",
    b"dense",
    b"max_pool",
    b"avg_pool",
    b"global_avg_pool",
    b"batch_norm",
    b"dropout",
    b"flatten",
    b"filters",
    b"kernel",
    b"stride",
    b"padding",
    b"units",
    b"batch_size",
    b"accumulation_steps",
    b"precision",
    b"\"fp16\"",
    b"\"bf16\"",
    b"recompute",
    b"workspace_limit",
    b"oom",
    b"strategies",
    b"command",
    b"argv",
    b"global_batch",
    b"micro_batch",
    b"precisions",
    b"\"{micro_batch}\"",
    b"\"{max_steps}\"",
    b"\"{precision}\"",
    b"{",
    b"}",
    b"0",
    b"-1",
    b"4294967296",
    b"18446744073709551615",
    b"9223372036854775807",
    b"1e308",
    b"nan",
    b"inf",
    b"-0.0",
    b"\"1TiB\"",
    b"\"0B\"",
    b"[]",
    b"{}",
    b",",
    b"=",
    b"\"",
];

/// A job file as `carve` reads it: a command job (a `[command]` table) through its own
/// checks, every other through the model job's.
pub fn fuzz_spec_toml(data: &[u8]) {
    let Some(text) = text_of(data) else { return };
    if let Ok(document) = toml::from_str::<toml::Table>(text)
        && document.contains_key("command")
    {
        match load_spec_toml(text) {
            Ok(ValidatedSpec::Command(job)) => check_valid_command_job(&job),
            Ok(ValidatedSpec::Model(_)) => panic!("a spec with [command] was read as a model job"),
            Err(error) => assert!(
                !error.reason.trim().is_empty(),
                "a rejection without a reason (field {:?})",
                error.field
            ),
        }
        return;
    }
    match load_job_spec_toml(text) {
        Ok(job) => {
            check_valid_job(&job);
            // `carve submit` sends the file as JSON: the scheduler must read the same spec.
            let json = job_spec_to_json(&job.spec)
                .unwrap_or_else(|error| panic!("a valid spec does not write as JSON: {error}"));
            let again = validated_job_from_json(&json).unwrap_or_else(|error| {
                panic!("a valid job file is refused once sent as JSON: {error}\nJSON: {json}")
            });
            assert_same_spec(&again.spec, &job.spec, "on its way through JSON");
            assert_eq!(
                estimate_summary(&again),
                estimate_summary(&job),
                "the estimate changed on the spec's way through JSON"
            );
        }
        Err(error) => assert!(
            !error.reason.trim().is_empty(),
            "a rejection without a reason (field {:?})",
            error.field
        ),
    }
}

/// The API's `spec_json`, as SubmitJob and EstimateJob read it (and, for a command job,
/// as SubmitJob reads either kind).
pub fn fuzz_spec_json(data: &[u8]) {
    let Some(text) = text_of(data) else { return };
    if is_command_spec_json(text) {
        match validated_spec_from_json(text) {
            Ok(ValidatedSpec::Command(job)) => check_valid_command_job(&job),
            Ok(ValidatedSpec::Model(_)) => panic!("a spec with command was read as a model job"),
            Err(ApiError::InvalidArgument { field, reason }) => {
                assert!(
                    field.starts_with("spec"),
                    "a spec rejection names {field:?}"
                );
                assert!(
                    !reason.trim().is_empty(),
                    "a rejection without a reason ({field:?})"
                );
            }
            Err(other) => panic!("bad spec_json is not an invalid argument: {other:?}"),
        }
        return;
    }
    match validated_job_from_json(text) {
        Ok(job) => {
            check_valid_job(&job);
            let json = job_spec_to_json(&job.spec)
                .unwrap_or_else(|error| panic!("a valid spec does not write as JSON: {error}"));
            let again = validated_job_from_json(&json).unwrap_or_else(|error| {
                panic!("a valid spec_json is refused once written again: {error}\nJSON: {json}")
            });
            assert_same_spec(&again.spec, &job.spec, "when written again");
        }
        Err(ApiError::InvalidArgument { field, reason }) => {
            assert!(
                field.starts_with("spec"),
                "a spec rejection names {field:?}, not a spec field"
            );
            assert!(
                !reason.trim().is_empty(),
                "a rejection without a reason (field {field:?})"
            );
        }
        Err(other) => panic!("bad spec_json is not an invalid argument: {other:?}"),
    }
}

/// The checks every valid spec must pass: its estimate, and a shrink into half of it
/// that, when it answers with a config, answers one that really fits its budget.
fn check_valid_job(job: &ValidatedJob) {
    let config = RunConfig::from_spec(&job.spec);
    let Ok(estimate) = estimate_job(job, &config) else {
        return;
    };
    assert!(
        estimate.peak_bytes <= estimate.required_bytes,
        "the peak ({}) is above the slice the step needs ({})",
        estimate.peak_bytes,
        estimate.required_bytes
    );
    let half = estimate.required_bytes / 2;
    if half == 0 {
        return;
    }
    if let Ok(decision) = plan_shrink(job, &config, None, half) {
        let plan = compile_step_plan(job, &decision.config).unwrap_or_else(|error| {
            panic!(
                "the shrink planner chose a config that does not compile: {error:?}\n{:?}",
                decision.config
            )
        });
        assert!(
            try_plan_in_slice(&plan, decision.budget_bytes).is_ok(),
            "the shrink planner chose a config that does not fit its budget of {} bytes: {:?}",
            decision.budget_bytes,
            decision.config
        );
    }
}

/// The checks every valid command job must pass: it reads back the same from its JSON,
/// its first configuration renders, and the command shrink planner's answer for half of
/// what a plausible model says it needs really fits by that model, keeps the global
/// batch unless the job allows shrink_batch, and renders too.
fn check_valid_command_job(job: &ValidatedCommandJob) {
    let json = serde_json::to_string(&job.spec)
        .unwrap_or_else(|error| panic!("a valid command job does not write as JSON: {error}"));
    match parse_spec_json(&json) {
        Ok(ValidatedSpec::Command(again)) => {
            assert_eq!(again.spec, job.spec, "on its way through JSON")
        }
        other => {
            panic!("a valid command job is refused once sent as JSON: {other:?}\nJSON: {json}")
        }
    }
    let config = job.initial_config();
    let rendered = render_command(job, &config, "/checkpoints/job", None)
        .unwrap_or_else(|error| panic!("the first configuration does not render: {error}"));
    assert!(!rendered.argv.is_empty(), "rendered to no program");
    let _ = rendered.display_line();
    let model = CommandMemoryModel {
        fixed_bytes: 1 << 30,
        per_sample_bytes: 16 << 20,
        precision: config.precision,
        recompute: false,
    };
    let half = model.need_bytes(&config) / 2;
    if let Ok(decision) = plan_command_shrink(job, &model, &config, None, half) {
        assert!(
            model.need_bytes(&decision.config) <= decision.budget_bytes,
            "the command shrink planner chose {:?}, which its model says needs more than {}",
            decision.config,
            decision.budget_bytes
        );
        let allows_smaller_batch = job
            .spec
            .oom
            .strategies
            .contains(&ShrinkStrategy::ShrinkBatch);
        assert!(
            allows_smaller_batch || decision.config.batch_size == config.batch_size,
            "the global batch changed without shrink_batch: {:?}",
            decision.config
        );
        render_command(job, &decision.config, "/checkpoints/job", None)
            .unwrap_or_else(|error| panic!("the planner's configuration does not render: {error}"));
    }
}

/// Specs are the same when their JSON values are, floats within [`floats_close`].
fn assert_same_spec(left: &JobSpec, right: &JobSpec, when: &str) {
    let as_value = |spec: &JobSpec| {
        serde_json::to_value(spec)
            .unwrap_or_else(|error| panic!("a valid spec does not write as JSON: {error}"))
    };
    let (left_value, right_value) = (as_value(left), as_value(right));
    assert!(
        same_value(&left_value, &right_value),
        "the spec changed {when}:\n{left_value}\n{right_value}"
    );
}

fn same_value(left: &Value, right: &Value) -> bool {
    match (left, right) {
        (Value::Number(left), Value::Number(right)) if left.is_f64() || right.is_f64() => {
            match (left.as_f64(), right.as_f64()) {
                (Some(left), Some(right)) => floats_close(left, right),
                _ => false,
            }
        }
        (Value::Array(left), Value::Array(right)) => {
            left.len() == right.len()
                && left
                    .iter()
                    .zip(right)
                    .all(|(left, right)| same_value(left, right))
        }
        (Value::Object(left), Value::Object(right)) => {
            left.len() == right.len()
                && left
                    .iter()
                    .all(|(key, left)| right.get(key).is_some_and(|right| same_value(left, right)))
        }
        _ => left == right,
    }
}

fn estimate_summary(job: &ValidatedJob) -> Option<(u64, u64)> {
    estimate_job(job, &RunConfig::from_spec(&job.spec))
        .ok()
        .map(|estimate| (estimate.peak_bytes, estimate.required_bytes))
}

pub(crate) fn text_of(data: &[u8]) -> Option<&str> {
    if data.len() > MAX_INPUT_BYTES {
        return None;
    }
    std::str::from_utf8(data).ok()
}
