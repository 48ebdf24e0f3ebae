//! WatchJob: a job's events as they happen, until the job ends.
//!
//! A plain watch forwards the scheduler's live events. A *resumable* one
//! (`WatchJobRequest.resumable` or `after_log_sequence`) reads them from the job's stored
//! story instead (each log line with the event it was made from, numbered by the job's
//! log sequence), woken by the live events: every event it sends carries its
//! `log_sequence`, so a watcher whose stream broke (a leader died) asks any replica for
//! the events after the last one it saw and gets each once, with no gap; and it never
//! falls behind, since the store, not a bounded channel, holds what it has not sent.
//! What a leader had not yet written when it died is lost to both kinds.

use std::time::Duration;

use carve_proto::ApiError;
use carve_proto::v1;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::auth::Caller;
use crate::convert::{job_state_from_proto, job_update_to_proto, timestamp};
use crate::scheduler::{JobUpdate, JobUpdateKind, now_ms};
use crate::store::{JobRecord, StoredJobEvent};

use super::{EventStream, Services};

/// Stored events read at once by a resumable watch.
const REPLAY_PAGE: u32 = 1_000;

/// How often a resumable watch waiting for events checks that its replica still leads:
/// a deposed one ends the stream UNAVAILABLE, so the watcher moves to the new leader.
const LEADERSHIP_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// The job's state now, the first event of a watch that starts now.
fn current_state(job: &JobRecord) -> JobUpdate {
    JobUpdate {
        job_id: job.id.clone(),
        sequence: 0,
        time_ms: now_ms(),
        kind: JobUpdateKind::StateChanged {
            previous: job.state,
            state: job.state,
            reason: "current state".into(),
        },
    }
}

/// A stored line as the event it was made from, or as a log event when it is only text.
fn stored_event_to_proto(job_id: &str, stored: &StoredJobEvent) -> v1::JobEvent {
    let mut event = stored
        .event
        .as_deref()
        .and_then(carve_proto::decode_job_event)
        .unwrap_or_else(|| v1::JobEvent {
            time: Some(timestamp(stored.time_ms)),
            event: Some(v1::job_event::Event::Log(v1::job_event::LogLine {
                attempt_number: u32::try_from(stored.attempt_number).unwrap_or(0),
                level: stored.level.clone(),
                message: stored.message.clone(),
                stream: stored.stream.clone(),
            })),
            ..v1::JobEvent::default()
        });
    event.job_id = job_id.to_string();
    event.log_sequence = u64::try_from(stored.sequence).unwrap_or(0);
    event
}

fn ends_the_job(event: &v1::JobEvent) -> bool {
    matches!(
        &event.event,
        Some(v1::job_event::Event::StateChanged(changed))
            if v1::JobState::try_from(changed.state)
                .ok()
                .and_then(job_state_from_proto)
                .is_some_and(|state| state.is_terminal())
    )
}

fn is_log(event: &v1::JobEvent) -> bool {
    matches!(&event.event, Some(v1::job_event::Event::Log(_)))
}

impl Services {
    pub(super) async fn watch(
        &self,
        request: Request<v1::WatchJobRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let request = request.into_inner();
        // Subscribe before reading the state, so nothing falls between the two.
        let events = self.scheduler.subscribe();
        let revocations = self.scheduler.subscribe_revocations();
        let job = self.scheduler.visible_job(&caller, &request.job_id).await?;
        let (sender, receiver) = mpsc::channel(256);
        let watch = Watch {
            services: self.clone(),
            job_id: job.id.clone(),
            caller,
            include_logs: request.include_logs,
            events,
            revocations,
            stopping: self.scheduler.shutting_down(),
            sender,
        };
        if request.resumable || request.after_log_sequence.is_some() {
            let after = request
                .after_log_sequence
                .map(|after| i64::try_from(after).unwrap_or(i64::MAX));
            tokio::spawn(watch.resumable(after));
        } else {
            tokio::spawn(watch.live(current_state(&job)));
        }
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }
}

/// One watch's task: what it watches and where it sends.
struct Watch {
    services: Services,
    job_id: String,
    caller: Caller,
    include_logs: bool,
    events: broadcast::Receiver<JobUpdate>,
    revocations: broadcast::Receiver<String>,
    /// Becomes true when the scheduler begins to stop: the stream ends UNAVAILABLE, so a
    /// graceful shutdown does not wait on it and the watcher moves to another replica.
    stopping: tokio::sync::watch::Receiver<bool>,
    sender: mpsc::Sender<Result<v1::JobEvent, Status>>,
}

/// What ends a wait for the job's next live event.
enum Woken {
    Event(Box<JobUpdate>),
    /// The watch fell this many events behind the scheduler's.
    Lagged(u64),
    /// The stream is over (a revoked token was told).
    Over,
}

impl Watch {
    /// Sends `item`; false when the watcher has gone.
    async fn send(&self, item: Result<v1::JobEvent, Status>) -> bool {
        self.sender.send(item).await.is_ok()
    }

    /// Waits for the next live event of the job; a revoked token or a scheduler that
    /// stops ends the stream.
    async fn next_live(&mut self) -> Woken {
        loop {
            let received = tokio::select! {
                received = self.events.recv() => received,
                stopping = async { self.stopping.wait_for(|stopping| *stopping).await.is_ok() } => {
                    if stopping {
                        let stopping = ApiError::Unavailable(
                            "the scheduler is stopping; watch again on another replica".into(),
                        );
                        self.send(Err(Status::from(stopping))).await;
                    }
                    return Woken::Over;
                }
                revoked = self.revocations.recv() => match revoked {
                    Ok(revoked) if revoked == self.caller.token_id => {
                        let revoked = ApiError::Unauthenticated("token rejected: revoked".into());
                        self.send(Err(Status::from(revoked))).await;
                        return Woken::Over;
                    }
                    Err(RecvError::Closed) => return Woken::Over,
                    _ => continue,
                },
            };
            match received {
                Ok(event) if event.job_id == self.job_id => return Woken::Event(Box::new(event)),
                Ok(_) => {}
                Err(RecvError::Lagged(missed)) => return Woken::Lagged(missed),
                Err(RecvError::Closed) => return Woken::Over,
            }
        }
    }

