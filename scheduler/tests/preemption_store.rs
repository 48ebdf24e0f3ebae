//! The store's contract for preemptions under way (`store/preemptions.rs`): every test
//! runs against SQLite and PostgreSQL, as `sqlite::NAME` and `postgres::NAME`, like
//! `store_contract.rs`. A decision (claim, evictions, preemption times, the urgent job's
//! waiting reason) is stored whole or not at all; rows are removed one by one as the
//! preemption completes; everything survives reopening the store; a replica that does
//! not lead writes nothing.

#[macro_use]
mod support;

use carve_scheduler::error::SchedulerError;
use carve_scheduler::store::{Backend, StoredClaim, StoredEviction, StoredPreemptions};
use support::{T0, TestDb, job, open_with_acme};

on_both_databases!(
    a_decision_is_stored_whole_and_read_back_after_reopening,
    forgetting_removes_only_the_named_claims_and_evictions,
    a_decision_with_an_eviction_for_another_job_is_refused_whole,
    preemption_times_older_than_an_hour_are_dropped_and_not_read,
    a_replica_that_does_not_lead_stores_no_decision,
);

const HOUR_MS: i64 = 3_600_000;

fn claim(urgent: &str, at: i64) -> StoredClaim {
    StoredClaim {
        urgent_job_id: urgent.to_string(),
        gpu_id: "GPU-0".to_string(),
        worker_id: "w-1".to_string(),
        slice_bytes: 40 << 30,
        claimed_at_ms: at,
    }
}

fn eviction(victim: &str, attempt_number: i64, urgent: &str, at: i64) -> StoredEviction {
    StoredEviction {
        victim_job_id: victim.to_string(),
        attempt_number,
        urgent_job_id: urgent.to_string(),
        grace_ends_at_ms: at + 30_000,
        message: format!("preempted by job {urgent} (priority 10): it needs 40 GiB"),
        evicted_at_ms: at,
    }
}

async fn a_decision_is_stored_whole_and_read_back_after_reopening(db: &TestDb) {
    let store = open_with_acme(db).await;
    store
        .submit_jobs(vec![job("urgent", "acme", "urgent")])
        .await
        .unwrap();
    let evictions = [
        eviction("low-1", 1, "urgent", T0),
        eviction("low-2", 3, "urgent", T0),
    ];
    store
        .record_preemption(&claim("urgent", T0), &evictions, "preempting low-1, low-2")
        .await
        .unwrap();
    assert_eq!(
        store.get_job("urgent").await.unwrap().waiting_reason,
        "preempting low-1, low-2",
        "the urgent job's waiting reason is written with the decision"
    );

    let reopened = db.open().await;
    let stored = reopened.preemptions(T0 - HOUR_MS).await.unwrap();
    assert_eq!(
        stored,
        StoredPreemptions {
            claims: vec![claim("urgent", T0)],
            evictions: evictions.to_vec(),
            times: vec![("low-1".to_string(), T0), ("low-2".to_string(), T0)],
        }
    );

    // The same urgent job deciding again (its earlier claim lapsed meanwhile) replaces
    // its claim, and an eviction of the same victim is replaced by the newer one.
    let later = T0 + 1000;
    reopened
        .record_preemption(
            &claim("urgent", later),
            &[eviction("low-1", 2, "urgent", later)],
            "again",
        )
        .await
        .unwrap();
    let stored = reopened.preemptions(T0 - HOUR_MS).await.unwrap();
    assert_eq!(stored.claims, vec![claim("urgent", later)]);
    assert_eq!(
        stored.evictions,
        vec![
            eviction("low-1", 2, "urgent", later),
            eviction("low-2", 3, "urgent", T0)
        ]
    );
    assert_eq!(
        stored.times,
        vec![
            ("low-1".to_string(), T0),
            ("low-1".to_string(), later),
            ("low-2".to_string(), T0)
        ],
        "each preemption counts towards the cap"
    );
}

