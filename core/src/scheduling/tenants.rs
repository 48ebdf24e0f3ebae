//! The tenants' side of a pass: each tenant's jobs in order, the ledger of what it has
//! used and may still use (its quotas, with what a blocked head holds), and its turn in
//! the weighted fair-share order (rule 1 and the quota filters of rule 2).

use std::cmp::Ordering;
use std::ops::Range;

use super::reservations::BlockedHead;
use super::{PendingJob, TenantState, WaitReason};

/// Pending jobs grouped by tenant, each tenant's in its scheduling order. The last keys
/// only make the order total, so that any input order gives the same result.
pub(super) fn jobs_in_tenant_order(pending: &[PendingJob]) -> Vec<&PendingJob> {
    let mut jobs: Vec<&PendingJob> = pending.iter().collect();
    jobs.sort_unstable_by(|left, right| {
        left.tenant
            .cmp(&right.tenant)
            .then_with(|| compare_job_rank(left, right))
            .then_with(|| left.slice_bytes.cmp(&right.slice_bytes))
    });
    jobs
}

/// Priority (higher first), then age (lower sequence first), then job id.
pub(super) fn compare_job_rank(left: &PendingJob, right: &PendingJob) -> Ordering {
    right
        .priority
        .cmp(&left.priority)
        .then_with(|| left.submit_sequence.cmp(&right.submit_sequence))
        .then_with(|| left.job_id.cmp(&right.job_id))
}

/// Tenants sorted by name, one per name (the entry that sorts first on every field).
pub(crate) fn tenants_by_name(tenants: &[TenantState]) -> Vec<&TenantState> {
    let mut sorted: Vec<&TenantState> = tenants.iter().collect();
    sorted.sort_unstable_by(|left, right| {
        (
            &left.tenant,
            left.weight,
            left.vram_quota_bytes,
            left.running_jobs_quota,
            left.vram_in_use_bytes,
            left.running_jobs,
            left.decayed_usage_byte_seconds,
        )
            .cmp(&(
                &right.tenant,
                right.weight,
                right.vram_quota_bytes,
                right.running_jobs_quota,
                right.vram_in_use_bytes,
                right.running_jobs,
                right.decayed_usage_byte_seconds,
            ))
    });
    sorted.dedup_by(|later, earlier| later.tenant == earlier.tenant);
    sorted
}

/// What one tenant has used and may still use during the pass.
pub(super) struct TenantLedger<'a> {
    pub(super) state: &'a TenantState,
    /// In use at the start plus placed in this pass (u128: sums of u64 cannot overflow).
    pub(super) vram_in_use_bytes: u128,
    pub(super) running_jobs: u64,
    /// The tenant's blocked head job, for which its quotas hold bytes and a job (rule 4).
    pub(super) blocked_head: Option<BlockedHead>,
    /// The tenant's jobs, as indices into the sorted jobs.
    pub(super) jobs: Range<usize>,
    /// The next job to consider.
    pub(super) next_job: usize,
}

impl<'a> TenantLedger<'a> {
    pub(super) fn new(state: &'a TenantState, jobs: Range<usize>) -> Self {
        TenantLedger {
            state,
            vram_in_use_bytes: u128::from(state.vram_in_use_bytes),
            running_jobs: u64::from(state.running_jobs),
            blocked_head: None,
            next_job: jobs.start,
            jobs,
        }
    }

    /// Why the tenant's quotas do not admit the job at `job_index` now, if they do not.
    pub(super) fn quota_reason(&self, job_index: usize, needs: u64) -> Option<WaitReason> {
        let (held_bytes, held_jobs) = match self.blocked_head {
            Some(head) if head.job_index != job_index => (head.slice_bytes, 1),
            _ => (0, 0),
        };
        if let Some(quota) = self.state.vram_quota_bytes {
            let in_use = self.vram_in_use_bytes + u128::from(held_bytes);
            if in_use + u128::from(needs) > u128::from(quota) {
                return Some(WaitReason::TenantVramQuota {
                    in_use: u64::try_from(in_use).unwrap_or(u64::MAX),
                    quota,
                    needs,
                });
            }
        }
        if let Some(quota) = self.state.running_jobs_quota {
            let running = self.running_jobs + held_jobs;
            if running >= u64::from(quota) {
                return Some(WaitReason::TenantRunningJobsQuota {
                    running: u32::try_from(running).unwrap_or(u32::MAX),
                    quota,
                });
            }
        }
        None
    }

    /// The tenant's turn; `holding_seconds` weighs a byte held now against a decayed
    /// byte-second (rule 1).
    pub(super) fn turn(&self, ledger_index: usize, holding_seconds: u128) -> FairShareTurn {
        FairShareTurn {
            effective_usage: self
                .state
                .decayed_usage_byte_seconds
                .saturating_add(self.vram_in_use_bytes.saturating_mul(holding_seconds)),
            vram_in_use_bytes: self.vram_in_use_bytes,
            weight: u128::from(self.state.weight.max(1)),
            ledger_index,
        }
    }
}

/// A tenant's place in the fair-share order: lower `effective_usage / weight` first (decayed
/// usage plus holdings at their steady-state weight), then lower `vram_in_use_bytes /
/// weight`, then tenant name (ledgers are in name order).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FairShareTurn {
    pub(crate) effective_usage: u128,
    pub(crate) vram_in_use_bytes: u128,
    pub(crate) weight: u128,
    pub(crate) ledger_index: usize,
}

impl Ord for FairShareTurn {
    fn cmp(&self, other: &Self) -> Ordering {
        // a/wa < b/wb  <=>  a*wb < b*wa: exact, no floats. Usage stays below 2^96 (sums
        // of u64 over far fewer than 2^32 jobs) and weights below 2^32, so no overflow.
        // Effective usage is byte-seconds: a cluster's bytes (under 2^50) times a
        // half-life's seconds (under 2^30 for decades) stay far below 2^96 too; the
        // products saturate rather than wrap beyond that.
        (self.effective_usage.saturating_mul(other.weight))
            .cmp(&other.effective_usage.saturating_mul(self.weight))
            .then_with(|| {
                (self.vram_in_use_bytes * other.weight)
                    .cmp(&(other.vram_in_use_bytes * self.weight))
            })
            .then_with(|| self.ledger_index.cmp(&other.ledger_index))
    }
}

impl PartialOrd for FairShareTurn {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for FairShareTurn {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for FairShareTurn {}
