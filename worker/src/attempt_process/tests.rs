//! The worker's side of an attempt: how its end is reported (outcomes, messages,
//! results), how its output is leveled, which process groups are never signalled, and
//! that an attempt without a container says so.

use super::*;
use crate::child_protocol::{OUT_OF_MEMORY_EXIT_CODE, WORKER_GONE_EXIT_CODE};
use std::os::unix::process::ExitStatusExt;

fn attempt() -> v1::AttemptRef {
    v1::AttemptRef {
        job_id: "job-1".into(),
        attempt_number: 1,
        lease_epoch: 1,
        gang_rank: None,
    }
}

fn outcome(body: &Body) -> v1::AttemptOutcome {
    match body {
        Body::AttemptFinished(finished) => v1::AttemptOutcome::try_from(finished.outcome).unwrap(),
        other => panic!("not a finish: {other:?}"),
    }
}

#[test]
fn an_oom_line_without_its_exit_code_is_a_crash_not_an_oom() {
    let oom = ChildLine::Oom {
        requested_bytes: 10,
        in_use_bytes: 5,
        limit_bytes: 12,
        largest_free_bytes: 7,
        peak_bytes: 5,
        checkpoint: None,
    };
    let killed = final_reports(
        &attempt(),
        Ok(ExitStatus::from_raw(9)),
        Some(oom.clone()),
        None,
        Observed::default(),
        &["boom".into()],
    );
    assert_eq!(killed.len(), 1);
    assert_eq!(outcome(&killed[0]), v1::AttemptOutcome::Interrupted);
    let Body::AttemptFinished(finished) = &killed[0] else {
        unreachable!()
    };
    assert!(
        finished
            .message
            .contains("killed by signal 9 (SIGKILL), which the worker did not send"),
        "{}",
        finished.message
    );
    assert!(finished.message.contains("boom"), "{}", finished.message);

    let out_of_memory = final_reports(
        &attempt(),
        Ok(ExitStatus::from_raw(OUT_OF_MEMORY_EXIT_CODE << 8)),
        Some(oom),
        None,
        Observed::default(),
        &[],
    );
    assert!(matches!(out_of_memory[0], Body::Oom(_)));
    assert_eq!(outcome(&out_of_memory[1]), v1::AttemptOutcome::OutOfMemory);
}

fn finish_message(body: &Body) -> &str {
    match body {
        Body::AttemptFinished(finished) => &finished.message,
        other => panic!("not a finish: {other:?}"),
    }
}

/// The one report for a process that ended with `status` and no final line.
fn unreported_end(status: std::io::Result<ExitStatus>) -> (v1::AttemptOutcome, String) {
    let observed = Observed {
        peak_bytes: 7,
        steps: None,
        host_memory_limit_reached: None,
    };
    let reports = final_reports(
        &attempt(),
        status,
        None,
        None,
        observed,
        &["last words".into()],
    );
    assert_eq!(reports.len(), 1);
    let message = finish_message(&reports[0]).to_string();
    assert!(
        message.ends_with("last lines of its stderr:\nlast words"),
        "{message}"
    );
    (outcome(&reports[0]), message)
}

#[test]
fn a_signal_from_outside_interrupts_and_the_program_s_own_end_fails() {
    for (signal, name) in [
        (9, "SIGKILL"),
        (15, "SIGTERM"),
        (1, "SIGHUP"),
        (13, "SIGPIPE"),
    ] {
        let (outcome, message) = unreported_end(Ok(ExitStatus::from_raw(signal)));
        assert_eq!(outcome, v1::AttemptOutcome::Interrupted, "{message}");
        assert!(
            message.contains(&format!("killed by signal {signal} ({name})")),
            "{message}"
        );
    }
    // Faults the program raised on itself would repeat on every retry.
    for (signal, name) in [
        (11, "SIGSEGV"),
        (6, "SIGABRT"),
        (4, "SIGILL"),
        (7, "SIGBUS"),
    ] {
        let (outcome, message) = unreported_end(Ok(ExitStatus::from_raw(signal)));
        assert_eq!(outcome, v1::AttemptOutcome::Failed, "{message}");
        assert!(
            message.contains(&format!("crashed with signal {signal} ({name})")),
            "{message}"
        );
    }
    // An exit code is the program's own word: failed, even 0 without its result.
    for code in [1, 0, 101] {
        let (outcome, message) = unreported_end(Ok(ExitStatus::from_raw(code << 8)));
        assert_eq!(outcome, v1::AttemptOutcome::Failed, "{message}");
        assert!(message.contains("ended without a result"), "{message}");
    }
    let (outcome, message) = unreported_end(Ok(ExitStatus::from_raw(WORKER_GONE_EXIT_CODE << 8)));
    assert_eq!(outcome, v1::AttemptOutcome::Interrupted, "{message}");
    assert!(message.contains("lost its worker"), "{message}");
    // Reaped by someone else: the process vanished.
    let (outcome, message) = unreported_end(Err(std::io::Error::from_raw_os_error(10)));
    assert_eq!(outcome, v1::AttemptOutcome::Interrupted, "{message}");
    assert!(message.contains("vanished"), "{message}");
}

#[test]
fn a_signal_the_worker_sent_is_a_cancel_not_an_interruption() {
    let reports = final_reports(
        &attempt(),
        Ok(ExitStatus::from_raw(9)),
        None,
        Some(WorkerStop::Cancelled("the worker is shutting down".into())),
        Observed::default(),
        &[],
    );
    assert_eq!(outcome(&reports[0]), v1::AttemptOutcome::Cancelled);
}

