//! What the worker makes of a command job's output lines (read by
//! `crate::program_output`): the `CARVE_PROGRESS key=value ...` lines a program may print
//! for its progress and results, the pace at which progress is reported (at most one a
//! second, the last always), and the bounded tail of stderr that tells an OOM from
//! another failure.

use std::collections::VecDeque;
use std::time::Duration;

use carve_core::command::metrics::{MetricSet, accuracy_of, metric_name_of_key};
use tokio::time::Instant;

/// How many stderr lines are kept for classifying the end (a Python traceback with its
/// OOM message fits).
pub const STDERR_TAIL_LINES: usize = 50;

/// The word that starts a progress line.
pub const PROGRESS_MARK: &str = "CARVE_PROGRESS";

/// The last lines of a stream, at most a fixed number.
#[derive(Debug, Clone)]
pub struct LineTail {
    lines: VecDeque<String>,
    most: usize,
}

impl LineTail {
    pub fn new(most: usize) -> LineTail {
        LineTail {
            lines: VecDeque::with_capacity(most),
            most,
        }
    }

    pub fn push(&mut self, line: String) {
        if self.lines.len() == self.most {
            self.lines.pop_front();
        }
        self.lines.push_back(line);
    }

    pub fn to_vec(&self) -> Vec<String> {
        self.lines.iter().cloned().collect()
    }
}

/// What one `CARVE_PROGRESS` line said; each key is optional.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProgressLine {
    pub step: Option<u64>,
    pub total_steps: Option<u64>,
    pub loss: Option<f64>,
    pub samples_per_second: Option<f64>,
    /// The program's own memory figures, used only when there is no guard account to
    /// read (a simulated GPU without the guard, where the program accounts for itself).
    pub memory_in_use_bytes: Option<u64>,
    pub memory_peak_bytes: Option<u64>,
    /// `accuracy=`: the test accuracy, a fraction from 0 to 1.
    pub accuracy: Option<f64>,
    /// `val_loss=` and `metric_<name>=`, bounded as `carve_core::command::metrics` says.
    pub metrics: MetricSet,
}

impl ProgressLine {
    /// Takes what a later line says, key by key (a key it lacks keeps its value); the
    /// peak is the largest memory figure seen.
    pub fn merge(&mut self, later: &ProgressLine) {
        self.step = later.step.or(self.step);
        self.total_steps = later.total_steps.or(self.total_steps);
        self.loss = later.loss.or(self.loss);
        self.samples_per_second = later.samples_per_second.or(self.samples_per_second);
        self.memory_in_use_bytes = later.memory_in_use_bytes.or(self.memory_in_use_bytes);
        self.memory_peak_bytes = self
            .memory_peak_bytes
            .max(later.memory_peak_bytes)
            .max(later.memory_in_use_bytes);
        self.accuracy = later.accuracy.or(self.accuracy);
        self.metrics.merge(&later.metrics);
    }

    /// Whether the line says anything of the run's steps (a line with only results, such
    /// as a final `accuracy=`, is not a progress report of its own).
    pub fn has_step_figures(&self) -> bool {
        self.step.is_some()
            || self.total_steps.is_some()
            || self.loss.is_some()
            || self.samples_per_second.is_some()
            || self.memory_in_use_bytes.is_some()
            || self.memory_peak_bytes.is_some()
    }
}

