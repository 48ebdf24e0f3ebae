//! A job submitted to a standby replica (issue 29, point 5): two replicas of the real
//! scheduler in-process on one PostgreSQL database (the server `support/mod.rs` starts),
//! the first leading. The standby knows no worker (only the leader has sessions), so its
//! answer must not say why no worker is ready: it says the job is queued for the
//! leader's next pass and names the leader, and the leader's pass then gives the job its
//! own reason.

#[macro_use]
mod support;

#[path = "support/worker.rs"]
mod test_worker;

#[path = "support/cluster.rs"]
mod cluster;

use std::time::Duration;

use carve_proto::v1;
use carve_scheduler::server::run;
use carve_scheduler::store::Store;
use tokio::sync::oneshot;
use tonic::transport::Channel;

use cluster::{JOB, connect_within, get, submit, test_config};

const DEADLINE: Duration = Duration::from_secs(15);

/// One replica on `database_url`: its endpoint and a channel to it; it stops when the
/// sender drops.
async fn replica(database_url: &str) -> (oneshot::Sender<()>, String, Channel) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let mut config = test_config(database_url.to_string(), Duration::from_secs(30), None);
    config.settings.leader_lease = Duration::from_secs(5);
    let (shutdown, signal) = oneshot::channel::<()>();
    tokio::spawn(async move {
        run(config, listener, async {
            let _ = signal.await;
        })
        .await
        .unwrap();
    });
    let channel = connect_within(&endpoint, DEADLINE).await;
    (shutdown, endpoint, channel)
}

/// Waits until the replica at `endpoint` holds the leadership.
async fn until_leading(store: &Store, endpoint: &str) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let leadership = store.leadership().await.unwrap();
        if leadership.current && leadership.endpoint == endpoint {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{endpoint} never led: {leadership:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standbys_answer_to_a_submit_says_the_job_waits_for_the_leaders_pass() {
    let database = support::shared_postgres()
        .create_database("standby")
        .await
        .unwrap_or_else(|error| panic!("{error}"));
    let (_leader_shutdown, leader_endpoint, leader) = replica(&database).await;
    let store = Store::open(&database).await.unwrap();
    until_leading(&store, &leader_endpoint).await;
    let (_standby_shutdown, _, standby) = replica(&database).await;
    let (user, _worker_token) =
        cluster::tenant_with_tokens(&leader, "acme", v1::Quota::default()).await;

    let answered = submit(&standby, &user, JOB, "").await.unwrap().job.unwrap();
    assert_eq!(answered.state, v1::JobState::Queued as i32);
    let reason = &answered.waiting_reason;
    assert!(
        reason.starts_with("queued for the leader's next pass"),
        "the standby's answer: {reason}"
    );
    assert!(reason.contains(&leader_endpoint), "{reason}");
    assert!(
        !reason.contains("draining or not ready"),
        "a standby knows no worker: {reason}"
    );

    // The leader's pass gives the job its own reason (it has no worker either).
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let job = get(&leader, &user, &answered.id).await.unwrap();
        if !job
            .waiting_reason
            .starts_with("queued for the leader's next pass")
        {
            assert!(
                job.waiting_reason.contains("draining or not ready"),
                "{}",
                job.waiting_reason
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the leader's pass never gave job {} its reason",
            answered.id
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
