//! Usage over time: what each attempt used (VRAM-byte-seconds, and GPU-seconds by GPU
//! type) and the per-tenant sums with an exponential decay, as Slurm's multifactor
//! fair share decays usage with `PriorityDecayHalfLife`.
//!
//! An attempt holding `b` bytes from `s` to `e` is charged, seen from `now`, the integral
//! of `b * 2^(-(now - t) / h)` over `[s, e]` (`h` the half-life): each moment of use
//! counts half as much one half-life later. The integral has a closed form,
//! `b * h / ln 2 * 2^(-(now - e) / h) * (1 - 2^(-(e - s) / h))`, so a tenant's decayed
//! usage is a sum over its attempts, and every term halves exactly when `now` moves on by
//! one half-life. Each term is rounded to whole byte-seconds (GPU types: whole
//! GPU-milliseconds) before the sum, so the sum is an integer sum and does not depend on
//! the order of the attempts.
//!
//! [`decayed_usage_at`] is the definition. [`DecayedUsageLedger`] keeps the same sums
//! incrementally (the scheduler and the simulator add attempts as they end and read the
//! totals at each pass) with the same term per attempt; its totals equal the definition's
//! up to float rounding. The fair-share order (scheduling's `TenantState::decayed_usage`)
//! reads these totals.

use std::collections::BTreeMap;

pub mod report;

/// Slurm's default `PriorityDecayHalfLife`: 7 days.
pub const DEFAULT_HALF_LIFE_MS: i64 = 7 * 24 * 3600 * 1000;

/// The decay: usage counts half as much after each half-life. Always positive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UsageDecay {
    half_life_ms: i64,
}

impl Default for UsageDecay {
    fn default() -> Self {
        UsageDecay {
            half_life_ms: DEFAULT_HALF_LIFE_MS,
        }
    }
}

impl UsageDecay {
    /// A decay with this half-life, or `None` when it is not positive.
    pub fn with_half_life_ms(half_life_ms: i64) -> Option<Self> {
        (half_life_ms > 0).then_some(UsageDecay { half_life_ms })
    }

    pub fn half_life_ms(&self) -> i64 {
        self.half_life_ms
    }

    /// `2^(-age / h)`: what one moment of use `age_ms` ago counts for now. Ages below 0
    /// (a clock that moved back) count as 0.
    pub fn factor(&self, age_ms: i64) -> f64 {
        (-(age_ms.max(0) as f64) / self.half_life_ms as f64).exp2()
    }

    /// The decayed seconds of holding something from `started_at_ms` to `ended_at_ms`,
    /// seen from `now_ms`: the integral above without the bytes. The part of the interval
    /// after `now_ms` is not counted (it has not happened).
    pub fn decayed_seconds(&self, started_at_ms: i64, ended_at_ms: i64, now_ms: i64) -> f64 {
        let end = ended_at_ms.min(now_ms);
        if end <= started_at_ms {
            return 0.0;
        }
        let half_life_s = self.half_life_ms as f64 / 1000.0;
        let held_fraction = -(-((end - started_at_ms) as f64) / self.half_life_ms as f64
            * std::f64::consts::LN_2)
            .exp_m1();
        half_life_s / std::f64::consts::LN_2 * self.factor(now_ms - end) * held_fraction
    }

    /// The decayed usage that holding `bytes` forever from now comes to: `bytes * h / ln 2`
    /// byte-seconds, what a tenant's decayed usage tends to if it holds `bytes` steadily.
    /// The fair-share order charges what a tenant holds now at this weight, so history and
    /// holdings are compared in one unit.
    pub fn steady_state_byte_seconds(&self, bytes: u64) -> u128 {
        let seconds = self.half_life_ms as f64 / 1000.0 / std::f64::consts::LN_2;
        (bytes as f64 * seconds).round() as u128
    }
}

/// One attempt's use of a slice: its tenant, the GPU type it ran on (the worker's GPU
/// model name), the slice's bytes, and when it held them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AttemptUsage {
    pub tenant: String,
    pub gpu_type: String,
    pub slice_bytes: u64,
    pub started_at_ms: i64,
    /// For an attempt still running: now.
    pub ended_at_ms: i64,
}

impl AttemptUsage {
    /// Milliseconds held (0 for an end before the start).
    pub fn held_ms(&self) -> u64 {
        u64::try_from(self.ended_at_ms.saturating_sub(self.started_at_ms)).unwrap_or(0)
    }

    /// Undecayed VRAM-byte-seconds, whole (rounded down).
    pub fn vram_byte_seconds(&self) -> u128 {
        u128::from(self.slice_bytes) * u128::from(self.held_ms()) / 1000
    }
}

/// One tenant's decayed usage at some moment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct DecayedUsage {
    /// Decayed VRAM-byte-seconds.
    pub vram_byte_seconds: u128,
    /// Decayed GPU-milliseconds by GPU type (an attempt counts as one GPU: a slice of a
    /// GPU is a share of its memory, not of its time).
    pub gpu_milliseconds_by_type: BTreeMap<String, u64>,
}

