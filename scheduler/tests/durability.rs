//! A kill -9 of the scheduler during a stream of submits loses no acknowledged job: the
//! real binary, SIGKILLed mid-stream, restarted on the same SQLite file, and counted.

use std::collections::HashSet;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use tonic::Request;

// The worker module only because the cluster module's calls use its `authorized`.
#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/worker.rs"]
mod test_worker;
use cluster::connect;

const ADMIN: &str = "carve_durability_admin";

const JOB: &str = r#"{
  "name": "tiny",
  "model": { "input_shape": [4], "loss": "softmax_cross_entropy", "layers": [ { "dense": { "units": 2 } } ] },
  "training": { "batch_size": 8, "steps": 1, "optimizer": { "sgd": { "learning_rate": 0.1 } } },
  "data": { "format": "synthetic", "samples": 16 }
}"#;

/// Starts the binary and returns it with the address it printed.
fn start_scheduler(directory: &std::path::Path) -> (Child, String) {
    let token_file = directory.join("admin.token");
    std::fs::write(&token_file, ADMIN).unwrap();
    cluster::spawn_scheduler_binary(&[
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--database".into(),
        format!("sqlite://{}", directory.join("carve.db").display()).into(),
        "--admin-token-file".into(),
        token_file.into(),
    ])
}

fn authorized<T>(message: T) -> Request<T> {
    carve_proto::client::authorized_request(message, ADMIN).expect("a valid token")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_submits_loses_no_acknowledged_job() {
    let directory = tempfile::tempdir().unwrap();
    let (mut child, address) = start_scheduler(directory.path());
    let channel = connect(&address).await;
    let acknowledged = Arc::new(Mutex::new(HashSet::new()));
    let mut submitters = Vec::new();
    for submitter in 0..8 {
        let channel = channel.clone();
        let acknowledged = acknowledged.clone();
        submitters.push(tokio::spawn(async move {
            let mut client = JobServiceClient::new(channel);
            for index in 0.. {
                let request = authorized(v1::SubmitJobRequest {
                    spec_json: JOB.into(),
                    idempotency_key: format!("{submitter}-{index}"),
                });
                match client.submit_job(request).await {
                    Ok(response) => {
                        let job = response.into_inner().job.unwrap();
                        acknowledged.lock().unwrap().insert(job.id);
                    }
                    // The server died: everything acknowledged before this is what counts.
                    Err(_) => return,
                }
            }
        }));
    }
    // Let a few hundred submits through, then kill -9 in the middle of the stream.
    for _ in 0..200 {
        if acknowledged.lock().unwrap().len() >= 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    for submitter in submitters {
        let _ = tokio::time::timeout(Duration::from_secs(10), submitter).await;
    }
    let acknowledged = acknowledged.lock().unwrap().clone();
    assert!(
        acknowledged.len() >= 50,
        "only {} submits were acknowledged",
        acknowledged.len()
    );

    let (mut restarted, address) = start_scheduler(directory.path());
    let mut client = JobServiceClient::new(connect(&address).await);
    let mut stored = HashSet::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_jobs(authorized(v1::ListJobsRequest {
                page_size: 1000,
                page_token: page_token.clone(),
                ..Default::default()
            }))
            .await
            .unwrap()
            .into_inner();
        stored.extend(page.jobs.into_iter().map(|job| job.id));
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    restarted.kill().unwrap();
    restarted.wait().unwrap();
    let lost: Vec<_> = acknowledged.difference(&stored).collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged jobs were lost, e.g. {:?}",
        lost.len(),
        lost.first()
    );
}
