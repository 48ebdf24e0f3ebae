//! The job state machine: which states a job goes through and which events move it.
//!
//! A job is `queued` until the scheduler places it on a GPU slice, `placed` until its
//! worker starts the attempt, `running` while the attempt trains, and ends `succeeded`,
//! `failed` or `cancelled`. An attempt that runs out of memory or whose worker is lost
//! ends the *attempt*, not the job: the job goes back to `queued` (with a smaller
//! configuration after an OOM, from its last checkpoint in both cases) while a retry is
//! possible. Every transition goes through [`next_state`], so the scheduler, its store and
//! its tests agree on one table, and an event that does not apply is an error that names
//! the state and the event instead of a silent no-op.

use std::fmt;

use crate::error::FieldError;

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum JobState {
    /// Waiting for the scheduler to give it a slice.
    Queued,
    /// Assigned a slice on a GPU; the worker has not started the attempt yet.
    Placed,
    /// An attempt is training.
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    /// Every state, in life order.
    pub const ALL: [JobState; 6] = [
        JobState::Queued,
        JobState::Placed,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ];

    /// The lowercase name used in messages, logs and the store.
    pub fn name(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Placed => "placed",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    /// The state with this [`name`](Self::name), if any.
    pub fn from_name(name: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|state| state.name() == name)
    }

    /// A terminal state accepts no further events.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled
        )
    }

    /// Whether the job holds (or is about to hold) a slice on a GPU, i.e. counts against
    /// its tenant's running-jobs and VRAM quotas.
    pub fn holds_slice(self) -> bool {
        matches!(self, JobState::Placed | JobState::Running)
    }
}

/// By [`JobState::name`]: how a stored state is read back.
impl TryFrom<&str> for JobState {
    type Error = FieldError;

    fn try_from(name: &str) -> Result<Self, FieldError> {
        JobState::from_name(name).ok_or_else(|| {
            FieldError::not_one_of(name, "a job state", &JobState::ALL.map(JobState::name))
        })
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

/// How one attempt of a job ended (or that it has not ended yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AttemptOutcome {
    Running,
    Succeeded,
    /// The attempt ran out of its slice's memory; the worker reported the numbers.
    OutOfMemory,
    Failed,
    Cancelled,
    /// The worker stopped heartbeating and lost its lease; the attempt's fate is unknown.
    Lost,
    /// The attempt process died of something outside the program (a signal the worker
    /// did not send, or it vanished): an infrastructure failure, retried like `Lost`.
    Interrupted,
    /// The scheduler stopped the attempt to make room for an urgent job (see
    /// `scheduling::preemption`); the job resumes from its checkpoint. Not a failure of
    /// the job or of its infrastructure, so it counts towards neither retry limit.
    Preempted,
}

impl AttemptOutcome {
    /// Every outcome.
    pub const ALL: [AttemptOutcome; 8] = [
        AttemptOutcome::Running,
        AttemptOutcome::Succeeded,
        AttemptOutcome::OutOfMemory,
        AttemptOutcome::Failed,
        AttemptOutcome::Cancelled,
        AttemptOutcome::Lost,
        AttemptOutcome::Interrupted,
        AttemptOutcome::Preempted,
    ];

    /// The lowercase name used in messages, logs and the store.
    pub fn name(self) -> &'static str {
        match self {
            AttemptOutcome::Running => "running",
            AttemptOutcome::Succeeded => "succeeded",
            AttemptOutcome::OutOfMemory => "out_of_memory",
            AttemptOutcome::Failed => "failed",
            AttemptOutcome::Cancelled => "cancelled",
            AttemptOutcome::Lost => "lost",
            AttemptOutcome::Interrupted => "interrupted",
            AttemptOutcome::Preempted => "preempted",
        }
    }

    /// The outcome with this [`name`](Self::name), if any.
    pub fn from_name(name: &str) -> Option<AttemptOutcome> {
        AttemptOutcome::ALL
            .into_iter()
            .find(|outcome| outcome.name() == name)
    }
}

/// By [`AttemptOutcome::name`]: how a stored outcome is read back.
impl TryFrom<&str> for AttemptOutcome {
    type Error = FieldError;

    fn try_from(name: &str) -> Result<Self, FieldError> {
        AttemptOutcome::from_name(name).ok_or_else(|| {
            let names = AttemptOutcome::ALL.map(AttemptOutcome::name);
            FieldError::not_one_of(name, "an attempt outcome", &names)
        })
    }
}

impl fmt::Display for AttemptOutcome {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

/// Something that happened to a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobEvent {
    /// The scheduler assigned the job a slice.
    Placed,
    /// The worker started the attempt.
    Started,
    AttemptSucceeded,
    /// The attempt ran out of memory. `retry_allowed` is the scheduler's verdict (retry
    /// limit not reached and the shrink planner found a configuration that fits).
    AttemptOutOfMemory {
        retry_allowed: bool,
    },
    AttemptFailed,
    /// The worker lost its lease; the job is requeued and resumes from its checkpoint.
    AttemptLost,
    /// A command job's profile measured its memory: the job is queued again, now sized,
    /// to train.
    ProfileMeasured,
    CancelRequested,
}

