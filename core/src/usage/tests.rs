//! Decayed usage: by example, and properties over random attempts (order independence,
//! halving in one half-life, the ledger against the definition).

use proptest::prelude::*;

use super::*;

const HOUR_MS: i64 = 3600 * 1000;

fn attempt(tenant: &str, slice_bytes: u64, started_at_ms: i64, ended_at_ms: i64) -> AttemptUsage {
    AttemptUsage {
        tenant: tenant.to_string(),
        gpu_type: "NVIDIA H100 80GB HBM3".to_string(),
        slice_bytes,
        started_at_ms,
        ended_at_ms,
    }
}

#[test]
fn a_short_attempt_just_ended_counts_about_its_byte_seconds() {
    let usage = attempt("a", 1 << 30, 0, 10_000);
    let totals = decayed_usage_at(std::slice::from_ref(&usage), 10_000, UsageDecay::default());
    let decayed = totals["a"].vram_byte_seconds;
    let undecayed = usage.vram_byte_seconds();
    assert!(decayed <= undecayed && decayed + undecayed / 100_000 >= undecayed);
    assert_eq!(
        totals["a"].gpu_milliseconds_by_type["NVIDIA H100 80GB HBM3"],
        10_000
    );
}

#[test]
fn use_after_now_is_not_counted() {
    let decay = UsageDecay::default();
    let ended = decayed_usage_at(&[attempt("a", 1000, 0, HOUR_MS)], HOUR_MS, decay);
    let running = decayed_usage_at(&[attempt("a", 1000, 0, 5 * HOUR_MS)], HOUR_MS, decay);
    assert_eq!(ended, running);
}

#[test]
fn a_half_life_must_be_positive() {
    assert!(UsageDecay::with_half_life_ms(0).is_none());
    assert!(UsageDecay::with_half_life_ms(-1).is_none());
    assert_eq!(
        UsageDecay::with_half_life_ms(HOUR_MS).map(|decay| decay.half_life_ms()),
        Some(HOUR_MS)
    );
}

#[test]
fn holding_steadily_tends_to_the_steady_state_weight() {
    let decay = UsageDecay::with_half_life_ms(HOUR_MS).unwrap();
    let bytes = 1u64 << 30;
    let held = decayed_usage_at(&[attempt("a", bytes, 0, 40 * HOUR_MS)], 40 * HOUR_MS, decay);
    let steady = decay.steady_state_byte_seconds(bytes);
    let difference = steady.abs_diff(held["a"].vram_byte_seconds);
    assert!(difference * 1_000_000 < steady, "{difference} of {steady}");
}

fn attempts_strategy() -> impl Strategy<Value = Vec<AttemptUsage>> {
    prop::collection::vec(
        (
            prop::sample::select(vec!["a", "b", "c"]),
            prop::sample::select(vec!["H100", "A100"]),
            1u64..(80u64 << 30),
            0i64..(30 * 24 * HOUR_MS),
            0i64..(3 * 24 * HOUR_MS),
        )
            .prop_map(
                |(tenant, gpu_type, slice_bytes, start, length)| AttemptUsage {
                    tenant: tenant.to_string(),
                    gpu_type: gpu_type.to_string(),
                    slice_bytes,
                    started_at_ms: start,
                    ended_at_ms: start + length,
                },
            ),
        0..40,
    )
}

const LATEST_END_MS: i64 = 33 * 24 * HOUR_MS;

proptest! {
    #[test]
    fn decayed_usage_does_not_depend_on_the_order_of_attempts(
        attempts in attempts_strategy(),
        shuffle_seed in any::<u64>(),
        half_life_hours in 1i64..400,
    ) {
        let decay = UsageDecay::with_half_life_ms(half_life_hours * HOUR_MS).unwrap();
        let mut shuffled = attempts.clone();
        // A seeded Fisher-Yates, so a failure replays.
        let mut state = shuffle_seed;
        for index in (1..shuffled.len()).rev() {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            shuffled.swap(index, (state >> 33) as usize % (index + 1));
        }
        prop_assert_eq!(
            decayed_usage_at(&attempts, LATEST_END_MS, decay),
            decayed_usage_at(&shuffled, LATEST_END_MS, decay)
        );
    }

    #[test]
    fn decayed_usage_halves_in_one_half_life(
        attempts in attempts_strategy(),
        half_life_hours in 1i64..400,
    ) {
        let decay = UsageDecay::with_half_life_ms(half_life_hours * HOUR_MS).unwrap();
        let now = decayed_usage_at(&attempts, LATEST_END_MS, decay);
        let later = decayed_usage_at(&attempts, LATEST_END_MS + decay.half_life_ms(), decay);
        for (tenant, usage) in &now {
            let count = attempts.iter().filter(|a| &a.tenant == tenant).count() as u128;
            // Each term is rounded once at each moment: at most one byte-second apart
            // per attempt (and the float term's own relative error).
            let halved = usage.vram_byte_seconds / 2;
            let later_bytes = later[tenant].vram_byte_seconds;
            let allowed = count + 1 + usage.vram_byte_seconds / 1_000_000_000_000;
            prop_assert!(halved.abs_diff(later_bytes) <= allowed,
                "{}: {} then {}", tenant, usage.vram_byte_seconds, later_bytes);
        }
    }

    #[test]
    fn the_ledger_agrees_with_the_definition(
        attempts in attempts_strategy(),
        half_life_hours in 1i64..400,
        read_after_hours in 0i64..2000,
    ) {
        let decay = UsageDecay::with_half_life_ms(half_life_hours * HOUR_MS).unwrap();
        let mut ledger = DecayedUsageLedger::new(decay, 0);
        for attempt in &attempts {
            ledger.add(attempt);
        }
        let now_ms = LATEST_END_MS + read_after_hours * HOUR_MS;
        let from_ledger = ledger.totals_at(now_ms, &[]);
        let defined = decayed_usage_at(&attempts, now_ms, decay);
        for (tenant, usage) in &defined {
            let ledger_bytes = from_ledger.get(tenant).map_or(0, |u| u.vram_byte_seconds);
            let allowed = usage.vram_byte_seconds / 1_000_000 + attempts.len() as u128 + 1;
            prop_assert!(ledger_bytes.abs_diff(usage.vram_byte_seconds) <= allowed,
                "{}: ledger {} definition {}", tenant, ledger_bytes, usage.vram_byte_seconds);
        }
    }
}