    /// A plain watch: the current state, then the live events.
    async fn live(mut self, first: JobUpdate) {
        let already_over = first.ends_the_job();
        if !self.send(Ok(job_update_to_proto(&first))).await || already_over {
            return;
        }
        loop {
            let event = match self.next_live().await {
                Woken::Event(event) => *event,
                Woken::Lagged(missed) => {
                    let behind = ApiError::DataLoss(format!(
                        "the watcher fell {missed} events behind; watch again"
                    ));
                    self.send(Err(Status::from(behind))).await;
                    return;
                }
                Woken::Over => return,
            };
            if !self.include_logs && matches!(event.kind, JobUpdateKind::Log { .. }) {
                continue;
            }
            let over = event.ends_the_job();
            if !self.send(Ok(job_update_to_proto(&event))).await || over {
                return;
            }
        }
    }

    /// A resumable watch (see the module documentation), after the stored event `after`
    /// or, without it, from now.
    async fn resumable(mut self, after: Option<i64>) {
        let (mut cursor, resuming) = match after {
            Some(after) => (after, true),
            None => match self.begin_now().await {
                Some(cursor) => (cursor, false),
                None => return,
            },
        };
        let mut checks = tokio::time::interval(LEADERSHIP_CHECK_INTERVAL);
        checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        if resuming && !self.replay_after_resuming(&mut cursor).await {
            return;
        }
        loop {
            if !self.send_stored(&mut cursor, false).await {
                return;
            }
            // Wait for the job's next event; a replica that no longer leads ends the
            // stream so that the watcher moves to the one that does.
            loop {
                tokio::select! {
                    woken = self.next_live() => match woken {
                        Woken::Event(_) | Woken::Lagged(_) => break,
                        Woken::Over => return,
                    },
                    _ = checks.tick() => {
                        if let Err(error) = self.services.scheduler.require_leader() {
                            self.send(Err(Status::from(error))).await;
                            return;
                        }
                    }
                }
            }
            // What came meanwhile is read from the store in one go.
            while self.events.try_recv().is_ok() {}
        }
    }

    /// Sends the job's current state, marked with its last stored sequence, and returns
    /// that sequence; `None` when the stream is over. The sequence is read first, so the
    /// state is at least as new as it and no event after it is missed.
    async fn begin_now(&self) -> Option<i64> {
        let scheduler = &self.services.scheduler;
        let started = async {
            let last = scheduler.last_job_event_sequence(&self.job_id).await?;
            let job = scheduler.visible_job(&self.caller, &self.job_id).await?;
            Ok::<_, crate::error::SchedulerError>((last, job))
        };
        let (last, job) = match started.await {
            Ok(started) => started,
            Err(error) => {
                self.send(Err(Status::from(error))).await;
                return None;
            }
        };
        let mut event = job_update_to_proto(&current_state(&job));
        event.log_sequence = u64::try_from(last).unwrap_or(0);
        let over = ends_the_job(&event);
        (self.send(Ok(event)).await && !over).then_some(last)
    }

    /// The first steps of a resumed watch: the stored events after `cursor`, and then,
    /// if the job has ended without its last event stored (a leader died before writing
    /// it), its current state. False when the stream is over.
    async fn replay_after_resuming(&self, cursor: &mut i64) -> bool {
        if !self.send_stored(cursor, true).await {
            return false;
        }
        match self
            .services
            .scheduler
            .visible_job(&self.caller, &self.job_id)
            .await
        {
            // Read again: the job may have ended, and stored its last event, since.
            Ok(job) if job.state.is_terminal() => {
                self.send_stored(cursor, false).await && self.begin_now().await.is_some()
            }
            Ok(_) => true,
            Err(error) => {
                self.send(Err(Status::from(error))).await;
                false
            }
        }
    }

    /// Sends the stored events after `cursor`, moving it; false when the stream is over.
    /// With `check_trimmed` (a resumed watch's first replay), when the events right after
    /// the cursor were trimmed the watch starts again from the job's current state.
    async fn send_stored(&self, cursor: &mut i64, mut check_trimmed: bool) -> bool {
        loop {
            let stored = match self
                .services
                .scheduler
                .stored_job_events(&self.job_id, *cursor, REPLAY_PAGE)
                .await
            {
                Ok(stored) => stored,
                Err(error) => {
                    self.send(Err(Status::from(error))).await;
                    return false;
                }
            };
            if std::mem::take(&mut check_trimmed)
                && stored
                    .first()
                    .is_some_and(|first| first.sequence > *cursor + 1)
            {
                match self.begin_now().await {
                    Some(now) => {
                        *cursor = now;
                        continue;
                    }
                    None => return false,
                }
            }
            for line in &stored {
                *cursor = line.sequence;
                let event = stored_event_to_proto(&self.job_id, line);
                if !self.include_logs && is_log(&event) {
                    continue;
                }
                let over = ends_the_job(&event);
                if !self.send(Ok(event)).await || over {
                    return false;
                }
            }
            if stored.len() < REPLAY_PAGE as usize {
                return true;
            }
        }
    }
}
