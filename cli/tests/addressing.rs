//! Addressing jobs from the command line, the real binary against a real `carve dev`: a
//! job by a unique prefix of its id or by its name, several at once for `get` and
//! `cancel` (each reported, the exit code the first failure's), an ambiguous reference
//! refused with exit code 2 listing its jobs; tables fitting 100 columns and `-o wide`
//! showing more (jobs, workers, tokens, tenants); and `carve submit` making a job file's relative data paths
//! absolute, so a worker elsewhere reads the files beside the job file.

use std::time::Duration;

#[allow(
    dead_code,
    reason = "this file needs only the IDX files of the local commands' helpers"
)]
mod support;
use support::{RELATIVE_IDX_JOB, write_idx_digits};

#[path = "support/dev_cluster.rs"]
mod dev_cluster;
use dev_cluster::{DevCluster, Outcome, submitted_job_id};

/// Submits the small mnist job under `name` with `steps`; answers its id.
fn submit_named(cluster: &DevCluster, name: &str, steps: u32) -> String {
    let name = format!("name=\"{name}\"");
    let steps = format!("training.steps={steps}");
    let submitted = cluster
        .carve(&[
            "submit",
            "examples/mnist-cnn.toml",
            "--set",
            &steps,
            "--set",
            "training.batch_size=8",
            "--set",
            &name,
        ])
        .expect_code(0);
    submitted_job_id(&submitted)
}

/// Waits until `carve get JOB` says the job reached `state`.
fn wait_for_state(cluster: &DevCluster, job: &str, state: &str) -> Outcome {
    for _ in 0..600 {
        let details = cluster.carve(&["get", job]).expect_code(0);
        if details.stdout.contains(&format!("state:      {state}")) {
            return details;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("job {job} never reached {state}");
}

#[test]
fn jobs_are_addressed_by_prefix_name_and_several_at_once() {
    let cluster = DevCluster::start();
    let long_a = submit_named(&cluster, "long-a", 1_000_000);
    let long_b = submit_named(&cluster, "long-b", 1_000_000);
    let again_1 = submit_named(&cluster, "again", 2);
    let again_2 = submit_named(&cluster, "again", 2);

    // By name and by most of the id.
    let by_name = cluster.carve(&["get", "long-a"]).expect_code(0);
    assert!(
        by_name.stdout.starts_with(&format!("job {long_a}  long-a")),
        "{}",
        by_name.context()
    );
    let prefix = &long_b[..long_b.len() - 8];
    let by_prefix = cluster.carve(&["get", prefix, "-o", "json"]).expect_code(0);
    assert_eq!(by_prefix.json()["id"], long_b.as_str());

    // A name two jobs share is a usage error that lists both.
    let ambiguous = cluster.carve(&["get", "again"]).expect_code(2);
    ambiguous.assert_stderr_contains(
        "error: cannot get job again: \"again\" is ambiguous: it names 2 jobs: ",
    );
    ambiguous.assert_stderr_contains(&format!("{again_2} (again, "));
    ambiguous.assert_stderr_contains(&format!("{again_1} (again, "));
    assert!(
        !ambiguous.stderr.contains("job_id"),
        "{}",
        ambiguous.context()
    );

    // Several at once: each shown, the failures reported, the first failure's code.
    let several = cluster
        .carve(&["get", "long-a", "again", "no-such-job"])
        .expect_code(2);
    several.assert_stdout_contains(&format!("job {long_a}  long-a"));
    several.assert_stderr_contains("\"again\" is ambiguous");
    several.assert_stderr_contains("job no-such-job not found");
    let listed = cluster
        .carve(&["get", "long-a", &long_b, "-o", "json"])
        .expect_code(0)
        .json();
    let ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|job| job["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [long_a.as_str(), long_b.as_str()]);

    // Watch and logs take a name too.
    wait_for_state(&cluster, &again_1, "succeeded");
    let watched = cluster
        .carve(&["watch", &again_1[..again_1.len() - 4]])
        .expect_code(0);
    watched.assert_stdout_contains(&format!("job {again_1} (again) succeeded"));
    let logs = cluster.carve(&["logs", "long-b"]).expect_code(0);
    logs.assert_stdout_contains("scheduler");

    // Tables fit 100 columns; -o wide shows more, uncut.
    let table = cluster.carve(&["jobs"]).expect_code(0);
    for line in table.stdout.lines() {
        assert!(line.chars().count() <= 100, "{line:?}\n{}", table.context());
    }
    table.assert_stdout_contains(&long_a);
    let wide = cluster.carve(&["jobs", "-o", "wide"]).expect_code(0);
    wide.assert_stdout_contains("PRIORITY");
    wide.assert_stdout_contains("batch 8, micro 8, fp32");
    assert!(
        wide.stdout.lines().any(|line| line.chars().count() > 100),
        "{}",
        wide.context()
    );

    // Cancelling several: each reported; one that fails does not stop the others.
    let cancelled = cluster.carve(&["cancel", "long-a", prefix]).expect_code(0);
    cancelled.assert_stdout_contains(&format!("job {long_a} (long-a)"));
    cancelled.assert_stdout_contains(&format!("job {long_b} (long-b)"));
    let long_c = submit_named(&cluster, "long-c", 1_000_000);
    let partly = cluster
        .carve(&["cancel", "no-such-job", "long-c"])
        .expect_code(6);
    partly.assert_stderr_contains("job no-such-job not found");
    partly.assert_stdout_contains(&format!("job {long_c} (long-c)"));
}

#[test]
fn submit_makes_relative_data_paths_absolute_against_the_job_file() {
    let cluster = DevCluster::start();
    let directory = tempfile::tempdir().unwrap();
    write_idx_digits(directory.path());
    let job_file = directory.path().join("job.toml");
    std::fs::write(&job_file, RELATIVE_IDX_JOB).unwrap();

    // carve runs in the repository, the job file is elsewhere: the paths mean its folder.
    let job_path = job_file.to_str().unwrap();
    let submitted = cluster
        .carve(&["submit", job_path, "--watch"])
        .expect_code(0);
    let job = submitted_job_id(&submitted);
    let stored = cluster
        .carve(&["get", &job, "-o", "json"])
        .expect_code(0)
        .json();
    let spec: serde_json::Value =
        serde_json::from_str(stored["spec_json"].as_str().unwrap()).unwrap();
    let images = directory.path().join("digits").join("images");
    assert_eq!(spec["data"]["train"]["images"], images.to_str().unwrap());
    assert_eq!(stored["state"], "JOB_STATE_SUCCEEDED");
}
