//! How an attempt process that has exited ended, as the scheduler hears it: its final
//! line and exit status, or why it stopped, classified into succeeded, out of memory,
//! cancelled, failed or interrupted (the rules are in the parent module's docs).

use std::process::ExitStatus;

use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use rustix::process::Signal;

use super::{Observed, WorkerStop};
use crate::child_protocol::{
    ChildLine, OUT_OF_MEMORY_EXIT_CODE, STOPPED_ON_SIGTERM_EXIT_CODE, WORKER_GONE_EXIT_CODE,
};

/// How an attempt ended, as the scheduler hears it.
pub fn final_reports(
    attempt: &v1::AttemptRef,
    exit_status: std::io::Result<ExitStatus>,
    final_line: Option<ChildLine>,
    worker_stop: Option<WorkerStop>,
    observed: Observed,
    stderr_tail: &[String],
) -> Vec<Body> {
    let measured_peak_bytes = observed.peak_bytes;
    // Ended early, an attempt says how far its progress lines got; the mean throughput
    // is only known from a finished line.
    let finished = |outcome: v1::AttemptOutcome, peak: u64, message: String| {
        v1::worker_message::AttemptFinished {
            attempt: Some(attempt.clone()),
            outcome: outcome as i32,
            final_loss: None,
            test_accuracy: None,
            measured_peak_bytes: peak,
            message,
            steps_done: observed.steps,
            samples_per_second: None,
            profile_points: Vec::new(),
            metrics: Vec::new(),
        }
    };
    let exit_code = exit_status.as_ref().ok().and_then(|status| status.code());
    match (worker_stop, final_line, exit_code) {
        // A stopped attempt that still finished training in time did finish.
        (
            _,
            Some(ChildLine::Finished {
                final_loss,
                test_accuracy,
                peak_bytes,
                steps,
                samples_per_second,
            }),
            Some(0),
        ) => vec![Body::AttemptFinished(v1::worker_message::AttemptFinished {
            final_loss: final_loss.is_finite().then_some(final_loss),
            test_accuracy: test_accuracy.filter(|accuracy| accuracy.is_finite()),
            // 0 is what a line of an older attempt process reads as: unknown.
            steps_done: (steps > 0).then_some(steps).or(observed.steps),
            samples_per_second: (samples_per_second.is_finite() && samples_per_second > 0.0)
                .then_some(samples_per_second),
            ..finished(
                v1::AttemptOutcome::Succeeded,
                peak_bytes.max(measured_peak_bytes),
                String::new(),
            )
        })],
        (Some(stop), _, _) => {
            let (outcome, reason) = stop.outcome_and_reason();
            vec![Body::AttemptFinished(finished(
                outcome,
                measured_peak_bytes,
                reason,
            ))]
        }
        (
            None,
            Some(ChildLine::Oom {
                requested_bytes,
                in_use_bytes,
                limit_bytes,
                largest_free_bytes,
                peak_bytes,
                checkpoint,
            }),
            Some(OUT_OF_MEMORY_EXIT_CODE),
        ) => vec![
            Body::Oom(v1::worker_message::OomReport {
                attempt: Some(attempt.clone()),
                report: Some(v1::OutOfMemoryReport {
                    requested_bytes,
                    in_use_bytes,
                    limit_bytes,
                    largest_free_bytes,
                    peak_bytes,
                }),
                checkpoint: checkpoint.map(|checkpoint| v1::Checkpoint {
                    step: checkpoint.step,
                    location: checkpoint.location,
                }),
                detected_by: carve_core::command::oom::OomSource::Allocator
                    .name()
                    .to_string(),
                evidence: String::new(),
            }),
            // The protocol's closing message; the scheduler already settled the attempt
            // on the report and only acknowledges it.
            Body::AttemptFinished(finished(
                v1::AttemptOutcome::OutOfMemory,
                peak_bytes.max(measured_peak_bytes),
                String::new(),
            )),
        ],
        (None, _, _) => {
            let (outcome, mut message) =
                classify_unreported_end(&exit_status, observed.host_memory_limit_reached);
            if !stderr_tail.is_empty() {
                message.push_str("; last lines of its stderr:\n");
                message.push_str(&stderr_tail.join("\n"));
            }
            vec![Body::AttemptFinished(finished(
                outcome,
                measured_peak_bytes,
                message,
            ))]
        }
    }
}