/// The definition: each tenant's decayed usage at `now_ms` from its attempts, in any
/// order.
pub fn decayed_usage_at(
    attempts: &[AttemptUsage],
    now_ms: i64,
    decay: UsageDecay,
) -> BTreeMap<String, DecayedUsage> {
    let mut totals: BTreeMap<String, DecayedUsage> = BTreeMap::new();
    for attempt in attempts {
        let seconds = decay.decayed_seconds(attempt.started_at_ms, attempt.ended_at_ms, now_ms);
        let total = totals.entry(attempt.tenant.clone()).or_default();
        total.vram_byte_seconds = total
            .vram_byte_seconds
            .saturating_add((attempt.slice_bytes as f64 * seconds).round() as u128);
        let gpu_ms = total
            .gpu_milliseconds_by_type
            .entry(attempt.gpu_type.clone())
            .or_default();
        *gpu_ms = gpu_ms.saturating_add((seconds * 1000.0).round() as u64);
    }
    totals
}

/// The per-tenant decayed sums kept as attempts end: each tenant's totals as of an
/// anchor moment, decayed to the moment they are read. Adding an attempt adds its term
/// seen from the anchor; the anchor moves forward (multiplying the totals down) when
/// reads get more than a half-life past it, so the numbers stay in range.
#[derive(Debug, Clone)]
pub struct DecayedUsageLedger {
    decay: UsageDecay,
    anchor_ms: i64,
    tenants: BTreeMap<String, LedgerTotals>,
}

#[derive(Debug, Clone, Default)]
struct LedgerTotals {
    vram_byte_seconds: f64,
    gpu_seconds_by_type: BTreeMap<String, f64>,
}

impl DecayedUsageLedger {
    pub fn new(decay: UsageDecay, anchor_ms: i64) -> Self {
        DecayedUsageLedger {
            decay,
            anchor_ms,
            tenants: BTreeMap::new(),
        }
    }

    pub fn decay(&self) -> UsageDecay {
        self.decay
    }

    /// Adds an ended attempt. Its term is taken over its whole interval (even a part after
    /// the anchor), so reading at or after its end counts all of it.
    pub fn add(&mut self, attempt: &AttemptUsage) {
        if attempt.ended_at_ms <= attempt.started_at_ms {
            return;
        }
        if attempt.ended_at_ms > self.anchor_ms + self.decay.half_life_ms {
            self.move_anchor(attempt.ended_at_ms);
        }
        // The term seen from the anchor: the integral's closed form with now = anchor, so
        // an interval after the anchor is scaled up by 2^((end - anchor) / h).
        let seen_from_end = self.decay.decayed_seconds(
            attempt.started_at_ms,
            attempt.ended_at_ms,
            attempt.ended_at_ms,
        );
        let seconds = seen_from_end * self.scale_to_anchor(attempt.ended_at_ms);
        let totals = self.tenants.entry(attempt.tenant.clone()).or_default();
        totals.vram_byte_seconds += attempt.slice_bytes as f64 * seconds;
        *totals
            .gpu_seconds_by_type
            .entry(attempt.gpu_type.clone())
            .or_default() += seconds;
    }

    /// The tenants' decayed usage at `now_ms`, plus `running` attempts (ended_at_ms: now)
    /// counted to `now_ms` without being kept.
    pub fn totals_at(
        &mut self,
        now_ms: i64,
        running: &[AttemptUsage],
    ) -> BTreeMap<String, DecayedUsage> {
        if now_ms > self.anchor_ms + self.decay.half_life_ms {
            self.move_anchor(now_ms);
        }
        let factor = 1.0 / self.scale_to_anchor(now_ms);
        let mut totals: BTreeMap<String, DecayedUsage> = self
            .tenants
            .iter()
            .map(|(tenant, totals)| {
                let usage = DecayedUsage {
                    vram_byte_seconds: (totals.vram_byte_seconds * factor).round() as u128,
                    gpu_milliseconds_by_type: totals
                        .gpu_seconds_by_type
                        .iter()
                        .map(|(gpu_type, seconds)| {
                            (gpu_type.clone(), (seconds * factor * 1000.0).round() as u64)
                        })
                        .collect(),
                };
                (tenant.clone(), usage)
            })
            .collect();
        for (tenant, usage) in decayed_usage_at(running, now_ms, self.decay) {
            let total = totals.entry(tenant).or_default();
            total.vram_byte_seconds = total
                .vram_byte_seconds
                .saturating_add(usage.vram_byte_seconds);
            for (gpu_type, ms) in usage.gpu_milliseconds_by_type {
                let entry = total.gpu_milliseconds_by_type.entry(gpu_type).or_default();
                *entry = entry.saturating_add(ms);
            }
        }
        totals
    }

    /// `2^((moment - anchor) / h)`: how much larger a term seen from the anchor is than
    /// the same term seen from `moment`.
    fn scale_to_anchor(&self, moment_ms: i64) -> f64 {
        ((moment_ms - self.anchor_ms) as f64 / self.decay.half_life_ms as f64).exp2()
    }

    fn move_anchor(&mut self, new_anchor_ms: i64) {
        let factor = 1.0 / self.scale_to_anchor(new_anchor_ms);
        for totals in self.tenants.values_mut() {
            totals.vram_byte_seconds *= factor;
            for seconds in totals.gpu_seconds_by_type.values_mut() {
                *seconds *= factor;
            }
        }
        self.anchor_ms = new_anchor_ms;
    }
}

#[cfg(test)]
mod tests;
