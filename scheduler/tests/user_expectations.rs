//! What users and operators expect of the real server (in-process on 127.0.0.1:0, a real
//! SQLite file, real gRPC clients): an idempotency key reused with another spec is
//! refused, not answered with the first job; the metrics page shows every gauge, at 0
//! when there is nothing to count, for every tenant, says why submits were refused,
//! counts a draining worker and its GPUs apart from the ready ones, and counts a job that
//! failed out of memory with no retry left.

use std::time::Duration;

use tonic::Code;

#[path = "support/worker.rs"]
mod test_worker;

#[path = "support/cluster.rs"]
mod cluster;
use carve_proto::v1;
use carve_proto::v1::cluster_service_client::ClusterServiceClient;
use cluster::{
    ADMIN, JOB, metric, scrape, start_for_tenant, start_with_worker, submit, wait_for_state,
};
use test_worker::authorized;

#[tokio::test]
async fn an_idempotency_key_reused_with_another_spec_is_refused() {
    let (_cluster, channel, user, _) = start_for_tenant(Duration::from_secs(30), "alice").await;
    let first = submit(&channel, &user, JOB, "nightly").await.unwrap();
    assert!(first.created);
    let first_id = first.job.unwrap().id;

    // A retry sends the same request and gets the first job back.
    let retry = submit(&channel, &user, JOB, "nightly").await.unwrap();
    assert!(!retry.created);
    assert_eq!(retry.job.unwrap().id, first_id);
    // The same spec written with other spacing is still a retry.
    let compact: serde_json::Value = serde_json::from_str(JOB).unwrap();
    let retry = submit(&channel, &user, &compact.to_string(), "nightly")
        .await
        .unwrap();
    assert!(!retry.created);
    assert_eq!(retry.job.unwrap().id, first_id);

    // Another spec under the same key would be another job: refused, naming the key and
    // the job it already names.
    let other_spec = JOB.replace("\"steps\": 10", "\"steps\": 20");
    assert_ne!(other_spec, JOB);
    let refused = submit(&channel, &user, &other_spec, "nightly")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::AlreadyExists, "{refused:?}");
    assert!(
        refused.message().contains("idempotency_key") && refused.message().contains(&first_id),
        "{}",
        refused.message()
    );

    // The refusal created nothing: another key takes the other spec as a new job.
    let other = submit(&channel, &user, &other_spec, "weekly")
        .await
        .unwrap();
    assert!(other.created);
    assert_ne!(other.job.unwrap().id, first_id);
}

#[tokio::test]
async fn a_fresh_server_exports_every_gauge_at_zero_for_every_tenant() {
    let (cluster, _channel, _user, _) = start_for_tenant(Duration::from_secs(30), "alice").await;
    let metrics = scrape(cluster.metrics_address).await;
    // A tenant with no jobs still has its series, so dashboards keep it.
    for gauge in [
        "carve_queued_jobs",
        "carve_running_jobs",
        "carve_vram_allocated_bytes",
        "carve_vram_estimated_bytes",
        "carve_vram_measured_bytes",
    ] {
        assert_eq!(
            metric(&metrics, &format!("{gauge}{{tenant=\"alice\"}}")),
            0,
            "{metrics}"
        );
    }
    for state in ["ready", "draining", "lost"] {
        assert_eq!(
            metric(&metrics, &format!("carve_workers{{state=\"{state}\"}}")),
            0,
            "{metrics}"
        );
    }
    for counter in [
        "carve_submits_accepted_total",
        "carve_submits_rejected_total{reason=\"invalid_spec\"}",
        "carve_submits_rejected_total{reason=\"quota\"}",
        "carve_placements_total",
        "carve_out_of_memory_total",
        "carve_retries_total",
        "carve_oom_retries_exhausted_total",
        "carve_attempts_lost_total",
        "carve_jobs_succeeded_total",
        "carve_jobs_failed_total",
        "carve_jobs_cancelled_total",
        "carve_submit_groups_committed_total",
        "carve_submit_jobs_committed_total",
        "carve_log_lines_stored_total",
        "carve_log_lines_dropped_total",
        "carve_submit_latency_seconds_count",
    ] {
        assert_eq!(metric(&metrics, counter), 0, "{counter}: {metrics}");
    }
}

