//! Which scheduler replica the worker's next session goes to, and how long it waits
//! before trying: the worker follows the leader. A replica that does not lead names the
//! leader in its refusal (the `carve-leader` trailer, [`carve_proto::status::leader_named_by`])
//! and the next attempt goes there at once; without a name the worker walks its
//! `--scheduler` list. The wait starts again from `--reconnect` initial whenever a
//! session was open or a replica names a new leader, stays short (at most
//! [`ANSWERED_BACKOFF_MAX`]) while any replica answers at all, and doubles up to the
//! configured maximum only while none answers, so a failover costs the leader's lease
//! and not a backoff grown during it.

use std::collections::HashSet;
use std::time::Duration;

use carve_proto::status::leader_named_by;

/// The longest wait between attempts while some replica answers (a standby between
/// leaders): the new leader is found this long after it takes over, at most.
pub const ANSWERED_BACKOFF_MAX: Duration = Duration::from_millis(250);

/// How one attempt at a session ended, as the choice of the next one reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptEnd {
    /// A session was open and ended (its scheduler died, stepped down or closed it),
    /// naming the leader when the scheduler did.
    SessionEnded { leader_named: Option<String> },
    /// The replica answered but did not take the session (a standby), naming the leader
    /// when it knows it.
    Refused { leader_named: Option<String> },
    /// Nothing answered: no connection, or it broke before any answer.
    NoAnswer,
}

impl AttemptEnd {
    /// How a call that failed with `status` ended: an answer from a replica, or a broken
    /// or missing connection (tonic's own statuses carry the transport error as their
    /// source; a scheduler's answer has none).
    pub fn of_status(status: &tonic::Status, session_was_open: bool) -> AttemptEnd {
        let leader_named = leader_named_by(status).map(str::to_string);
        let answered = std::error::Error::source(status).is_none();
        match (session_was_open, answered) {
            (true, _) => AttemptEnd::SessionEnded { leader_named },
            (false, true) => AttemptEnd::Refused { leader_named },
            (false, false) => AttemptEnd::NoAnswer,
        }
    }
}

/// Why the next attempt goes where it goes (what tests and logs read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointReason {
    /// The first attempt: the first endpoint listed.
    First,
    /// A replica named it as the leader.
    NamedLeader,
    /// The next one listed after the endpoint tried last.
    NextListed,
}

/// One attempt at a session, as the worker is about to make it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionAttempt {
    pub endpoint: String,
    pub reason: EndpointReason,
    /// How long the worker waited before it.
    pub waited: Duration,
    /// How the attempt before it ended (`None` for the first).
    pub after: Option<AttemptEnd>,
}

/// The worker's choice of replica and wait, across its attempts.
#[derive(Debug)]
pub struct SchedulerChoice {
    initial: Duration,
    most: Duration,
    /// The wait after an attempt no replica answered; doubles up to `most`.
    unanswered_backoff: Duration,
    /// The wait after a refusal that named no leader to go to; doubles up to
    /// [`ANSWERED_BACKOFF_MAX`].
    answered_backoff: Duration,
    /// Where the last attempt went, and its place in the list when it was listed.
    last: Option<(String, Option<usize>)>,
    /// Where the next attempt goes when a replica named the leader.
    named_leader: Option<String>,
    /// Whether some replica answered since the last open session.
    answered_since_session: bool,
    /// Endpoints that did not answer since the last open session: a leader named by a
    /// replica that has not seen it die is not followed back there.
    unanswered: HashSet<String>,
    next_wait: Duration,
    /// How the last attempt ended, told with the next.
    last_end: Option<AttemptEnd>,
}

impl SchedulerChoice {
    /// A choice whose waits start at `initial` and grow to `most` while nothing answers.
    pub fn new(initial: Duration, most: Duration) -> SchedulerChoice {
        SchedulerChoice {
            initial,
            most,
            unanswered_backoff: initial,
            answered_backoff: initial,
            last: None,
            named_leader: None,
            answered_since_session: false,
            unanswered: HashSet::new(),
            next_wait: Duration::ZERO,
            last_end: None,
        }
    }

    /// How long to wait before the next attempt.
    pub fn wait(&self) -> Duration {
        self.next_wait
    }

