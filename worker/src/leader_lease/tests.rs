//! The worker's count of its lease: from what moment it counts, and when it stops.

use std::time::{Duration, Instant};

use super::{LeaderLease, answer_deadline, stop_after, stop_grace};

const LEASE: Duration = Duration::from_secs(30);

#[test]
fn the_attempts_stop_and_die_a_quarter_lease_before_the_scheduler_can_replace_them() {
    assert_eq!(stop_after(LEASE), Duration::from_secs(15));
    assert_eq!(stop_grace(LEASE), Duration::from_millis(7_500));
    assert!(stop_after(LEASE) + stop_grace(LEASE) + LEASE / 4 <= LEASE);
}

#[test]
fn a_session_is_given_up_well_before_the_attempts_stop() {
    assert_eq!(
        answer_deadline(Duration::from_secs(5), LEASE),
        Duration::from_millis(7_500)
    );
    assert_eq!(
        answer_deadline(Duration::from_millis(100), Duration::from_secs(2)),
        Duration::from_secs(1)
    );
    assert!(answer_deadline(Duration::from_secs(5), LEASE) < stop_after(LEASE));
}

#[test]
fn the_lease_counts_from_when_the_answered_heartbeat_was_sent_not_when_its_answer_came() {
    let lease = LeaderLease::default();
    let start = Instant::now();
    assert_eq!(
        lease.stop_deadline(),
        None,
        "no deadline before a registration"
    );
    lease.session_began(LEASE, start);
    assert_eq!(lease.stop_deadline(), Some(start + stop_after(LEASE)));

    let sent = start + Duration::from_secs(10);
    lease.heartbeat_sent(2, sent);
    lease.heartbeat_sent(3, sent + Duration::from_secs(5));
    lease.heartbeat_answered(2);
    assert_eq!(lease.stop_deadline(), Some(sent + stop_after(LEASE)));
    // An answer to a heartbeat it never sent (or forgot) moves nothing.
    lease.heartbeat_answered(99);
    assert_eq!(lease.stop_deadline(), Some(sent + stop_after(LEASE)));
}

#[test]
fn a_new_session_counts_from_its_hello_only_once_its_leader_answers() {
    let lease = LeaderLease::default();
    let start = Instant::now();
    lease.session_began(LEASE, start);
    lease.heartbeat_sent(2, start);
    lease.heartbeat_answered(2);
    // Cut off for a minute: a new session's hello to a replica that never answers (a
    // standby, a frozen leader) does not renew the lease.
    let hello = start + Duration::from_secs(60);
    lease.session_began(LEASE, hello);
    assert_eq!(lease.stop_deadline(), Some(start + stop_after(LEASE)));
    lease.session_answered();
    assert_eq!(lease.stop_deadline(), Some(hello + stop_after(LEASE)));
    // The heartbeats of the session before are not this session's.
    lease.heartbeat_answered(2);
    assert_eq!(lease.stop_deadline(), Some(hello + stop_after(LEASE)));
}

#[test]
fn a_session_without_answers_is_overdue_after_the_answer_deadline() {
    let lease = LeaderLease::default();
    let start = Instant::now();
    let heartbeat = Duration::from_secs(5);
    assert_eq!(lease.answer_overdue_at(start, heartbeat), None);
    lease.session_began(LEASE, start);
    assert_eq!(
        lease.answer_overdue_at(start, heartbeat),
        Some(start + answer_deadline(heartbeat, LEASE))
    );
    let later = start + Duration::from_secs(3);
    lease.heartbeat_sent(2, later);
    lease.heartbeat_answered(2);
    assert_eq!(
        lease.answer_overdue_at(start, heartbeat),
        Some(later + answer_deadline(heartbeat, LEASE))
    );
}

#[tokio::test]
async fn attempts_are_told_to_stop_once_past_the_deadline_and_once_only() {
    let lease = std::sync::Arc::new(LeaderLease::default());
    let lease_length = Duration::from_millis(400);
    lease.session_began(lease_length, Instant::now());
    let (control, mut controls) = tokio::sync::mpsc::unbounded_channel();
    let attempt = carve_proto::v1::AttemptRef {
        job_id: "job-1".into(),
        attempt_number: 1,
        lease_epoch: 1,
        gang_rank: None,
    };
    let stopper = tokio::spawn(super::stop_attempts_without_a_leader(lease.clone(), {
        let attempt = attempt.clone();
        move || vec![(attempt.clone(), control.clone())]
    }));
    // A hang guard, not a timing: the deadline is 200 ms away.
    let told = tokio::time::timeout(Duration::from_secs(30), controls.recv())
        .await
        .expect("told within the hang guard")
        .expect("a control");
    match told {
        crate::attempt_process::AttemptControl::StopWithoutLeader {
            grace_period,
            reason,
        } => {
            assert_eq!(grace_period, stop_grace(lease_length));
            assert!(reason.contains("no scheduler leader heard"), "{reason}");
        }
        other => panic!("expected a stop without a leader, got {other:?}"),
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(600), controls.recv())
            .await
            .is_err(),
        "told a second time"
    );
    stopper.abort();
}