/// Reads a progress line: `CARVE_PROGRESS` (anywhere in the line, so that a logging
/// prefix such as `INFO:root:` is allowed) followed by space separated `key=value` pairs:
/// `step`, `total_steps`, `loss`, `samples_per_s`, `memory_in_use_bytes`,
/// `memory_peak_bytes`, `accuracy`, `val_loss` and `metric_<name>`. Unknown keys and
/// values that do not parse or are not finite are ignored, and so are metrics past the
/// bounds (`carve_core::command::metrics`). `None` when the line is not a progress line.
pub fn parse_progress_line(line: &str) -> Option<ProgressLine> {
    let (_, rest) = line.split_once(PROGRESS_MARK)?;
    // `CARVE_PROGRESSED` or `CARVE_PROGRESS=1` are not the mark.
    if !(rest.is_empty() || rest.starts_with(char::is_whitespace)) {
        return None;
    }
    let mut progress = ProgressLine::default();
    for pair in rest.split_whitespace() {
        let Some((key, value)) = pair.split_once('=') else {
            continue;
        };
        let finite = || {
            value
                .parse::<f64>()
                .ok()
                .filter(|number| number.is_finite())
        };
        match key {
            "step" => progress.step = value.parse().ok().or(progress.step),
            "total_steps" => progress.total_steps = value.parse().ok().or(progress.total_steps),
            "loss" => progress.loss = finite().or(progress.loss),
            "samples_per_s" => {
                progress.samples_per_second = finite()
                    .filter(|rate| *rate >= 0.0)
                    .or(progress.samples_per_second);
            }
            "memory_in_use_bytes" => {
                progress.memory_in_use_bytes = value.parse().ok().or(progress.memory_in_use_bytes);
            }
            "memory_peak_bytes" => {
                progress.memory_peak_bytes = value.parse().ok().or(progress.memory_peak_bytes);
            }
            "accuracy" => progress.accuracy = finite().and_then(accuracy_of).or(progress.accuracy),
            _ => {
                if let (Some(name), Some(value)) = (metric_name_of_key(key), finite()) {
                    let _ = progress.metrics.record(name, value);
                }
            }
        }
    }
    Some(progress)
}

/// The least time between two progress reports of a run.
pub const PROGRESS_REPORT_SPACING: Duration = Duration::from_secs(1);

/// When a run's progress is reported: at most one report per [`PROGRESS_REPORT_SPACING`],
/// and a line that came too soon is not lost but reported when the spacing has passed
/// (or at the run's end), so the last progress is always reported. A program printing a
/// progress line per step for 3,000 fast steps makes a report a second, not 3,000.
#[derive(Debug, Clone, Default)]
pub struct ProgressPacing {
    last_report: Option<Instant>,
    /// A progress line came since the last report.
    pending: bool,
}

impl ProgressPacing {
    /// A progress line came at `now`: whether to report it now (else it is pending).
    pub fn line_came(&mut self, now: Instant) -> bool {
        if self
            .last_report
            .is_some_and(|last| now < last + PROGRESS_REPORT_SPACING)
        {
            self.pending = true;
            return false;
        }
        self.reported(now);
        true
    }

    /// When a pending line is due; `None` with nothing pending.
    pub fn pending_due(&self) -> Option<Instant> {
        self.pending
            .then(|| self.last_report.map(|last| last + PROGRESS_REPORT_SPACING))
            .flatten()
    }

    /// Whether a line is waiting to be reported.
    pub fn is_pending(&self) -> bool {
        self.pending
    }

    /// A report went out at `now` (a pending line's, or one the caller made itself).
    pub fn reported(&mut self, now: Instant) {
        self.last_report = Some(now);
        self.pending = false;
    }

    /// The last report's moment, if any.
    pub fn last_report(&self) -> Option<Instant> {
        self.last_report
    }
}

