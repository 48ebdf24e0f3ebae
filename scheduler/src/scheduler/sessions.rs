//! Worker sessions: registration, the one session stream a worker holds at a time,
//! heartbeats, the recheck of the sessions' tokens, fencing of reports by lease epoch
//! (`current_attempt`), draining, and the dispatch of each message a worker sends.

use std::sync::atomic::Ordering;
use std::time::Duration;

use carve_core::job_state::{JobEvent, JobState};
use carve_proto::ApiError;
use tokio::time::Instant;

use crate::auth::{Caller, Role, generate_id};
use crate::cache::LOOKUP_TIME_TO_LIVE;
use crate::error::SchedulerError;
use crate::store::{AttemptOutcome, AttemptResults, AttemptStartDetails, WorkerRecord};

use super::command_jobs::{OomDetected, display_argv};
use super::logs::JobUpdateKind;
use super::session_handles::{LiveSession, SessionHandle, SessionSender};
use super::worker_reports::{
    AttemptRef, Checkpoint, Gpu, GpuFreeBytes, Registered, WorkerCommand, WorkerRegistration,
    WorkerReport,
};
use super::{LiveWorker, RunningAttempt, Scheduler, WorkerState, now_ms};

impl Scheduler {
    pub async fn register_worker(
        &self,
        caller: &Caller,
        request: WorkerRegistration,
    ) -> Result<Registered, SchedulerError> {
        self.may_hold_sessions(caller)?;
        if request.hostname.is_empty() {
            return Err(ApiError::InvalidArgument {
                field: "hostname".into(),
                reason: "must not be empty".into(),
            }
            .into());
        }
        for (index, gpu) in request.gpus.iter().enumerate() {
            if gpu.uuid.is_empty() {
                return Err(ApiError::InvalidArgument {
                    field: format!("gpus[{index}].uuid"),
                    reason: "must not be empty".into(),
                }
                .into());
            }
            if gpu.total_bytes == 0 || gpu.context_bytes >= gpu.total_bytes {
                return Err(ApiError::InvalidArgument {
                    field: format!("gpus[{index}].total_bytes"),
                    reason: format!(
                        "{} total with {} taken by the context leaves nothing for slices",
                        gpu.total_bytes, gpu.context_bytes
                    ),
                }
                .into());
            }
        }
        // A token resumes only a worker it registered (or one registered before workers
        // were bound to tokens); any other id it names gets it a new identity, so a
        // worker token cannot take over another node's attempts.
        let known = !request.previous_worker_id.is_empty()
            && self
                .live()
                .workers
                .get(&request.previous_worker_id)
                .is_some_and(|worker| {
                    worker.record.token_id.is_empty() || worker.record.token_id == caller.token_id
                });
        let same_node = if known || !request.previous_worker_id.is_empty() {
            None
        } else {
            self.same_node_worker(&request.hostname, &request.gpus, caller)
                .await?
        };
        let worker_id = if known {
            request.previous_worker_id.clone()
        } else if let Some(worker_id) = same_node {
            // A new process on the node: what its previous process ran died with it.
            self.interrupt_attempts_of(&worker_id).await?;
            worker_id
        } else {
            generate_id("worker")
        };
        let now = now_ms();
        let record = WorkerRecord {
            id: worker_id.clone(),
            hostname: request.hostname.clone(),
            gpus_json: gpus_to_column(&request.gpus),
            state: WorkerState::Ready,
            last_heartbeat_ms: now,
            registered_at_ms: now,
            version: request.version.clone(),
            token_id: caller.token_id.clone(),
            drain_reason: String::new(),
        };
        self.store.upsert_worker(&record).await?;
        {
            let mut live = self.live();
            let session = live
                .workers
                .get_mut(&worker_id)
                .and_then(|worker| worker.session.take());
            live.workers.insert(
                worker_id.clone(),
                LiveWorker {
                    record,
                    gpus: request.gpus,
                    state: WorkerState::Ready,
                    last_heartbeat: Instant::now(),
                    session,
                },
            );
        }
        Ok(Registered {
            worker_id,
            heartbeat_interval: self.settings.heartbeat_interval,
            lease_duration: self.settings.lease_duration,
        })
    }

