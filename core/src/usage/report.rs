//! Accounting (issue 32): who used what over a period, per tenant and per user (the
//! token that submitted the job), per GPU type: jobs, attempts, GPU time, VRAM requested
//! (the slice) against VRAM used (the measured peak, where measured), OOM retries,
//! preemptions and queue-time percentiles. `carve usage`, the usage API and the
//! scheduler's usage counters on `/metrics` all read these figures.
//!
//! Each attempt is one [`AccountedAttempt`], read from the store; [`usage_report`] clips
//! it to the period and sums. Everything is integer arithmetic (milliseconds, and bytes
//! times milliseconds in `u128`), so the figures are exact and do not depend on the
//! order of the attempts.
//!
//! What counts where:
//! - an attempt counts in a period where it held its slice at some moment of it (placed
//!   before the end, not ended by the start; one placed and ended in the same
//!   millisecond inside the period counts with no time); a running one holds its slice
//!   until `now`;
//! - its GPU time and VRAM are its time held within the period; one attempt is one GPU
//!   whatever its slice (as `usage.rs` counts GPU time);
//! - an OOM retry (an attempt after one that ran out of memory) and its queue time
//!   count where it was placed; a preemption counts where the preempted attempt ended.

use std::collections::{BTreeMap, BTreeSet};

/// Who submitted a job: the token's id and its description. Both empty: unknown (a job
/// from before submitters were kept, or one since deleted).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Submitter {
    pub token_id: String,
    pub description: String,
}

impl Submitter {
    pub fn is_unknown(&self) -> bool {
        self.token_id.is_empty()
    }
}

/// One attempt as accounting reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountedAttempt {
    pub tenant: String,
    pub submitter: Submitter,
    pub gpu_type: String,
    pub job_id: String,
    pub attempt_number: i64,
    pub slice_bytes: u64,
    pub placed_at_ms: i64,
    /// `None` while it holds its slice.
    pub ended_at_ms: Option<i64>,
    pub measured_peak_bytes: Option<u64>,
    /// Since when it waited to be placed: its job's submit for a first attempt, the
    /// previous attempt's end for a later one; `None` when unknown.
    pub queued_since_ms: Option<i64>,
    /// Its job's previous attempt ran out of memory: this attempt is an OOM retry.
    pub retries_out_of_memory: bool,
    /// It was stopped for an urgent job.
    pub preempted: bool,
}

/// A period `[from_ms, to_ms)`, milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Period {
    pub from_ms: i64,
    pub to_ms: i64,
}

impl Period {
    fn contains(&self, moment_ms: i64) -> bool {
        self.from_ms <= moment_ms && moment_ms < self.to_ms
    }
}

/// What one group of attempts used in a period (see the module's documentation for what
/// counts where). In per-tenant figures the submitter is empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageFigures {
    pub tenant: String,
    pub submitter: Submitter,
    pub gpu_type: String,
    pub jobs: u64,
    pub attempts: u64,
    pub gpu_milliseconds: u64,
    /// Slice bytes times milliseconds held.
    pub vram_requested_byte_milliseconds: u128,
    /// Measured peak times milliseconds held, over the attempts with a measured peak.
    pub vram_used_byte_milliseconds: u128,
    /// Slice bytes times milliseconds over those same measured attempts.
    pub vram_requested_measured_byte_milliseconds: u128,
    pub measured_attempts: u64,
    pub oom_retries: u64,
    pub preemptions: u64,
    /// Attempts placed in the period whose wait is known.
    pub queued_attempts: u64,
    /// Nearest-rank percentiles of those waits; 0 when there are none.
    pub queue_time_p50_ms: u64,
    pub queue_time_p90_ms: u64,
    pub queue_time_p99_ms: u64,
}

/// The figures of a period: per tenant and GPU type, and per tenant, submitter and GPU
/// type, each sorted by its key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageReport {
    pub tenants: Vec<UsageFigures>,
    pub users: Vec<UsageFigures>,
}

/// The figures of `attempts` over `period`, running attempts counted up to `now_ms`.
/// Attempts that did not hold a slice in the period are left out, so callers may pass
/// more than the period's.
pub fn usage_report(attempts: &[AccountedAttempt], period: Period, now_ms: i64) -> UsageReport {
    let mut tenants: BTreeMap<(String, String), Accumulator> = BTreeMap::new();
    let mut users: BTreeMap<(String, String, String), Accumulator> = BTreeMap::new();
    for attempt in attempts {
        let Some(share) = attempt_share(attempt, period, now_ms) else {
            continue;
        };
        tenants
            .entry((attempt.tenant.clone(), attempt.gpu_type.clone()))
            .or_default()
            .add(attempt, &share);
        users
            .entry((
                attempt.tenant.clone(),
                attempt.submitter.token_id.clone(),
                attempt.gpu_type.clone(),
            ))
            .or_default()
            .add(attempt, &share);
    }
    UsageReport {
        tenants: tenants
            .into_iter()
            .map(|((tenant, gpu_type), accumulator)| {
                accumulator.figures(tenant, Submitter::default(), gpu_type)
            })
            .collect(),
        users: users
            .into_iter()
            .map(|((tenant, _, gpu_type), accumulator)| {
                let submitter = accumulator.submitter.clone().unwrap_or_default();
                accumulator.figures(tenant, submitter, gpu_type)
            })
            .collect(),
    }
}