async fn forgetting_removes_only_the_named_claims_and_evictions(db: &TestDb) {
    let store = db.open().await;
    store
        .record_preemption(&claim("u-1", T0), &[eviction("v-1", 1, "u-1", T0)], "")
        .await
        .unwrap();
    store
        .record_preemption(&claim("u-2", T0), &[eviction("v-2", 4, "u-2", T0)], "")
        .await
        .unwrap();

    // Another attempt of v-2 is not the one being evicted: its row stays.
    store
        .forget_preemptions(&[], &[("v-2".to_string(), 3)])
        .await
        .unwrap();
    store
        .forget_preemptions(&["u-1".to_string()], &[("v-1".to_string(), 1)])
        .await
        .unwrap();
    // Rows already gone are skipped.
    store
        .forget_preemptions(&["u-1".to_string()], &[("v-1".to_string(), 1)])
        .await
        .unwrap();
    store.forget_preemptions(&[], &[]).await.unwrap();

    let stored = store.preemptions(T0 - HOUR_MS).await.unwrap();
    assert_eq!(stored.claims, vec![claim("u-2", T0)]);
    assert_eq!(stored.evictions, vec![eviction("v-2", 4, "u-2", T0)]);
    assert_eq!(
        stored.times.len(),
        2,
        "the times stay: they count towards the cap for an hour"
    );

    store
        .forget_preemptions(&["u-2".to_string()], &[("v-2".to_string(), 4)])
        .await
        .unwrap();
    let stored = store.preemptions(T0 - HOUR_MS).await.unwrap();
    assert!(stored.claims.is_empty() && stored.evictions.is_empty());
}

async fn a_decision_with_an_eviction_for_another_job_is_refused_whole(db: &TestDb) {
    let store = db.open().await;
    let refused = store
        .record_preemption(
            &claim("u-1", T0),
            &[
                eviction("v-1", 1, "u-1", T0),
                eviction("v-2", 1, "someone-else", T0),
            ],
            "",
        )
        .await;
    match refused {
        Err(SchedulerError::Api(error)) => {
            let text = error.to_string();
            assert!(text.contains("evictions.urgent_job_id"), "{text}");
        }
        other => panic!("expected an invalid argument, got {other:?}"),
    }
    assert_eq!(
        store.preemptions(0).await.unwrap(),
        StoredPreemptions::default(),
        "nothing of a refused decision is stored"
    );
}

async fn preemption_times_older_than_an_hour_are_dropped_and_not_read(db: &TestDb) {
    let store = db.open().await;
    store
        .record_preemption(&claim("u-1", T0), &[eviction("v-1", 1, "u-1", T0)], "")
        .await
        .unwrap();
    store
        .forget_preemptions(&["u-1".to_string()], &[("v-1".to_string(), 1)])
        .await
        .unwrap();
    let half_an_hour_later = T0 + HOUR_MS / 2;
    assert_eq!(
        store
            .preemptions(half_an_hour_later - HOUR_MS)
            .await
            .unwrap()
            .times,
        vec![("v-1".to_string(), T0)]
    );
    // A reader asks for the last hour only.
    assert!(store.preemptions(T0).await.unwrap().times.is_empty());

    // A decision more than an hour later removes the old times.
    let later = T0 + HOUR_MS + 1;
    store
        .record_preemption(
            &claim("u-2", later),
            &[eviction("v-2", 1, "u-2", later)],
            "",
        )
        .await
        .unwrap();
    assert_eq!(
        store.preemptions(0).await.unwrap().times,
        vec![("v-2".to_string(), later)]
    );
}

async fn a_replica_that_does_not_lead_stores_no_decision(db: &TestDb) {
    if db.backend() == Backend::Sqlite {
        // SQLite is single-node: its writes are never fenced, so there is nothing to
        // refuse (the PostgreSQL run checks the fence).
        let store = db.open().await;
        store
            .record_preemption(&claim("u-1", T0), &[eviction("v-1", 1, "u-1", T0)], "")
            .await
            .unwrap();
        return;
    }
    let leader = db.open().await;
    leader
        .record_preemption(&claim("u-1", T0), &[eviction("v-1", 1, "u-1", T0)], "")
        .await
        .unwrap();
    let standby = db.open().await;
    standby.set_leader_epoch(None);
    let refused = standby
        .record_preemption(&claim("u-2", T0), &[eviction("v-2", 1, "u-2", T0)], "")
        .await;
    assert!(
        matches!(&refused, Err(error) if error.to_string().contains("standby")),
        "{refused:?}"
    );
    let refused = standby
        .forget_preemptions(&["u-1".to_string()], &[("v-1".to_string(), 1)])
        .await;
    assert!(refused.is_err(), "{refused:?}");
    let stored = leader.preemptions(0).await.unwrap();
    assert_eq!(stored.claims, vec![claim("u-1", T0)]);
    assert_eq!(stored.evictions, vec![eviction("v-1", 1, "u-1", T0)]);
}
