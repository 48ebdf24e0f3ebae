//! A job's spec is parsed and checked once in a scheduler's life, at admission: its
//! placements, the retry plan after an out-of-memory report and the success report's
//! peak key use what admission read (`carve_stored_spec_reads_total` counts the reads
//! after it). The real scheduler in-process over gRPC with a hand-driven worker.

#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/worker.rs"]
mod test_worker;

use std::time::Duration;

use carve_proto::v1;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_spec_is_read_once_through_placements_an_oom_retry_and_its_success() {
    let (cluster, channel, user, _, mut worker) =
        cluster::start_with_worker(Duration::from_secs(30), "alice").await;
    let (job, first) = cluster::submit_and_place(&channel, &user, &mut worker).await;
    worker.run_out_of_memory(&first).await;
    let second = worker.next_assignment().await;
    assert_eq!(second.attempt.as_ref().unwrap().attempt_number, 2);
    worker.succeed(&second, 1 << 20).await;
    cluster::wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;

    let metrics = cluster::scrape(cluster.metrics_address).await;
    assert_eq!(
        cluster::metric(&metrics, "carve_stored_spec_reads_total"),
        0,
        "two placements, an OOM retry and a success read no stored spec again"
    );
}
