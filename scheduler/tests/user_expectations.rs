//! What users and operators expect of the real server (in-process on 127.0.0.1:0, a real
//! SQLite file, real gRPC clients): an idempotency key reused with another spec is
//! refused, not answered with the first job.

use std::time::Duration;

use tonic::Code;

#[path = "support/worker.rs"]
mod test_worker;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{JOB, start_for_tenant, submit};

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