    /// The endpoint of the next attempt among `listed` (the `--scheduler` list, resolved
    /// now), and why.
    pub fn next_attempt(&mut self, listed: &[String]) -> SessionAttempt {
        let waited = self.next_wait;
        let after = self.last_end.take();
        if let Some(leader) = self.named_leader.take() {
            let place = listed.iter().position(|endpoint| *endpoint == leader);
            self.last = Some((leader.clone(), place));
            return SessionAttempt {
                endpoint: leader,
                reason: EndpointReason::NamedLeader,
                waited,
                after,
            };
        }
        let place = match (&self.last, listed.len()) {
            (_, 0) => None,
            (None, _) => Some(0),
            // After an endpoint that was not listed (a named leader), the list from its
            // start.
            (Some((_, None)), _) => Some(0),
            (Some((_, Some(place))), count) => Some((place + 1) % count),
        };
        let endpoint = place
            .and_then(|place| listed.get(place))
            .cloned()
            .unwrap_or_default();
        let reason = if self.last.is_none() {
            EndpointReason::First
        } else {
            EndpointReason::NextListed
        };
        self.last = Some((endpoint.clone(), place));
        SessionAttempt {
            endpoint,
            reason,
            waited,
            after,
        }
    }

    /// A session opened at the last endpoint: waits start over.
    pub fn session_opened(&mut self) {
        self.unanswered_backoff = self.initial;
        self.answered_backoff = self.initial;
        self.answered_since_session = false;
        self.unanswered.clear();
    }

    /// Reads how the last attempt ended and sets where and when the next one goes.
    pub fn attempt_ended(&mut self, end: AttemptEnd) {
        let tried = self.last.as_ref().map(|(endpoint, _)| endpoint.clone());
        self.last_end = Some(end.clone());
        match end {
            AttemptEnd::SessionEnded { leader_named } => {
                // The scheduler was there a moment ago: back to short waits.
                self.session_opened();
                match self.leader_to_follow(leader_named, tried.as_deref()) {
                    Some(leader) => {
                        self.named_leader = Some(leader);
                        self.next_wait = Duration::ZERO;
                    }
                    // Not at once: a scheduler that ends every session as it opens
                    // must not be called in a tight loop.
                    None => self.next_wait = self.initial,
                }
            }
            AttemptEnd::Refused { leader_named } => {
                self.answered_since_session = true;
                self.unanswered_backoff = self.initial;
                match self.leader_to_follow(leader_named, tried.as_deref()) {
                    Some(leader) => {
                        // A new endpoint: go at once, the waits start over.
                        self.named_leader = Some(leader);
                        self.answered_backoff = self.initial;
                        self.next_wait = Duration::ZERO;
                    }
                    None => {
                        self.next_wait = self.answered_backoff;
                        self.answered_backoff = (self.answered_backoff * 2).min(self.short_most());
                    }
                }
            }
            AttemptEnd::NoAnswer => {
                if let Some(tried) = tried {
                    self.unanswered.insert(tried);
                }
                if self.answered_since_session {
                    // Another replica answers: the leader is being chosen, not gone.
                    self.next_wait = self.answered_backoff;
                    self.answered_backoff = (self.answered_backoff * 2).min(self.short_most());
                } else {
                    self.next_wait = self.unanswered_backoff;
                    self.unanswered_backoff = (self.unanswered_backoff * 2).min(self.most);
                }
            }
        }
    }

    /// A named leader worth going to: not the endpoint just tried (a replica naming
    /// itself) and not one that did not answer since the last session (a standby that
    /// has not yet seen the leader die still names it).
    fn leader_to_follow(&self, named: Option<String>, tried: Option<&str>) -> Option<String> {
        named.filter(|leader| Some(leader.as_str()) != tried && !self.unanswered.contains(leader))
    }

