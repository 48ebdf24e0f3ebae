//! How long a run has left, from the pace of its steps after the first one reported.
//!
//! The time before a run's first reported step is start-up: the interpreter, imports,
//! reading data, building the model, a checkpoint loaded, the first step's compilation.
//! Counting it in the pace makes the ETA of an early step many times the run ("ETA 57s"
//! at step 1 of a 12 s run). So the pace is measured from the first step reported to the
//! latest: `(latest.step - first.step) / (latest.at - first.at)`, and there is no ETA
//! until a later step than the first was reported.
//!
//! Times are passed in (any fixed origin: seconds since the run started, or since the
//! Unix epoch), so that the decision is the same for whoever measures.

use std::time::Duration;

/// A step reached at a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepMark {
    pub step: u64,
    /// Since a fixed origin, the same for every mark of one run.
    pub at: Duration,
}

/// The first and the latest step of a run as they were reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepRate {
    first: Option<StepMark>,
    latest: Option<StepMark>,
}

impl StepRate {
    /// Takes a report of `step` at `at`. A step below the latest (the program started
    /// over, or resumed from an earlier checkpoint) or a moment before the latest starts
    /// the measure again from it.
    pub fn observe(&mut self, step: u64, at: Duration) {
        let mark = StepMark { step, at };
        match self.latest {
            Some(latest) if step >= latest.step && at >= latest.at => {
                self.latest = Some(mark);
            }
            _ => {
                self.first = Some(mark);
                self.latest = Some(mark);
            }
        }
    }

    /// Steps per second since the first reported step; `None` until a later step came
    /// some time after it.
    pub fn steps_per_second(&self) -> Option<f64> {
        let (first, latest) = (self.first?, self.latest?);
        let steps = latest
            .step
            .checked_sub(first.step)
            .filter(|steps| *steps > 0)?;
        let seconds = latest.at.checked_sub(first.at)?.as_secs_f64();
        (seconds > 0.0).then(|| steps as f64 / seconds)
    }

    /// The time from the latest report to `total_steps` at that pace; `None` without a
    /// pace, or when the latest step reached the total.
    pub fn time_left(&self, total_steps: u64) -> Option<Duration> {
        let latest = self.latest?;
        let steps_left = total_steps
            .checked_sub(latest.step)
            .filter(|left| *left > 0)?;
        let rate = self.steps_per_second()?;
        Duration::try_from_secs_f64(steps_left as f64 / rate).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seconds(value: f64) -> Duration {
        Duration::from_secs_f64(value)
    }

    #[test]
    fn start_up_before_the_first_step_does_not_count() {
        // The run: 5 s of start-up, then 12 steps of about half a second.
        let mut rate = StepRate::default();
        rate.observe(1, seconds(5.0));
        // One step alone says nothing of the pace (the old ETA said 57 s here).
        assert_eq!(rate.time_left(12), None);
        rate.observe(2, seconds(5.5));
        assert_eq!(rate.time_left(12), Some(seconds(5.0)));
        rate.observe(7, seconds(8.0));
        assert_eq!(rate.steps_per_second(), Some(2.0));
        assert_eq!(rate.time_left(12), Some(seconds(2.5)));
        rate.observe(12, seconds(10.5));
        assert_eq!(rate.time_left(12), None);
    }

    #[test]
    fn a_resumed_run_counts_from_its_own_first_report() {
        let mut rate = StepRate::default();
        rate.observe(300, seconds(40.0));
        rate.observe(310, seconds(45.0));
        // 2 steps a second: 190 steps left take 95 s.
        assert_eq!(rate.time_left(500), Some(seconds(95.0)));
    }

    #[test]
    fn a_step_going_back_starts_the_measure_again() {
        let mut rate = StepRate::default();
        rate.observe(1, seconds(1.0));
        rate.observe(50, seconds(2.0));
        rate.observe(10, seconds(30.0));
        assert_eq!(rate.steps_per_second(), None);
        rate.observe(20, seconds(40.0));
        assert_eq!(rate.steps_per_second(), Some(1.0));
    }

    #[test]
    fn no_pace_without_time_or_steps_between_the_reports() {
        let mut rate = StepRate::default();
        assert_eq!(rate.time_left(10), None);
        rate.observe(3, seconds(1.0));
        rate.observe(3, seconds(2.0));
        assert_eq!(rate.time_left(10), None);
        let mut same_moment = StepRate::default();
        same_moment.observe(3, seconds(1.0));
        same_moment.observe(5, seconds(1.0));
        assert_eq!(same_moment.time_left(10), None);
    }
}
