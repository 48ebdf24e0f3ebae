//! Addressing jobs the way people do: every call that takes a job id (get, cancel, watch,
//! logs) also takes a unique prefix of the id or the job's name, within the caller's
//! tenant; a reference that names several jobs is refused with INVALID_ARGUMENT on
//! `job_id`, listing them. And a submitted spec's relative data path, which a worker would
//! read from its own directory, is refused naming the field. The real server over real
//! gRPC, on SQLite and on PostgreSQL (as `sqlite::NAME` and `postgres::NAME`, like the
//! store's contract suite).

#[macro_use]
mod support;

use carve_proto::v1;
use tonic::Code;
use tonic::transport::Channel;

#[path = "support/worker.rs"]
mod test_worker;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{ADMIN, cancel, get, job_logs, submit, submit_named, tenant_with_tokens, watch};
use support::TestDb;

on_both_databases!(
    get_cancel_watch_and_logs_take_a_prefix_or_a_name,
    a_reference_that_names_several_jobs_lists_them,
    references_stay_within_the_callers_tenant,
    a_relative_data_path_is_refused_at_submit,
);

/// A scheduler on `db`, and a channel to it; it stops when the sender drops.
async fn start_on(db: &TestDb) -> (tokio::sync::oneshot::Sender<()>, Channel) {
    cluster::start_on_database(db.url()).await
}

/// The whole id of the job `reference` names, as `token` gets it.
async fn resolved_id(channel: &Channel, token: &str, reference: &str) -> String {
    get(channel, token, reference).await.unwrap().id
}

/// The field an INVALID_ARGUMENT status names in its trailer.
fn field_of(status: &tonic::Status) -> &str {
    status
        .metadata()
        .get(carve_proto::status::FIELD_METADATA_KEY)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("")
}

async fn get_cancel_watch_and_logs_take_a_prefix_or_a_name(db: &TestDb) {
    let (_stop, channel) = start_on(db).await;
    let (user, _) = tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    let first = submit_named(&channel, &user, "first-run").await;
    let second = submit_named(&channel, &user, "second-run").await;

    assert_eq!(resolved_id(&channel, &user, "first-run").await, first.id);
    // Most of the id, as a person copies it from a table.
    let prefix = &second.id[..second.id.len() - 6];
    assert_eq!(resolved_id(&channel, &user, prefix).await, second.id);
    // The whole id still works, and a name is matched whole, never as a prefix.
    assert_eq!(resolved_id(&channel, &user, &first.id).await, first.id);
    let missing = get(&channel, &user, "first").await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound, "{missing:?}");
    assert_eq!(missing.message(), "job first not found");

    let mut events = watch(&channel, &user, "second-run").await;
    let event = events.message().await.unwrap().unwrap();
    assert_eq!(event.job_id, second.id);

    let cancelled = cancel(&channel, &user, "first-run", "by name")
        .await
        .unwrap()
        .job
        .unwrap();
    assert_eq!(cancelled.id, first.id);
    assert_eq!(cancelled.state, v1::JobState::Cancelled as i32);
    let already = cancel(&channel, &user, "first-run", "").await.unwrap_err();
    assert_eq!(already.code(), Code::FailedPrecondition);
    assert!(already.message().contains(&first.id), "{already:?}");

    let logs = job_logs(
        &channel,
        &user,
        v1::GetJobLogsRequest {
            job_id: "first-run".into(),
            ..v1::GetJobLogsRequest::default()
        },
    )
    .await
    .unwrap();
    assert!(
        logs.lines
            .iter()
            .any(|line| line.message.contains("by name")),
        "{logs:?}"
    );
}

