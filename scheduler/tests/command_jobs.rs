//! Command jobs through the real scheduler, with a test worker that speaks the protocol by
//! hand: a profile first when the command's memory is unknown, the job sized by the
//! fitted model, an out-of-memory the guard saw shrunk to a micro-batch that keeps the
//! global batch, and what `get` shows of each attempt. The real worker, guard and program
//! are in worker/tests/command_jobs_end_to_end.rs.

use std::time::Duration;

use carve_proto::v1;
use tonic::Code;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::TestWorker;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{get, start_for_tenant, start_with_worker, submit, wait_for_state};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A command job of global batch 64 run at micro-batch 64 first; `vram` is its
/// resources.vram.
fn command_job(vram: &str) -> String {
    serde_json::json!({
        "name": "standin",
        "command": {
            "argv": ["python3", "train.py", "--micro-batch", "{micro_batch}",
                     "--accumulation-steps", "{accumulation_steps}", "--steps", "{max_steps}"],
            "working_directory": "/tmp",
            "global_batch": 64,
            "steps": 6,
        },
        "resources": { "vram": vram },
        "oom": { "strategies": ["accumulate"] },
    })
    .to_string()
}

fn attempt_of(assignment: &v1::scheduler_message::Assignment) -> v1::AttemptRef {
    assignment.attempt.clone().unwrap()
}

/// Reports `assignment` started, running `argv`; `uncontained`: without a container.
async fn started_with_argv(
    worker: &mut TestWorker,
    assignment: &v1::scheduler_message::Assignment,
    argv: &[&str],
    uncontained: bool,
) {
    worker
        .send(v1::worker_message::Body::AttemptStarted(
            v1::worker_message::AttemptStarted {
                attempt: assignment.attempt.clone(),
                reserved_bytes: assignment.slice_bytes,
                resumed_from: None,
                command_argv: argv.iter().map(|arg| arg.to_string()).collect(),
                uncontained,
                image_digest: String::new(),
            },
        ))
        .await;
}

