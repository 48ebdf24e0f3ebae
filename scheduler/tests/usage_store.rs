//! The store's contract for usage over time (`store/usage.rs`, issue 32): every test
//! runs against SQLite and PostgreSQL, as `sqlite::NAME` and `postgres::NAME`. An
//! attempt's row is written at placement and ended once; reads by period see exactly
//! the attempts that held a slice in it; decayed usage rebuilt from the rows after
//! reopening equals core's definition; a replica that does not lead writes nothing.

#[macro_use]
mod support;

use carve_core::usage::{UsageDecay, decayed_usage_at};
use carve_scheduler::store::{Backend, UsageRecord};
use support::{T0, TestDb};

on_both_databases!(
    a_placement_then_its_end_is_read_back_after_reopening,
    the_first_end_is_kept_and_a_second_start_changes_nothing,
    a_period_sees_the_attempts_that_held_a_slice_in_it,
    decayed_usage_rebuilt_from_the_store_equals_the_definition,
    bad_rows_are_refused_by_field_and_nothing_is_written,
    a_replica_that_does_not_lead_records_no_usage,
);

const HOUR_MS: i64 = 3_600_000;
const GIB: i64 = 1 << 30;

fn placed(job_id: &str, attempt_number: i64, tenant: &str, at: i64) -> UsageRecord {
    UsageRecord {
        job_id: job_id.to_string(),
        attempt_number,
        tenant: tenant.to_string(),
        gpu_type: "NVIDIA H100 80GB HBM3".to_string(),
        slice_bytes: 20 * GIB,
        placed_at_ms: at,
        ended_at_ms: None,
        measured_peak_bytes: None,
    }
}

async fn a_placement_then_its_end_is_read_back_after_reopening(db: &TestDb) {
    let store = db.open().await;
    let record = placed("job-1", 1, "acme", T0);
    store
        .record_usage(std::slice::from_ref(&record))
        .await
        .unwrap();
    assert_eq!(
        store.usage_between(T0, T0 + 1, None).await.unwrap(),
        vec![record.clone()],
        "a running attempt is read with no end"
    );
    assert!(
        store
            .end_usage("job-1", 1, T0 + HOUR_MS, Some(17 * GIB))
            .await
            .unwrap()
    );
    let reopened = db.open().await;
    let ended = UsageRecord {
        ended_at_ms: Some(T0 + HOUR_MS),
        measured_peak_bytes: Some(17 * GIB),
        ..record
    };
    assert_eq!(
        reopened.usage_between(0, i64::MAX, None).await.unwrap(),
        vec![ended]
    );
}

async fn the_first_end_is_kept_and_a_second_start_changes_nothing(db: &TestDb) {
    let store = db.open().await;
    store
        .record_usage(&[placed("job-1", 1, "acme", T0)])
        .await
        .unwrap();
    assert!(store.end_usage("job-1", 1, T0 + 1000, None).await.unwrap());
    // A replayed end, and a replayed placement, do not stretch the attempt.
    assert!(
        !store
            .end_usage("job-1", 1, T0 + HOUR_MS, Some(1))
            .await
            .unwrap()
    );
    let mut replay = placed("job-1", 1, "acme", T0 - HOUR_MS);
    replay.slice_bytes = 70 * GIB;
    store.record_usage(&[replay]).await.unwrap();
    // An end for an attempt never placed ends nothing.
    assert!(!store.end_usage("job-2", 1, T0, None).await.unwrap());
    let rows = store.usage_between(0, i64::MAX, None).await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].placed_at_ms, T0);
    assert_eq!(rows[0].slice_bytes, 20 * GIB);
    assert_eq!(rows[0].ended_at_ms, Some(T0 + 1000));
    assert_eq!(rows[0].measured_peak_bytes, None);
    // An end stamped before its placement (a clock that moved back) is the placement.
    store
        .record_usage(&[placed("job-3", 1, "acme", T0)])
        .await
        .unwrap();
    assert!(store.end_usage("job-3", 1, T0 - 5000, None).await.unwrap());
    let rows = store.usage_between(0, i64::MAX, None).await.unwrap();
    let job_3 = rows.iter().find(|row| row.job_id == "job-3").unwrap();
    assert_eq!(job_3.ended_at_ms, Some(T0));
}

