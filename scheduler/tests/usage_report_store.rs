//! Accounting's reads from the store (issue 32, `store/usage_report.rs`), on SQLite and
//! PostgreSQL: a job keeps the token that submitted it (older jobs read as unknown),
//! and the attempts of a period come back with their outcomes, OOM retries and queue
//! times, filtered by tenant and by submitter (token id or description).

#[macro_use]
mod support;

use carve_core::usage::report::{Period, Submitter, usage_report};
use carve_scheduler::store::{AttemptOutcome, SubmitBatcher, UsageQuery, UsageRecord};
use support::{T0, TestDb, attempt, finish_plainly, job, open_with_acme, tenant};

on_both_databases!(
    a_job_keeps_its_submitter_and_one_without_reads_as_unknown,
    a_period_reads_outcomes_oom_retries_and_queue_times,
);

const MINUTE: i64 = 60_000;
const HOUR: i64 = 60 * MINUTE;
const GIB: i64 = 1 << 30;

fn alice() -> Submitter {
    Submitter {
        token_id: "tok-alice".to_string(),
        description: "alice's laptop".to_string(),
    }
}

fn usage(job_id: &str, number: i64, tenant: &str, placed: i64) -> UsageRecord {
    UsageRecord {
        job_id: job_id.to_string(),
        attempt_number: number,
        tenant: tenant.to_string(),
        gpu_type: "NVIDIA H100 80GB HBM3".to_string(),
        slice_bytes: 20 * GIB,
        placed_at_ms: placed,
        ended_at_ms: None,
        measured_peak_bytes: None,
    }
}

/// Places attempt `number` of `job_id` at `placed` with its usage row.
async fn place(
    store: &carve_scheduler::store::Store,
    job_id: &str,
    number: i64,
    tenant: &str,
    placed: i64,
) {
    let mut record = attempt(job_id, number, 1);
    record.started_at_ms = placed;
    store.create_attempt(&record).await.unwrap();
    store
        .record_usage(&[usage(job_id, number, tenant, placed)])
        .await
        .unwrap();
}

fn everything() -> UsageQuery {
    UsageQuery {
        from_ms: 0,
        to_ms: i64::MAX,
        tenant: None,
        submitter: None,
    }
}

async fn a_job_keeps_its_submitter_and_one_without_reads_as_unknown(db: &TestDb) {
    let store = open_with_acme(db).await;
    let batcher = SubmitBatcher::spawn(store.clone());
    let submitted = batcher
        .submit_by(job("job-alice", "acme", "a"), None, alice())
        .await
        .unwrap();
    assert!(submitted.created);
    // Without a submitter, as every job stored before the column (whose default is '').
    store
        .submit_jobs(vec![job("job-old", "acme", "b")])
        .await
        .unwrap();
    place(&store, "job-alice", 1, "acme", T0).await;
    place(&store, "job-old", 1, "acme", T0).await;
    // A usage row whose job is gone (usage outlives its job) counts with no submitter.
    store
        .record_usage(&[usage("job-deleted", 1, "acme", T0)])
        .await
        .unwrap();
    let reopened = db.open().await;
    let attempts = reopened.accounted_attempts(&everything()).await.unwrap();
    let submitters: Vec<(&str, &Submitter)> = attempts
        .iter()
        .map(|attempt| (attempt.job_id.as_str(), &attempt.submitter))
        .collect();
    assert_eq!(
        submitters,
        [
            ("job-alice", &alice()),
            ("job-deleted", &Submitter::default()),
            ("job-old", &Submitter::default()),
        ]
    );
    for by in ["tok-alice", "alice's laptop"] {
        let mine = reopened
            .accounted_attempts(&UsageQuery {
                submitter: Some(by.to_string()),
                ..everything()
            })
            .await
            .unwrap();
        assert_eq!(mine.len(), 1, "by {by}");
        assert_eq!(mine[0].job_id, "job-alice");
    }
}

async fn a_period_reads_outcomes_oom_retries_and_queue_times(db: &TestDb) {
    let store = open_with_acme(db).await;
    store.create_tenant(&tenant("globex")).await.unwrap();
    store
        .submit_jobs(vec![
            job("job-1", "acme", "one"),
            job("job-2", "globex", "two"),
        ])
        .await
        .unwrap();
    // job-1 (submitted at T0): out of memory, retried, preempted, retried again and
    // running now.
    place(&store, "job-1", 1, "acme", T0 + 10 * MINUTE).await;
    finish_plainly(
        &store,
        "job-1",
        1,
        1,
        AttemptOutcome::OutOfMemory,
        T0 + HOUR,
    )
    .await
    .unwrap();
    place(&store, "job-1", 2, "acme", T0 + HOUR + 30 * MINUTE).await;
    finish_plainly(
        &store,
        "job-1",
        2,
        1,
        AttemptOutcome::Preempted,
        T0 + 2 * HOUR,
    )
    .await
    .unwrap();
    place(&store, "job-1", 3, "acme", T0 + 3 * HOUR).await;
    // globex's one attempt, placed an hour after its submit.
    place(&store, "job-2", 1, "globex", T0 + HOUR).await;
    finish_plainly(
        &store,
        "job-2",
        1,
        1,
        AttemptOutcome::Succeeded,
        T0 + 5 * HOUR,
    )
    .await
    .unwrap();

    let period = Period {
        from_ms: T0 + HOUR,
        to_ms: T0 + 4 * HOUR,
    };
    let acme = store
        .accounted_attempts(&UsageQuery {
            from_ms: period.from_ms,
            to_ms: period.to_ms,
            tenant: Some("acme".to_string()),
            submitter: None,
        })
        .await
        .unwrap();
    // The first attempt ended exactly at the period's start: it held nothing in it.
    let read: Vec<(i64, Option<i64>, bool, bool)> = acme
        .iter()
        .map(|attempt| {
            (
                attempt.attempt_number,
                attempt.queued_since_ms,
                attempt.retries_out_of_memory,
                attempt.preempted,
            )
        })
        .collect();
    assert_eq!(
        read,
        [
            (2, Some(T0 + HOUR), true, true),
            (3, Some(T0 + 2 * HOUR), false, false),
        ]
    );
    let now = T0 + 3 * HOUR + 30 * MINUTE;
    let report = usage_report(&acme, period, now);
    assert_eq!(report.tenants.len(), 1);
    let figures = &report.tenants[0];
    assert_eq!((figures.jobs, figures.attempts), (1, 2));
    // 30 minutes of attempt 2, 30 of attempt 3 (running, to now).
    assert_eq!(figures.gpu_milliseconds, HOUR as u64);
    assert_eq!(
        figures.vram_requested_byte_milliseconds,
        (20 * GIB) as u128 * HOUR as u128
    );
    assert_eq!((figures.oom_retries, figures.preemptions), (1, 1));
    // Waits of 30 minutes (after the OOM) and 60 (after the preemption).
    assert_eq!(figures.queued_attempts, 2);
    assert_eq!(figures.queue_time_p50_ms, (30 * MINUTE) as u64);
    assert_eq!(figures.queue_time_p99_ms, HOUR as u64);

    let everyone = store
        .accounted_attempts(&UsageQuery {
            from_ms: period.from_ms,
            to_ms: period.to_ms,
            tenant: None,
            submitter: None,
        })
        .await
        .unwrap();
    let globex: Vec<_> = everyone
        .iter()
        .filter(|attempt| attempt.tenant == "globex")
        .collect();
    assert_eq!(globex.len(), 1);
    assert_eq!(globex[0].queued_since_ms, Some(T0));
    assert_eq!(everyone.len(), 3);
}