#[test]
fn group_ids_that_would_reach_other_processes_are_never_signalled() {
    for group in [0, 1, u32::MAX] {
        assert!(
            signal_process_group(group, Signal::KILL).is_err(),
            "{group}"
        );
    }
}

#[test]
fn a_stopped_attempt_is_cancelled_or_failed_with_its_reason() {
    for (stop, expected) in [
        (
            WorkerStop::Cancelled("cancelled by alice".into()),
            v1::AttemptOutcome::Cancelled,
        ),
        // The watchdog's stop: the stderr tail is not the story, the reason is.
        (
            WorkerStop::Failed("over its slice".into()),
            v1::AttemptOutcome::Failed,
        ),
    ] {
        let (_, reason) = stop.clone().outcome_and_reason();
        let reports = final_reports(
            &attempt(),
            Ok(ExitStatus::from_raw(15)),
            None,
            Some(stop),
            Observed {
                peak_bytes: 42,
                steps: Some(30),
                host_memory_limit_reached: None,
            },
            &["ignored".into()],
        );
        let Body::AttemptFinished(finished) = &reports[0] else {
            unreachable!()
        };
        assert_eq!(reports.len(), 1);
        assert_eq!(outcome(&reports[0]), expected);
        assert_eq!(finished.message, reason);
        assert_eq!(finished.measured_peak_bytes, 42);
        assert_eq!(finished.steps_done, Some(30));
    }
}

#[test]
fn a_finished_attempt_reports_its_results() {
    let line = ChildLine::Finished {
        final_loss: 0.25,
        test_accuracy: Some(0.9),
        peak_bytes: 5,
        steps: 500,
        samples_per_second: 1200.0,
    };
    let observed = Observed {
        peak_bytes: 9,
        steps: Some(490),
        host_memory_limit_reached: None,
    };
    let reports = final_reports(
        &attempt(),
        Ok(ExitStatus::from_raw(0)),
        Some(line),
        None,
        observed,
        &[],
    );
    let Body::AttemptFinished(finished) = &reports[0] else {
        unreachable!()
    };
    assert_eq!(outcome(&reports[0]), v1::AttemptOutcome::Succeeded);
    assert_eq!(
        (finished.final_loss, finished.test_accuracy),
        (Some(0.25), Some(0.9))
    );
    assert_eq!(
        (finished.steps_done, finished.samples_per_second),
        (Some(500), Some(1200.0))
    );
    assert_eq!(finished.measured_peak_bytes, 9);
}

#[test]
fn output_lines_get_the_level_their_words_say() {
    assert_eq!(output_level("UserWarning: lr is high"), "warn");
    assert_eq!(output_level("RuntimeError: CUDA error"), "error");
    assert_eq!(output_level("Traceback (most recent call last):"), "error");
    assert_eq!(output_level("epoch 1: loss 0.5"), "info");
}

#[tokio::test]
async fn an_engine_attempt_without_a_container_says_so_at_its_start() {
    // An attempt process as the engine's: it says it started, then ends.
    let child = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(r#"echo '{"type":"started","reserved_bytes":5,"pid":9}'"#)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let (reports, mut sent) = mpsc::unbounded_channel();
    let (_control, control) = mpsc::unbounded_channel();
    tokio::time::timeout(
        Duration::from_secs(20),
        watch_attempt_process(child, None, attempt(), reports, control, || {}),
    )
    .await
    .expect("the attempt process ended");
    let bodies: Vec<Body> = std::iter::from_fn(|| sent.try_recv().ok()).collect();
    let Some(Body::AttemptStarted(started)) = bodies.first() else {
        panic!("no start first: {bodies:?}")
    };
    assert!(started.uncontained, "{started:?}");
    assert_eq!(started.reserved_bytes, 5);
    // The same warning a command job's uncontained attempt logs, right after its start.
    assert_eq!(bodies.get(1), Some(&uncontained_log_line(&attempt())));
    let Some(Body::Log(line)) = bodies.get(1) else {
        unreachable!()
    };
    assert_eq!(
        (line.level.as_str(), line.message.as_str()),
        ("warn", UNCONTAINED_WARNING)
    );
}

#[test]
fn a_contained_engine_attempt_s_start_says_nothing_of_it() {
    let line = ChildLine::Started {
        reserved_bytes: 5,
        pid: 9,
        resumed_from: None,
    };
    let Some(Body::AttemptStarted(contained)) = report_for_line(&attempt(), &line, false) else {
        panic!("not a start")
    };
    assert!(!contained.uncontained);
    let Some(Body::AttemptStarted(uncontained)) = report_for_line(&attempt(), &line, true) else {
        panic!("not a start")
    };
    assert!(uncontained.uncontained);
}

/// The kernel's OOM killer in a container at its host memory limit is the job's own
/// failure, not an interruption: retried, it would be killed again, forever.
#[test]
fn a_process_killed_at_its_container_s_memory_limit_fails() {
    let reports = final_reports(
        &attempt(),
        Ok(ExitStatus::from_raw(9)),
        None,
        None,
        Observed {
            host_memory_limit_reached: Some(256 << 20),
            ..Observed::default()
        },
        &[],
    );
    let [Body::AttemptFinished(finished)] = reports.as_slice() else {
        panic!("one finish: {reports:?}");
    };
    assert_eq!(finished.outcome, v1::AttemptOutcome::Failed as i32);
    assert!(
        finished.message.contains("host memory limit of 256 MiB"),
        "{}",
        finished.message
    );
    // The same SIGKILL without the limit reached came from outside: interrupted.
    let (outcome, _) = unreported_end(Ok(ExitStatus::from_raw(9)));
    assert_eq!(outcome, v1::AttemptOutcome::Interrupted);
}