    /// The worker a fresh process (no previous id) on node `hostname` offering `gpus` is,
    /// among the workers that hold no session (one that does is another process, running
    /// now), so a restarted worker keeps its identity instead of leaving a lost one:
    /// the most recently heard-from worker of that node registered with the caller's
    /// token; else, for a worker started again with a new token (`carve dev` makes one at
    /// every start; operators rotate them), one of that node that offered one of the same
    /// GPUs (a GPU is served by one worker at a time) and was registered with a token of
    /// the caller's tenant. Another tenant's token never takes a worker over: it gets a
    /// worker of its own and the other stays as it was.
    async fn same_node_worker(
        &self,
        hostname: &str,
        gpus: &[Gpu],
        caller: &Caller,
    ) -> Result<Option<String>, SchedulerError> {
        let mut candidates: Vec<WorkerRecord> = self
            .store
            .list_workers()
            .await?
            .into_iter()
            .filter(|worker| worker.hostname == hostname)
            .collect();
        candidates.sort_by_key(|worker| std::cmp::Reverse(worker.last_heartbeat_ms));
        candidates.retain(|worker| {
            self.live()
                .workers
                .get(&worker.id)
                .is_none_or(|live| live.session.is_none())
        });
        if let Some(same_token) = candidates
            .iter()
            .find(|worker| worker.token_id == caller.token_id)
        {
            return Ok(Some(same_token.id.clone()));
        }
        for worker in candidates {
            let shares_a_gpu = gpus_from_column(&worker)?
                .iter()
                .any(|offered| gpus.iter().any(|gpu| gpu.uuid == offered.uuid));
            if !shares_a_gpu || worker.token_id.is_empty() {
                continue;
            }
            // A token since deleted names no tenant: its worker is not taken over.
            match self.store.get_token(&worker.token_id).await {
                Ok(token) if token.tenant == caller.tenant => return Ok(Some(worker.id)),
                Ok(_) | Err(SchedulerError::Api(ApiError::NotFound { .. })) => {}
                Err(other) => return Err(other),
            }
        }
        Ok(None)
    }