/// The message of an error starting a program, without the "(os error 2)" the standard
/// library adds: "No such file or directory".
pub fn start_error_text(error: &std::io::Error) -> String {
    let text = error.to_string();
    match text.rfind(" (os error ") {
        Some(at) if text.ends_with(')') => text[..at].to_string(),
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_are_read_key_by_key() {
        let full = parse_progress_line(
            "CARVE_PROGRESS step=12 total_steps=100 loss=0.53 samples_per_s=812.5",
        )
        .unwrap();
        assert_eq!(
            full,
            ProgressLine {
                step: Some(12),
                total_steps: Some(100),
                loss: Some(0.53),
                samples_per_second: Some(812.5),
                ..ProgressLine::default()
            }
        );
        let partial =
            parse_progress_line("INFO:root:CARVE_PROGRESS loss=nan step=x total_steps=9 odd")
                .unwrap();
        assert_eq!(
            partial,
            ProgressLine {
                total_steps: Some(9),
                ..ProgressLine::default()
            }
        );
        assert_eq!(
            parse_progress_line("CARVE_PROGRESS memory_peak_bytes=4096")
                .unwrap()
                .memory_peak_bytes,
            Some(4096)
        );
        assert_eq!(
            parse_progress_line("CARVE_PROGRESS"),
            Some(ProgressLine::default())
        );
        assert_eq!(parse_progress_line("step=1 loss=2"), None);
        assert_eq!(parse_progress_line("CARVE_PROGRESSED step=1"), None);
    }

    #[test]
    fn merged_progress_keeps_the_latest_of_each_key_and_the_largest_memory() {
        let mut merged = ProgressLine::default();
        for line in [
            "CARVE_PROGRESS step=1 loss=2.0 memory_in_use_bytes=300",
            "CARVE_PROGRESS step=2 memory_in_use_bytes=100 memory_peak_bytes=200",
        ] {
            merged.merge(&parse_progress_line(line).unwrap());
        }
        assert_eq!(
            merged,
            ProgressLine {
                step: Some(2),
                total_steps: None,
                loss: Some(2.0),
                samples_per_second: None,
                memory_in_use_bytes: Some(100),
                memory_peak_bytes: Some(300),
                ..ProgressLine::default()
            }
        );
    }

    #[test]
    fn results_are_read_as_accuracy_and_bounded_metrics() {
        let line = parse_progress_line(
            "CARVE_PROGRESS accuracy=0.931 val_loss=0.41 metric_top5=0.99 metric_f1=nan \
             metric_=3 metric_a=b accuracy_pct=93",
        )
        .unwrap();
        assert_eq!(line.accuracy, Some(0.931));
        let metrics: Vec<(&str, f64)> = line
            .metrics
            .metrics()
            .iter()
            .map(|metric| (metric.name.as_str(), metric.value))
            .collect();
        assert_eq!(metrics, vec![("val_loss", 0.41), ("top5", 0.99)]);
        assert!(!line.has_step_figures());
        // A percentage is not an accuracy.
        assert_eq!(
            parse_progress_line("CARVE_PROGRESS accuracy=93.1")
                .unwrap()
                .accuracy,
            None
        );
        // Thousands of distinct keys on lines of a run: the merged set stays bounded.
        let mut merged = ProgressLine::default();
        for line_number in 0..500 {
            let keys: Vec<String> = (0..20)
                .map(|key| format!("metric_k{line_number}_{key}=1.5"))
                .collect();
            let line = format!("CARVE_PROGRESS step={line_number} {}", keys.join(" "));
            merged.merge(&parse_progress_line(&line).unwrap());
        }
        assert_eq!(
            merged.metrics.metrics().len(),
            carve_core::command::metrics::MOST_METRICS
        );
    }

    #[test]
    fn progress_is_reported_at_most_once_a_second_and_the_last_is_kept() {
        let start = Instant::now();
        let at = |millis: u64| start + Duration::from_millis(millis);
        let mut pacing = ProgressPacing::default();
        assert!(pacing.line_came(at(0)));
        assert_eq!(pacing.pending_due(), None);
        // 3,000 lines within the next second: none reported, one pending.
        for millis in 1..=999 {
            assert!(!pacing.line_came(at(millis)));
        }
        assert!(pacing.is_pending());
        assert_eq!(pacing.pending_due(), Some(at(1000)));
        pacing.reported(at(1000));
        assert!(!pacing.is_pending());
        assert!(pacing.line_came(at(2500)));
        assert!(!pacing.line_came(at(2600)));
        assert_eq!(pacing.pending_due(), Some(at(3500)));
    }

    #[test]
    fn the_tail_keeps_the_last_lines() {
        let mut tail = LineTail::new(2);
        for line in ["a", "b", "c"] {
            tail.push(line.to_string());
        }
        assert_eq!(tail.to_vec(), vec!["b", "c"]);
    }

    #[test]
    fn start_errors_read_without_the_os_error_number() {
        let missing = std::io::Error::from_raw_os_error(2);
        assert_eq!(start_error_text(&missing), "No such file or directory");
        let other = std::io::Error::other("the spawner is gone");
        assert_eq!(start_error_text(&other), "the spawner is gone");
    }
}