#[tokio::test]
async fn a_refused_submit_is_counted_under_its_reason() {
    let (cluster, channel, user, _) = start_for_tenant(Duration::from_secs(30), "alice").await;
    let refused = submit(&channel, &user, "{ not json", "").await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let refused = submit(&channel, "no-such-token", JOB, "")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    submit(&channel, &user, JOB, "nightly").await.unwrap();
    let other_spec = JOB.replace("\"steps\": 10", "\"steps\": 20");
    let refused = submit(&channel, &user, &other_spec, "nightly")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::AlreadyExists, "{refused:?}");

    let metrics = scrape(cluster.metrics_address).await;
    for (reason, count) in [
        ("invalid_spec", 1),
        ("unauthenticated", 1),
        ("idempotency_conflict", 1),
        ("quota", 0),
        ("too_large", 0),
    ] {
        assert_eq!(
            metric(
                &metrics,
                &format!("carve_submits_rejected_total{{reason=\"{reason}\"}}")
            ),
            count,
            "{reason}: {metrics}"
        );
    }
}

#[tokio::test]
async fn a_draining_worker_is_not_ready_and_offers_no_allocatable_memory() {
    let (cluster, channel, _, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    let metrics = scrape(cluster.metrics_address).await;
    assert_eq!(metric(&metrics, "carve_workers{state=\"ready\"}"), 1);
    assert!(
        sum_of(&metrics, "carve_gpu_memory_allocatable_bytes") > 0,
        "{metrics}"
    );

    ClusterServiceClient::new(channel.clone())
        .drain_worker(authorized(
            v1::DrainWorkerRequest {
                worker_id: worker.id.clone(),
                reason: "maintenance".into(),
            },
            ADMIN,
        ))
        .await
        .unwrap();
    assert!(matches!(
        worker.next().await,
        v1::scheduler_message::Body::Drain(_)
    ));
    let metrics = scrape(cluster.metrics_address).await;
    assert_eq!(metric(&metrics, "carve_workers{state=\"draining\"}"), 1);
    assert_eq!(metric(&metrics, "carve_workers{state=\"ready\"}"), 0);
    assert!(sum_of(&metrics, "carve_gpus") >= 1, "{metrics}");
    assert!(
        sum_of(&metrics, "carve_gpu_memory_total_bytes") > 0,
        "{metrics}"
    );
    assert_eq!(
        sum_of(&metrics, "carve_gpu_memory_allocatable_bytes"),
        0,
        "{metrics}"
    );
}

/// The sum of a gauge's series over all its labels.
fn sum_of(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test]
async fn a_job_failed_out_of_memory_with_no_retry_left_is_counted() {
    let (cluster, channel, user, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    let no_retries = JOB.replacen('{', "{ \"oom\": { \"max_retries\": 0 },", 1);
    let job = submit(&channel, &user, &no_retries, "")
        .await
        .unwrap()
        .job
        .unwrap();
    let assignment = worker.next_assignment().await;
    worker.run_out_of_memory(&assignment).await;
    let failed = wait_for_state(&channel, &user, &job.id, v1::JobState::Failed).await;
    assert!(failed.message.contains("retry limit"), "{failed:?}");

    let metrics = scrape(cluster.metrics_address).await;
    assert_eq!(
        metric(&metrics, "carve_oom_retries_exhausted_total"),
        1,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "carve_out_of_memory_total"),
        1,
        "{metrics}"
    );
    assert_eq!(metric(&metrics, "carve_retries_total"), 0, "{metrics}");
}
