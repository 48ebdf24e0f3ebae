//! The results a command job's program reports for itself (`CARVE_PROGRESS accuracy=0.93
//! val_loss=0.41 metric_top5=0.99`): which keys are metrics, what a metric's name may be,
//! and the bounds that keep a hostile program from bloating the store or the display with
//! thousands of names, megabyte names or values that are not numbers.
//!
//! The worker applies these rules as it reads the program's lines, and the scheduler
//! applies them again to what a worker reports: both keep the same set.

/// The most metrics one attempt keeps; a name past this many distinct names is dropped
/// (the first names reported are kept, their values updated).
pub const MOST_METRICS: usize = 16;

/// The longest metric name kept, in bytes; a longer name is dropped, not cut (two long
/// names cut to the same prefix would become one metric).
pub const MOST_METRIC_NAME_BYTES: usize = 48;

/// The progress key whose value is the attempt's test accuracy (0 to 1), shown in the
/// ACCURACY column as model jobs' is.
pub const ACCURACY_KEY: &str = "accuracy";

/// The progress key of the validation loss, a metric under its own name.
pub const VALIDATION_LOSS_KEY: &str = "val_loss";

/// The prefix of a progress key naming a metric of the program's own: `metric_top5=0.98`
/// is the metric `top5`.
pub const METRIC_KEY_PREFIX: &str = "metric_";

/// One metric: its name and its latest finite value.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Metric {
    pub name: String,
    pub value: f64,
}

/// Why a metric was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricRefusal {
    /// Empty, longer than [`MOST_METRIC_NAME_BYTES`], or with a character other than
    /// ASCII letters, digits, `_`, `.`, `-` and `/`.
    BadName,
    /// NaN or infinite.
    NotFinite,
    /// [`MOST_METRICS`] other names are already kept.
    TooMany,
}

/// The metric name a progress key reports, if it is a metric key: `val_loss` for
/// `val_loss`, `top5` for `metric_top5`. `accuracy` is not a metric here: it is the
/// test accuracy ([`accuracy_of`]).
pub fn metric_name_of_key(key: &str) -> Option<&str> {
    if key == VALIDATION_LOSS_KEY {
        return Some(key);
    }
    key.strip_prefix(METRIC_KEY_PREFIX)
}

/// A reported accuracy, kept when it is a fraction (0 to 1); a percentage such as 93.5
/// or a value that is not finite is refused rather than shown as 9350%.
pub fn accuracy_of(value: f64) -> Option<f64> {
    (value.is_finite() && (0.0..=1.0).contains(&value)).then_some(value)
}

fn is_good_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MOST_METRIC_NAME_BYTES
        && name
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'.' | b'-' | b'/'))
}

/// An attempt's metrics in the order their names were first reported, each name once
/// with its latest value, at most [`MOST_METRICS`] of them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricSet {
    metrics: Vec<Metric>,
}

impl MetricSet {
    /// Keeps `value` as the latest of `name`, or says why not.
    pub fn record(&mut self, name: &str, value: f64) -> Result<(), MetricRefusal> {
        if !is_good_name(name) {
            return Err(MetricRefusal::BadName);
        }
        if !value.is_finite() {
            return Err(MetricRefusal::NotFinite);
        }
        if let Some(kept) = self.metrics.iter_mut().find(|metric| metric.name == name) {
            kept.value = value;
            return Ok(());
        }
        if self.metrics.len() >= MOST_METRICS {
            return Err(MetricRefusal::TooMany);
        }
        self.metrics.push(Metric {
            name: name.to_string(),
            value,
        });
        Ok(())
    }

    /// Every metric of `later`, recorded in its order (what the bounds refuse is left out).
    pub fn merge(&mut self, later: &MetricSet) {
        for metric in &later.metrics {
            let _ = self.record(&metric.name, metric.value);
        }
    }

    /// The set of `metrics` the bounds allow, in their order: what the scheduler keeps of
    /// a worker's report.
    pub fn bounded(metrics: impl IntoIterator<Item = Metric>) -> MetricSet {
        let mut set = MetricSet::default();
        for metric in metrics {
            let _ = set.record(&metric.name, metric.value);
        }
        set
    }

    pub fn metrics(&self) -> &[Metric] {
        &self.metrics
    }

    pub fn into_metrics(self) -> Vec<Metric> {
        self.metrics
    }

    pub fn is_empty(&self) -> bool {
        self.metrics.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_keys_are_val_loss_and_the_metric_prefix() {
        assert_eq!(metric_name_of_key("val_loss"), Some("val_loss"));
        assert_eq!(metric_name_of_key("metric_top5"), Some("top5"));
        assert_eq!(metric_name_of_key("metric_"), Some(""));
        assert_eq!(metric_name_of_key("accuracy"), None);
        assert_eq!(metric_name_of_key("loss"), None);
        assert_eq!(accuracy_of(0.93), Some(0.93));
        assert_eq!(accuracy_of(93.5), None);
        assert_eq!(accuracy_of(f64::NAN), None);
    }

    #[test]
    fn a_name_is_kept_once_with_its_latest_value_in_first_reported_order() {
        let mut set = MetricSet::default();
        set.record("val_loss", 0.5).unwrap();
        set.record("top5", 0.9).unwrap();
        set.record("val_loss", 0.4).unwrap();
        let names: Vec<(&str, f64)> = set
            .metrics()
            .iter()
            .map(|metric| (metric.name.as_str(), metric.value))
            .collect();
        assert_eq!(names, vec![("val_loss", 0.4), ("top5", 0.9)]);
    }

    #[test]
    fn a_hostile_program_cannot_grow_the_set_past_its_bounds() {
        let mut set = MetricSet::default();
        for index in 0..10_000 {
            let _ = set.record(&format!("m{index}"), index as f64);
        }
        assert_eq!(set.metrics().len(), MOST_METRICS);
        // The names kept first still update.
        set.record("m0", -1.0).unwrap();
        assert_eq!(set.metrics()[0].value, -1.0);
        assert_eq!(set.record("m99999", 1.0), Err(MetricRefusal::TooMany));

        let mut set = MetricSet::default();
        let huge = "x".repeat(1 << 20);
        assert_eq!(set.record(&huge, 1.0), Err(MetricRefusal::BadName));
        let longest = "x".repeat(MOST_METRIC_NAME_BYTES);
        assert_eq!(set.record(&longest, 1.0), Ok(()));
        assert_eq!(
            set.record(&format!("{longest}x"), 1.0),
            Err(MetricRefusal::BadName)
        );
        for bad in ["", "a b", "a=b", "\u{1b}[2J", "ä", "a\nb"] {
            assert_eq!(set.record(bad, 1.0), Err(MetricRefusal::BadName), "{bad:?}");
        }
        for value in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(set.record("fine", value), Err(MetricRefusal::NotFinite));
        }
        assert_eq!(set.metrics().len(), 1);
    }

    #[test]
    fn a_report_is_bounded_as_the_program_was() {
        let many = (0..1_000).map(|index| Metric {
            name: if index == 3 {
                "y".repeat(4096)
            } else {
                format!("n{index}")
            },
            value: if index == 5 { f64::NAN } else { 1.0 },
        });
        let set = MetricSet::bounded(many);
        assert_eq!(set.metrics().len(), MOST_METRICS);
        assert!(
            set.metrics()
                .iter()
                .all(|metric| metric.value.is_finite()
                    && metric.name.len() <= MOST_METRIC_NAME_BYTES)
        );
        assert_eq!(set.metrics()[3].name, "n4");
    }
}