async fn a_period_sees_the_attempts_that_held_a_slice_in_it(db: &TestDb) {
    let store = db.open().await;
    let mut before = placed("before", 1, "acme", T0 - 3 * HOUR_MS);
    before.ended_at_ms = Some(T0 - 2 * HOUR_MS);
    let mut across_start = placed("across", 1, "acme", T0 - HOUR_MS);
    across_start.ended_at_ms = Some(T0 + HOUR_MS);
    let mut inside = placed("inside", 2, "globex", T0 + HOUR_MS);
    inside.ended_at_ms = Some(T0 + 2 * HOUR_MS);
    let running = placed("running", 1, "globex", T0 + 3 * HOUR_MS);
    let after = placed("after", 1, "acme", T0 + 10 * HOUR_MS);
    store
        .record_usage(&[
            after.clone(),
            running.clone(),
            inside.clone(),
            across_start.clone(),
            before.clone(),
        ])
        .await
        .unwrap();
    let period = store
        .usage_between(T0, T0 + 4 * HOUR_MS, None)
        .await
        .unwrap();
    assert_eq!(
        period,
        vec![across_start.clone(), inside.clone(), running.clone()]
    );
    assert_eq!(
        store
            .usage_between(T0, T0 + 4 * HOUR_MS, Some("globex"))
            .await
            .unwrap(),
        vec![inside, running],
        "one tenant's rows only"
    );
    assert_eq!(
        store
            .usage_between(T0, T0 + 4 * HOUR_MS, Some("nobody"))
            .await
            .unwrap(),
        vec![]
    );
}

async fn decayed_usage_rebuilt_from_the_store_equals_the_definition(db: &TestDb) {
    let store = db.open().await;
    let mut records = Vec::new();
    for index in 0..12i64 {
        let mut record = placed(
            &format!("job-{index}"),
            1 + index % 3,
            ["acme", "globex", "initech"][index as usize % 3],
            T0 + index * HOUR_MS,
        );
        record.slice_bytes = (index + 1) * GIB;
        if index % 4 != 0 {
            record.ended_at_ms = Some(T0 + index * HOUR_MS + (index + 1) * 600_000);
        }
        records.push(record);
    }
    store.record_usage(&records).await.unwrap();
    let now = T0 + 20 * HOUR_MS;
    let decay = UsageDecay::default();
    let rebuilt: Vec<_> = db
        .open()
        .await
        .usage_between(now - 30 * decay.half_life_ms(), i64::MAX, None)
        .await
        .unwrap()
        .iter()
        .map(|record| record.attempt_usage(now))
        .collect();
    let defined: Vec<_> = records
        .iter()
        .map(|record| record.attempt_usage(now))
        .collect();
    assert_eq!(
        decayed_usage_at(&rebuilt, now, decay),
        decayed_usage_at(&defined, now, decay)
    );
    assert_eq!(rebuilt.len(), 12);
}

async fn bad_rows_are_refused_by_field_and_nothing_is_written(db: &TestDb) {
    let store = db.open().await;
    let mut backwards = placed("job-2", 1, "acme", T0);
    backwards.ended_at_ms = Some(T0 - 1);
    let mut negative = placed("job-3", 1, "acme", T0);
    negative.slice_bytes = -1;
    let zeroth = placed("job-4", 0, "acme", T0);
    for (bad, field) in [
        (backwards, "ended_at_ms"),
        (negative, "slice_bytes"),
        (zeroth, "attempt_number"),
    ] {
        let refused = store
            .record_usage(&[placed("job-1", 1, "acme", T0), bad])
            .await
            .unwrap_err();
        assert!(refused.to_string().contains(field), "{refused}");
    }
    assert_eq!(
        store.usage_between(0, i64::MAX, None).await.unwrap(),
        vec![]
    );
}

async fn a_replica_that_does_not_lead_records_no_usage(db: &TestDb) {
    if db.backend() == Backend::Sqlite {
        // SQLite is single-node: its writes are never fenced (the PostgreSQL run checks).
        let store = db.open().await;
        store
            .record_usage(&[placed("job-1", 1, "acme", T0)])
            .await
            .unwrap();
        return;
    }
    let leader = db.open().await;
    leader
        .record_usage(&[placed("job-1", 1, "acme", T0)])
        .await
        .unwrap();
    let standby = db.open().await;
    standby.set_leader_epoch(None);
    let refused = standby
        .record_usage(&[placed("job-2", 1, "acme", T0)])
        .await;
    assert!(
        matches!(&refused, Err(error) if error.to_string().contains("standby")),
        "{refused:?}"
    );
    assert!(
        standby
            .end_usage("job-1", 1, T0 + HOUR_MS, None)
            .await
            .is_err()
    );
    let rows = leader.usage_between(0, i64::MAX, None).await.unwrap();
    assert_eq!(rows, vec![placed("job-1", 1, "acme", T0)]);
}
