//! One worker's session stream: who may hold it, how it ends, and how its messages are
//! read so that heartbeats are never stuck behind reports.
//!
//! A session belongs to the token that registered its worker (see
//! `Scheduler::open_session`), and a worker has one live session at a time: opening a
//! new one, revoking the token, or the worker's lease running out ends the old one, and
//! the scheduler accepts reports only from the session it holds now.
//!
//! The stream is read by two tasks. The reader handles heartbeats at once (they touch
//! only memory) and hands every other message, in order, to the report task, which may
//! wait for the job lock behind a long scheduling pass. A worker's liveness therefore
//! depends only on its messages arriving, never on how busy the scheduler's job
//! changes are.
//!
//! The scheduler's side of the session (`LiveSession`, `SessionHandle`) is the
//! scheduler's own (`scheduler/session_handles.rs`): this file uses the scheduler, never
//! the reverse.

use std::sync::Arc;

use carve_proto::ApiError;
use carve_proto::v1;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tonic::{Status, Streaming};

use crate::convert::worker_report_from_proto;
use crate::error::SchedulerError;
use crate::scheduler::worker_reports::{WorkerCommand, WorkerReport};
use crate::scheduler::{Scheduler, SessionHandle, SessionSender};

/// Reports a session may have waiting for the report task; past this the reader waits
/// too, which slows the worker's stream (HTTP/2 flow control), not the scheduler.
const REPORTS_IN_FLIGHT: usize = 1024;

/// Serves an opened session until the worker closes it, the scheduler ends it or stops.
pub fn serve_session(
    scheduler: Arc<Scheduler>,
    worker_id: String,
    session: SessionHandle,
    mut incoming: Streaming<v1::WorkerMessage>,
    sender: SessionSender,
) {
    let (reports, mut queued_reports) =
        mpsc::channel::<(u64, Result<WorkerReport, ApiError>)>(REPORTS_IN_FLIGHT);
    let report_scheduler = Arc::clone(&scheduler);
    let report_worker = worker_id.clone();
    let report_sender = sender.clone();
    let session_id = session.id;
    let report_task = tokio::spawn(async move {
        while let Some((sequence, report)) = queued_reports.recv().await {
            let handled = match report {
                Ok(report) => {
                    report_scheduler
                        .handle_worker_message(&report_worker, session_id, report)
                        .await
                }
                Err(error) => Err(error.into()),
            };
            let acknowledged = match handled {
                Ok(()) => true,
                // A fenced report is answered, not fatal: the worker learns its attempt is gone.
                Err(error @ SchedulerError::Conflict(_)) => {
                    tracing::info!(worker = %report_worker, %error, "fenced report");
                    true
                }
                Err(error) => {
                    tracing::warn!(worker = %report_worker, %error, "worker message rejected");
                    let _ = report_sender.send(Err(error.into())).await;
                    false
                }
            };
            if !acknowledged {
                break;
            }
            let _ = report_sender
                .send(Ok(WorkerCommand::Ack { sequence }))
                .await;
        }
    });
    let mut shutting_down = scheduler.shutting_down();
    let mut ended = session.into_ended();
    tokio::spawn(async move {
        let mut ended_by_scheduler = None;
        loop {
            // A stopping scheduler ends its sessions, so the server can finish.
            let message = tokio::select! {
                message = incoming.next() => message,
                _ = shutting_down.wait_for(|stopping| *stopping) => break,
                why = &mut ended => {
                    ended_by_scheduler = Some(why.unwrap_or_else(|_| {
                        Status::from(ApiError::Aborted(format!(
                            "a newer session of worker {worker_id} replaced this one"
                        )))
                    }));
                    break;
                }
            };
            let Some(Ok(message)) = message else { break };
            let sequence = message.sequence;
            let report = worker_report_from_proto(message);
            if let Ok(WorkerReport::Heartbeat {
                gpus,
                cached_image_digests,
            }) = &report
            {
                scheduler.record_cached_images(&worker_id, cached_image_digests);
                // Not acknowledged with an Ack: the worker reads one as "every report up
                // to this sequence", and reports before this heartbeat may still be in
                // the queue. Its own answer tells the worker a leader heard it.
                if scheduler.heartbeat(&worker_id, session_id, gpus) {
                    // Never waits: a worker that does not read its stream misses answers,
                    // which only shortens its own lease.
                    let _ = sender.try_send(Ok(WorkerCommand::HeartbeatAck { sequence }));
                }
                continue;
            }
            if reports.send((sequence, report)).await.is_err() {
                // The report task stopped on a rejected message and said why.
                break;
            }
        }
        // Reports the worker sent before it closed are still handled (on a session the
        // scheduler ended, they are refused one by one).
        drop(reports);
        let _ = report_task.await;
        if let Some(status) = ended_by_scheduler {
            let _ = sender.send(Err(status)).await;
        }
        scheduler.close_session(&worker_id, session_id);
    });
}