    /// Ends, as interrupted, the attempts the scheduler counts as running on `worker_id`:
    /// its process was replaced, and a restarted worker kills what its previous life
    /// left. Each goes back to the queue to resume from its checkpoint, as after any
    /// interruption.
    async fn interrupt_attempts_of(&self, worker_id: &str) -> Result<(), SchedulerError> {
        let attempts: Vec<AttemptRef> = self
            .live()
            .running
            .iter()
            .filter(|(_, running)| running.worker_id == worker_id)
            .map(|(job_id, running)| AttemptRef {
                job_id: job_id.clone(),
                attempt_number: running.attempt_number,
                lease_epoch: running.lease_epoch,
            })
            .collect();
        for attempt in attempts {
            let interrupted = self
                .handle_finished(
                    worker_id,
                    attempt,
                    Some(AttemptOutcome::Interrupted),
                    0,
                    &format!("worker {worker_id} restarted; its previous process stopped"),
                    AttemptResults::default(),
                )
                .await;
            match interrupted {
                // Finished meanwhile by another path: nothing left to do.
                Ok(()) | Err(SchedulerError::Conflict(_)) => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// Binds a session stream to a registered worker and reconciles what it still runs.
    /// Only the token that registered the worker may open its session; a worker has one
    /// session at a time, so a newer one ends the one before.
    pub async fn open_session(
        &self,
        caller: &Caller,
        worker_id: &str,
        running_attempts: &[AttemptRef],
        sender: SessionSender,
    ) -> Result<SessionHandle, SchedulerError> {
        self.may_hold_sessions(caller)?;
        let (handle, never_arrived) = {
            let mut live = self.live();
            let worker = live.worker_mut(worker_id)?;
            if worker.record.token_id != caller.token_id {
                return Err(ApiError::PermissionDenied(format!(
                    "worker {worker_id} was registered with another token; a worker speaks \
                     only with the token it registered with"
                ))
                .into());
            }
            if worker.state == WorkerState::Lost {
                worker.state = WorkerState::Ready;
            }
            let id = self.session_ids.fetch_add(1, Ordering::Relaxed);
            let (session, handle) = LiveSession::open(id, caller.token_id.clone(), sender);
            // The session before, if any, ends here (dropped: "replaced").
            worker.session = Some(session);
            worker.last_heartbeat = Instant::now();
            // Attempts placed here before this session whose hello does not list them
            // never reached the worker: their assignment went down a session that
            // broke, or was lost with a leader that died between storing and sending it.
            // (Those placed from now on go down this session.)
            let never_arrived: Vec<(String, RunningAttempt)> = live
                .running
                .iter()
                .filter(|(job_id, running)| {
                    running.worker_id == worker_id
                        && !running_attempts.iter().any(|attempt| {
                            attempt.job_id == **job_id
                                && attempt.attempt_number == running.attempt_number
                        })
                })
                .map(|(job_id, running)| (job_id.clone(), running.clone()))
                .collect();
            (handle, never_arrived)
        };
        if !never_arrived.is_empty() {
            let _guard = self.job_changes.lock().await;
            let now = now_ms();
            for (job_id, running) in never_arrived {
                let unchanged = {
                    let mut live = self.live();
                    let same = live.running.get(&job_id).is_some_and(|current| {
                        current.worker_id == running.worker_id
                            && current.attempt_number == running.attempt_number
                    });
                    if same {
                        live.running.remove(&job_id);
                    }
                    same
                };
                if unchanged {
                    self.lose_attempt(
                        &job_id,
                        &running,
                        &format!("worker {worker_id} came back without it"),
                        &format!(
                            "lost: attempt {} never reached worker {worker_id}",
                            running.attempt_number
                        ),
                        now,
                    )
                    .await?;
                }
            }
        }
        // Attempts the worker runs that were reassigned meanwhile are stopped.
        for attempt in running_attempts {
            let current = self.live().running.get(&attempt.job_id).cloned();
            let still_ours = current.is_some_and(|current| {
                current.worker_id == worker_id && current.attempt_number == attempt.attempt_number
            });
            if !still_ours {
                self.send_to_worker(
                    worker_id,
                    WorkerCommand::Cancel {
                        attempt: attempt.clone(),
                        grace_period: Duration::ZERO,
                        reason: "the attempt was reassigned while the worker was away".into(),
                    },
                );
            }
        }
        self.wake();
        Ok(handle)
    }

    /// Whether `session_id` is the session `worker_id` holds now.
    fn is_current_session(&self, worker_id: &str, session_id: u64) -> bool {
        self.live()
            .workers
            .get(worker_id)
            .and_then(|worker| worker.session.as_ref())
            .is_some_and(|session| session.id == session_id)
    }

    /// Forgets a session that ended, unless the worker has opened a newer one since.
    pub fn close_session(&self, worker_id: &str, session_id: u64) {
        if let Some(worker) = self.live().workers.get_mut(worker_id)
            && worker
                .session
                .as_ref()
                .is_some_and(|current| current.id == session_id)
        {
            worker.session = None;
        }
    }

    /// Ends the sessions opened with a token (it was revoked): their workers are
    /// unschedulable until they come back with a valid token, and lose their attempts
    /// when their lease runs out.
    pub(super) fn end_sessions_of_token(&self, token_id: &str, why: &str) {
        for worker in self.live().workers.values_mut() {
            if worker
                .session
                .as_ref()
                .is_some_and(|session| session.token_id == token_id)
                && let Some(session) = worker.session.take()
            {
                session.end(SchedulerError::Api(ApiError::Unauthenticated(
                    why.to_string(),
                )));
            }
        }
    }

    /// Ends the sessions whose token was revoked through another replica, or expired,
    /// since they opened: the token is read again from the store at most every
    /// [`LOOKUP_TIME_TO_LIVE`], as a call's authentication would. A revoke through this
    /// scheduler ends them at once (`revoke_token`).
    pub async fn recheck_session_tokens(&self) -> Result<(), SchedulerError> {
        {
            let mut last = self
                .last_session_token_check
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if last.is_some_and(|last| last.elapsed() < LOOKUP_TIME_TO_LIVE) {
                return Ok(());
            }
            *last = Some(Instant::now());
        }
        let mut token_ids: Vec<String> = self
            .live()
            .workers
            .values()
            .filter_map(|worker| worker.session.as_ref())
            .map(|session| session.token_id.clone())
            .collect();
        token_ids.sort();
        token_ids.dedup();
        let now = now_ms();
        for token_id in token_ids {
            let token = self.store.get_token(&token_id).await?;
            let why = if token.revoked {
                "token rejected: revoked"
            } else if token.expires_at_ms.is_some_and(|expires| expires <= now) {
                "token rejected: expired"
            } else {
                continue;
            };
            self.end_sessions_of_token(&token_id, why);
        }
        Ok(())
    }

    /// A heartbeat on the worker's current session; one on a session that was replaced
    /// or ended says nothing about the worker. Whether the worker may count it as heard
    /// by a leader: on its current session of a replica that leads (a leader past its
    /// self-fence does not), so the worker's own lease never outlasts the scheduler's.
    pub fn heartbeat(&self, worker_id: &str, session_id: u64, gpus: &[GpuFreeBytes]) -> bool {
        let leading = self.is_leading();
        let mut live = self.live();
        if let Some(worker) = live.workers.get_mut(worker_id)
            && worker
                .session
                .as_ref()
                .is_some_and(|session| session.id == session_id)
        {
            worker.last_heartbeat = Instant::now();
            worker.record.last_heartbeat_ms = now_ms();
            for reported in gpus {
                if let Some(gpu) = worker
                    .gpus
                    .iter_mut()
                    .find(|gpu| gpu.uuid == reported.gpu_uuid)
                {
                    gpu.free_bytes = reported.free_bytes;
                }
            }
            return leading;
        }
        false
    }

    /// Whether a report about `attempt` comes from the worker that holds it now.
    pub(super) fn current_attempt(
        &self,
        worker_id: &str,
        attempt: &AttemptRef,
    ) -> Option<RunningAttempt> {
        self.live()
            .running
            .get(&attempt.job_id)
            .filter(|running| {
                running.worker_id == worker_id && running.attempt_number == attempt.attempt_number
            })
            .cloned()
    }

    /// Handles one message of a worker's session; only the session the worker holds now
    /// may report.
    pub async fn handle_worker_message(
        &self,
        worker_id: &str,
        session_id: u64,
        report: WorkerReport,
    ) -> Result<(), SchedulerError> {
        // A leader past its self-fence (woken from a freeze, say) handles no report,
        // not even one that only logs: the worker sends it again to the new leader.
        self.require_leader()?;
        if !self.is_current_session(worker_id, session_id) {
            return Err(ApiError::FailedPrecondition(format!(
                "this session of worker {worker_id} was replaced or ended; reports go on \
                 the worker's current session"
            ))
            .into());
        }
        match report {
            WorkerReport::Hello => Err(SchedulerError::Api(ApiError::InvalidArgument {
                field: "body.hello".into(),
                reason: "hello is only the first message of a session".into(),
            })),
            WorkerReport::Heartbeat {
                gpus,
                cached_image_digests,
            } => {
                self.heartbeat(worker_id, session_id, &gpus);
                self.record_cached_images(worker_id, &cached_image_digests);
                Ok(())
            }
            WorkerReport::AttemptStarted {
                attempt,
                resumed_from,
                command_argv,
                uncontained,
                image_digest,
            } => {
                let started = attempt.clone();
                self.attempt_started(worker_id, attempt, resumed_from, &command_argv, uncontained)
                    .await?;
                // After the fenced start was stored: only the attempt that holds the job
                // records what its image resolved to.
                if let Some(digest) = image_digest {
                    self.record_image_digest(&started, &digest).await?;
                }
                Ok(())
            }
            WorkerReport::ImagePull { attempt, pull } => {
                self.image_pull_reported(worker_id, attempt, pull)
            }
            WorkerReport::Progress { attempt, progress } => {
                if self.current_attempt(worker_id, &attempt).is_none() {
                    return Err(self.fenced(&attempt));
                }
                if let Some(progress) = progress
                    && let Some(running) = self.live().running.get_mut(&attempt.job_id)
                {
                    running.measured_peak_bytes =
                        running.measured_peak_bytes.max(progress.memory_peak_bytes);
                    running.latest_progress = Some(progress);
                }
                self.emit(
                    &attempt.job_id,
                    JobUpdateKind::Progress {
                        attempt_number: attempt.attempt_number,
                        progress,
                    },
                );
                Ok(())
            }
            WorkerReport::Log {
                attempt,
                level,
                message,
                stream,
            } => {
                if self.current_attempt(worker_id, &attempt).is_some() {
                    self.emit(
                        &attempt.job_id,
                        JobUpdateKind::Log {
                            attempt_number: attempt.attempt_number,
                            level,
                            message,
                            stream,
                        },
                    );
                }
                Ok(())
            }
            WorkerReport::CheckpointWritten {
                attempt,
                checkpoint,
            } => {
                let _guard = self.job_changes.lock().await;
                if self.current_attempt(worker_id, &attempt).is_none() {
                    return Err(self.fenced(&attempt));
                }
                if let Some(checkpoint) = checkpoint {
                    let mut job = self.store.get_job(&attempt.job_id).await?;
                    job.checkpoint_location = Some(checkpoint.location.clone());
                    job.checkpoint_step = checkpoint.step as i64;
                    self.update_job(&job).await?;
                    // Said once stored: a leader deposed while it handled this report
                    // (its fenced write refused) must not log a checkpoint nobody kept.
                    self.emit_attempt_line(
                        &attempt,
                        format!(
                            "checkpoint of step {} written to {}",
                            checkpoint.step, checkpoint.location
                        ),
                    );
                    // Stored: the worker may now delete what this one supersedes.
                    self.send_to_worker(
                        worker_id,
                        WorkerCommand::CheckpointRecorded {
                            attempt,
                            checkpoint,
                        },
                    );
                }
                Ok(())
            }
            WorkerReport::OutOfMemory {
                attempt,
                report,
                checkpoint,
                detected_by,
                evidence,
            } => {
                let detected = OomDetected {
                    by: detected_by,
                    evidence,
                };
                self.handle_oom(worker_id, attempt, report, checkpoint, detected)
                    .await
            }
            WorkerReport::AttemptFinished {
                attempt,
                outcome,
                measured_peak_bytes,
                message,
                results,
                profile_points,
            } => {
                if !profile_points.is_empty() && outcome == Some(AttemptOutcome::Succeeded) {
                    return self
                        .handle_profile_finished(worker_id, attempt, profile_points)
                        .await;
                }
                self.handle_finished(
                    worker_id,
                    attempt,
                    outcome,
                    measured_peak_bytes,
                    &message,
                    results,
                )
                .await
            }
        }
    }

    /// An attempt started training in its slice: the time it began, the checkpoint it
    /// says it loaded, the argv it ran and whether it runs uncontained are stored, and a
    /// placed job becomes running.
    async fn attempt_started(
        &self,
        worker_id: &str,
        attempt: AttemptRef,
        resumed_from: Option<Checkpoint>,
        command_argv: &[String],
        uncontained: bool,
    ) -> Result<(), SchedulerError> {
        let _guard = self.job_changes.lock().await;
        if self.current_attempt(worker_id, &attempt).is_none() {
            return Err(self.fenced(&attempt));
        }
        // The attempt's own word on where it resumed: the checkpoint it loaded,
        // which a checkpoint report lost with its worker may not have told.
        let resumed = resumed_from
            .as_ref()
            .map(|checkpoint| (checkpoint.location.as_str(), checkpoint.step as i64));
        self.store
            .record_attempt_started(
                &attempt.job_id,
                i64::from(attempt.attempt_number),
                now_ms(),
                resumed,
                &AttemptStartDetails {
                    command_argv: command_argv.to_vec(),
                    uncontained,
                },
            )
            .await?;
        if !command_argv.is_empty() {
            self.emit_attempt_line(&attempt, format!("running {}", display_argv(command_argv)));
        }
        if let Some(checkpoint) = &resumed_from {
            self.emit_attempt_line(
                &attempt,
                format!(
                    "resumed from step {} (checkpoint {})",
                    checkpoint.step, checkpoint.location
                ),
            );
        }
        let mut job = self.store.get_job(&attempt.job_id).await?;
        if job.state == JobState::Placed {
            self.move_job(&mut job, JobEvent::Started, "the attempt started")
                .await?;
        }
        Ok(())
    }

    pub(super) fn fenced(&self, attempt: &AttemptRef) -> SchedulerError {
        SchedulerError::Conflict(format!(
            "attempt {}/{} is not this worker's any more",
            attempt.job_id, attempt.attempt_number
        ))
    }

    /// Drain and undrain: admins only.
    /// Drains (for `reason`, kept and shown with the worker; empty: none given) or
    /// undrains the worker `reference` names (its id, or its node's name); answers its id.
    pub async fn set_draining(
        &self,
        caller: &Caller,
        reference: &str,
        draining: bool,
        reason: &str,
    ) -> Result<String, SchedulerError> {
        caller.require(&[Role::Admin])?;
        let reason = if draining { reason.trim() } else { "" };
        let worker_id = {
            let mut live = self.live();
            let worker_id = live.resolve_worker(reference)?;
            let worker = live.worker_mut(&worker_id)?;
            worker.state = if draining {
                WorkerState::Draining
            } else {
                WorkerState::Ready
            };
            worker.record.drain_reason = reason.to_string();
            worker_id
        };
        self.store
            .set_worker_draining(&worker_id, draining, reason)
            .await?;
        if draining {
            self.send_to_worker(&worker_id, WorkerCommand::Drain);
        }
        self.wake();
        Ok(worker_id)
    }
}

/// A worker's GPUs as its row keeps them (column `gpus_json`): the one encoder.
fn gpus_to_column(gpus: &[Gpu]) -> String {
    let stored: Vec<GpuJson> = gpus.iter().map(GpuJson::from_gpu).collect();
    // Strings, integers and booleans always serialise.
    serde_json::to_string(&stored).unwrap_or_else(|_| "[]".into())
}

/// A worker's GPUs from its row (column `gpus_json`), as registered: the one decoder. A
/// column this build cannot read is an error naming the worker and the column, never a
/// worker without GPUs.
pub(super) fn gpus_from_column(record: &WorkerRecord) -> Result<Vec<Gpu>, SchedulerError> {
    serde_json::from_str::<Vec<GpuJson>>(&record.gpus_json)
        .map(|gpus| gpus.into_iter().map(GpuJson::into_gpu).collect())
        .map_err(|error| {
            ApiError::Internal(format!(
                "corrupt row: column gpus_json of worker {:?}: {error}",
                record.id
            ))
            .into()
        })
}

/// How a worker's GPUs are kept in the store (JSON, not the wire format).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct GpuJson {
    uuid: String,
    index: u32,
    model_name: String,
    total_bytes: u64,
    context_bytes: u64,
    simulated: bool,
    compute_capability: String,
}

impl GpuJson {
    fn from_gpu(gpu: &Gpu) -> GpuJson {
        GpuJson {
            uuid: gpu.uuid.clone(),
            index: gpu.index,
            model_name: gpu.model_name.clone(),
            total_bytes: gpu.total_bytes,
            context_bytes: gpu.context_bytes,
            simulated: gpu.simulated,
            compute_capability: gpu.compute_capability.clone(),
        }
    }

    /// The GPU as registered: all its memory but the context's is free until a
    /// heartbeat says otherwise.
    fn into_gpu(self) -> Gpu {
        Gpu {
            uuid: self.uuid,
            index: self.index,
            model_name: self.model_name,
            total_bytes: self.total_bytes,
            context_bytes: self.context_bytes,
            free_bytes: self.total_bytes.saturating_sub(self.context_bytes),
            simulated: self.simulated,
            compute_capability: self.compute_capability,
        }
    }
}