#[tokio::test]
async fn a_profile_sizes_the_job_and_an_oom_is_retried_with_accumulation() {
    let (_cluster, channel, user, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    let job = submit(&channel, &user, &command_job("auto"), "")
        .await
        .unwrap()
        .job
        .unwrap();

    // Nothing is known of the program's memory: its first attempt is a profile, in the
    // largest slice a GPU gives.
    let profile = worker.next_assignment().await;
    assert!(profile.profile);
    assert_eq!(profile.kind, "command");
    assert_eq!(profile.config.as_ref().unwrap().micro_batch_size, 64);
    started_with_argv(&mut worker, &profile, &["python3", "train.py"], false).await;
    // fixed 1 GiB + 16 MiB per sample.
    worker
        .finish_profile(&profile, GIB, 16 * MIB, [32, 64])
        .await;

    // Sized by the model: the configuration as written, in a slice of what it needs.
    let training = worker.next_assignment().await;
    assert!(!training.profile);
    assert_eq!(attempt_of(&training).attempt_number, 2);
    assert_eq!(training.config.as_ref().unwrap().micro_batch_size, 64);
    assert!(
        training.slice_bytes >= 2 * GIB && training.slice_bytes < 3 * GIB,
        "slice {}",
        training.slice_bytes
    );
    started_with_argv(
        &mut worker,
        &training,
        &["python3", "train.py", "64"],
        false,
    )
    .await;
    // Memory the two-step profile did not see: the guard refused 512 MiB at 1.9 GiB.
    worker
        .send(v1::worker_message::Body::Oom(
            v1::worker_message::OomReport {
                attempt: training.attempt.clone(),
                report: Some(v1::OutOfMemoryReport {
                    requested_bytes: 512 * MIB,
                    in_use_bytes: 1946 * MIB,
                    limit_bytes: training.slice_bytes,
                    largest_free_bytes: 0,
                    peak_bytes: 1946 * MIB,
                }),
                checkpoint: None,
                detected_by: "guard".into(),
                evidence: "the guard refused 512 MiB with 1.9 GiB of 2 GiB in use".into(),
            },
        ))
        .await;

    // One retry: the largest micro-batch that fits the same slice, same global batch.
    let retry = worker.next_assignment().await;
    assert!(!retry.profile);
    let config = retry.config.unwrap();
    assert_eq!(attempt_of(&retry).attempt_number, 3);
    assert_eq!(config.batch_size, 64, "the global batch is kept");
    assert_eq!(config.micro_batch_size, 32);
    // The retry runs on a worker restarted without its sandbox (--insecure-no-sandbox).
    started_with_argv(&mut worker, &retry, &["python3", "train.py", "32"], true).await;
    worker.succeed(&retry, 1800 * MIB).await;
    wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;

    let shown = get(&channel, &user, &job.id).await.unwrap();
    assert_eq!(shown.attempts.len(), 3);
    let [first, second, third] = &shown.attempts[..] else {
        unreachable!()
    };
    assert!(first.profile);
    assert_eq!(first.profile_points.len(), 2);
    assert!(first.chosen_because.starts_with("profile:"), "{first:?}");
    assert_eq!(second.chosen_because, "sized by the profile");
    assert_eq!(second.oom_detected_by, "guard");
    assert!(
        second.failure_message.contains("guard refused"),
        "{second:?}"
    );
    assert_eq!(second.command_argv, ["python3", "train.py", "64"]);
    // Only the attempt its worker said ran uncontained shows it.
    assert_eq!(
        shown
            .attempts
            .iter()
            .map(|attempt| attempt.uncontained)
            .collect::<Vec<_>>(),
        [false, false, true]
    );
    assert_eq!(
        third.chosen_because,
        "after attempt 2 ran out of memory: micro-batch 64 -> 32 (2 accumulation steps)"
    );
    // The model, raised by what attempt 2 needed, is the command's.
    let model = shown.memory_model.unwrap();
    assert!(
        model.fixed_bytes + 64 * model.per_sample_bytes >= 1946 * MIB + 512 * MIB,
        "{model:?}"
    );

    // The same command again is not profiled: its model is known.
    let again = submit(&channel, &user, &command_job("auto"), "")
        .await
        .unwrap()
        .job
        .unwrap();
    let placed = worker.next_assignment().await;
    assert_eq!(attempt_of(&placed).job_id, again.id);
    assert!(!placed.profile);
}

#[tokio::test]
async fn a_declared_vram_skips_the_profile_and_bad_commands_name_their_field() {
    let (_cluster, channel, user, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "bob").await;
    let job = submit(&channel, &user, &command_job("3GiB"), "")
        .await
        .unwrap()
        .job
        .unwrap();
    let assignment = worker.next_assignment().await;
    assert_eq!(attempt_of(&assignment).job_id, job.id);
    assert!(!assignment.profile);
    assert_eq!(assignment.slice_bytes, 3 * GIB);

    let unknown_placeholder = command_job("auto").replace("{max_steps}", "{max_step}");
    let refused = submit(&channel, &user, &unknown_placeholder, "")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused.message().contains("spec.command.argv[7]"),
        "{}",
        refused.message()
    );
    let both = serde_json::json!({
        "name": "both",
        "command": { "argv": ["true"], "global_batch": 1, "working_directory": "/tmp" },
        "model": { "input_shape": [4], "layers": [], "loss": "mse" },
    })
    .to_string();
    let refused = submit(&channel, &user, &both, "").await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused.message().contains("spec.command"),
        "{}",
        refused.message()
    );
    // A gang is refused until the scheduler places one whole, never run as one slice.
    let gang = command_job("1GiB").replace(
        r#""resources":{"vram":"1GiB"}"#,
        r#""resources":{"vram":"1GiB","gpus":2}"#,
    );
    assert!(gang.contains(r#""gpus":2"#), "{gang}");
    let refused = submit(&channel, &user, &gang, "").await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused.message().contains("spec.resources.gpus"),
        "{}",
        refused.message()
    );
}

#[tokio::test]
async fn a_profile_submitted_before_any_gpu_is_known_gets_the_largest_gpu_once_one_is() {
    let (_cluster, channel, user, worker_token) =
        start_for_tenant(Duration::from_secs(30), "carol").await;
    // No worker yet: the profile's slice is a guess, larger than the GPU that comes.
    let job = submit(&channel, &user, &command_job("auto"), "")
        .await
        .unwrap()
        .job
        .unwrap();
    let mut worker = TestWorker::connect(&channel, &worker_token, "gpu-small", 8 * GIB).await;
    let profile = worker.next_assignment().await;
    assert_eq!(attempt_of(&profile).job_id, job.id);
    assert!(profile.profile);
    assert!(
        profile.slice_bytes <= 8 * GIB && profile.slice_bytes > 7 * GIB,
        "the largest slice the 8 GiB GPU gives, not {}",
        profile.slice_bytes
    );
}