async fn a_reference_that_names_several_jobs_lists_them(db: &TestDb) {
    let (_stop, channel) = start_on(db).await;
    let (user, _) = tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    let older = submit_named(&channel, &user, "again").await;
    let newer = submit_named(&channel, &user, "again").await;

    let ambiguous = get(&channel, &user, "again").await.unwrap_err();
    assert_eq!(ambiguous.code(), Code::InvalidArgument);
    assert_eq!(field_of(&ambiguous), "job_id");
    let message = ambiguous.message();
    assert!(
        message.starts_with("job_id: \"again\" is ambiguous: it names 2 jobs: "),
        "{message}"
    );
    // Newest first, each with its whole id to copy.
    let newer_at = message.find(&newer.id).expect("lists the newer job");
    let older_at = message.find(&older.id).expect("lists the older job");
    assert!(newer_at < older_at, "{message}");
    assert!(message.contains("(again, queued)"), "{message}");

    // A prefix every id shares is ambiguous the same way, and cancels nothing.
    let refused = cancel(&channel, &user, "job-", "").await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("it names 2 jobs"), "{refused:?}");
    assert_eq!(
        get(&channel, &user, &older.id).await.unwrap().state,
        v1::JobState::Queued as i32
    );

    // Past ten candidates the list stops and says there are more.
    for _ in 0..10 {
        submit_named(&channel, &user, "again").await;
    }
    let many = get(&channel, &user, "again").await.unwrap_err();
    assert!(
        many.message().contains("it names more than 10 jobs")
            && many
                .message()
                .ends_with(", and more; use more of the id, or the whole id"),
        "{many:?}"
    );
}

async fn references_stay_within_the_callers_tenant(db: &TestDb) {
    let (_stop, channel) = start_on(db).await;
    let (alice, _) = tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    let (bob, _) = tenant_with_tokens(&channel, "bob", v1::Quota::default()).await;
    let alices = submit_named(&channel, &alice, "shared-name").await;
    let bobs = submit_named(&channel, &bob, "shared-name").await;

    // Each tenant's name means its own job, and another tenant's id prefix is missing.
    assert_eq!(
        resolved_id(&channel, &alice, "shared-name").await,
        alices.id
    );
    assert_eq!(resolved_id(&channel, &bob, "shared-name").await, bobs.id);
    let prefix = &bobs.id[..bobs.id.len() - 2];
    let hidden = get(&channel, &alice, prefix).await.unwrap_err();
    assert_eq!(hidden.code(), Code::NotFound, "{hidden:?}");
    let hidden = cancel(&channel, &alice, &bobs.id, "").await.unwrap_err();
    assert_eq!(hidden.code(), Code::NotFound, "{hidden:?}");

    // An admin sees every tenant's jobs: the name is ambiguous, and says whose each is.
    let ambiguous = get(&channel, ADMIN, "shared-name").await.unwrap_err();
    assert_eq!(ambiguous.code(), Code::InvalidArgument);
    let message = ambiguous.message();
    assert!(
        message.contains("tenant alice") && message.contains("tenant bob"),
        "{message}"
    );
    assert_eq!(resolved_id(&channel, ADMIN, prefix).await, bobs.id);
}

/// An IDX job whose training images are at `images`.
fn idx_job(images: &str) -> String {
    serde_json::json!({
        "name": "digits",
        "model": {
            "input_shape": [28, 28, 1],
            "loss": "softmax_cross_entropy",
            "layers": [{ "flatten": {} }, { "dense": { "units": 10 } }]
        },
        "training": { "batch_size": 8, "steps": 2, "optimizer": { "sgd": { "learning_rate": 0.1 } } },
        "data": { "format": "idx", "train": { "images": images, "labels": "/data/mnist/labels" } }
    })
    .to_string()
}

async fn a_relative_data_path_is_refused_at_submit(db: &TestDb) {
    let (_stop, channel) = start_on(db).await;
    let (user, _) = tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    let refused = submit(&channel, &user, &idx_job("data/mnist/images"), "")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(field_of(&refused), "spec.data.train.images");
    assert!(
        refused.message().starts_with(
            "spec.data.train.images: \"data/mnist/images\" is a relative path, which a worker \
             would read from its own directory"
        ),
        "{refused:?}"
    );
    let accepted = submit(&channel, &user, &idx_job("/data/mnist/images"), "")
        .await
        .unwrap();
    assert!(accepted.created);
}
