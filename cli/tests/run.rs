//! Runs the real `carve run`: a small job trains to completion with the JSON the worker
//! will read, and a job that does not fit its slice exits 3 with the OOM numbers and the
//! planner's next config, which then runs in the same slice from the checkpoint.

use std::path::Path;
use std::process::Output;

use serde_json::Value;

mod support;
use support::{RELATIVE_IDX_JOB, carve, carve_with_stdin, succeeded, write_file, write_idx_digits};

const JOB: &str = include_str!("specs/cli-run.toml");

fn write_job(directory: &Path) -> String {
    write_file(directory, "job.toml", JOB)
}

fn json_of(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "not JSON ({error}): {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

#[test]
fn a_job_trains_and_reports_its_metrics_as_json() {
    let directory = tempfile::tempdir().unwrap();
    let job = write_job(directory.path());
    let checkpoint = directory.path().join("job.ckpt");
    let output = carve(&[
        "run",
        &job,
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "-o",
        "json",
    ]);
    succeeded(&output);
    let report = json_of(&output);
    assert_eq!(report["steps"], 30);
    assert!(report["final_loss"].as_f64().unwrap().is_finite());
    assert!(report["test_accuracy"].as_f64().unwrap() > 0.6, "{report}");
    assert_eq!(report["peak_bytes"], report["estimate_bytes"]);
    assert!(checkpoint.exists());
}

#[test]
fn out_of_memory_exits_three_and_the_next_config_then_fits() {
    let directory = tempfile::tempdir().unwrap();
    let job = write_job(directory.path());
    let estimate: Value = json_of(&carve(&["estimate", &job, "-o", "json"]));
    let required = estimate["required_bytes"].as_u64().unwrap();
    let slice = (required * 3 / 4).to_string();
    let checkpoint = directory.path().join("job.ckpt");
    let output = carve(&["run", &job, "--slice", &slice, "-o", "json"]);
    assert_eq!(
        output.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report = json_of(&output);
    let oom = &report["oom"];
    assert_eq!(oom["limit_bytes"].as_u64().unwrap().to_string(), slice);
    assert!(oom["requested_bytes"].as_u64().unwrap() > oom["largest_free_bytes"].as_u64().unwrap());
    let next = &report["next"]["config"];
    let mut arguments = vec![
        "run".to_string(),
        job.clone(),
        "--slice".to_string(),
        slice.clone(),
        "--precision".to_string(),
        next["precision"].as_str().unwrap().to_string(),
        "--micro-batch-size".to_string(),
        next["micro_batch_size"].to_string(),
        "--checkpoint".to_string(),
        checkpoint.to_str().unwrap().to_string(),
        "-o".to_string(),
        "json".to_string(),
    ];
    let mut first_half = arguments.clone();
    first_half.extend(["--stop-after-steps".to_string(), "15".to_string()]);
    let arguments_ref: Vec<&str> = first_half.iter().map(String::as_str).collect();
    let stopped = carve(&arguments_ref);
    succeeded(&stopped);
    assert_eq!(json_of(&stopped)["steps"], 15);

    // The shrunk attempt resumes from the checkpoint the first half wrote, to the end.
    arguments.push("--resume".to_string());
    arguments.push(checkpoint.to_str().unwrap().to_string());
    let arguments_ref: Vec<&str> = arguments.iter().map(String::as_str).collect();
    let resumed = carve(&arguments_ref);
    succeeded(&resumed);
    assert_eq!(json_of(&resumed)["steps"], 30);
}

#[test]
fn the_cuda_backend_trains_or_is_refused_with_the_reason() {
    let directory = tempfile::tempdir().unwrap();
    let job = write_job(directory.path());
    let output = carve(&["run", &job, "--backend", "cuda", "-o", "json"]);
    match carve_engine::cuda::CudaBackend::available() {
        Err(reason) => {
            println!("skipped: CUDA not available: {reason}");
            assert_eq!(output.status.code(), Some(1));
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(stderr.contains("CUDA not available"), "{stderr}");
            assert!(stderr.contains(&reason), "{stderr}");
        }
        Ok(()) => {
            succeeded(&output);
            assert_eq!(json_of(&output)["backend"], "cuda:0");
        }
    }
}

#[test]
fn a_spec_from_stdin_finds_its_relative_data_in_the_current_directory() {
    let directory = tempfile::tempdir().unwrap();
    write_idx_digits(directory.path());

    let output = carve_with_stdin(
        &["run", "-", "-o", "json"],
        directory.path(),
        RELATIVE_IDX_JOB,
    );
    succeeded(&output);
    assert_eq!(json_of(&output)["steps"], 2);
}
