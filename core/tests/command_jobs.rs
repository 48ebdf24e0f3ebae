//! A command job through the pure core as the scheduler and the worker drive it: read
//! the job file, render the profile runs, fit the model from their peaks, classify the
//! training run's OOM from its stderr, shrink, and render the retry, which keeps the
//! global batch.

use carve_core::command::memory_model::{CommandMemoryModel, ProfilePoint};
use carve_core::command::oom::{CommandExit, CommandRunEnd, OomSource, classify_command_exit};
use carve_core::command::render::render_command;
use carve_core::command::shrink::plan_command_shrink;
use carve_core::command::validate::{ValidatedSpec, load_spec_toml, parse_spec_json};
use carve_core::shrink::OomObservation;

const MIB: u64 = 1 << 20;

/// The stand-in's job file, as CI submits it.
const STANDIN_JOB: &str = r#"
name = "standin"
[command]
argv = ["python3", "examples/command/standin_train.py",
        "--micro-batch", "{micro_batch}", "--accumulation-steps", "{accumulation_steps}",
        "--global-batch", "{global_batch}", "--precision", "{precision}",
        "--checkpoint-dir", "{checkpoint_dir}", "--steps", "{max_steps}",
        "--fixed-mib", "512", "--per-sample-mib", "32"]
global_batch = 64
steps = 20
[resources]
vram = "auto"
[oom]
strategies = ["accumulate"]
max_retries = 1
"#;

#[test]
fn profile_admit_oom_and_one_retry_that_keeps_the_global_batch() {
    let ValidatedSpec::Command(job) = load_spec_toml(STANDIN_JOB).unwrap() else {
        panic!("the stand-in's job file is a command job");
    };
    // The API carries the spec as JSON: the same job comes back.
    let json = serde_json::to_string(&job.spec).unwrap();
    assert_eq!(
        parse_spec_json(&json).unwrap(),
        ValidatedSpec::Command(job.clone())
    );

    // The profile: one short run per micro-batch, each stopped by {max_steps}.
    let own = job.initial_config();
    let profile_micro_batches = job.profile_micro_batches();
    assert_eq!(profile_micro_batches, [64, 32]);
    let mut points = Vec::new();
    for micro_batch in profile_micro_batches {
        let config = carve_core::plan::RunConfig {
            micro_batch_size: micro_batch,
            ..own
        };
        let run = render_command(&job, &config, "/scratch/profile", Some(2)).unwrap();
        assert!(
            run.display_line()
                .contains(&format!("--micro-batch {micro_batch} "))
        );
        assert!(run.display_line().contains("--steps 2 "));
        points.push(ProfilePoint {
            micro_batch,
            peak_bytes: 512 * MIB + 32 * MIB * micro_batch,
            ran_out: false,
        });
    }
    let model = CommandMemoryModel::fit(&points, own.precision, false).unwrap();
    assert_eq!(model.need_bytes(&own), 512 * MIB + 64 * 32 * MIB);

    // Admitted in a slice of what the profile saw; the run needs more late (memory a
    // 2-step profile cannot see) and PyTorch says so on stderr.
    let slice_bytes = model.need_bytes(&own);
    let stderr: Vec<String> = [
        "Traceback (most recent call last):",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacity of 2.50 GiB of which 0 bytes is free. Of the allocated memory 2.45 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.",
    ]
    .map(String::from)
    .to_vec();
    let end = classify_command_exit(&CommandExit {
        exit_code: Some(1),
        signal: None,
        guard_refusal: None,
        stderr_tail: &stderr,
        slice_bytes,
        peak_bytes: slice_bytes - MIB,
        host_memory_limit_reached: None,
    });
    let CommandRunEnd::OutOfMemory { source, report, .. } = end else {
        panic!("expected an OOM, got {end:?}");
    };
    assert_eq!(source, OomSource::PyTorch);
    assert_eq!(report.requested, 64 * MIB);

    // One retry: the largest micro-batch that fits, the same global batch.
    let observation = OomObservation {
        report,
        estimated_required_bytes: model.need_bytes(&own),
    };
    let decision =
        plan_command_shrink(&job, &model, &own, Some(&observation), slice_bytes).unwrap();
    assert_eq!(decision.config.batch_size, 64);
    assert_eq!(decision.config.micro_batch_size, 32);
    assert!(decision.estimate.required_bytes <= slice_bytes);
    let retry = render_command(&job, &decision.config, "/checkpoints/job-1/", None).unwrap();
    let line = retry.display_line();
    assert!(
        line.contains("--micro-batch 32 --accumulation-steps 2 --global-batch 64"),
        "{line}"
    );
    assert!(line.contains("--steps 20 "), "{line}");
    assert_eq!(retry.env["CARVE_CHECKPOINT_DIR"], "/checkpoints/job-1/");
}
