//! The accounting figures by hand: clipping to the period, running attempts, the events
//! by where they happened, nearest-rank percentiles, per user, and order independence.

use super::*;

const HOUR: i64 = 3_600_000;
const GIB: u64 = 1 << 30;

fn attempt(job: &str, number: i64, placed: i64, ended: Option<i64>) -> AccountedAttempt {
    AccountedAttempt {
        tenant: "acme".to_string(),
        submitter: Submitter {
            token_id: "tok-1".to_string(),
            description: "alice".to_string(),
        },
        gpu_type: "H100".to_string(),
        job_id: job.to_string(),
        attempt_number: number,
        slice_bytes: 10 * GIB,
        placed_at_ms: placed,
        ended_at_ms: ended,
        measured_peak_bytes: None,
        queued_since_ms: None,
        retries_out_of_memory: false,
        preempted: false,
    }
}

#[test]
fn time_is_clipped_to_the_period_and_running_attempts_count_to_now() {
    let period = Period {
        from_ms: 10 * HOUR,
        to_ms: 20 * HOUR,
    };
    let attempts = [
        // Across the start: 2 of its 4 hours count.
        attempt("a", 1, 8 * HOUR, Some(12 * HOUR)),
        // Before the period: nothing.
        attempt("b", 1, HOUR, Some(10 * HOUR)),
        // Running since 18 h, now is 19 h: one hour.
        attempt("c", 1, 18 * HOUR, None),
        // After the period: nothing.
        attempt("d", 1, 20 * HOUR, Some(21 * HOUR)),
    ];
    let report = usage_report(&attempts, period, 19 * HOUR);
    assert_eq!(report.tenants.len(), 1);
    let figures = &report.tenants[0];
    assert_eq!(figures.jobs, 2);
    assert_eq!(figures.attempts, 2);
    assert_eq!(figures.gpu_milliseconds, 3 * HOUR as u64);
    assert_eq!(
        figures.vram_requested_byte_milliseconds,
        u128::from(10 * GIB) * 3 * HOUR as u128
    );
    assert_eq!(figures.measured_attempts, 0);
    assert_eq!(figures.vram_used_byte_milliseconds, 0);
}

#[test]
fn used_is_the_measured_peak_over_the_measured_attempts_only() {
    let mut measured = attempt("a", 1, 0, Some(2 * HOUR));
    measured.measured_peak_bytes = Some(4 * GIB);
    let unmeasured = attempt("b", 1, 0, Some(HOUR));
    let report = usage_report(
        &[measured, unmeasured],
        Period {
            from_ms: 0,
            to_ms: 10 * HOUR,
        },
        10 * HOUR,
    );
    let figures = &report.tenants[0];
    assert_eq!(figures.measured_attempts, 1);
    assert_eq!(
        figures.vram_used_byte_milliseconds,
        u128::from(4 * GIB) * 2 * HOUR as u128
    );
    assert_eq!(
        figures.vram_requested_measured_byte_milliseconds,
        u128::from(10 * GIB) * 2 * HOUR as u128
    );
    assert_eq!(
        figures.vram_requested_byte_milliseconds,
        u128::from(10 * GIB) * 3 * HOUR as u128
    );
}

#[test]
fn events_count_where_they_happened() {
    let period = Period {
        from_ms: 10 * HOUR,
        to_ms: 20 * HOUR,
    };
    // Preempted inside the period, placed before it: a preemption, no queue time.
    let mut preempted = attempt("a", 1, 9 * HOUR, Some(11 * HOUR));
    preempted.preempted = true;
    preempted.queued_since_ms = Some(0);
    // An OOM retry placed in the period after waiting 30 minutes.
    let mut retry = attempt("a", 2, 12 * HOUR, Some(13 * HOUR));
    retry.retries_out_of_memory = true;
    retry.queued_since_ms = Some(11 * HOUR + HOUR / 2);
    // Preempted after the period: no preemption in it.
    let mut later = attempt("b", 1, 19 * HOUR, Some(21 * HOUR));
    later.preempted = true;
    let report = usage_report(&[preempted, retry, later], period, 30 * HOUR);
    let figures = &report.tenants[0];
    assert_eq!(figures.preemptions, 1);
    assert_eq!(figures.oom_retries, 1);
    assert_eq!(figures.queued_attempts, 1);
    assert_eq!(figures.queue_time_p50_ms, (HOUR / 2) as u64);
}

#[test]
fn percentiles_are_nearest_rank() {
    let values: Vec<u64> = (1..=100).collect();
    assert_eq!(nearest_rank(&values, 50), 50);
    assert_eq!(nearest_rank(&values, 90), 90);
    assert_eq!(nearest_rank(&values, 99), 99);
    assert_eq!(nearest_rank(&[7], 99), 7);
    assert_eq!(nearest_rank(&[1, 2, 3], 50), 2);
    assert_eq!(nearest_rank(&[1, 2, 3, 4], 50), 2);
    assert_eq!(nearest_rank(&[], 50), 0);
}

#[test]
fn users_and_gpu_types_are_separate_groups_and_order_does_not_matter() {
    let mut bob = attempt("b", 1, 0, Some(HOUR));
    bob.submitter = Submitter {
        token_id: "tok-2".to_string(),
        description: "bob".to_string(),
    };
    let mut old = attempt("c", 1, 0, Some(2 * HOUR));
    old.submitter = Submitter::default();
    let mut other_gpu = attempt("d", 1, 0, Some(3 * HOUR));
    other_gpu.gpu_type = "A100".to_string();
    let alice = attempt("a", 1, 0, Some(4 * HOUR));
    let period = Period {
        from_ms: 0,
        to_ms: 10 * HOUR,
    };
    let mut attempts = vec![alice, bob, old, other_gpu];
    let report = usage_report(&attempts, period, 10 * HOUR);
    attempts.reverse();
    assert_eq!(usage_report(&attempts, period, 10 * HOUR), report);
    let tenants: Vec<(&str, u64)> = report
        .tenants
        .iter()
        .map(|figures| (figures.gpu_type.as_str(), figures.gpu_milliseconds))
        .collect();
    assert_eq!(
        tenants,
        [("A100", 3 * HOUR as u64), ("H100", 7 * HOUR as u64)]
    );
    let users: Vec<(&str, &str, &str, u64)> = report
        .users
        .iter()
        .map(|figures| {
            (
                figures.submitter.token_id.as_str(),
                figures.submitter.description.as_str(),
                figures.gpu_type.as_str(),
                figures.gpu_milliseconds,
            )
        })
        .collect();
    assert_eq!(
        users,
        [
            ("", "", "H100", 2 * HOUR as u64),
            ("tok-1", "alice", "A100", 3 * HOUR as u64),
            ("tok-1", "alice", "H100", 4 * HOUR as u64),
            ("tok-2", "bob", "H100", HOUR as u64),
        ]
    );
    assert!(report.tenants.iter().all(|f| f.submitter.is_unknown()));
}
