//! A read whose connection breaks mid-command is retried on the other endpoints: two
//! single-node schedulers in-process (each on its own SQLite file) stand for two
//! replicas, and the one carve connected to stops under it.

use std::time::Duration;

use carve_proto::v1;

use super::connection::{Connection, ConnectionOptions};

#[path = "../../tests/support/in_process.rs"]
mod in_process;
use in_process::{ADMIN, job_json, start};

#[tokio::test(flavor = "multi_thread")]
async fn a_read_whose_connection_breaks_is_retried_on_the_other_endpoint() {
    let (first_directory, second_directory) =
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let any_port = "127.0.0.1:0".parse().unwrap();
    let (first, stop_first, _) = start(first_directory.path(), any_port).await;
    let (second, _stop_second, _) = start(second_directory.path(), any_port).await;
    // Only the second has the job.
    let channel = carve_proto::client::connect(
        &second,
        None,
        None,
        carve_proto::client::BearerToken::new(ADMIN).unwrap(),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let [user] = carve_proto::client::create_tenant_with_tokens(
        channel,
        "alice",
        v1::Quota::default(),
        &[v1::Role::User],
        "test",
    )
    .await
    .unwrap()
    .try_into()
    .unwrap();
    let on_second = Connection::open(&ConnectionOptions {
        endpoint: Some(second.clone()),
        token: Some(user),
        ..ConnectionOptions::default()
    })
    .await
    .unwrap();
    on_second
        .jobs()
        .submit_job(v1::SubmitJobRequest {
            spec_json: job_json("on-the-other-replica"),
            idempotency_key: String::new(),
        })
        .await
        .unwrap();

    // carve (as the admin, whose token both know) connects to the first, which stops.
    let connection = Connection::open(&ConnectionOptions {
        endpoint: Some(format!("{first},{second}")),
        token: Some(ADMIN.into()),
        ..ConnectionOptions::default()
    })
    .await
    .unwrap();
    assert_eq!(connection.endpoint, first);
    stop_first.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    let listed = connection
        .retrying(|connection| async move {
            connection
                .jobs()
                .list_jobs(v1::ListJobsRequest::default())
                .await
        })
        .await
        .unwrap();
    let names: Vec<&str> = listed.jobs.iter().map(|job| job.name.as_str()).collect();
    assert_eq!(names, ["on-the-other-replica"], "answered by the second");

    // An answer from the scheduler is not a broken connection: it is not retried.
    let calls = std::sync::atomic::AtomicU32::new(0);
    let missing = on_second
        .retrying(|connection| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            async move {
                connection
                    .jobs()
                    .get_job(v1::GetJobRequest {
                        job_id: "job-missing".into(),
                    })
                    .await
            }
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);
    assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 1);
}
