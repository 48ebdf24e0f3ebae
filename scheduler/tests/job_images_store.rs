//! The store's contract for job images (`store/job_images.rs`, issue 30): every test runs
//! against SQLite and PostgreSQL, as `sqlite::NAME` and `postgres::NAME`. A tenant's
//! secrets are its own (no read, listing or delete of one tenant reaches another's), a
//! listing never carries a value, a job keeps the first digest reported for it, and
//! deleting a tenant or a job deletes what it held.

#[macro_use]
mod support;

use carve_core::job_state::JobState;
use carve_scheduler::store::{SecretRecord, Store};
use support::{T0, TestDb, job, tenant};

on_both_databases!(
    a_secret_is_read_back_only_by_its_own_tenant,
    a_taken_name_is_refused_unless_replaced_and_deletes_are_per_tenant,
    a_jobs_first_digest_stays,
    a_deleted_tenant_takes_its_secrets_and_jobs_digests_with_it,
);

const DIGEST_1: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
const DIGEST_2: &str = "sha256:2222222222222222222222222222222222222222222222222222222222222222";

async fn with_two_tenants(db: &TestDb) -> Store {
    let store = db.open().await;
    store.create_tenant(&tenant("alice")).await.unwrap();
    store.create_tenant(&tenant("bob")).await.unwrap();
    store
}

async fn a_secret_is_read_back_only_by_its_own_tenant(db: &TestDb) {
    let store = with_two_tenants(db).await;
    let created = store
        .create_secret("alice", "registry", b"robot:hunter2", false, T0)
        .await
        .unwrap();
    assert_eq!(
        created,
        SecretRecord {
            tenant: "alice".into(),
            name: "registry".into(),
            created_at_ms: T0,
            updated_at_ms: T0,
        }
    );
    let reopened = db.open().await;
    assert_eq!(
        reopened
            .secret_value("alice", "registry")
            .await
            .unwrap()
            .as_deref(),
        Some(&b"robot:hunter2"[..])
    );
    assert!(reopened.secret_exists("alice", "registry").await.unwrap());
    // Bob names the same secret: it is not his.
    assert_eq!(
        reopened.secret_value("bob", "registry").await.unwrap(),
        None
    );
    assert!(!reopened.secret_exists("bob", "registry").await.unwrap());
    assert_eq!(reopened.list_secrets("bob").await.unwrap(), vec![]);
    // A listing has names and times: the record type has no value to show.
    assert_eq!(reopened.list_secrets("alice").await.unwrap(), vec![created]);
}

async fn a_taken_name_is_refused_unless_replaced_and_deletes_are_per_tenant(db: &TestDb) {
    let store = with_two_tenants(db).await;
    store
        .create_secret("alice", "registry", b"robot:one", false, T0)
        .await
        .unwrap();
    let taken = store
        .create_secret("alice", "registry", b"robot:two", false, T0 + 1)
        .await
        .unwrap_err();
    assert!(taken.to_string().contains("already exists"), "{taken}");
    assert_eq!(
        store.secret_value("alice", "registry").await.unwrap(),
        Some(b"robot:one".to_vec()),
        "a refused create leaves the value"
    );
    let replaced = store
        .create_secret("alice", "registry", b"robot:two", true, T0 + 5)
        .await
        .unwrap();
    assert_eq!(
        (replaced.created_at_ms, replaced.updated_at_ms),
        (T0, T0 + 5)
    );
    assert_eq!(
        store.secret_value("alice", "registry").await.unwrap(),
        Some(b"robot:two".to_vec())
    );
    // The same name is Bob's own secret, apart from Alice's.
    store
        .create_secret("bob", "registry", b"bob:own", false, T0)
        .await
        .unwrap();
    let missing_tenant = store
        .create_secret("nobody", "registry", b"x:y", false, T0)
        .await
        .unwrap_err();
    assert!(
        missing_tenant.to_string().contains("not found"),
        "{missing_tenant}"
    );
    // Bob deleting "registry" deletes his, never Alice's.
    store.delete_secret("bob", "registry").await.unwrap();
    assert!(store.secret_exists("alice", "registry").await.unwrap());
    let gone = store.delete_secret("bob", "registry").await.unwrap_err();
    assert!(gone.to_string().contains("not found"), "{gone}");
}

async fn a_jobs_first_digest_stays(db: &TestDb) {
    let store = with_two_tenants(db).await;
    store
        .submit_jobs(vec![job("job-1", "alice", "a"), job("job-2", "alice", "b")])
        .await
        .unwrap();
    assert_eq!(store.job_image_digest("job-1").await.unwrap(), None);
    assert_eq!(
        store
            .record_job_image_digest("job-1", DIGEST_1, T0)
            .await
            .unwrap(),
        DIGEST_1
    );
    // A later attempt's other digest (a re-pushed tag) does not replace it.
    assert_eq!(
        store
            .record_job_image_digest("job-1", DIGEST_2, T0 + 1)
            .await
            .unwrap(),
        DIGEST_1
    );
    let reopened = db.open().await;
    assert_eq!(
        reopened.job_image_digest("job-1").await.unwrap().as_deref(),
        Some(DIGEST_1)
    );
    let page = reopened
        .job_image_digests(&["job-1", "job-2", "job-none"])
        .await
        .unwrap();
    assert_eq!(page.len(), 1);
    assert_eq!(page["job-1"], DIGEST_1);
    // Both jobs are queued; only job-1 has a digest.
    assert_eq!(
        reopened.queued_job_image_digests().await.unwrap(),
        vec![("job-1".to_string(), DIGEST_1.to_string())]
    );
}

async fn a_deleted_tenant_takes_its_secrets_and_jobs_digests_with_it(db: &TestDb) {
    let store = with_two_tenants(db).await;
    store
        .create_secret("bob", "registry", b"bob:pw", false, T0)
        .await
        .unwrap();
    store
        .submit_jobs(vec![job("job-b", "bob", "b")])
        .await
        .unwrap();
    store
        .record_job_image_digest("job-b", DIGEST_1, T0)
        .await
        .unwrap();
    let mut finished = store.get_job("job-b").await.unwrap();
    finished.state = JobState::Cancelled;
    finished.finished_at_ms = Some(T0 + 1);
    store.update_job(&finished).await.unwrap();
    store.delete_tenant("bob", T0 + 10).await.unwrap();
    // Recreated under the same name, the tenant finds nothing of the old one's.
    store.create_tenant(&tenant("bob")).await.unwrap();
    assert_eq!(store.secret_value("bob", "registry").await.unwrap(), None);
    assert_eq!(store.list_secrets("bob").await.unwrap(), vec![]);
    assert_eq!(store.job_image_digest("job-b").await.unwrap(), None);
}
