//! The send schedule of an open-loop run: request `i` is due at `i / rate` seconds after
//! the start, whether or not earlier requests have been answered. Latency is measured from
//! that due time, not from when the request actually went out, so a stalled server is
//! charged for the requests it kept the client from sending (no coordinated omission).

use std::time::Duration;

use crate::BenchError;

/// A fixed-rate schedule of `count` sends over `duration`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacedSchedule {
    rate_per_second: u32,
    count: u64,
}

impl PacedSchedule {
    /// The schedule of `rate_per_second` sends a second for `duration` (at least one send).
    pub fn new(rate_per_second: u32, duration: Duration) -> Result<PacedSchedule, BenchError> {
        if rate_per_second == 0 {
            return Err(BenchError::invalid_argument(
                "rates",
                "a rate must be above 0",
            ));
        }
        let count = (duration.as_secs_f64() * f64::from(rate_per_second)).round() as u64;
        Ok(PacedSchedule {
            rate_per_second,
            count: count.max(1),
        })
    }

    pub fn rate_per_second(&self) -> u32 {
        self.rate_per_second
    }

    /// How many sends the schedule has.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// When send `index` is due, after the start. Computed from the index (not by adding
    /// intervals), so rounding never accumulates.
    pub fn due_after_start(&self, index: u64) -> Duration {
        let nanos = u128::from(index) * 1_000_000_000 / u128::from(self.rate_per_second);
        Duration::from_nanos(nanos as u64)
    }
}

/// Parses `1000,2000,5000`: rates in jobs per second, each above 0.
pub fn parse_rates(text: &str) -> Result<Vec<u32>, BenchError> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(Vec::new());
    }
    text.split(',')
        .map(|rate| {
            let rate = rate.trim();
            match rate.parse::<u32>() {
                Ok(0) => Err(BenchError::invalid_argument(
                    "rates",
                    "a rate must be above 0",
                )),
                Ok(rate) => Ok(rate),
                Err(_) => Err(BenchError::invalid_argument(
                    "rates",
                    format!("{rate:?} is not a whole number of jobs per second"),
                )),
            }
        })
        .collect()
}

/// Parses a duration: `8s`, `500ms`, `2m`, or a number of seconds (`1.5`).
pub fn parse_duration(text: &str) -> Result<Duration, BenchError> {
    let text = text.trim();
    let (number, unit_seconds) = if let Some(number) = text.strip_suffix("ms") {
        (number, 0.001)
    } else if let Some(number) = text.strip_suffix('s') {
        (number, 1.0)
    } else if let Some(number) = text.strip_suffix('m') {
        (number, 60.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number.trim().parse().map_err(|_| {
        BenchError::invalid_argument(
            "duration",
            format!("{text:?} is not a duration like 8s, 500ms or 2m"),
        )
    })?;
    if !value.is_finite() || value <= 0.0 || value * unit_seconds > 86_400.0 {
        return Err(BenchError::invalid_argument(
            "duration",
            format!("{text:?} must be above 0 and at most a day"),
        ));
    }
    Ok(Duration::from_secs_f64(value * unit_seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("8s").unwrap(), Duration::from_secs(8));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        for bad in ["", "fast", "0s", "-1s", "2d"] {
            let error = parse_duration(bad).unwrap_err().to_string();
            assert!(error.starts_with("duration:"), "{bad}: {error}");
        }
    }

    #[test]
    fn sends_are_evenly_spaced_from_the_start() {
        let schedule = PacedSchedule::new(1000, Duration::from_secs(2)).unwrap();
        assert_eq!(schedule.count(), 2000);
        assert_eq!(schedule.due_after_start(0), Duration::ZERO);
        assert_eq!(schedule.due_after_start(1), Duration::from_millis(1));
        assert_eq!(schedule.due_after_start(1999), Duration::from_millis(1999));
    }

    #[test]
    fn rates_that_do_not_divide_a_second_do_not_drift() {
        let schedule = PacedSchedule::new(3, Duration::from_secs(10)).unwrap();
        assert_eq!(schedule.count(), 30);
        assert_eq!(
            schedule.due_after_start(1),
            Duration::from_nanos(333_333_333)
        );
        // Three intervals make exactly one second: nothing accumulated.
        assert_eq!(schedule.due_after_start(3), Duration::from_secs(1));
        assert_eq!(
            schedule.due_after_start(29),
            Duration::from_nanos(9_666_666_666)
        );
    }

    #[test]
    fn a_short_run_still_sends_once() {
        let schedule = PacedSchedule::new(1, Duration::from_millis(100)).unwrap();
        assert_eq!(schedule.count(), 1);
    }

    #[test]
    fn bad_rates_name_the_field() {
        assert_eq!(parse_rates("1000, 2000").unwrap(), vec![1000, 2000]);
        assert!(parse_rates("").unwrap().is_empty());
        let zero = parse_rates("1000,0").unwrap_err().to_string();
        assert_eq!(zero, "rates: a rate must be above 0");
        let word = parse_rates("fast").unwrap_err().to_string();
        assert!(
            word.starts_with("rates:") && word.contains("fast"),
            "{word}"
        );
        assert!(PacedSchedule::new(0, Duration::from_secs(1)).is_err());
    }
}
