//! Preemption through the real scheduler and a test worker: a high-priority job that does
//! not fit beside a running low-priority one makes the scheduler cancel it with a grace
//! period and a reason; once the worker confirms, the urgent job is placed in the freed
//! slice, and the preempted job, back in the queue, resumes from its checkpoint after it.

use std::time::Duration;

use carve_proto::v1;
use carve_scheduler::scheduler::SchedulerSettings;
use tonic::transport::Channel;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::TestWorker;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{
    Cluster, JOB, all_job_logs, channel, get, metric, scrape, start_adjusted, submit,
    tenant_with_tokens, wait_for_state,
};

const CONTEXT_BYTES: u64 = 256 << 20;

fn with_priority(priority: i32, name: &str) -> String {
    JOB.replacen(
        "\"name\": \"small\",",
        &format!("\"name\": \"{name}\", \"priority\": {priority},"),
        1,
    )
}

/// A cluster whose tests' settings `adjust` changes (young attempts may be preempted),
/// with a low-priority job running on a GPU sized to hold one such job and a half: the
/// job is submitted before any GPU exists, so its size is known first.
async fn low_job_running(
    adjust: impl FnOnce(&mut SchedulerSettings),
) -> (
    Cluster,
    Channel,
    String,
    TestWorker,
    v1::Job,
    v1::scheduler_message::Assignment,
) {
    let cluster = start_adjusted(Duration::from_secs(30), |settings| {
        settings.preemption.min_run_time = Duration::ZERO;
        adjust(settings);
    })
    .await;
    let channel = channel(&cluster).await;
    let (user, worker_token) = tenant_with_tokens(&channel, "acme", v1::Quota::default()).await;
    let low = submit(&channel, &user, &with_priority(0, "low"), "")
        .await
        .unwrap()
        .job
        .unwrap();
    let required = low.estimate.as_ref().unwrap().required_bytes;
    let mut worker = TestWorker::connect(
        &channel,
        &worker_token,
        "gpu-a",
        CONTEXT_BYTES + required * 3 / 2,
    )
    .await;
    let assignment = worker.next_assignment().await;
    worker.started(&assignment).await;
    (cluster, channel, user, worker, low, assignment)
}

#[tokio::test]
async fn an_urgent_job_preempts_a_lower_priority_one_which_resumes_from_its_checkpoint() {
    let (cluster, channel, user, mut worker, low, low_assignment) =
        low_job_running(|settings| settings.preemption.grace_period = Duration::from_secs(7)).await;
    let required = low.estimate.as_ref().unwrap().required_bytes;
    let low_attempt = low_assignment.attempt.clone().unwrap();
    worker
        .checkpoint_written(&low_attempt, 5, "/checkpoints/low.ckpt".into())
        .await;

    let high = submit(&channel, &user, &with_priority(10, "high"), "")
        .await
        .unwrap()
        .job
        .unwrap();
    let cancel = match worker.next().await {
        v1::scheduler_message::Body::Cancel(cancel) => cancel,
        other => panic!("expected the low job's cancel, got {other:?}"),
    };
    assert_eq!(cancel.attempt.as_ref(), Some(&low_attempt));
    assert_eq!(
        cancel.grace_period.as_ref().map(|grace| grace.seconds),
        Some(7)
    );
    assert!(
        cancel
            .reason
            .contains(&format!("preempted by job {} (priority 10)", high.id)),
        "{}",
        cancel.reason
    );
    // Nothing is placed in the slice until the worker confirms the victim stopped.
    let early = worker.messages_within(Duration::from_millis(300)).await;
    assert!(
        early.is_empty(),
        "placed before the victim stopped: {early:?}"
    );

    let others = worker
        .finish(&low_attempt, v1::AttemptOutcome::Cancelled, required / 2)
        .await;
    let high_assignment = match others.into_iter().next() {
        Some(v1::scheduler_message::Body::Assignment(assignment)) => assignment,
        None => worker.next_assignment().await,
        Some(other) => panic!("expected the high job's assignment, got {other:?}"),
    };
    assert_eq!(high_assignment.attempt.as_ref().unwrap().job_id, high.id);
    let queued = wait_for_state(&channel, &user, &low.id, v1::JobState::Queued).await;
    let first = &queued.attempts[0];
    assert_eq!(first.outcome, v1::AttemptOutcome::Preempted as i32);
    assert!(
        first.failure_message.contains(&high.id),
        "{}",
        first.failure_message
    );
    worker.started(&high_assignment).await;
    let others = worker.succeed(&high_assignment, required / 2).await;
    wait_for_state(&channel, &user, &high.id, v1::JobState::Succeeded).await;

    let resumed = match others.into_iter().next() {
        Some(v1::scheduler_message::Body::Assignment(assignment)) => assignment,
        None => worker.next_assignment().await,
        Some(other) => panic!("expected the low job's second assignment, got {other:?}"),
    };
    assert_eq!(resumed.attempt.as_ref().unwrap().job_id, low.id);
    assert_eq!(resumed.attempt.as_ref().unwrap().attempt_number, 2);
    assert_eq!(
        resumed
            .resume_from
            .as_ref()
            .map(|checkpoint| checkpoint.step),
        Some(5)
    );
    worker.started(&resumed).await;
    worker.succeed(&resumed, required / 2).await;
    let done = wait_for_state(&channel, &user, &low.id, v1::JobState::Succeeded).await;
    assert_eq!(done.attempts.len(), 2);

    let logs = all_job_logs(&channel, &user, &low.id).await;
    assert!(
        logs.lines.iter().any(|line| line
            .message
            .contains(&format!("preempted by job {}", high.id))),
        "{:?}",
        logs.lines
    );
    let metrics = scrape(cluster.metrics_address).await;
    assert_eq!(metric(&metrics, "carve_preemptions_total"), 1);
    let _ = get(&channel, &user, &low.id).await.unwrap();
}

#[tokio::test]
async fn with_preemption_off_the_urgent_job_waits() {
    let (_cluster, channel, user, mut worker, _, _) =
        low_job_running(|settings| settings.preemption.enabled = false).await;
    submit(&channel, &user, &with_priority(10, "high"), "")
        .await
        .unwrap();
    let sent = worker.messages_within(Duration::from_millis(500)).await;
    assert!(sent.is_empty(), "{sent:?}");
}
