//! Latencies are recorded in HDR histograms (microseconds, 3 significant digits, so every
//! quantile is within 0.1 %) and summarized as p50/p90/p99/p99.9/max.

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::BenchError;

/// The largest latency a histogram records exactly: one hour, in microseconds. Longer
/// ones are clamped to it (and would say the run failed anyway).
const HIGHEST_TRACKABLE_MICROS: u64 = 3_600_000_000;

/// A histogram of latencies in microseconds.
pub fn new_latency_histogram() -> Result<Histogram<u64>, BenchError> {
    Histogram::new_with_bounds(1, HIGHEST_TRACKABLE_MICROS, 3)
        .map_err(|error| BenchError::Io(format!("create a latency histogram: {error}")))
}

/// Records `micros` (clamped into the histogram's range).
pub fn record_micros(histogram: &mut Histogram<u64>, micros: u64) {
    histogram.saturating_record(micros.clamp(1, HIGHEST_TRACKABLE_MICROS));
}

/// Quantiles of a run's latencies, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

impl LatencySummary {
    pub fn of(histogram: &Histogram<u64>) -> LatencySummary {
        if histogram.is_empty() {
            return LatencySummary {
                count: 0,
                p50_ms: 0.0,
                p90_ms: 0.0,
                p99_ms: 0.0,
                p999_ms: 0.0,
                max_ms: 0.0,
            };
        }
        let millis = |micros: u64| micros as f64 / 1000.0;
        LatencySummary {
            count: histogram.len(),
            p50_ms: millis(histogram.value_at_quantile(0.50)),
            p90_ms: millis(histogram.value_at_quantile(0.90)),
            p99_ms: millis(histogram.value_at_quantile(0.99)),
            p999_ms: millis(histogram.value_at_quantile(0.999)),
            max_ms: millis(histogram.max()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_of_a_known_distribution() {
        let mut histogram = new_latency_histogram().unwrap();
        // 1 ms .. 1000 ms, one each: quantile q is about q * 1000 ms.
        for millis in 1..=1000u64 {
            record_micros(&mut histogram, millis * 1000);
        }
        let summary = LatencySummary::of(&histogram);
        assert_eq!(summary.count, 1000);
        let close = |actual: f64, expected: f64| (actual - expected).abs() <= expected * 0.002;
        assert!(close(summary.p50_ms, 500.0), "{summary:?}");
        assert!(close(summary.p90_ms, 900.0), "{summary:?}");
        assert!(close(summary.p99_ms, 990.0), "{summary:?}");
        assert!(close(summary.p999_ms, 999.0), "{summary:?}");
        assert!(close(summary.max_ms, 1000.0), "{summary:?}");
    }

    #[test]
    fn one_slow_request_shows_only_in_the_tail() {
        let mut histogram = new_latency_histogram().unwrap();
        for _ in 0..999 {
            record_micros(&mut histogram, 2_000);
        }
        record_micros(&mut histogram, 250_000);
        let summary = LatencySummary::of(&histogram);
        assert!((summary.p99_ms - 2.0).abs() < 0.01, "{summary:?}");
        assert!((summary.max_ms - 250.0).abs() < 0.25, "{summary:?}");
    }

    #[test]
    fn an_empty_histogram_summarizes_to_zeros_and_extremes_are_clamped() {
        let mut histogram = new_latency_histogram().unwrap();
        assert_eq!(LatencySummary::of(&histogram).count, 0);
        record_micros(&mut histogram, 0);
        record_micros(&mut histogram, u64::MAX);
        let summary = LatencySummary::of(&histogram);
        assert_eq!(summary.count, 2);
        assert!(summary.max_ms >= 3_600_000.0 * 0.999, "{summary:?}");
    }
}
