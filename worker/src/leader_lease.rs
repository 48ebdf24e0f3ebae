//! The worker's own count of its lease: how long since a leader last heard it, and what
//! the worker does when none has for too long.
//!
//! The scheduler declares a worker lost `lease_duration` after the last heartbeat it
//! received, and then gives the worker's attempts to others. A worker cut off from every
//! leader (partitioned, or holding a session with a leader that froze) must stop its
//! attempts before that moment, or a job runs twice. The worker cannot see the
//! scheduler's clock, so it counts from a moment that is never later than the
//! scheduler's: the time it *sent* the last heartbeat a leader answered
//! (`HeartbeatAck`, which a scheduler sends only while it leads and before its own
//! self-fence), or the hello of a session that a leader answered. From there:
//!
//! - after [`answer_deadline`] with no answer the session itself is given up (the
//!   acknowledgement deadline): the worker reconnects, to another replica if need be;
//! - after [`stop_after`] (half the lease) its attempts are stopped as a preemption
//!   stops them (SIGTERM, the engine checkpoints the step under way), and end
//!   `INTERRUPTED`; the reports wait for the next session, and the scheduler retries
//!   the jobs from their recorded checkpoints;
//! - [`stop_grace`] (a quarter lease) later they are killed, still a quarter lease
//!   before the scheduler could give them away.
//!
//! An engine attempt process counts the same deadline itself ([`crate::attempt_lease`]):
//! a worker that is frozen (SIGSTOP) cannot stop anything, but its attempt processes
//! stop on their own when the worker stops renewing their lease.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use carve_proto::v1;
use tokio::sync::{mpsc, watch};

use crate::attempt_process::AttemptControl;

/// Heartbeats remembered per session for matching answers; older ones are forgotten
/// (an answer to one of them would be older than a later answer anyway).
const REMEMBERED_HEARTBEATS: usize = 64;

/// How long without a leader's word a worker keeps its attempts running: half its lease.
pub fn stop_after(lease: Duration) -> Duration {
    lease / 2
}

/// How long a stopped attempt has to checkpoint before it is killed: a quarter lease,
/// so the kill comes a quarter lease before the scheduler could place the job again.
pub fn stop_grace(lease: Duration) -> Duration {
    lease / 4
}

/// How long a session may go without any answer to its heartbeats before the worker
/// gives it up and reconnects: three heartbeat intervals, never more than a quarter
/// lease (so a session with a frozen leader ends well before the attempts stop), never
/// under a second.
pub fn answer_deadline(heartbeat_interval: Duration, lease: Duration) -> Duration {
    (heartbeat_interval * 3)
        .min(lease / 4)
        .max(Duration::from_secs(1))
}

/// The worker's lease as the worker counts it.
#[derive(Debug, Default)]
struct LeaseState {
    /// The scheduler's lease, from the last registration; `None` before the first.
    lease: Option<Duration>,
    /// The latest moment a leader is known to have heard this worker (a send time).
    heard_at: Option<Instant>,
    /// This session's heartbeats not answered yet: sequence and send time.
    heartbeats: VecDeque<(u64, Instant)>,
    /// When this session's hello was sent; taken as heard when the first answer of any
    /// kind comes on the session.
    hello_sent_at: Option<Instant>,
}

/// Shared by the session loop (which feeds it), the stopper and every engine attempt's
/// lease renewals (which read its deadline).
#[derive(Debug)]
pub struct LeaderLease {
    state: Mutex<LeaseState>,
    /// When the attempts are to stop, as it moves; `None` until the first registration.
    stop_deadline: watch::Sender<Option<Instant>>,
}

impl Default for LeaderLease {
    fn default() -> Self {
        LeaderLease {
            state: Mutex::default(),
            stop_deadline: watch::Sender::new(None),
        }
    }
}

impl LeaderLease {
    pub fn new() -> Arc<LeaderLease> {
        Arc::new(LeaderLease::default())
    }

    fn state(&self) -> MutexGuard<'_, LeaseState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A registration told the lease's length; a new session begins with its hello sent
    /// at `hello_sent_at`.
    pub fn session_began(&self, lease: Duration, hello_sent_at: Instant) {
        let mut state = self.state();
        state.lease = Some(lease);
        state.heartbeats.clear();
        state.hello_sent_at = Some(hello_sent_at);
        // A worker's first session: nothing runs yet, and its attempts' deadline starts
        // with the hello.
        if state.heard_at.is_none() {
            state.heard_at = Some(hello_sent_at);
        }
        self.publish(&state);
    }

