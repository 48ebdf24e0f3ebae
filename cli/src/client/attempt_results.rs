//! What each attempt achieved and how far a running one is, as `carve get` and `carve
//! jobs` show them (like `sacct`): its start, elapsed time, steps, final loss, test
//! accuracy and throughput, and for a running attempt its latest progress with an ETA.

use carve_proto::v1;

use crate::elapsed::{between, duration_text, now_timestamp, progress_timing_text};

use super::output::{print_table, timestamp_text};

/// A loss for people: four decimals, or `-`.
fn loss_text(loss: Option<f64>) -> String {
    loss.map_or_else(|| "-".into(), |loss| format!("{loss:.4}"))
}

fn is_running(attempt: &v1::Attempt) -> bool {
    attempt.outcome == v1::AttemptOutcome::Running as i32
}

/// How long the attempt ran: to its end, or to now while it runs.
fn elapsed_text(attempt: &v1::Attempt, now: &prost_types::Timestamp) -> String {
    let Some(started) = &attempt.started_at else {
        return "-".into();
    };
    let end = attempt.finished_at.as_ref().unwrap_or(now);
    duration_text(between(started, end))
}

/// The metrics a command job's program reported, `val_loss 0.4100, top5 0.9700`; `-`
/// for none. Names and count are bounded where they are kept, and names hold no
/// characters that could move a terminal's cursor.
pub fn metrics_text(metrics: &[v1::Metric]) -> String {
    if metrics.is_empty() {
        return "-".into();
    }
    metrics
        .iter()
        .map(|metric| format!("{} {:.4}", metric.name, metric.value))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The results of a job's last attempt that reported any, for `carve jobs -o wide`:
/// `accuracy 93.10%, val_loss 0.4100`; `-` when none did.
pub fn last_results_text(job: &v1::Job) -> String {
    let Some(attempt) = job
        .attempts
        .iter()
        .rev()
        .find(|attempt| attempt.test_accuracy.is_some() || !attempt.metrics.is_empty())
    else {
        return "-".into();
    };
    let mut parts = Vec::new();
    if let Some(accuracy) = attempt.test_accuracy {
        parts.push(format!("accuracy {:.2}%", accuracy * 100.0));
    }
    if !attempt.metrics.is_empty() {
        parts.push(metrics_text(&attempt.metrics));
    }
    parts.join(", ")
}

/// One row of the results table.
fn results_row(attempt: &v1::Attempt, now: &prost_types::Timestamp) -> [String; 8] {
    let progress = attempt.progress.as_ref().filter(|_| is_running(attempt));
    let steps = match (attempt.steps_done, progress) {
        (Some(steps), _) => steps.to_string(),
        (None, Some(progress)) => format!("{}/{}", progress.step, progress.total_steps),
        (None, None) => "-".into(),
    };
    let loss = attempt
        .final_loss
        .or_else(|| progress.map(|progress| progress.loss));
    let samples_per_second = attempt
        .samples_per_second
        .or_else(|| progress.map(|progress| progress.samples_per_second));
    [
        attempt.number.to_string(),
        timestamp_text(attempt.started_at.as_ref()),
        elapsed_text(attempt, now),
        steps,
        loss_text(loss),
        attempt.test_accuracy.map_or_else(
            || "-".into(),
            |accuracy| format!("{:.2}%", accuracy * 100.0),
        ),
        samples_per_second.map_or_else(|| "-".into(), |rate| format!("{rate:.0}")),
        metrics_text(&attempt.metrics),
    ]
}

/// Prints the results table of a job's attempts (loss and throughput of a running
/// attempt are its latest progress report's); a METRICS column when any attempt's
/// program reported metrics.
pub fn print_results(job: &v1::Job) {
    let now = now_timestamp();
    let rows: Vec<[String; 8]> = job
        .attempts
        .iter()
        .map(|attempt| results_row(attempt, &now))
        .collect();
    let header = [
        "ATTEMPT",
        "STARTED",
        "ELAPSED",
        "STEPS",
        "LOSS",
        "ACCURACY",
        "SAMPLES/S",
        "METRICS",
    ];
    if job
        .attempts
        .iter()
        .any(|attempt| !attempt.metrics.is_empty())
    {
        print_table(header, &rows);
        return;
    }
    let header: [&str; 7] = std::array::from_fn(|column| header[column]);
    let rows: Vec<[String; 7]> = rows
        .into_iter()
        .map(|row| std::array::from_fn(|column| row[column].clone()))
        .collect();
    print_table(header, &rows);
}

/// `step 120/500 (24%), loss 0.4321, elapsed 1m02s, ETA 3m15s` for the running attempt
/// of `job` that reported progress; `None` otherwise.
pub fn progress_text(job: &v1::Job) -> Option<String> {
    let attempt = job.attempts.last().filter(|attempt| is_running(attempt))?;
    if attempt.progress.is_none()
        && let Some(pull) = &attempt.image_pull
    {
        return Some(format!(
            "attempt {}: {}",
            attempt.number,
            image_pull_text(pull)
        ));
    }
    let progress = attempt.progress.as_ref()?;
    let elapsed = attempt
        .started_at
        .as_ref()
        .map(|started| between(started, &now_timestamp()))
        .unwrap_or_default();
    let percent = (progress.step * 100)
        .checked_div(progress.total_steps)
        .unwrap_or(0);
    Some(format!(
        "attempt {}: step {}/{} ({percent}%), loss {:.4}, {}",
        attempt.number,
        progress.step,
        progress.total_steps,
        progress.loss,
        progress_timing_text(progress, elapsed)
    ))
}

/// An image pull under way as get and watch show it: "pulling image (x of y MiB)", with
/// the image named.
pub fn image_pull_text(pull: &v1::ImagePull) -> String {
    format!(
        "pulling image {} ({} of {} MiB)",
        pull.image,
        pull.done_bytes >> 20,
        pull.total_bytes.div_ceil(1 << 20)
    )
}

/// The loss `carve jobs` shows: the last attempt's final loss, or its latest progress's
/// while it runs; `-` when there is none.
pub fn last_loss_text(job: &v1::Job) -> String {
    let loss = job.attempts.last().and_then(|attempt| {
        attempt.final_loss.or_else(|| {
            attempt
                .progress
                .as_ref()
                .filter(|_| is_running(attempt))
                .map(|progress| progress.loss)
        })
    });
    loss_text(loss)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> prost_types::Timestamp {
        prost_types::Timestamp { seconds, nanos: 0 }
    }

    /// Attempt `number`, started at second 1,000, now `outcome`.
    fn started(number: u32, outcome: v1::AttemptOutcome) -> v1::Attempt {
        v1::Attempt {
            number,
            outcome: outcome as i32,
            started_at: Some(at(1_000)),
            ..v1::Attempt::default()
        }
    }

    /// The attempt's row at second `now` from its elapsed time on, and a job of it.
    fn shown_at(attempt: v1::Attempt, now: i64) -> (Vec<String>, v1::Job) {
        let row = results_row(&attempt, &at(now))[2..].to_vec();
        let job = v1::Job {
            attempts: vec![attempt],
            ..v1::Job::default()
        };
        (row, job)
    }

    #[test]
    fn an_ended_attempt_shows_its_stored_results() {
        let attempt = v1::Attempt {
            finished_at: Some(at(1_062)),
            final_loss: Some(0.12345),
            test_accuracy: Some(0.9123),
            steps_done: Some(500),
            samples_per_second: Some(1234.4),
            ..started(2, v1::AttemptOutcome::Succeeded)
        };
        let (row, job) = shown_at(attempt, 5_000);
        assert_eq!(row, ["1m02s", "500", "0.1235", "91.23%", "1234", "-"]);
        assert_eq!(last_loss_text(&job), "0.1235");
        assert_eq!(progress_text(&job), None);
    }

    #[test]
    fn a_placed_attempt_pulling_its_image_shows_the_pull() {
        let attempt = v1::Attempt {
            image_pull: Some(v1::ImagePull {
                image: "registry.example.org/team/train:2.5".into(),
                done_bytes: 300 << 20,
                total_bytes: (1 << 30) + 1,
            }),
            ..started(2, v1::AttemptOutcome::Running)
        };
        let job = v1::Job {
            attempts: vec![attempt],
            ..v1::Job::default()
        };
        assert_eq!(
            progress_text(&job).unwrap(),
            "attempt 2: pulling image registry.example.org/team/train:2.5 (300 of 1025 MiB)"
        );
    }

    #[test]
    fn a_running_attempt_shows_its_latest_progress() {
        let attempt = v1::Attempt {
            progress: Some(v1::TrainingProgress {
                step: 120,
                total_steps: 500,
                loss: 0.5,
                samples_per_second: 64.0,
                seconds_left: Some(195.0),
                ..v1::TrainingProgress::default()
            }),
            ..started(1, v1::AttemptOutcome::Running)
        };
        let (row, job) = shown_at(attempt, 1_030);
        assert_eq!(row, ["30s", "120/500", "0.5000", "-", "64", "-"]);
        assert_eq!(last_loss_text(&job), "0.5000");
        let text = progress_text(&job).unwrap();
        assert!(
            text.starts_with("attempt 1: step 120/500 (24%), loss 0.5000, elapsed "),
            "{text}"
        );
        assert!(text.ends_with(", ETA 3m15s"), "{text}");
    }

    #[test]
    fn a_command_jobs_results_show_like_a_model_jobs() {
        let metric = |name: &str, value| v1::Metric {
            name: name.into(),
            value,
        };
        let attempt = v1::Attempt {
            finished_at: Some(at(1_012)),
            final_loss: Some(0.25),
            test_accuracy: Some(0.931),
            steps_done: Some(40),
            command_argv: vec!["python3".into(), "train.py".into()],
            metrics: vec![metric("val_loss", 0.41), metric("top5", 0.99)],
            ..started(1, v1::AttemptOutcome::Succeeded)
        };
        let (row, job) = shown_at(attempt, 5_000);
        assert_eq!(
            row,
            [
                "12s",
                "40",
                "0.2500",
                "93.10%",
                "-",
                "val_loss 0.4100, top5 0.9900"
            ]
        );
        assert_eq!(last_loss_text(&job), "0.2500");
        assert_eq!(metrics_text(&[]), "-");
        assert_eq!(
            last_results_text(&job),
            "accuracy 93.10%, val_loss 0.4100, top5 0.9900"
        );
        assert_eq!(last_results_text(&v1::Job::default()), "-");
    }

    #[test]
    fn a_command_jobs_eta_waits_for_its_workers_pace() {
        let progress = |seconds_left| v1::TrainingProgress {
            step: 1,
            total_steps: 12,
            seconds_left,
            ..v1::TrainingProgress::default()
        };
        let running = |progress| v1::Job {
            attempts: vec![v1::Attempt {
                progress: Some(progress),
                command_argv: vec!["python3".into()],
                ..started(1, v1::AttemptOutcome::Running)
            }],
            ..v1::Job::default()
        };
        // Step 1 after a long start-up: no pace yet, so no ETA (not "ETA 57s").
        let text = progress_text(&running(progress(None))).unwrap();
        assert!(!text.contains("ETA"), "{text}");
        let text = progress_text(&running(progress(Some(11.0)))).unwrap();
        assert!(text.ends_with(", ETA 11s"), "{text}");
    }
}
