//! A command job's own results and output as a user meets them through the real `carve`
//! binary against `carve dev` (issue 28): a program that prints 3,000 progress lines, a
//! line on each stream and its results (`accuracy`, `val_loss`, `metric_top5`).
//! `carve watch` off a terminal prints a progress line a second at most, the last one
//! kept; `carve get` and `carve jobs -o wide` show the results as model jobs' are shown;
//! `carve logs` marks each program line with its stream and stores few progress lines.

#[allow(dead_code)]
mod support;
use support::dev_cluster::*;

const PROGRAM: &str = r#"
import sys, time
time.sleep(0.5)
for step in range(1, 3001):
    print("CARVE_PROGRESS step=%d total_steps=3000 loss=%f" % (step, 1.0 / step))
    if step % 1000 == 0:
        time.sleep(0.3)
print("evaluating on the test set")
print("a warning on stderr", file=sys.stderr)
print("CARVE_PROGRESS accuracy=0.931 val_loss=0.41 metric_top5=0.99")
"#;

const JOB: &str = r#"
name = "results-command"
[command]
argv = ["python3", "train.py"]
global_batch = 8
micro_batch = 8
steps = 3000
[resources]
vram = "512MiB"
"#;

#[test]
fn a_command_jobs_results_streams_and_paced_progress_are_shown() {
    let cluster = DevCluster::start();
    let folder = tempfile::tempdir().unwrap();
    std::fs::write(folder.path().join("train.py"), PROGRAM).unwrap();
    let job_file = folder.path().join("results.toml");
    std::fs::write(&job_file, JOB).unwrap();
    let submitted = cluster
        .carve(&["submit", job_file.to_str().unwrap()])
        .expect_code(0);
    let job = submitted_job_id(&submitted);

    let watched = cluster.carve(&["watch", &job]).expect_code(0);
    let progress_lines: Vec<&str> = watched
        .stdout
        .lines()
        .filter(|line| line.starts_with("attempt 1: step "))
        .collect();
    // A run of a few seconds: a handful of lines, not 3,000.
    assert!(
        !progress_lines.is_empty() && progress_lines.len() <= 30,
        "{} progress lines: {}",
        progress_lines.len(),
        watched.context()
    );
    assert!(
        progress_lines
            .last()
            .unwrap()
            .starts_with("attempt 1: step 3000/3000"),
        "{}",
        watched.context()
    );

    let shown = cluster.carve(&["get", &job]).expect_code(0);
    shown.assert_stdout_contains("93.10%");
    // The table fits 100 columns: a long METRICS cell may be cut; JSON and `-o wide`
    // have it whole.
    shown.assert_stdout_contains("METRICS");
    shown.assert_stdout_contains("val_loss 0.4100");
    let listed = cluster.carve(&["jobs", "-o", "wide"]).expect_code(0);
    listed.assert_stdout_contains("accuracy 93.10%, val_loss 0.4100, top5 0.9900");
    let json = cluster
        .carve(&["get", &job, "-o", "json"])
        .expect_code(0)
        .json();
    let attempt = &json["attempts"][0];
    assert_eq!(attempt["test_accuracy"], 0.931, "{json}");
    assert_eq!(attempt["metrics"][0]["name"], "val_loss", "{json}");

    let logs = cluster
        .carve(&["logs", &job, "--attempt", "1"])
        .expect_code(0);
    logs.assert_stdout_contains(" attempt 1 stdout: evaluating on the test set");
    logs.assert_stdout_contains(" attempt 1 stderr: a warning on stderr");
    let stored_progress = logs
        .stdout
        .lines()
        .filter(|line| line.contains(": step "))
        .count();
    assert!(
        stored_progress <= 30,
        "{stored_progress} progress lines stored: {}",
        logs.context()
    );
    assert!(
        !logs.stdout.contains("CARVE_PROGRESS"),
        "{}",
        logs.context()
    );
}