    /// A heartbeat of this session went out at `sent_at`.
    pub fn heartbeat_sent(&self, sequence: u64, sent_at: Instant) {
        let mut state = self.state();
        if state.heartbeats.len() == REMEMBERED_HEARTBEATS {
            state.heartbeats.pop_front();
        }
        state.heartbeats.push_back((sequence, sent_at));
    }

    /// The session's leader answered something: it heard the hello.
    pub fn session_answered(&self) {
        let mut state = self.state();
        if let Some(hello) = state.hello_sent_at.take() {
            state.heard_at = state.heard_at.max(Some(hello));
            self.publish(&state);
        }
    }

    /// The leader answered heartbeat `sequence`: it heard the worker at its send time.
    pub fn heartbeat_answered(&self, sequence: u64) {
        let mut state = self.state();
        let sent_at = state
            .heartbeats
            .iter()
            .find(|(sent, _)| *sent == sequence)
            .map(|(_, at)| *at);
        state.heartbeats.retain(|(sent, _)| *sent > sequence);
        if let Some(sent_at) = sent_at {
            state.hello_sent_at = None;
            state.heard_at = state.heard_at.max(Some(sent_at));
            self.publish(&state);
        }
    }

    /// When the worker's attempts stop unless a leader hears it first; `None` before
    /// the first registration.
    pub fn stop_deadline(&self) -> Option<Instant> {
        *self.stop_deadline.borrow()
    }

    /// The deadline as it moves (each engine attempt's renewals follow it).
    pub fn watch_stop_deadline(&self) -> watch::Receiver<Option<Instant>> {
        self.stop_deadline.subscribe()
    }

    /// The lease's length, once a registration told it.
    pub fn lease(&self) -> Option<Duration> {
        self.state().lease
    }

    /// When the session that began at `session_began_at` is given up without an answer
    /// from its leader: [`answer_deadline`] after the last time a leader heard the worker
    /// or the session began, whichever is later.
    pub fn answer_overdue_at(
        &self,
        session_began_at: Instant,
        heartbeat_interval: Duration,
    ) -> Option<Instant> {
        let state = self.state();
        let lease = state.lease?;
        let since = state
            .heard_at
            .map_or(session_began_at, |heard| heard.max(session_began_at));
        Some(since + answer_deadline(heartbeat_interval, lease))
    }

    fn publish(&self, state: &LeaseState) {
        let deadline = state
            .lease
            .zip(state.heard_at)
            .map(|(lease, heard)| heard + stop_after(lease));
        self.stop_deadline.send_if_modified(|current| {
            let changed = *current != deadline;
            *current = deadline;
            changed
        });
    }
}

/// An attempt the stopper may stop: its reference and its control channel.
pub type StoppableAttempt = (v1::AttemptRef, mpsc::UnboundedSender<AttemptControl>);

/// Stops every attempt `running` lists once the lease's stop deadline passes without a
/// leader hearing the worker, and those that start afterwards, until a leader hears it
/// again; runs for as long as the worker does. Each attempt is told once.
pub async fn stop_attempts_without_a_leader(
    lease: Arc<LeaderLease>,
    running: impl Fn() -> Vec<StoppableAttempt>,
) {
    let mut deadlines = lease.watch_stop_deadline();
    let mut told: Vec<String> = Vec::new();
    loop {
        let deadline = *deadlines.borrow_and_update();
        let due = deadline.filter(|deadline| Instant::now() >= *deadline);
        match (due, lease.lease()) {
            (Some(deadline), Some(length)) => {
                for (attempt, control) in running() {
                    let key = format!("{}/{}", attempt.job_id, attempt.attempt_number);
                    if told.contains(&key) {
                        continue;
                    }
                    let silent_for =
                        Instant::now().saturating_duration_since(deadline) + stop_after(length);
                    tracing::warn!(
                        job = %attempt.job_id,
                        attempt = attempt.attempt_number,
                        ?silent_for,
                        "no leader has heard this worker for half its lease: stopping the attempt"
                    );
                    let _ = control.send(AttemptControl::StopWithoutLeader {
                        grace_period: stop_grace(length),
                        reason: format!(
                            "stopped by its worker: no scheduler leader heard the worker for \
                             {silent_for:.1?}, half its lease of {length:?} (the scheduler \
                             would give the attempt to another worker at the lease's end)"
                        ),
                    });
                    told.push(key);
                }
                // New attempts are told at the next check; a renewal wakes it at once.
                let _ = tokio::time::timeout(Duration::from_millis(250), deadlines.changed()).await;
            }
            (Some(_), None) | (None, _) => {
                told.clear();
                match deadline {
                    Some(deadline) => {
                        tokio::select! {
                            _ = tokio::time::sleep_until(deadline.into()) => {}
                            changed = deadlines.changed() => if changed.is_err() { return },
                        }
                    }
                    None => {
                        if deadlines.changed().await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
