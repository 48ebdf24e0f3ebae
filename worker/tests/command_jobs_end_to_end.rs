//! A command job end to end, without a GPU: the real scheduler and the real worker
//! in-process (one simulated GPU, the guard named as with `--guard-library`), the CI
//! stand-in program (`examples/command/standin_train.py`, its job file as it is) under
//! the real guard in front of the fake driver. The story of issue 16: profile -> admitted
//! by the fitted model -> out of memory at run time (the guard refuses) -> exactly one
//! retry with gradient accumulation keeping the global batch -> success, every optimizer
//! step having seen the global batch.

use std::path::{Path, PathBuf};
use std::time::Duration;

use carve_core::command::validate::{ValidatedSpec, load_spec_toml};
use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_worker::gpus::SimulatedGpu;

#[path = "support/cluster.rs"]
#[allow(dead_code, reason = "not every helper is used here")]
mod cluster;
#[path = "support/guard_world.rs"]
mod guard_world;
#[allow(dead_code, reason = "the chaos test's helpers are not all used here")]
mod support;

use cluster::{Cluster, WAIT};
use guard_world::guard_world;
use support::{authorized, poll_until};

const ADMIN: &str = "carve_command_jobs_admin_secret";
const GIB: u64 = 1 << 30;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/command")
        .canonicalize()
        .expect("examples/command")
}

/// `examples/command/standin.toml` as it is, run in its folder as `carve submit` does,
/// with the fake driver on its library path.
fn standin_job(libraries: &Path) -> String {
    let text = std::fs::read_to_string(examples().join("standin.toml")).unwrap();
    let ValidatedSpec::Command(job) = load_spec_toml(&text).expect("the example is valid") else {
        panic!("standin.toml is a command job");
    };
    let mut spec = job.spec;
    spec.command.working_directory = Some(examples().display().to_string());
    spec.command
        .env
        .insert("LD_LIBRARY_PATH".into(), libraries.display().to_string());
    serde_json::to_string(&spec).unwrap()
}

fn outcome(attempt: &v1::Attempt) -> v1::AttemptOutcome {
    v1::AttemptOutcome::try_from(attempt.outcome).unwrap()
}