/// Why an attempt process the worker did not stop ended without its final line, and
/// whose fault that was. Killed by a signal from outside (the kernel's OOM killer, an
/// operator, a node agent) or gone without an exit status is INTERRUPTED: the program
/// did nothing wrong, and the scheduler retries it from its checkpoint. A fault signal
/// the program raised on itself (a segfault, an abort, an illegal instruction) and any
/// exit code are the program's own FAILED: retrying would repeat them.
fn classify_unreported_end(
    exit_status: &std::io::Result<ExitStatus>,
    host_memory_limit_reached: Option<u64>,
) -> (v1::AttemptOutcome, String) {
    use std::os::unix::process::ExitStatusExt;
    let status = match exit_status {
        Ok(status) => status,
        Err(error) => {
            return (
                v1::AttemptOutcome::Interrupted,
                format!("the attempt process vanished: it cannot be waited for ({error})"),
            );
        }
    };
    if let (Some(limit), Some(signal)) = (host_memory_limit_reached, status.signal())
        && signal == Signal::KILL.as_raw()
    {
        // The kernel's OOM killer: killed again at every retry, so the job's own failure.
        return (
            v1::AttemptOutcome::Failed,
            format!(
                "the attempt process was killed by the kernel (SIGKILL): its container \
                 reached its host memory limit of {} (the worker's --attempt-memory)",
                carve_core::bytes::HumanBytes(limit)
            ),
        );
    }
    if let Some(signal) = status.signal() {
        let name = signal_name(signal);
        return if is_fault_signal(signal) {
            (
                v1::AttemptOutcome::Failed,
                format!(
                    "the attempt process ended without a result: it crashed with signal \
                     {signal} ({name})"
                ),
            )
        } else {
            (
                v1::AttemptOutcome::Interrupted,
                format!(
                    "the attempt process was killed by signal {signal} ({name}), which the \
                     worker did not send"
                ),
            )
        };
    }
    if status.code() == Some(STOPPED_ON_SIGTERM_EXIT_CODE) {
        return (
            v1::AttemptOutcome::Interrupted,
            "the attempt process was sent SIGTERM, which the worker did not send: it \
             checkpointed and stopped"
                .to_string(),
        );
    }
    if status.code() == Some(WORKER_GONE_EXIT_CODE) {
        return (
            v1::AttemptOutcome::Interrupted,
            format!(
                "the attempt process lost its worker (its stdout closed or its parent \
                 changed) and stopped ({status})"
            ),
        );
    }
    (
        v1::AttemptOutcome::Failed,
        format!("the attempt process ended without a result ({status})"),
    )
}

/// Signals the kernel raises on a process for its own fault.
fn is_fault_signal(signal: i32) -> bool {
    [
        Signal::SEGV,
        Signal::BUS,
        Signal::ILL,
        Signal::FPE,
        Signal::ABORT,
        Signal::SYS,
        Signal::TRAP,
    ]
    .iter()
    .any(|fault| fault.as_raw() == signal)
}

/// The usual name of a signal number, for failure messages.
fn signal_name(signal: i32) -> &'static str {
    const NAMES: [(Signal, &str); 17] = [
        (Signal::HUP, "SIGHUP"),
        (Signal::INT, "SIGINT"),
        (Signal::QUIT, "SIGQUIT"),
        (Signal::ILL, "SIGILL"),
        (Signal::TRAP, "SIGTRAP"),
        (Signal::ABORT, "SIGABRT"),
        (Signal::BUS, "SIGBUS"),
        (Signal::FPE, "SIGFPE"),
        (Signal::KILL, "SIGKILL"),
        (Signal::USR1, "SIGUSR1"),
        (Signal::SEGV, "SIGSEGV"),
        (Signal::USR2, "SIGUSR2"),
        (Signal::PIPE, "SIGPIPE"),
        (Signal::ALARM, "SIGALRM"),
        (Signal::TERM, "SIGTERM"),
        (Signal::XCPU, "SIGXCPU"),
        (Signal::SYS, "SIGSYS"),
    ];
    NAMES
        .iter()
        .find(|(known, _)| known.as_raw() == signal)
        .map_or("an unnamed signal", |(_, name)| name)
}
