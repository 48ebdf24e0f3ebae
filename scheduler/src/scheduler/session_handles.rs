//! The scheduler's side of a worker's session: the live half it keeps with the worker
//! (`LiveSession`: the session's id, its token, the sender of its commands, and the way
//! to end it) and the handle the stream's tasks keep (`SessionHandle`: the id and word of
//! the end). The gRPC stream itself is served by `services/worker_session.rs`, which
//! depends on these and never the reverse.

use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::error::SchedulerError;

use super::worker_reports::WorkerCommand;

/// A worker's session stream, as the scheduler writes it (the handler makes the wire
/// messages).
pub type SessionSender = mpsc::Sender<Result<WorkerCommand, Status>>;

/// The scheduler's side of a worker's live session.
#[derive(Debug)]
pub(crate) struct LiveSession {
    pub id: u64,
    /// The token the session was opened with: revoking it ends the session.
    pub token_id: String,
    pub sender: SessionSender,
    /// Dropping it ends the session as replaced; `end` ends it with a reason.
    ender: Option<oneshot::Sender<Status>>,
}

impl LiveSession {
    /// The live half of a new session and the handle its stream's tasks keep.
    pub fn open(id: u64, token_id: String, sender: SessionSender) -> (LiveSession, SessionHandle) {
        let (ender, ended) = oneshot::channel();
        (
            LiveSession {
                id,
                token_id,
                sender,
                ender: Some(ender),
            },
            SessionHandle { id, ended },
        )
    }

    /// Ends the session; the worker receives `why` as the stream's final status.
    pub fn end(mut self, why: SchedulerError) {
        if let Some(ender) = self.ender.take() {
            let _ = ender.send(Status::from(why));
        }
    }
}

/// What the stream's tasks hold: the session's id, and word of its end.
#[derive(Debug)]
pub struct SessionHandle {
    pub id: u64,
    ended: oneshot::Receiver<Status>,
}

impl SessionHandle {
    /// Word of the session's end: the status the scheduler ended it with, or an error
    /// when its live half was dropped (a newer session replaced it).
    pub fn into_ended(self) -> oneshot::Receiver<Status> {
        self.ended
    }
}