impl JobEvent {
    /// The lowercase name used in messages and logs.
    pub fn name(self) -> &'static str {
        match self {
            JobEvent::Placed => "placed",
            JobEvent::Started => "started",
            JobEvent::AttemptSucceeded => "attempt_succeeded",
            JobEvent::AttemptOutOfMemory { .. } => "attempt_out_of_memory",
            JobEvent::AttemptFailed => "attempt_failed",
            JobEvent::AttemptLost => "attempt_lost",
            JobEvent::ProfileMeasured => "profile_measured",
            JobEvent::CancelRequested => "cancel_requested",
        }
    }
}

impl fmt::Display for JobEvent {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

/// An event that does not apply to the job's current state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cannot apply {} to a {} job", event.name(), from.name())]
pub struct InvalidTransition {
    pub from: JobState,
    pub event: JobEvent,
}

/// The state a job in `current` moves to when `event` happens.
///
/// - queued --placed--> placed --started--> running;
/// - placed or running: attempt_succeeded -> succeeded; attempt_failed -> failed;
///   attempt_out_of_memory -> queued when a retry is allowed, else failed;
///   attempt_lost -> queued (requeued, resumes from its checkpoint); profile_measured ->
///   queued (a command job's profile ended; it trains next);
/// - any non-terminal state --cancel_requested--> cancelled;
/// - terminal states accept nothing, and every other pair is an [`InvalidTransition`].
pub fn next_state(current: JobState, event: JobEvent) -> Result<JobState, InvalidTransition> {
    let attempt_in_flight = matches!(current, JobState::Placed | JobState::Running);
    let next = match (current, event) {
        (JobState::Queued, JobEvent::Placed) => Some(JobState::Placed),
        (JobState::Placed, JobEvent::Started) => Some(JobState::Running),
        (_, JobEvent::AttemptSucceeded) if attempt_in_flight => Some(JobState::Succeeded),
        (_, JobEvent::AttemptOutOfMemory { retry_allowed }) if attempt_in_flight => {
            Some(if retry_allowed {
                JobState::Queued
            } else {
                JobState::Failed
            })
        }
        (_, JobEvent::AttemptFailed) if attempt_in_flight => Some(JobState::Failed),
        (_, JobEvent::AttemptLost | JobEvent::ProfileMeasured) if attempt_in_flight => {
            Some(JobState::Queued)
        }
        (_, JobEvent::CancelRequested) if !current.is_terminal() => Some(JobState::Cancelled),
        _ => None,
    };
    next.ok_or(InvalidTransition {
        from: current,
        event,
    })
}

/// How a job the store shows with an attempt in flight (placed or running) moves when
/// none of its attempts is running any more: an attempt's end was stored without the
/// job's move (as code before the two were written in one transaction could leave it),
/// and the job would otherwise wait forever. It moves as its last attempt's end would
/// have moved it where that end decided the job alone: a success succeeds it, a failure
/// fails it, a cancel cancels it. Anything else (an out-of-memory report, a lost,
/// interrupted or preempted attempt, a profile, no attempt at all) sends it back to the
/// queue to run again from its checkpoint, where the usual paths decide again: a
/// retry's configuration comes from the next report, not from a guess here.
pub fn event_for_stranded_job(
    last_attempt: Option<AttemptOutcome>,
    last_was_profile: bool,
) -> JobEvent {
    match last_attempt {
        Some(AttemptOutcome::Succeeded) if !last_was_profile => JobEvent::AttemptSucceeded,
        Some(AttemptOutcome::Failed) => JobEvent::AttemptFailed,
        Some(AttemptOutcome::Cancelled) => JobEvent::CancelRequested,
        _ => JobEvent::AttemptLost,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_EVENTS: [JobEvent; 8] = [
        JobEvent::Placed,
        JobEvent::Started,
        JobEvent::AttemptSucceeded,
        JobEvent::AttemptOutOfMemory {
            retry_allowed: true,
        },
        JobEvent::AttemptOutOfMemory {
            retry_allowed: false,
        },
        JobEvent::AttemptFailed,
        JobEvent::AttemptLost,
        JobEvent::CancelRequested,
    ];

    #[test]
    fn queued_is_placed_then_started() {
        assert_eq!(
            next_state(JobState::Queued, JobEvent::Placed),
            Ok(JobState::Placed)
        );
        assert_eq!(
            next_state(JobState::Placed, JobEvent::Started),
            Ok(JobState::Running)
        );
    }

    #[test]
    fn attempt_outcomes_apply_to_placed_and_running_jobs() {
        for state in [JobState::Placed, JobState::Running] {
            assert_eq!(
                next_state(state, JobEvent::AttemptSucceeded),
                Ok(JobState::Succeeded)
            );
            assert_eq!(
                next_state(state, JobEvent::AttemptFailed),
                Ok(JobState::Failed)
            );
            assert_eq!(
                next_state(
                    state,
                    JobEvent::AttemptOutOfMemory {
                        retry_allowed: true
                    }
                ),
                Ok(JobState::Queued)
            );
            assert_eq!(
                next_state(
                    state,
                    JobEvent::AttemptOutOfMemory {
                        retry_allowed: false
                    }
                ),
                Ok(JobState::Failed)
            );
            assert_eq!(
                next_state(state, JobEvent::AttemptLost),
                Ok(JobState::Queued)
            );
        }
    }

    #[test]
    fn every_non_terminal_state_can_be_cancelled() {
        for state in [JobState::Queued, JobState::Placed, JobState::Running] {
            assert_eq!(
                next_state(state, JobEvent::CancelRequested),
                Ok(JobState::Cancelled)
            );
        }
    }

    #[test]
    fn terminal_states_accept_nothing() {
        for state in [JobState::Succeeded, JobState::Failed, JobState::Cancelled] {
            assert!(state.is_terminal());
            for event in ALL_EVENTS {
                assert_eq!(
                    next_state(state, event),
                    Err(InvalidTransition { from: state, event }),
                    "{state} accepted {event}"
                );
            }
        }
    }

    #[test]
    fn events_out_of_order_are_rejected() {
        let rejected = [
            (JobState::Queued, JobEvent::Started),
            (JobState::Queued, JobEvent::AttemptSucceeded),
            (JobState::Queued, JobEvent::AttemptFailed),
            (JobState::Queued, JobEvent::AttemptLost),
            (
                JobState::Queued,
                JobEvent::AttemptOutOfMemory {
                    retry_allowed: true,
                },
            ),
            (JobState::Placed, JobEvent::Placed),
            (JobState::Running, JobEvent::Placed),
            (JobState::Running, JobEvent::Started),
        ];
        for (state, event) in rejected {
            assert!(
                next_state(state, event).is_err(),
                "{state} accepted {event}"
            );
        }
    }

    #[test]
    fn the_table_has_exactly_the_documented_transitions() {
        let mut accepted = 0;
        for state in JobState::ALL {
            for event in ALL_EVENTS {
                if next_state(state, event).is_ok() {
                    accepted += 1;
                }
            }
        }
        // placed, started, 2 x (succeeded, failed, oom retry, oom final, lost), 3 x cancel.
        assert_eq!(accepted, 1 + 1 + 2 * 5 + 3);
    }

    #[test]
    fn invalid_transition_message_names_event_and_state() {
        let error = next_state(JobState::Queued, JobEvent::AttemptSucceeded).unwrap_err();
        assert_eq!(
            error.to_string(),
            "cannot apply attempt_succeeded to a queued job"
        );
        let error = next_state(JobState::Cancelled, JobEvent::CancelRequested).unwrap_err();
        assert_eq!(
            error.to_string(),
            "cannot apply cancel_requested to a cancelled job"
        );
    }

    #[test]
    fn names_round_trip() {
        for state in JobState::ALL {
            assert_eq!(JobState::from_name(state.name()), Some(state));
            assert_eq!(state.to_string(), state.name());
        }
        for outcome in AttemptOutcome::ALL {
            assert_eq!(AttemptOutcome::from_name(outcome.name()), Some(outcome));
        }
        assert_eq!(AttemptOutcome::OutOfMemory.name(), "out_of_memory");
        assert_eq!(JobState::from_name("Queued"), None);
        assert_eq!(JobState::try_from("placed"), Ok(JobState::Placed));
        assert_eq!(
            JobState::try_from("sleeping").unwrap_err().to_string(),
            "\"sleeping\" is not a job state \
             (queued, placed, running, succeeded, failed, cancelled)"
        );
        assert_eq!(
            AttemptOutcome::try_from("out_of_memory"),
            Ok(AttemptOutcome::OutOfMemory)
        );
        assert!(AttemptOutcome::try_from("oom").is_err());
        assert!(!JobState::Running.is_terminal());
        assert!(JobState::Running.holds_slice() && !JobState::Queued.holds_slice());
    }
    #[test]
    fn a_stranded_job_moves_as_its_last_attempt_ended_or_runs_again() {
        use AttemptOutcome::*;
        for (last, profile, expected) in [
            (Some(Succeeded), false, JobEvent::AttemptSucceeded),
            (Some(Succeeded), true, JobEvent::AttemptLost),
            (Some(Failed), false, JobEvent::AttemptFailed),
            (Some(Cancelled), false, JobEvent::CancelRequested),
            (Some(OutOfMemory), false, JobEvent::AttemptLost),
            (Some(Lost), false, JobEvent::AttemptLost),
            (Some(Interrupted), false, JobEvent::AttemptLost),
            (Some(Preempted), false, JobEvent::AttemptLost),
            (None, false, JobEvent::AttemptLost),
        ] {
            let event = event_for_stranded_job(last, profile);
            assert_eq!(event, expected, "{last:?}, profile {profile}");
            for state in [JobState::Placed, JobState::Running] {
                assert!(
                    next_state(state, event).is_ok(),
                    "{event:?} moves a {state:?} job"
                );
            }
        }
    }
}