/// What one attempt adds to its groups in a period.
#[derive(Debug)]
struct AttemptShare {
    held_ms: u64,
    /// The wait before it, where it was placed in the period and the wait is known.
    queue_time_ms: Option<u64>,
    oom_retry: bool,
    preemption: bool,
}

/// `None` when the attempt did not hold its slice in the period.
fn attempt_share(attempt: &AccountedAttempt, period: Period, now_ms: i64) -> Option<AttemptShare> {
    let end_ms = attempt
        .ended_at_ms
        .unwrap_or(now_ms)
        .max(attempt.placed_at_ms);
    let placed_in_period = period.contains(attempt.placed_at_ms);
    let overlaps = attempt.placed_at_ms < period.to_ms && end_ms > period.from_ms;
    if !(overlaps || placed_in_period) {
        return None;
    }
    let held_from = attempt.placed_at_ms.max(period.from_ms);
    let held_to = end_ms.min(period.to_ms);
    let held_ms = u64::try_from(held_to.saturating_sub(held_from)).unwrap_or(0);
    let queue_time_ms = attempt
        .queued_since_ms
        .filter(|_| placed_in_period)
        .map(|since| u64::try_from(attempt.placed_at_ms.saturating_sub(since)).unwrap_or(0));
    Some(AttemptShare {
        held_ms,
        queue_time_ms,
        oom_retry: attempt.retries_out_of_memory && placed_in_period,
        preemption: attempt.preempted
            && attempt.ended_at_ms.is_some_and(|end| period.contains(end)),
    })
}

#[derive(Debug, Default)]
struct Accumulator {
    submitter: Option<Submitter>,
    jobs: BTreeSet<String>,
    attempts: u64,
    gpu_milliseconds: u64,
    vram_requested_byte_milliseconds: u128,
    vram_used_byte_milliseconds: u128,
    vram_requested_measured_byte_milliseconds: u128,
    measured_attempts: u64,
    oom_retries: u64,
    preemptions: u64,
    queue_times_ms: Vec<u64>,
}

impl Accumulator {
    fn add(&mut self, attempt: &AccountedAttempt, share: &AttemptShare) {
        // A token's description is the same on each of its jobs; the first one read is
        // kept so the figures do not depend on the order.
        let keep = match &self.submitter {
            None => true,
            Some(kept) => attempt.submitter.description < kept.description,
        };
        if keep {
            self.submitter = Some(attempt.submitter.clone());
        }
        self.jobs.insert(attempt.job_id.clone());
        self.attempts += 1;
        self.gpu_milliseconds = self.gpu_milliseconds.saturating_add(share.held_ms);
        let requested = u128::from(attempt.slice_bytes) * u128::from(share.held_ms);
        self.vram_requested_byte_milliseconds += requested;
        if let Some(peak) = attempt.measured_peak_bytes {
            self.measured_attempts += 1;
            self.vram_used_byte_milliseconds += u128::from(peak) * u128::from(share.held_ms);
            self.vram_requested_measured_byte_milliseconds += requested;
        }
        self.oom_retries += u64::from(share.oom_retry);
        self.preemptions += u64::from(share.preemption);
        if let Some(wait) = share.queue_time_ms {
            self.queue_times_ms.push(wait);
        }
    }

    fn figures(mut self, tenant: String, submitter: Submitter, gpu_type: String) -> UsageFigures {
        self.queue_times_ms.sort_unstable();
        UsageFigures {
            tenant,
            submitter,
            gpu_type,
            jobs: self.jobs.len() as u64,
            attempts: self.attempts,
            gpu_milliseconds: self.gpu_milliseconds,
            vram_requested_byte_milliseconds: self.vram_requested_byte_milliseconds,
            vram_used_byte_milliseconds: self.vram_used_byte_milliseconds,
            vram_requested_measured_byte_milliseconds: self
                .vram_requested_measured_byte_milliseconds,
            measured_attempts: self.measured_attempts,
            oom_retries: self.oom_retries,
            preemptions: self.preemptions,
            queued_attempts: self.queue_times_ms.len() as u64,
            queue_time_p50_ms: nearest_rank(&self.queue_times_ms, 50),
            queue_time_p90_ms: nearest_rank(&self.queue_times_ms, 90),
            queue_time_p99_ms: nearest_rank(&self.queue_times_ms, 99),
        }
    }
}

/// The nearest-rank `percent`th percentile of sorted `values`: the smallest value at
/// least `percent`% of them are at or below; 0 for none.
pub fn nearest_rank(sorted: &[u64], percent: u64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let count = sorted.len() as u64;
    let rank = (percent * count).div_ceil(100).clamp(1, count);
    sorted[(rank - 1) as usize]
}

#[cfg(test)]
mod tests;
