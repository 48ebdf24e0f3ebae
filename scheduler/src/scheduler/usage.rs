//! Fair share over time in the scheduler (issue 32): each tenant's decayed usage for the
//! scheduling pass, from the attempts' usage rows (`store/usage.rs`) and the attempts
//! running now, through core's ledger (`carve_core::usage`), the one the simulator keeps.
//!
//! The ended attempts' totals are read from the store (rows that ended within 30
//! half-lives; older ones count for less than a billionth) on the first pass after a
//! start or a takeover, and again after any attempt that a pass saw running has ended
//! (at most every [`REREAD_AT_MOST_EVERY_MS`]); in between, the cached totals are
//! decayed to the pass's moment, and an attempt that ended since the last pass is added
//! to them as ended at that pass (at most a pass late; the next read has its stored
//! end). Running attempts count from their placement to now.
//! A pass skipped because its inputs did not change stays sound: decayed usage only
//! orders the tenants, and a pass that placed nothing would place nothing in any order.

use std::collections::BTreeMap;

use carve_core::scheduling::TenantState;
use carve_core::usage::{AttemptUsage, DecayedUsageLedger, UsageDecay};

use crate::error::SchedulerError;

use super::Scheduler;

/// Reads of the ended attempts' usage are at most this frequent.
const REREAD_AT_MOST_EVERY_MS: i64 = 10_000;

/// Rows that ended more than this many half-lives ago are not read.
const HALF_LIVES_READ: i64 = 30;

/// The ended attempts' decayed totals as last read, and which attempts ran then.
#[derive(Debug)]
pub(super) struct UsageHistory {
    ledger: DecayedUsageLedger,
    read_at_ms: i64,
    /// The attempts running at the last pass, by `(job id, attempt number)`.
    running: BTreeMap<(String, u32), AttemptUsage>,
    /// Whether attempts ended since the read, added as ended at a pass.
    ended_since_read: bool,
}

impl Scheduler {
    /// The usage decay the operator set (`--fair-share-half-life-hours`).
    pub(super) fn usage_decay(&self) -> UsageDecay {
        let half_life_ms =
            i64::try_from(self.settings.fair_share_half_life.as_millis()).unwrap_or(i64::MAX);
        UsageDecay::with_half_life_ms(half_life_ms).unwrap_or_default()
    }

    /// Sets each tenant's decayed usage at `now_ms` (ended attempts from the store,
    /// running ones from the live state).
    pub(super) async fn set_decayed_usage(
        &self,
        tenants: &mut [TenantState],
        now_ms: i64,
    ) -> Result<(), SchedulerError> {
        let decay = self.usage_decay();
        let running: BTreeMap<(String, u32), AttemptUsage> = self
            .live()
            .running
            .iter()
            .map(|(job_id, attempt)| {
                let usage = AttemptUsage {
                    tenant: attempt.tenant.clone(),
                    gpu_type: String::new(),
                    slice_bytes: attempt.slice_bytes,
                    started_at_ms: attempt.started_at_ms,
                    ended_at_ms: now_ms.max(attempt.started_at_ms),
                };
                ((job_id.clone(), attempt.attempt_number), usage)
            })
            .collect();
        let reread = {
            let history = self.usage_history.lock().unwrap_or_else(|p| p.into_inner());
            match history.as_ref() {
                None => true,
                Some(history) => {
                    history.ledger.decay() != decay
                        || (now_ms - history.read_at_ms >= REREAD_AT_MOST_EVERY_MS
                            && history.ended_since_read)
                }
            }
        };
        if reread {
            let since_ms =
                now_ms.saturating_sub(decay.half_life_ms().saturating_mul(HALF_LIVES_READ));
            let rows = self.store.usage_between(since_ms, i64::MAX, None).await?;
            let mut ledger = DecayedUsageLedger::new(decay, now_ms);
            for row in rows.iter().filter(|row| row.ended_at_ms.is_some()) {
                ledger.add(&row.attempt_usage(now_ms));
            }
            *self.usage_history.lock().unwrap_or_else(|p| p.into_inner()) = Some(UsageHistory {
                ledger,
                read_at_ms: now_ms,
                running: BTreeMap::new(),
                ended_since_read: false,
            });
        }
        let totals = {
            let mut history = self.usage_history.lock().unwrap_or_else(|p| p.into_inner());
            let Some(history) = history.as_mut() else {
                return Ok(());
            };
            // Attempts the last pass saw running that no longer run ended since: counted
            // as ended now until the next read has their stored ends.
            let previous = std::mem::take(&mut history.running);
            for (key, mut usage) in previous {
                if !running.contains_key(&key) {
                    usage.ended_at_ms = now_ms.max(usage.started_at_ms);
                    history.ledger.add(&usage);
                    history.ended_since_read = true;
                }
            }
            let running_usage: Vec<AttemptUsage> = running.values().cloned().collect();
            history.running = running;
            history.ledger.totals_at(now_ms, &running_usage)
        };
        for tenant in tenants {
            tenant.decayed_usage_byte_seconds = totals
                .get(&tenant.tenant)
                .map_or(0, |usage| usage.vram_byte_seconds);
        }
        Ok(())
    }

    /// Forgets the cached totals: the next pass reads them from the store (at a start
    /// or on taking the lead, when another replica may have ended attempts).
    pub(super) fn forget_usage_history(&self) {
        *self.usage_history.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}
