//! A training run's reported checkpoints (`CARVE_CHECKPOINT` lines,
//! [`crate::command_checkpoint`]): each copied to its recorded place off the async
//! runtime, one at a time, then reported as `CheckpointWritten`; and the checkpoint a
//! run resumes from, when the assignment names one this node holds.

use std::path::PathBuf;

use carve_core::command::checkpoint::CheckpointLine;
use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::command_checkpoint::{
    record_reported_checkpoint, recorded_directory, resume_checkpoint,
};

/// The recorded checkpoint a run resumes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ResumePoint {
    /// The copy, as the program sees it (`CARVE_RESUME_FROM`).
    pub(super) path: PathBuf,
    pub(super) step: u64,
    /// The directory of every recorded copy of the job, mounted read-only.
    pub(super) recorded_directory: PathBuf,
}

impl ResumePoint {
    /// What `resume_from` names, when it is a recorded copy of `checkpoint_dir`'s on this
    /// node; `None` otherwise (then the run starts from what its directory holds).
    pub(super) fn of_assignment(
        checkpoint_dir: &std::path::Path,
        resume_from: Option<&v1::Checkpoint>,
    ) -> Option<ResumePoint> {
        let checkpoint = resume_from?;
        let recorded_directory = recorded_directory(checkpoint_dir);
        let path = resume_checkpoint(&recorded_directory, &checkpoint.location)?;
        Some(ResumePoint {
            path,
            step: checkpoint.step,
            recorded_directory,
        })
    }
}

/// Records the checkpoints one run reports, in the order reported.
pub(super) struct CheckpointRecorder {
    lines: mpsc::UnboundedSender<CheckpointLine>,
    task: JoinHandle<()>,
}

impl CheckpointRecorder {
    pub(super) fn start(
        attempt: v1::AttemptRef,
        checkpoint_dir: PathBuf,
        reports: mpsc::UnboundedSender<Body>,
    ) -> CheckpointRecorder {
        let (lines, mut waiting) = mpsc::unbounded_channel::<CheckpointLine>();
        let task = tokio::spawn(async move {
            let recorded = recorded_directory(&checkpoint_dir);
            while let Some(mut line) = waiting.recv().await {
                // A newer checkpoint supersedes one still waiting: only it is copied.
                while let Ok(newer) = waiting.try_recv() {
                    line = newer;
                }
                let (directory, recorded, number) = (
                    checkpoint_dir.clone(),
                    recorded.clone(),
                    attempt.attempt_number,
                );
                let copied = {
                    let line = line.clone();
                    tokio::task::spawn_blocking(move || {
                        record_reported_checkpoint(&directory, &recorded, number, &line)
                    })
                    .await
                    .unwrap_or_else(|error| Err(format!("the copy stopped: {error}")))
                };
                let body = match copied {
                    Ok(location) => {
                        Body::CheckpointWritten(v1::worker_message::CheckpointWritten {
                            attempt: Some(attempt.clone()),
                            checkpoint: Some(v1::Checkpoint {
                                step: line.step,
                                location: location.to_string_lossy().into_owned(),
                            }),
                        })
                    }
                    Err(reason) => {
                        tracing::warn!(job = %attempt.job_id, step = line.step, %reason, "reported checkpoint not recorded");
                        Body::Log(v1::worker_message::LogLine {
                            attempt: Some(attempt.clone()),
                            level: "warn".to_string(),
                            message: format!(
                                "the checkpoint of step {} is not recorded: {reason}",
                                line.step
                            ),
                            stream: String::new(),
                        })
                    }
                };
                let _ = reports.send(body);
            }
        });
        CheckpointRecorder { lines, task }
    }

    /// A checkpoint line the program printed.
    pub(super) fn reported(&self, line: CheckpointLine) {
        let _ = self.lines.send(line);
    }

    /// Waits until every reported checkpoint is recorded or refused (before the run's
    /// final reports, so that the scheduler has the last one when the attempt ends).
    pub(super) async fn finish(self) {
        drop(self.lines);
        let _ = self.task.await;
    }
}
