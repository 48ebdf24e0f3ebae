//! The worker's own limits end to end (issue 26): the real scheduler and the real worker
//! in-process, command jobs whose programs never end by themselves. One that asks for a
//! 2 s `max_duration` (a training attempt, and a profile attempt) is stopped past it; one
//! that writes past the worker's checkpoint limit into `{checkpoint_dir}` is stopped once
//! a measurement sees it. Each ends FAILED with the worker's message, in seconds.
//! Contained where this machine can (runc and root, as CI has), uncontained elsewhere:
//! the limits are the worker's, so they hold either way.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use carve_proto::v1;
use carve_worker::attempt_limits::RunLimits;
use carve_worker::gpus::SimulatedGpu;
use serde_json::json;

#[path = "support/cluster.rs"]
#[allow(dead_code, reason = "not every helper is used here")]
mod cluster;
#[allow(dead_code, reason = "the chaos test's helpers are not all used here")]
mod support;

use cluster::Cluster;

const ADMIN: &str = "carve_attempt_limits_admin_secret";
const GIB: u64 = 1 << 30;

/// Long enough for a stop a few seconds past the limits, much shorter than the 600 s
/// the programs would run.
const WITHIN: Duration = Duration::from_secs(30);

async fn cluster(directory: &Path) -> Cluster {
    let url = format!("sqlite://{}", directory.join("carve.db").display());
    Cluster::start(
        directory,
        url,
        PathBuf::from(env!("CARGO_BIN_EXE_carve-worker")),
        ADMIN,
        |config| {
            // Room for the jobs side by side: the profile takes a whole GPU.
            config.simulated_gpus = vec![
                SimulatedGpu {
                    total_bytes: 4 * GIB
                };
                2
            ];
            config.run_limits = RunLimits {
                max_duration: Some(Duration::from_secs(3_600)),
                checkpoint_bytes: Some(4 << 20),
                measure_interval: Duration::from_secs(1),
            };
        },
    )
    .await
}

fn command_job(name: &str, argv: &[&str], resources: serde_json::Value) -> String {
    json!({
        "name": name,
        "command": { "argv": argv, "global_batch": 1, "steps": 10 },
        "resources": resources,
    })
    .to_string()
}

/// Waits until the job has ended, and checks it ended FAILED within [`WITHIN`].
async fn failed_within(cluster: &Cluster, job_id: &str, submitted: Instant) -> v1::Job {
    let job = cluster.wait_for_state(job_id, v1::JobState::Failed).await;
    assert!(
        submitted.elapsed() < WITHIN,
        "stopped only after {:?}: {job:#?}",
        submitted.elapsed()
    );
    job
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_past_their_max_duration_or_checkpoint_limit_are_stopped_and_fail() {
    let directory = tempfile::tempdir().unwrap();
    let cluster = cluster(directory.path()).await;
    let submitted = Instant::now();
    let sleeper = cluster
        .submit(command_job(
            "sleeper",
            &["sh", "-c", "echo running; exec sleep 600"],
            json!({ "vram": "256MiB", "max_duration": "2s" }),
        ))
        .await;
    // A program that ignores SIGTERM: its profile attempt is killed after the grace.
    let profiled = cluster
        .submit(command_job(
            "profiled-sleeper",
            &[
                "sh",
                "-c",
                "trap '' TERM; echo steps $0; sleep 600",
                "{max_steps}",
            ],
            json!({ "vram": "auto", "max_duration": "2s" }),
        ))
        .await;
    let filler = cluster
        .submit(command_job(
            "filler",
            &[
                "sh",
                "-c",
                "head -c 8388608 /dev/zero > \"$0/filling\" && echo written; exec sleep 600",
                "{checkpoint_dir}",
            ],
            json!({ "vram": "256MiB" }),
        ))
        .await;

    let sleeper = failed_within(&cluster, &sleeper.id, submitted).await;
    let attempt = &sleeper.attempts[0];
    assert_eq!(attempt.outcome, v1::AttemptOutcome::Failed as i32);
    assert!(
        attempt.failure_message.starts_with(&format!(
            "stopped by the worker: attempt {}/1 ran for ",
            sleeper.id
        )) && attempt
            .failure_message
            .ends_with("past its max_duration of 2s (the job's resources.max_duration)"),
        "{attempt:#?}"
    );
    assert!(
        sleeper.message.contains("past its max_duration of 2s"),
        "{sleeper:#?}"
    );

    let profiled = failed_within(&cluster, &profiled.id, submitted).await;
    let attempt = &profiled.attempts[0];
    assert!(
        attempt.profile,
        "the profile is the first attempt: {profiled:#?}"
    );
    assert_eq!(attempt.outcome, v1::AttemptOutcome::Failed as i32);
    assert!(
        attempt
            .failure_message
            .contains("past its max_duration of 2s"),
        "{attempt:#?}"
    );

    let filler = failed_within(&cluster, &filler.id, submitted).await;
    let attempt = &filler.attempts[0];
    assert_eq!(attempt.outcome, v1::AttemptOutcome::Failed as i32);
    assert!(
        attempt.failure_message.starts_with(&format!(
            "stopped by the worker: attempt {}/1's checkpoint directory",
            filler.id
        )) && attempt
            .failure_message
            .contains("past this worker's limit of 4 MiB (--attempt-checkpoint-limit)"),
        "{attempt:#?}"
    );
    for job in [&sleeper, &profiled, &filler] {
        eprintln!("{}: {}", job.name, job.attempts[0].failure_message);
    }
    // It was the program's own writing that the worker measured.
    let written = cluster.checkpoints.join(&filler.id).join("filling");
    let written = std::fs::metadata(&written).unwrap();
    assert_eq!(written.len(), 8 << 20);
    if support::can_contain() {
        // Written in its container, as its tenant's own host uid.
        use std::os::unix::fs::MetadataExt;
        assert!(
            written.uid() >= carve_worker::sandbox::DEFAULT_FIRST_HOST_UID,
            "{written:?}"
        );
    }
}
