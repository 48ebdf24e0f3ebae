//! What a researcher sees of a job's training through the real `carve` binary against
//! `carve dev` (issue 19): `get` shows each attempt's results (steps, loss, throughput,
//! start and elapsed time) in its table and in `-o json`/`-o yaml`, `jobs` the last
//! loss, `logs --attempt 1` the attempt's own lines, `watch` the elapsed time, and for a
//! queued job why it waits.

use std::time::Duration;

// The local commands' helpers are not used here.
#[allow(dead_code)]
mod support;
use support::dev_cluster::{DevCluster, submitted_job_id, wait_for};

/// The small mnist job, a few steps of a small batch, named `name`, with `steps` steps.
fn small_job(steps: u64, name: &str) -> Vec<String> {
    [
        "submit",
        "examples/mnist-cnn.toml",
        "--set",
        &format!("training.steps={steps}"),
        "--set",
        "training.batch_size=8",
        "--set",
        &format!("name=\"{name}\""),
    ]
    .map(String::from)
    .to_vec()
}

fn submit(cluster: &DevCluster, steps: u64, name: &str) -> String {
    let arguments = small_job(steps, name);
    let arguments: Vec<&str> = arguments.iter().map(String::as_str).collect();
    submitted_job_id(&cluster.carve(&arguments).expect_code(0))
}

#[test]
fn get_jobs_logs_and_watch_show_what_the_training_did() {
    let cluster = DevCluster::start();
    let job = submit(&cluster, 3, "results");
    let watched = cluster.carve(&["watch", &job]).expect_code(0);
    // Off a terminal, progress is lines: with the elapsed time.
    watched.assert_stdout_contains("attempt 1: step 3/3");
    watched.assert_stdout_contains("elapsed ");

    let details = cluster.carve(&["get", &job]).expect_code(0);
    assert!(
        details
            .stdout
            .lines()
            .any(|line| line.starts_with("ATTEMPT  STARTED") && line.ends_with("SAMPLES/S")),
        "no results table: {}",
        details.context()
    );
    let json = cluster
        .carve(&["get", &job, "-o", "json"])
        .expect_code(0)
        .json();
    let attempt = &json["attempts"][0];
    assert_eq!(attempt["steps_done"], 3, "{json}");
    assert!(
        attempt["final_loss"].as_f64().is_some_and(f64::is_finite),
        "{json}"
    );
    assert!(
        attempt["samples_per_second"]
            .as_f64()
            .is_some_and(|rate| rate > 0.0),
        "{json}"
    );
    assert!(attempt["finished_at"].is_string(), "{json}");
    let yaml = cluster.carve(&["get", &job, "-o", "yaml"]).expect_code(0);
    yaml.assert_stdout_contains("steps_done: 3");
    yaml.assert_stdout_contains("final_loss: ");

    let listed = cluster.carve(&["jobs"]).expect_code(0);
    listed.assert_stdout_contains("LOSS");
    let loss = format!("{:.4}", attempt["final_loss"].as_f64().unwrap());
    listed.assert_stdout_contains(&loss);

    // The attempt's own lines: its progress and its results, under its number.
    let logs = cluster
        .carve(&["logs", &job, "--attempt", "1"])
        .expect_code(0);
    assert!(!logs.stdout.trim().is_empty(), "{}", logs.context());
    assert!(
        logs.stdout.lines().all(|line| line.contains(" attempt 1 ")),
        "{}",
        logs.context()
    );
    logs.assert_stdout_contains("step 3/3: loss ");
    logs.assert_stdout_contains("ended: 3 steps, final loss ");
    // Without the filter, the scheduler's notes are there too.
    let everything = cluster.carve(&["logs", &job]).expect_code(0);
    everything.assert_stdout_contains(" scheduler info: ");
    everything.assert_stdout_contains(" attempt 1 info: step 3/3");
}

#[test]
fn watching_a_queued_job_says_why_it_waits() {
    let cluster = DevCluster::start();
    cluster
        .carve_with_token(
            &cluster.admin_token,
            &["admin", "quota", "set", "dev", "--max-running-jobs", "1"],
        )
        .expect_code(0);
    let running = submit(&cluster, 100_000, "long");
    let waiting = submit(&cluster, 3, "waits");
    let mut watch = cluster.spawn_carve(&["watch", &waiting]);
    std::thread::sleep(Duration::from_secs(3));
    for job in [&running, &waiting] {
        cluster.carve(&["cancel", job]).expect_code(0);
    }
    let watched = wait_for(&mut watch, "carve watch of a queued job");
    let first = watched.stdout.lines().next().unwrap_or_default();
    assert!(first.starts_with("queued: "), "{}", watched.context());
    assert!(
        !watched
            .stdout
            .contains("waiting for the first progress report"),
        "{}",
        watched.context()
    );
}
