//! What a person meets in a day with `carve dev`, through the real binary: `carve jobs`
//! shows each job's short id and `carve get` takes it (or the id without `job-`); a
//! spec error from `carve submit` names the job file's line, or the `--set` that wrote
//! the value, never a place in the JSON the client built; a second `carve dev` on a data
//! directory in use is refused naming the first one's pid; and `carve dev` restarted on
//! its data directory leaves no lost worker behind.

use std::path::Path;
use std::time::{Duration, Instant};

// The local commands' helpers are not used here.
#[allow(dead_code)]
mod support;
use support::dev_cluster::{DevCluster, Outcome, run_carve, submitted_job_id};

/// Submits the small mnist job with `steps`, `--set`s appended; answers the outcome.
fn submit_mnist(cluster: &DevCluster, steps: u32, sets: &[&str]) -> Outcome {
    let steps = format!("training.steps={steps}");
    let mut arguments = vec![
        "submit",
        "examples/mnist-cnn.toml",
        "--set",
        &steps,
        "--set",
        "training.batch_size=8",
    ];
    for set in sets {
        arguments.extend(["--set", set]);
    }
    cluster.carve(&arguments)
}

/// Waits until `carve get JOB -o json` says the job reached `state` (within 2 minutes).
fn wait_for_state(cluster: &DevCluster, job: &str, state: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let details = cluster.carve(&["get", job, "-o", "json"]).expect_code(0);
        if details.json()["state"] == state {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never {state}\n{}",
            details.context()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The workers `carve cluster -o json` lists, as the admin sees them.
fn listed_workers(cluster: &DevCluster) -> Vec<serde_json::Value> {
    cluster
        .carve_with_token(&cluster.admin_token, &["cluster", "-o", "json"])
        .expect_code(0)
        .json()["workers"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[test]
fn jobs_shows_short_ids_that_get_takes_and_submit_names_the_job_file_line() {
    let cluster = DevCluster::start();
    let first = submitted_job_id(&submit_mnist(&cluster, 2, &[]).expect_code(0));
    let second = submitted_job_id(&submit_mnist(&cluster, 2, &[]).expect_code(0));

    let table = cluster.carve(&["jobs"]).expect_code(0);
    let mut lines = table.stdout.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(&header[..3], ["ID", "SHORT", "NAME"], "{}", table.context());
    let mut shown = 0;
    for line in lines {
        let cells: Vec<&str> = line.split_whitespace().collect();
        let (id, short) = (cells[0], cells[1]);
        assert!(
            short.len() >= 4 && short.len() < id.len() && id.ends_with(short),
            "{}",
            table.context()
        );
        let got = cluster.carve(&["get", short, "-o", "json"]).expect_code(0);
        assert_eq!(got.json()["id"], id);
        shown += 1;
    }
    assert_eq!(shown, 2, "{}", table.context());
    let without_prefix = second.strip_prefix("job-").unwrap();
    let got = cluster
        .carve(&["get", without_prefix, "-o", "json"])
        .expect_code(0);
    assert_eq!(got.json()["id"], second.as_str());

    // Both still going under one name: ambiguous, listing both (exit code 2).
    let ambiguous = cluster.carve(&["get", "mnist-cnn"]).expect_code(2);
    ambiguous.assert_stderr_contains(&first);
    ambiguous.assert_stderr_contains(&second);
    // One cancelled: the name is the one still going.
    cluster.carve(&["cancel", &first]).expect_code(0);
    let got = cluster
        .carve(&["get", "mnist-cnn", "-o", "json"])
        .expect_code(0);
    assert_eq!(got.json()["id"], second.as_str());

    // A wrong value in the job file: its line, as `carve estimate` says it.
    let directory = tempfile::tempdir().unwrap();
    let example = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mnist-cnn.toml"),
    )
    .unwrap();
    let line = example
        .lines()
        .position(|line| line.starts_with("batch_size = "))
        .expect("the example sets a batch size")
        + 1;
    let broken = example.replacen("batch_size = 64", "batch_size = \"many\"", 1);
    let file = directory.path().join("broken.toml");
    std::fs::write(&file, broken).unwrap();
    let refused = cluster
        .carve(&["submit", file.to_str().unwrap()])
        .expect_code(7);
    refused.assert_stderr_contains(&format!(
        "spec.training.batch_size: invalid type: string \"many\", expected u64 (line {line})"
    ));
    assert!(!refused.stderr.contains("column"), "{}", refused.context());
    // The same value from --set: the --set is named.
    let refused = submit_mnist(&cluster, 2, &["training.batch_size=many"]).expect_code(7);
    refused.assert_stderr_contains("(--set training.batch_size)");
    assert!(!refused.stderr.contains("column"), "{}", refused.context());
}

#[test]
fn a_second_carve_dev_on_a_data_dir_in_use_is_refused_naming_the_first() {
    let data = tempfile::tempdir().unwrap();
    let first = DevCluster::start_on(data.path());
    let second = run_carve(
        &[
            "dev",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.path().to_str().unwrap(),
        ],
        &[],
    );
    assert_ne!(second.code, Some(0), "{}", second.context());
    second.assert_stderr_contains(&format!(
        "is in use by another carve dev (pid {}); stop that one, or give this one another \
         --data-dir",
        first.child.id()
    ));
    assert!(
        !second.stderr.contains("transport error"),
        "{}",
        second.context()
    );
}

#[test]
fn a_restarted_carve_dev_leaves_no_lost_worker_behind() {
    let data = tempfile::tempdir().unwrap();
    let first = DevCluster::start_on(data.path());
    let job = submitted_job_id(&submit_mnist(&first, 2, &[]).expect_code(0));
    wait_for_state(&first, &job, "JOB_STATE_SUCCEEDED");
    let workers = listed_workers(&first);
    assert_eq!(workers.len(), 1, "{workers:?}");
    let worker_id = workers[0]["id"].clone();
    // Killed, as a closed terminal or a crash ends it: nothing is said to the scheduler.
    drop(first);

    let again = DevCluster::start_on(data.path());
    // A job that runs proves the new worker registered (only a connected one is given
    // attempts); it is the old worker, taken over, not a second one beside a lost one.
    let job = submitted_job_id(&submit_mnist(&again, 2, &[]).expect_code(0));
    wait_for_state(&again, &job, "JOB_STATE_SUCCEEDED");
    let workers = listed_workers(&again);
    assert_eq!(workers.len(), 1, "{workers:?}");
    assert_eq!(workers[0]["id"], worker_id, "{workers:?}");
}
