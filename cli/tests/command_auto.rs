//! `vram = "auto"` as a new user meets it: `carve dev` (a child process: scheduler,
//! worker with simulated GPUs) runs `examples/command/standin.toml` as it is, the
//! stand-in's memory simulated (no CUDA driver) and reported in its CARVE_PROGRESS lines.
//! The job profiles, is sized by what it measured (never a 0-byte slice), runs (one
//! out-of-memory retry, as the file describes) and succeeds; `carve get` shows the
//! fitted model and what it rests on; `carve reset-model` forgets it.

#[allow(dead_code)]
mod support;
use support::dev_cluster::*;

#[test]
fn an_auto_command_job_profiles_is_sized_runs_and_get_shows_its_model() {
    let cluster = DevCluster::start();
    let submitted = cluster
        .carve(&["submit", "examples/command/standin.toml"])
        .expect_code(0);
    let job = submitted_job_id(&submitted);
    cluster.carve(&["watch", &job]).expect_code(0);

    let details = cluster
        .carve(&["get", &job, "-o", "json"])
        .expect_code(0)
        .json();
    assert_eq!(details["state"], "JOB_STATE_SUCCEEDED", "{details}");
    let attempts = details["attempts"].as_array().unwrap();
    assert_eq!(attempts[0]["profile"], true, "{details}");
    for attempt in attempts {
        let slice = attempt["slice_bytes"].as_u64().unwrap_or(0);
        assert!(slice >= 256 << 20, "a slice under the floor: {details}");
    }
    let model = &details["memory_model"];
    assert_eq!(model["measured"], true, "{details}");
    assert!(model["fixed_bytes"].as_u64().unwrap() > 0, "{details}");
    assert!(model["per_sample_bytes"].as_u64().unwrap() > 0, "{details}");

    let shown = cluster.carve(&["get", &job]).expect_code(0);
    shown.assert_stdout_contains("per sample of the micro-batch");
    shown.assert_stdout_contains(&format!(
        "model:      fitted from {job} attempt 1's profile"
    ));

    let reset = cluster.carve(&["reset-model", &job]).expect_code(0);
    reset.assert_stdout_contains("forgot 1 memory model");
    let shown = cluster.carve(&["get", &job]).expect_code(0);
    assert!(!shown.stdout.contains("model:"), "{}", shown.context());
    let again = cluster.carve(&["reset-model", "--all"]).expect_code(0);
    again.assert_stdout_contains("no memory model to forget");
}