    fn short_most(&self) -> Duration {
        ANSWERED_BACKOFF_MAX.min(self.most).max(self.initial)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INITIAL: Duration = Duration::from_millis(100);
    const MOST: Duration = Duration::from_secs(5);

    fn listed() -> Vec<String> {
        ["http://a:1", "http://b:1", "http://c:1"]
            .map(String::from)
            .to_vec()
    }

    fn refused_naming(leader: &str) -> AttemptEnd {
        AttemptEnd::Refused {
            leader_named: Some(leader.into()),
        }
    }

    #[test]
    fn a_standby_naming_the_leader_sends_the_next_attempt_there_at_once() {
        let mut choice = SchedulerChoice::new(INITIAL, MOST);
        let first = choice.next_attempt(&listed());
        assert_eq!(first.endpoint, "http://a:1");
        assert_eq!(first.reason, EndpointReason::First);
        choice.attempt_ended(refused_naming("http://c:1"));
        assert_eq!(choice.wait(), Duration::ZERO);
        let next = choice.next_attempt(&listed());
        assert_eq!(next.endpoint, "http://c:1");
        assert_eq!(next.reason, EndpointReason::NamedLeader);
        // A leader that is not in the list (its advertised endpoint) is followed too.
        choice.attempt_ended(refused_naming("http://d:7470"));
        assert_eq!(choice.next_attempt(&listed()).endpoint, "http://d:7470");
    }

    #[test]
    fn the_wait_grows_to_the_maximum_only_while_nothing_answers() {
        let mut choice = SchedulerChoice::new(INITIAL, MOST);
        let mut waits = Vec::new();
        for _ in 0..8 {
            choice.next_attempt(&listed());
            choice.attempt_ended(AttemptEnd::NoAnswer);
            waits.push(choice.wait());
        }
        assert_eq!(waits[0], INITIAL);
        assert_eq!(*waits.last().unwrap(), MOST);

        // One replica answers (a standby with no leader yet): the waits are short again
        // and stay short, whatever the others do.
        choice.next_attempt(&listed());
        choice.attempt_ended(AttemptEnd::Refused { leader_named: None });
        assert_eq!(choice.wait(), INITIAL);
        for _ in 0..10 {
            choice.next_attempt(&listed());
            choice.attempt_ended(AttemptEnd::NoAnswer);
            assert!(choice.wait() <= ANSWERED_BACKOFF_MAX, "{:?}", choice.wait());
        }
    }

    #[test]
    fn a_dead_leader_still_named_by_a_standby_is_not_followed_back() {
        let mut choice = SchedulerChoice::new(INITIAL, MOST);
        // The session with the leader a breaks (killed): the next goes to b.
        choice.next_attempt(&listed());
        choice.session_opened();
        choice.attempt_ended(AttemptEnd::SessionEnded { leader_named: None });
        let second = choice.next_attempt(&listed());
        assert_eq!(second.endpoint, "http://b:1");
        // b has not seen a's lease run out: it names a, which is tried once ...
        choice.attempt_ended(refused_naming("http://a:1"));
        let third = choice.next_attempt(&listed());
        assert_eq!(third.endpoint, "http://a:1");
        assert_eq!(third.reason, EndpointReason::NamedLeader);
        choice.attempt_ended(AttemptEnd::NoAnswer);
        assert!(choice.wait() <= ANSWERED_BACKOFF_MAX);
        // ... and not again: the list goes on from a.
        let fourth = choice.next_attempt(&listed());
        assert_eq!(fourth.endpoint, "http://b:1");
        choice.attempt_ended(refused_naming("http://a:1"));
        assert_eq!(choice.next_attempt(&listed()).endpoint, "http://c:1");
    }

    #[test]
    fn a_leader_that_steps_down_naming_the_new_one_is_left_for_it_at_once() {
        let mut choice = SchedulerChoice::new(INITIAL, MOST);
        choice.next_attempt(&listed());
        choice.session_opened();
        choice.attempt_ended(AttemptEnd::SessionEnded {
            leader_named: Some("http://c:1".into()),
        });
        assert_eq!(choice.wait(), Duration::ZERO);
        let next = choice.next_attempt(&listed());
        assert_eq!(
            (next.endpoint.as_str(), next.reason),
            ("http://c:1", EndpointReason::NamedLeader)
        );
        // After a named leader, the list resumes from the endpoint after it.
        choice.attempt_ended(AttemptEnd::NoAnswer);
        assert_eq!(choice.next_attempt(&listed()).endpoint, "http://a:1");
    }

    #[test]
    fn a_transport_failure_is_no_answer_and_a_standbys_refusal_is_one() {
        let refusal = tonic::Status::from(carve_proto::ApiError::NotLeader {
            leader_endpoint: Some("http://b:1".into()),
            reason: "this scheduler replica is a standby; the leader is at http://b:1".into(),
        });
        assert_eq!(
            AttemptEnd::of_status(&refusal, false),
            AttemptEnd::Refused {
                leader_named: Some("http://b:1".into())
            }
        );
        let broken = tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset",
        )));
        assert_eq!(AttemptEnd::of_status(&broken, false), AttemptEnd::NoAnswer);
        assert_eq!(
            AttemptEnd::of_status(&broken, true),
            AttemptEnd::SessionEnded { leader_named: None }
        );
    }
}
