//! A job's spec is parsed and checked once, at admission, and never again: its
//! placements, the retry plan after an out-of-memory report and the success report's
//! peak key use what admission validated, in the same scheduler's life and after a
//! restart, which reads the validated form admission stored with the job
//! (`jobs.workload_json`); `carve_stored_spec_reads_total` counts every read of a stored
//! spec. A job stored without that form (a row from before the column) has its spec read
//! once, and the form stored then, so the next life reads none. The real scheduler
//! in-process over gRPC with a hand-driven worker.

#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/worker.rs"]
mod test_worker;

use std::path::Path;
use std::time::Duration;

use carve_proto::v1;
use carve_scheduler::error::SchedulerError;
use carve_scheduler::server::run;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use test_worker::TestWorker;

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

/// One life of the scheduler on a database, with its metrics page.
struct Life {
    channel: Channel,
    metrics_address: std::net::SocketAddr,
    shutdown: oneshot::Sender<()>,
    server: JoinHandle<Result<(), SchedulerError>>,
}

impl Life {
    async fn start(database_url: &str) -> Life {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        let metrics_address = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let config = cluster::test_config(
            database_url.to_string(),
            Duration::from_secs(30),
            Some(metrics_address),
        );
        let (shutdown, signal) = oneshot::channel::<()>();
        let server = tokio::spawn(run(config, listener, async {
            let _ = signal.await;
        }));
        let channel = cluster::connect_within(&address, Duration::from_secs(10)).await;
        Life {
            channel,
            metrics_address,
            shutdown,
            server,
        }
    }

    async fn spec_reads(&self) -> u64 {
        let metrics = cluster::scrape(self.metrics_address).await;
        cluster::metric(&metrics, "carve_stored_spec_reads_total")
    }

    async fn stop(self) {
        drop(self.channel);
        let _ = self.shutdown.send(());
        self.server
            .await
            .expect("the server task did not panic")
            .expect("run ends cleanly");
    }
}

/// Runs `job_id` on `worker` to its end: placed, out of memory, placed again with the
/// retry plan, succeeded.
async fn run_through_an_oom_retry(life: &Life, user: &str, worker: &mut TestWorker, job_id: &str) {
    let first = worker.next_assignment().await;
    assert_eq!(first.attempt.as_ref().unwrap().job_id, job_id);
    worker.run_out_of_memory(&first).await;
    let second = worker.next_assignment().await;
    assert_eq!(second.attempt.as_ref().unwrap().job_id, job_id);
    assert_eq!(second.attempt.as_ref().unwrap().attempt_number, 2);
    worker.succeed(&second, 1 << 20).await;
    cluster::wait_for_state(&life.channel, user, job_id, v1::JobState::Succeeded).await;
}

/// Opens the test's SQLite database directly, as the previous release's scheduler or an
/// operator would.
async fn database(directory: &Path) -> sqlx::SqlitePool {
    sqlx::SqlitePool::connect(&cluster::sqlite_url(directory))
        .await
        .unwrap()
}

/// Whether `job_id` has a stored validated form.
async fn has_stored_form(directory: &Path, job_id: &str) -> bool {
    let pool = database(directory).await;
    let (form,): (Option<String>,) = sqlx::query_as("SELECT workload_json FROM jobs WHERE id = $1")
        .bind(job_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    form.is_some()
}

/// Forgets `job_id`'s stored form, as a row written before the column holds none.
async fn forget_stored_form(directory: &Path, job_id: &str) {
    let pool = database(directory).await;
    let forgotten = sqlx::query("UPDATE jobs SET workload_json = NULL WHERE id = $1")
        .bind(job_id)
        .execute(&pool)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(forgotten, 1);
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_placement_and_the_oom_retry_use_the_stored_form_not_the_spec() {
    let directory = tempfile::tempdir().unwrap();
    let database_url = cluster::sqlite_url(directory.path());

    // Life 1 admits two jobs; no worker, so both are queued when it stops. One job runs
    // at a time (the quota), in submit order.
    let life = Life::start(&database_url).await;
    let quota = v1::Quota {
        max_running_jobs: Some(1),
        ..v1::Quota::default()
    };
    let (user, worker_token) = cluster::tenant_with_tokens(&life.channel, "alice", quota).await;
    let stored = cluster::submit_named(&life.channel, &user, "stored").await;
    let old_row = cluster::submit_named(&life.channel, &user, "old-row").await;
    life.stop().await;
    assert!(has_stored_form(directory.path(), &stored.id).await);
    // The second job's row as one written before the column: no stored form.
    forget_stored_form(directory.path(), &old_row.id).await;

    // Life 2 places the first job, plans its retry after an OOM and ends it from what
    // admission stored: no spec is read.
    let life = Life::start(&database_url).await;
    let mut worker = TestWorker::connect(&life.channel, &worker_token, "gpu-a", 16 << 30).await;
    run_through_an_oom_retry(&life, &user, &mut worker, &stored.id).await;
    // Its success frees the quota, and the next pass may place the other job (reading
    // its spec, which has no stored form) before this read of the metric: that read is
    // then the other job's, which shows placed. The count after both journeys (one)
    // says no read was this job's either way.
    let reads = life.spec_reads().await;
    if reads == 1 {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while cluster::get(&life.channel, &user, &old_row.id)
            .await
            .unwrap()
            .attempts
            .is_empty()
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "a spec was read, and not for the job without a stored form"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    } else {
        assert_eq!(
            reads, 0,
            "a restarted scheduler placed and retried a job without reading its spec"
        );
    }

    // The job without a stored form has its spec read once through the same journey,
    // and the form is stored then, for every later read.
    run_through_an_oom_retry(&life, &user, &mut worker, &old_row.id).await;
    assert_eq!(life.spec_reads().await, 1);
    worker.disconnect();
    life.stop().await;
    assert!(has_stored_form(directory.path(), &old_row.id).await);
}
