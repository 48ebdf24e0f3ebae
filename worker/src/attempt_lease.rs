//! An engine attempt process's own lease, renewed by its worker: the last link of the
//! chain scheduler -> worker -> attempt process, so an attempt stops before the
//! scheduler can give its job to another worker even when its worker cannot stop it.
//!
//! A worker frozen by SIGSTOP (or stalled some other way) neither heartbeats nor stops
//! its attempts, but its attempt processes run on: they are in their own process groups
//! and their parent is still alive. The worker therefore hands each engine attempt the
//! time left until its own stop deadline ([`crate::leader_lease`]): at start
//! (`--worker-lease-ms`) and on the process's stdin (`lease-ms N` lines) each time a
//! leader hears the worker. A process whose deadline passes stops as on SIGTERM (after
//! the step under way, with a checkpoint, exit 143), and one still running a grace
//! period later exits at once (exit 4, its worker gone) without finishing the step.
//! Nothing is written while the worker is frozen, so the deadline is never moved on a
//! frozen worker's behalf.
//!
//! Command jobs' programs are the user's own and take no such lease: a frozen worker's
//! command attempts run on until it wakes (its own stop then comes at once).

use std::io::BufRead;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::process::ChildStdin;
use tokio::sync::watch;

use crate::child_protocol::WORKER_GONE_EXIT_CODE;

/// The start of a renewal line on the attempt process's stdin: the milliseconds left.
pub const RENEWAL_PREFIX: &str = "lease-ms ";

/// What the attempt process does at `now` with its lease running to `deadline` and
/// `grace` after it to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseCheck {
    /// The lease runs.
    Held,
    /// Past the deadline: stop after the step under way, with a checkpoint.
    Stop,
    /// Past the deadline and the grace: exit now.
    Exit,
}

/// The decision, as a pure function of the moments.
pub fn check_lease(now: Instant, deadline: Instant, grace: Duration) -> LeaseCheck {
    if now < deadline {
        LeaseCheck::Held
    } else if now < deadline + grace {
        LeaseCheck::Stop
    } else {
        LeaseCheck::Exit
    }
}

/// The milliseconds a renewal line gives; `None` for any other line.
pub fn parse_renewal(line: &str) -> Option<Duration> {
    line.trim_end()
        .strip_prefix(RENEWAL_PREFIX)?
        .parse::<u64>()
        .ok()
        .map(Duration::from_millis)
}

/// The renewal line for `left`.
pub fn renewal_line(left: Duration) -> String {
    format!("{RENEWAL_PREFIX}{}\n", left.as_millis())
}

/// The attempt process's side: holds the lease `left` from now, renewed by lines on
/// stdin, and raises `stop` (the flag SIGTERM raises) at its deadline; exits the process
/// `grace` later. Two threads, for as long as the process lives.
pub fn hold_the_lease(left: Duration, grace: Duration, stop: Arc<AtomicBool>) {
    let deadline = Arc::new(Mutex::new(Instant::now() + left));
    let renewed = deadline.clone();
    let _ = std::thread::Builder::new()
        .name("lease-renewals".into())
        .spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { return };
                if let Some(left) = parse_renewal(&line) {
                    *renewed
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner()) = Instant::now() + left;
                }
            }
            // End of stdin: the worker is gone or closed it; the deadline stays.
        });
    let _ = std::thread::Builder::new()
        .name("lease-check".into())
        .spawn(move || {
            let mut told = false;
            loop {
                std::thread::sleep(Duration::from_millis(50));
                let deadline = *deadline
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                match check_lease(Instant::now(), deadline, grace) {
                    LeaseCheck::Held => told = false,
                    LeaseCheck::Stop => {
                        if !told {
                            eprintln!(
                                "stopping: the worker did not renew this attempt's lease \
                                 (no scheduler leader heard it for half its lease); \
                                 checkpointing after the step under way"
                            );
                            told = true;
                        }
                        stop.store(true, Ordering::Release);
                    }
                    LeaseCheck::Exit => {
                        eprintln!(
                            "stopping now: the lease ran out {grace:?} ago and the step \
                             under way has not ended"
                        );
                        std::process::exit(WORKER_GONE_EXIT_CODE);
                    }
                }
            }
        });
}

/// The worker's side: writes the time left until `deadlines`' deadline to the attempt
/// process's stdin each time it moves, until the process or the worker's lease ends.
pub async fn renew_attempt_lease(
    mut stdin: ChildStdin,
    mut deadlines: watch::Receiver<Option<Instant>>,
) {
    loop {
        let deadline = *deadlines.borrow_and_update();
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = renewal_line(left);
            if stdin.write_all(line.as_bytes()).await.is_err() || stdin.flush().await.is_err() {
                return;
            }
        }
        if deadlines.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{LeaseCheck, check_lease, parse_renewal, renewal_line};

    #[test]
    fn the_process_stops_at_its_deadline_and_exits_a_grace_later() {
        let deadline = Instant::now() + Duration::from_secs(10);
        let grace = Duration::from_secs(5);
        let at = |seconds: u64| deadline - Duration::from_secs(10) + Duration::from_secs(seconds);
        assert_eq!(check_lease(at(9), deadline, grace), LeaseCheck::Held);
        assert_eq!(check_lease(at(10), deadline, grace), LeaseCheck::Stop);
        assert_eq!(check_lease(at(14), deadline, grace), LeaseCheck::Stop);
        assert_eq!(check_lease(at(15), deadline, grace), LeaseCheck::Exit);
    }

    #[test]
    fn renewal_lines_round_trip_and_nothing_else_renews() {
        assert_eq!(
            parse_renewal(&renewal_line(Duration::from_millis(1500))),
            Some(Duration::from_millis(1500))
        );
        for other in [
            "",
            "lease-ms",
            "lease-ms -5",
            "lease-ms 1e9",
            "renew 100",
            "lease-ms 5 6",
        ] {
            assert_eq!(parse_renewal(other), None, "{other:?}");
        }
    }
}
