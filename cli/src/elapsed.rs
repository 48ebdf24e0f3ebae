//! Elapsed times and ETAs of training, in the words `carve watch`, `carve run` and
//! `carve get` share: `elapsed 1m02s, ETA 3m15s`.

use std::time::Duration;

/// A duration for people, in its two largest units: `42s`, `1m02s`, `3h04m`, `2d05h`.
pub fn duration_text(duration: Duration) -> String {
    let seconds = duration.as_secs();
    match seconds {
        0..60 => format!("{seconds}s"),
        60..3600 => format!("{}m{:02}s", seconds / 60, seconds % 60),
        3600..86_400 => format!("{}h{:02}m", seconds / 3600, seconds % 3600 / 60),
        _ => format!("{}d{:02}h", seconds / 86_400, seconds % 86_400 / 3600),
    }
}

/// How long the steps left take at the pace so far: `steps_done` steps took `elapsed`
/// (steps of this run only, not those before a resume). `None` before a step is done.
pub fn estimated_time_left(
    steps_done: u64,
    steps_left: u64,
    elapsed: Duration,
) -> Option<Duration> {
    if steps_done == 0 {
        return None;
    }
    let per_step = elapsed.as_secs_f64() / steps_done as f64;
    Duration::try_from_secs_f64(per_step * steps_left as f64).ok()
}

/// `elapsed 1m02s, ETA 3m15s` for a run at `step` of `total_steps` that started at
/// `first_step` (its resume step, 0 from scratch) `elapsed` ago; the ETA is left out
/// before a step of its own is done, and once it is done.
pub fn timing_text(first_step: u64, step: u64, total_steps: u64, elapsed: Duration) -> String {
    let mut text = format!("elapsed {}", duration_text(elapsed));
    let steps_left = total_steps.saturating_sub(step);
    if steps_left > 0
        && let Some(left) =
            estimated_time_left(step.saturating_sub(first_step), steps_left, elapsed)
    {
        text.push_str(&format!(", ETA {}", duration_text(left)));
    }
    text
}

/// The timing of a progress report: the elapsed time, and the time left its worker sent
/// (the pace of the steps since the first one reported, start-up not counted:
/// `carve_core::step_rate`). A worker sends none before it knows a pace, and then no ETA
/// is shown (an estimate from the attempt's start would count the start-up: "ETA 57s"
/// at step 1 of a 12 s run).
pub fn progress_timing_text(
    progress: &carve_proto::v1::TrainingProgress,
    elapsed: Duration,
) -> String {
    let mut text = format!("elapsed {}", duration_text(elapsed));
    if progress.step < progress.total_steps
        && let Some(left) = progress
            .seconds_left
            .and_then(|seconds| Duration::try_from_secs_f64(seconds).ok())
    {
        text.push_str(&format!(", ETA {}", duration_text(left)));
    }
    text
}

/// The time from `start` to `end` (seconds and nanoseconds since the Unix epoch), never
/// negative: a client clock behind the scheduler's reads as no time at all.
pub fn between(start: &prost_types::Timestamp, end: &prost_types::Timestamp) -> Duration {
    let nanos =
        |at: &prost_types::Timestamp| i128::from(at.seconds) * 1_000_000_000 + i128::from(at.nanos);
    let difference = (nanos(end) - nanos(start)).max(0);
    Duration::from_nanos(u64::try_from(difference).unwrap_or(u64::MAX))
}

/// Now, as a timestamp, for [`between`].
pub fn now_timestamp() -> prost_types::Timestamp {
    prost_types::Timestamp::from(std::time::SystemTime::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_in_their_two_largest_units() {
        assert_eq!(duration_text(Duration::from_secs(42)), "42s");
        assert_eq!(duration_text(Duration::from_secs(62)), "1m02s");
        assert_eq!(
            duration_text(Duration::from_secs(3 * 3600 + 4 * 60 + 5)),
            "3h04m"
        );
        assert_eq!(
            duration_text(Duration::from_secs(2 * 86_400 + 5 * 3600)),
            "2d05h"
        );
    }

    #[test]
    fn the_eta_is_the_pace_so_far_times_the_steps_left() {
        // 100 steps in 50 s: 400 steps left take 200 s.
        let elapsed = Duration::from_secs(50);
        assert_eq!(
            estimated_time_left(100, 400, elapsed),
            Some(Duration::from_secs(200))
        );
        assert_eq!(estimated_time_left(0, 400, elapsed), None);
        // Resumed at step 300: only the 100 steps since count for the pace.
        assert_eq!(timing_text(300, 400, 500, elapsed), "elapsed 50s, ETA 50s");
        assert_eq!(timing_text(0, 0, 500, elapsed), "elapsed 50s");
        assert_eq!(timing_text(0, 500, 500, elapsed), "elapsed 50s");
    }

    #[test]
    fn the_workers_time_left_is_shown_when_it_sent_one() {
        let progress = carve_proto::v1::TrainingProgress {
            step: 1,
            total_steps: 12,
            seconds_left: Some(5.5),
            ..Default::default()
        };
        // 6 s of start-up before step 1: an estimate from the start would say 1m06s.
        let elapsed = Duration::from_secs(6);
        assert_eq!(
            progress_timing_text(&progress, elapsed),
            "elapsed 6s, ETA 5s"
        );
        let no_pace_yet = carve_proto::v1::TrainingProgress {
            seconds_left: None,
            ..progress
        };
        assert_eq!(progress_timing_text(&no_pace_yet, elapsed), "elapsed 6s");
        let done = carve_proto::v1::TrainingProgress {
            step: 12,
            ..progress
        };
        assert_eq!(progress_timing_text(&done, elapsed), "elapsed 6s");
    }

    #[test]
    fn time_between_two_timestamps_is_never_negative() {
        let at = |seconds, nanos| prost_types::Timestamp { seconds, nanos };
        assert_eq!(
            between(&at(10, 0), &at(12, 500_000_000)),
            Duration::from_millis(2500)
        );
        assert_eq!(between(&at(12, 0), &at(10, 0)), Duration::ZERO);
    }
}
