//! Preemption end to end: the real scheduler and the real worker in-process (a simulated
//! 1 GiB GPU), real attempt processes training tiny jobs. A long low-priority job runs; a
//! high-priority job that does not fit beside it arrives; the low one is stopped (it
//! checkpoints on SIGTERM, and its attempt ends preempted), the high one runs and
//! succeeds, and the low one resumes from that checkpoint and finishes.

use std::path::PathBuf;
use std::time::Duration;

use carve_proto::v1;

#[path = "support/cluster.rs"]
#[allow(dead_code, reason = "not every helper is used here")]
mod cluster;
use cluster::{Cluster, WAIT};

// The chaos test's helpers are not all used here.
#[allow(dead_code)]
mod support;
use support::tiny_job_spec;

const ADMIN: &str = "carve_preemption_admin_secret";

/// A tiny job of `steps` (checkpointing every 1000) in a 600 MiB slice, at `priority`:
/// two do not fit side by side on the 1 GiB GPU.
fn job_at_priority(name: &str, priority: i32, steps: u64) -> String {
    tiny_job_spec(name, steps, 1000, r#", "resources": { "vram": "600MiB" }"#).replacen(
        &format!("\"name\": \"{name}\","),
        &format!("\"name\": \"{name}\", \"priority\": {priority},"),
        1,
    )
}

fn outcome(attempt: &v1::Attempt) -> v1::AttemptOutcome {
    v1::AttemptOutcome::try_from(attempt.outcome).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_job_resumes_from_its_checkpoint_after_the_urgent_one() {
    let directory = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", directory.path().join("carve.db").display());
    let program = PathBuf::from(env!("CARGO_BIN_EXE_carve-worker"));
    let mut cluster = Cluster::start(directory.path(), url, program, ADMIN, |_| {}).await;

    let low = cluster.submit(job_at_priority("low", 0, 3000)).await;
    let first = cluster.next_process().await;
    assert_eq!(first.attempt_number, 1);
    // Checkpoints come every 1000 steps, after the preemption: the step the second
    // attempt resumes from is the one the first checkpointed when told to stop.
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cluster
        .get(&low.id)
        .await
        .attempts
        .first()
        .is_some_and(|attempt| {
            attempt
                .progress
                .as_ref()
                .is_some_and(|progress| progress.step > 0)
        })
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "training never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let high = cluster.submit(job_at_priority("high", 10, 20)).await;
    let urgent = cluster.next_process().await;
    assert_eq!(urgent.job_id, high.id);
    cluster
        .wait_for_state(&high.id, v1::JobState::Succeeded)
        .await;

    let second = cluster.next_process().await;
    assert_eq!(
        (second.job_id.as_str(), second.attempt_number),
        (low.id.as_str(), 2)
    );
    let finished = cluster
        .wait_for_state(&low.id, v1::JobState::Succeeded)
        .await;
    assert_eq!(finished.attempts.len(), 2, "{finished:#?}");
    let preempted = &finished.attempts[0];
    assert_eq!(outcome(preempted), v1::AttemptOutcome::Preempted);
    assert!(
        preempted
            .failure_message
            .contains(&format!("preempted by job {} (priority 10)", high.id)),
        "{}",
        preempted.failure_message
    );
    let lines = cluster.attempt_lines(&low.id, 1).await;
    assert!(
        lines
            .iter()
            .any(|line| line.message.contains("preempted by job")),
        "{lines:?}"
    );
    let resumed = &finished.attempts[1];
    assert_eq!(outcome(resumed), v1::AttemptOutcome::Succeeded);
    let resumed_from = resumed
        .resumed_from
        .as_ref()
        .expect("resumed from a checkpoint");
    assert!(
        resumed_from
            .location
            .starts_with(&cluster.checkpoints.display().to_string()),
        "{resumed_from:?}"
    );
    assert!(
        resumed_from.step > 0 && resumed_from.step < 1000,
        "not the checkpoint written on SIGTERM: {resumed_from:?}"
    );
}