/// The scheduler and a worker with one simulated GPU of `gpu_bytes`, under `guard`
/// when given.
async fn cluster(directory: &Path, gpu_bytes: u64, guard: Option<PathBuf>) -> Cluster {
    let url = format!("sqlite://{}", directory.join("carve.db").display());
    Cluster::start(
        directory,
        url,
        PathBuf::from(env!("CARGO_BIN_EXE_carve-worker")),
        ADMIN,
        |config| {
            config.simulated_gpus = vec![SimulatedGpu {
                total_bytes: gpu_bytes,
            }];
            // Contained, the program sees its code (the examples) and, as the operator's
            // read-only paths, the fake driver where the test's build left it.
            config.sandbox.job_paths = vec![examples()];
            config.sandbox.read_only_host_paths = guard
                .iter()
                .filter_map(|guard| guard.parent().map(Path::to_path_buf))
                .chain([directory.join("lib")])
                .collect();
            config.guard_library = guard;
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profiled_command_runs_out_under_the_guard_and_one_retry_keeps_the_global_batch() {
    let directory = tempfile::tempdir().unwrap();
    let (guard, libraries) = guard_world(directory.path());
    // Larger than the 16 GiB profile slice the scheduler picks when the job is submitted
    // before the worker registered (the test does not wait for it).
    let cluster = cluster(directory.path(), 20 * GIB, Some(guard)).await;
    let job = cluster.submit(standin_job(&libraries)).await;
    let job = cluster
        .wait_for_state(&job.id, v1::JobState::Succeeded)
        .await;
    let attempts = &job.attempts;
    let summary: Vec<_> = attempts
        .iter()
        .map(|attempt| {
            (
                attempt.profile,
                outcome(attempt),
                attempt.config.map(|config| config.micro_batch_size),
                attempt.oom_detected_by.as_str(),
            )
        })
        .collect();
    assert_eq!(summary.len(), 3, "{job:#?}");

    // The profile: micro-batches 64 and 32 for 2 steps, peaks 200 + 12 MiB per sample.
    let profile = &attempts[0];
    assert!(profile.profile, "{profile:#?}");
    assert_eq!(outcome(profile), v1::AttemptOutcome::Succeeded);
    let points: Vec<(u64, u64, bool)> = profile
        .profile_points
        .iter()
        .map(|point| (point.micro_batch, point.peak_bytes >> 20, point.ran_out))
        .collect();
    assert_eq!(points, vec![(64, 968, false), (32, 584, false)]);

    // Admitted at micro-batch 64, it runs out at step 3, which the profile could not see.
    let ran_out = &attempts[1];
    assert!(!ran_out.profile);
    assert_eq!(
        outcome(ran_out),
        v1::AttemptOutcome::OutOfMemory,
        "{ran_out:#?}"
    );
    assert_eq!(ran_out.config.unwrap().micro_batch_size, 64);
    assert_eq!(ran_out.oom_detected_by, "guard");
    assert_eq!(ran_out.oom.unwrap().requested_bytes, 256 << 20);
    assert!(
        ran_out.command_argv.iter().any(|argument| argument == "64"),
        "{:?}",
        ran_out.command_argv
    );

    // One retry, with accumulation: the same global batch in smaller micro-batches.
    let retry = &attempts[2];
    assert_eq!(outcome(retry), v1::AttemptOutcome::Succeeded, "{retry:#?}");
    let config = retry.config.unwrap();
    assert_eq!(config.batch_size, 64);
    assert!(config.micro_batch_size < 64, "{config:?}");
    assert!(retry.measured_peak_bytes.unwrap_or(0) > 0, "{retry:#?}");
    assert!(retry.measured_peak_bytes.unwrap() <= retry.slice_bytes);
    assert_eq!(retry.steps_done, Some(6));

    // The stand-in's own record: it resumed, and every optimizer step saw 64 samples.
    let checkpoint = cluster.checkpoints.join(&job.id).join("standin.json");
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&checkpoint).unwrap()).unwrap();
    assert_eq!(record["step"], 6, "{record:#}");
    let steps = record["optimizer_steps"].as_array().unwrap();
    assert_eq!(steps.len(), 6, "{record:#}");
    for (index, step) in steps.iter().enumerate() {
        assert_eq!(step["step"], index as u64 + 1, "{record:#}");
        assert_eq!(step["samples"], 64, "{record:#}");
    }
    assert!(record["runs"].as_array().unwrap().len() >= 2, "{record:#}");

    // The program's own output is in the job's logs.
    let lines = cluster.attempt_lines(&job.id, 3).await;
    assert!(
        lines
            .iter()
            .any(|line| line.message.contains("standin: done at step 6")),
        "{lines:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_command_is_stopped_and_leaves_no_process_or_record() {
    let directory = tempfile::tempdir().unwrap();
    // No guard on simulated GPUs: the program runs as it is.
    let mut cluster = cluster(directory.path(), 4 * GIB, None).await;
    let spec = serde_json::json!({
        "name": "sleeper",
        "command": {
            "argv": ["sh", "-c", "echo ready; exec sleep 600"],
            "global_batch": 1,
        },
        "resources": { "vram": "1GiB" },
    });
    let job = cluster.submit(spec.to_string()).await;
    let process = cluster.next_process().await;
    assert_eq!(process.job_id, job.id);
    let record = cluster
        .checkpoints
        .join("attempt-processes/test-node")
        .join(format!("{}.attempt-1.json", job.id));
    poll_until(
        WAIT,
        Duration::from_millis(20),
        "the process is recorded",
        || record.is_file().then_some(()),
    )
    .await;
    cluster.wait_for_state(&job.id, v1::JobState::Running).await;
    JobServiceClient::new(cluster.channel.clone())
        .cancel_job(authorized(
            v1::CancelJobRequest {
                job_id: job.id.clone(),
                reason: "enough".into(),
            },
            &cluster.user,
        ))
        .await
        .unwrap();
    // The job is cancelled at once; its attempt once the worker reports it stopped.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let job = cluster.get(&job.id).await;
        if job.attempts[0].outcome == v1::AttemptOutcome::Cancelled as i32 {
            assert_eq!(job.state, v1::JobState::Cancelled as i32);
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{job:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let process_entry = PathBuf::from(format!("/proc/{}", process.process_id));
    poll_until(
        WAIT,
        Duration::from_millis(20),
        "the program is gone",
        || (!process_entry.exists()).then_some(()),
    )
    .await;
    poll_until(
        WAIT,
        Duration::from_millis(20),
        "its record is removed",
        || (!record.exists()).then_some(()),
    )
    .await;
    let lines = cluster.attempt_lines(&job.id, 1).await;
    assert!(
        lines.iter().any(|line| line.message == "ready"),
        "{lines:#?}"
    );
}
