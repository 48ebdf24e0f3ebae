//! Fair share over time through the real scheduler and a test worker (issue 32): a
//! tenant with a night of recorded usage (written through the store as history) and a
//! tenant without any both wait for a GPU with room for one job; the one without history
//! is placed first, though the other's name sorts first (instantaneous fair share would
//! take it). Each attempt's usage row is written at its placement and ended with it, and
//! agrees with the attempt's own record.

use std::time::Duration;

use carve_proto::v1;
use carve_scheduler::store::UsageRecord;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::TestWorker;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{JOB, channel, start, submit, tenant_with_tokens, wait_for_state};

const CONTEXT_BYTES: u64 = 256 << 20;
const HOUR_MS: i64 = 3_600_000;

fn named(name: &str) -> String {
    JOB.replace("\"small\"", &format!("\"{name}\""))
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_with_a_night_of_usage_yields_to_one_without() {
    let cluster = start(Duration::from_secs(30)).await;
    let channel = channel(&cluster).await;
    let (night_user, worker_token) =
        tenant_with_tokens(&channel, "aa-night", v1::Quota::default()).await;
    let (fresh_user, _) = tenant_with_tokens(&channel, "zz-fresh", v1::Quota::default()).await;

    // Last night: eight hours of a 40 GiB slice, ended an hour ago.
    let store = cluster.other_replica().await;
    let now = now_ms();
    let night = UsageRecord {
        job_id: "job-last-night".to_string(),
        attempt_number: 1,
        tenant: "aa-night".to_string(),
        gpu_type: "NVIDIA H100 80GB HBM3".to_string(),
        slice_bytes: 40 << 30,
        placed_at_ms: now - 9 * HOUR_MS,
        ended_at_ms: Some(now - HOUR_MS),
        measured_peak_bytes: Some(31 << 30),
    };
    store
        .record_usage(std::slice::from_ref(&night))
        .await
        .unwrap();

    // Both submit before any GPU exists, so both wait for the same pass.
    let from_night = submit(&channel, &night_user, &named("night-job"), "")
        .await
        .unwrap()
        .job
        .unwrap();
    let from_fresh = submit(&channel, &fresh_user, &named("fresh-job"), "")
        .await
        .unwrap()
        .job
        .unwrap();
    let required = from_night.estimate.as_ref().unwrap().required_bytes;
    let mut worker = TestWorker::connect(
        &channel,
        &worker_token,
        "gpu-a",
        CONTEXT_BYTES + required * 3 / 2,
    )
    .await;

    let first = worker.next_assignment().await;
    let first_attempt = first.attempt.clone().unwrap();
    assert_eq!(
        first_attempt.job_id, from_fresh.id,
        "the tenant without history is placed first"
    );
    worker.succeed(&first, required / 2).await;
    let second = worker.next_assignment().await;
    let second_attempt = second.attempt.clone().unwrap();
    assert_eq!(second_attempt.job_id, from_night.id);
    worker.succeed(&second, required / 3).await;
    wait_for_state(
        &channel,
        &night_user,
        &from_night.id,
        v1::JobState::Succeeded,
    )
    .await;

    // Each attempt's usage, as stored, is its attempt's slice, placement and end.
    let rows = store.usage_between(0, i64::MAX, None).await.unwrap();
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert_eq!(rows[0], night);
    for (row, job, peak) in [
        (&rows[1], &from_fresh, required / 2),
        (&rows[2], &from_night, required / 3),
    ] {
        let attempts = store.list_attempts(&job.id).await.unwrap();
        assert_eq!(attempts.len(), 1);
        let attempt = &attempts[0];
        assert_eq!(row.job_id, job.id);
        assert_eq!(row.attempt_number, 1);
        assert_eq!(row.tenant, job.tenant);
        assert_eq!(row.gpu_type, "simulated");
        assert_eq!(row.slice_bytes, attempt.slice_bytes);
        assert_eq!(row.placed_at_ms, attempt.started_at_ms);
        assert_eq!(row.ended_at_ms, attempt.finished_at_ms);
        assert_eq!(row.measured_peak_bytes, Some(peak as i64));
    }
}
