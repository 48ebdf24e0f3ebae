//! The store's reads and writes for the scheduling pass over a long queue (the narrow
//! queued-job rows, the queue fingerprint, per-tenant counts and grouped waiting-reason
//! writes), on SQLite and on PostgreSQL.

#[macro_use]
mod support;

use carve_core::workload::JobKind;
use carve_scheduler::store::{
    JobRecord, JobState, QueueFingerprint, Store, WAITING_REASON_IDS_PER_STATEMENT,
    WAITING_REASONS_PER_TRANSACTION,
};
use support::TestDb;

on_both_databases!(
    queued_jobs_are_read_narrow_in_submit_order,
    the_fingerprint_changes_when_the_queue_does,
    waiting_reasons_are_written_in_groups_to_queued_jobs_only,
    range_reads_return_the_queued_jobs_between_two_sequences,
    jobs_waiting_for_the_same_reason_are_updated_together,
);

async fn store_with_tenants(db: &TestDb) -> Store {
    let store = db.open().await;
    for name in ["alpha", "beta"] {
        store.create_tenant(&support::tenant(name)).await.unwrap();
    }
    store
}

fn job(id: &str, tenant: &str, priority: i64, required_bytes: i64) -> JobRecord {
    JobRecord {
        id: id.into(),
        tenant: tenant.into(),
        name: id.into(),
        kind: JobKind::Model,
        spec_json: r#"{"name":"a spec the pass never reads"}"#.into(),
        state: JobState::Queued,
        priority,
        submit_sequence: 0,
        idempotency_key: None,
        config_json: "{}".into(),
        estimate_json: "{}".into(),
        required_bytes,
        waiting_reason: String::new(),
        message: String::new(),
        created_at_ms: 1,
        finished_at_ms: None,
        checkpoint_location: None,
        checkpoint_step: 0,
        attempts_count: 0,
    }
}

async fn queued_jobs_are_read_narrow_in_submit_order(db: &TestDb) {
    let store = store_with_tenants(db).await;
    store
        .submit_jobs(vec![
            job("job-1", "beta", 5, 100),
            job("job-2", "alpha", 0, 200),
            job("job-3", "alpha", 1, 300),
        ])
        .await
        .unwrap();
    let mut finished = store.get_job("job-2").await.unwrap();
    finished.state = JobState::Cancelled;
    store.update_job(&finished).await.unwrap();

    let queued = store.queued_jobs_for_scheduling().await.unwrap();
    let summary: Vec<(&str, &str, i64, i64)> = queued
        .iter()
        .map(|job| {
            (
                job.id.as_str(),
                job.tenant.as_str(),
                job.priority,
                job.required_bytes,
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![("job-1", "beta", 5, 100), ("job-3", "alpha", 1, 300)]
    );
    assert!(queued[0].submit_sequence < queued[1].submit_sequence);
    assert_eq!(
        store.queued_jobs_by_tenant().await.unwrap(),
        vec![("alpha".to_string(), 1), ("beta".to_string(), 1)]
    );
}

async fn the_fingerprint_changes_when_the_queue_does(db: &TestDb) {
    let store = store_with_tenants(db).await;
    assert_eq!(
        store.queue_fingerprint().await.unwrap(),
        QueueFingerprint::default()
    );
    store
        .submit_jobs(vec![
            job("job-1", "alpha", 0, 1),
            job("job-2", "alpha", 0, 1),
        ])
        .await
        .unwrap();
    let two = store.queue_fingerprint().await.unwrap();
    assert_eq!(two.queued_jobs, 2);
    assert_eq!(two.highest_submit_sequence, 2);
    assert_eq!(
        store.queue_fingerprint().await.unwrap(),
        two,
        "nothing changed"
    );

    let mut placed = store.get_job("job-2").await.unwrap();
    placed.state = JobState::Placed;
    store.update_job(&placed).await.unwrap();
    let one = store.queue_fingerprint().await.unwrap();
    assert_eq!(one.queued_jobs, 1);
    assert_eq!(one.highest_submit_sequence, 1);
}

async fn waiting_reasons_are_written_in_groups_to_queued_jobs_only(db: &TestDb) {
    let store = store_with_tenants(db).await;
    // More than one transaction's worth, so the grouping is crossed.
    let count = WAITING_REASONS_PER_TRANSACTION + 10;
    let jobs: Vec<JobRecord> = (0..count)
        .map(|index| job(&format!("job-{index}"), "alpha", 0, 1))
        .collect();
    store.submit_jobs(jobs).await.unwrap();
    let mut running = store.get_job("job-0").await.unwrap();
    running.state = JobState::Running;
    store.update_job(&running).await.unwrap();

    let mut reasons: Vec<(String, String)> = (0..count)
        .map(|index| (format!("job-{index}"), format!("waits for reason {index}")))
        .collect();
    reasons.push(("job-unknown".into(), "ignored".into()));
    let updated = store.set_waiting_reasons(&reasons).await.unwrap();
    assert_eq!(
        updated,
        (count - 1) as u64,
        "the running and unknown jobs are skipped"
    );

    let queued = store.queued_jobs_for_scheduling().await.unwrap();
    assert_eq!(queued.len(), count - 1);
    for job in &queued {
        let index = job.id.trim_start_matches("job-");
        assert_eq!(job.waiting_reason, format!("waits for reason {index}"));
    }
    assert_eq!(store.get_job("job-0").await.unwrap().waiting_reason, "");
    assert_eq!(store.set_waiting_reasons(&[]).await.unwrap(), 0);
}

async fn range_reads_return_the_queued_jobs_between_two_sequences(db: &TestDb) {
    let store = store_with_tenants(db).await;
    store
        .submit_jobs(
            (1..=5)
                .map(|n| job(&format!("job-{n}"), "alpha", 0, n))
                .collect(),
        )
        .await
        .unwrap();
    let mut placed = store.get_job("job-3").await.unwrap();
    placed.state = JobState::Placed;
    store.update_job(&placed).await.unwrap();
    let ids = |jobs: Vec<carve_scheduler::store::QueuedJob>| -> Vec<String> {
        jobs.into_iter().map(|job| job.id).collect()
    };
    assert_eq!(
        ids(store.queued_jobs_in_sequence_range(1, 4).await.unwrap()),
        vec!["job-2", "job-4"]
    );
    assert_eq!(
        ids(store
            .queued_jobs_in_sequence_range(i64::MIN, 5)
            .await
            .unwrap()),
        ids(store.queued_jobs_for_scheduling().await.unwrap())
    );
    assert!(
        store
            .queued_jobs_in_sequence_range(5, 9)
            .await
            .unwrap()
            .is_empty()
    );
}

async fn jobs_waiting_for_the_same_reason_are_updated_together(db: &TestDb) {
    let store = store_with_tenants(db).await;
    let count = WAITING_REASON_IDS_PER_STATEMENT * 2 + 3;
    store
        .submit_jobs(
            (0..count)
                .map(|index| job(&format!("job-{index}"), "beta", 0, 1))
                .collect(),
        )
        .await
        .unwrap();
    let mut reasons: Vec<(String, String)> = (0..count)
        .map(|index| {
            let reason = if index % 2 == 0 { "even" } else { "odd" };
            (format!("job-{index}"), reason.to_string())
        })
        .collect();
    // Named twice: the last reason given wins; unknown ids are skipped.
    reasons.push(("job-0".into(), "changed".into()));
    reasons.push(("no-such-job".into(), "odd".into()));
    assert_eq!(
        store.set_waiting_reasons(&reasons).await.unwrap(),
        count as u64
    );
    for index in [1, 2, count - 1] {
        let expected = if index % 2 == 0 { "even" } else { "odd" };
        let job = store.get_job(&format!("job-{index}")).await.unwrap();
        assert_eq!(job.waiting_reason, expected);
    }
    assert_eq!(
        store.get_job("job-0").await.unwrap().waiting_reason,
        "changed"
    );
}
