//! How attempts and jobs end: a cancel, an attempt's finish, an out-of-memory report and
//! its retry through the shrink planner, a lost lease, and the retries after
//! infrastructure failures with their backoff.

use std::time::Duration;

use carve_core::allocator::OutOfMemory;
use carve_core::command::memory_model::learning::Measurement;
use carve_core::job_state::{AttemptOutcome, JobEvent, JobState};
use carve_core::shrink::OomObservation;
use carve_proto::ApiError;
use tokio::time::Instant;

use crate::auth::Caller;
use crate::error::SchedulerError;
use crate::metrics::Metrics;
use crate::store::{
    AttemptEnd, AttemptEndDetails, AttemptResults, JobRecord, config_to_json, estimate_to_json,
};

use super::command_jobs::OomDetected;
use super::logs::JobUpdateKind;
use super::worker_reports::{AttemptRef, Checkpoint, WorkerCommand};
use super::{INFRASTRUCTURE_RETRIES, RunningAttempt, Scheduler, StateChange, WorkerState, now_ms};

impl Scheduler {
    /// Cancels the job `reference` names (as [`Scheduler::visible_job`] reads it) if it has
    /// not ended: it is cancelled at once, and
    /// a running attempt is asked to stop (its slice is freed when its worker confirms).
    pub async fn cancel(
        &self,
        caller: &Caller,
        reference: &str,
        reason: &str,
    ) -> Result<JobRecord, SchedulerError> {
        let _guard = self.job_changes.lock().await;
        let mut job = self.visible_job(caller, reference).await?;
        // The reference may be a prefix or a name: from here on, the job's own id.
        let job_id = &job.id.clone();
        if job.state.is_terminal() {
            return Err(ApiError::FailedPrecondition(format!(
                "job {job_id} already {}",
                job.state
            ))
            .into());
        }
        let message = if reason.is_empty() {
            format!("cancelled by {}", caller.token_id)
        } else {
            format!("cancelled: {reason}")
        };
        job.message.clone_from(&message);
        job.finished_at_ms = Some(now_ms());
        job.waiting_reason.clear();
        self.move_job(&mut job, JobEvent::CancelRequested, &message)
            .await?;
        // A running attempt keeps its slice until its worker confirms it stopped.
        let running = self.live().running.get(job_id).cloned();
        if let Some(running) = running {
            self.send_to_worker(
                &running.worker_id,
                WorkerCommand::Cancel {
                    attempt: AttemptRef {
                        job_id: job_id.to_string(),
                        attempt_number: running.attempt_number,
                        lease_epoch: running.lease_epoch,
                    },
                    grace_period: Duration::from_secs(10),
                    reason: job.message.clone(),
                },
            );
        }
        Metrics::count(&self.metrics.jobs_cancelled);
        Ok(job)
    }

    pub(super) async fn handle_oom(
        &self,
        worker_id: &str,
        attempt: AttemptRef,
        report: OutOfMemory,
        checkpoint: Option<Checkpoint>,
        detected: OomDetected,
    ) -> Result<(), SchedulerError> {
        let _guard = self.job_changes.lock().await;
        let running = self
            .current_attempt(worker_id, &attempt)
            .ok_or_else(|| self.fenced(&attempt))?;
        let now = now_ms();
        let end = AttemptEnd {
            job_id: attempt.job_id.clone(),
            attempt_number: i64::from(attempt.attempt_number),
            outcome: AttemptOutcome::OutOfMemory,
            measured_peak_bytes: Some(report.peak as i64),
            oom: Some(report),
            message: if detected.evidence.is_empty() {
                report.to_string()
            } else {
                detected.evidence.clone()
            },
            finished_at_ms: now,
            results: running.results_so_far(),
            details: AttemptEndDetails {
                profile_points: Vec::new(),
                oom_detected_by: Some(detected.by),
            },
        };
        let mut job = self.store.get_job(&attempt.job_id).await?;
        if let Some(checkpoint) = checkpoint.filter(|checkpoint| !checkpoint.location.is_empty()) {
            job.checkpoint_location = Some(checkpoint.location);
            job.checkpoint_step = checkpoint.step as i64;
        }
        let old_config = job.config()?;
        let job_id = job.id.clone();
        let announce_out_of_memory = |config| {
            Metrics::count(&self.metrics.out_of_memory_reports);
            self.emit(
                &job_id,
                JobUpdateKind::OutOfMemory {
                    attempt_number: attempt.attempt_number,
                    config,
                    report,
                },
            );
        };
        if job.state.is_terminal() {
            // Cancelled meanwhile: the slice is free, nothing to retry.
            self.end_attempt_with_job(&end, &mut job, None).await?;
            self.live().running.remove(&attempt.job_id);
            announce_out_of_memory(old_config);
            self.wake();
            return Ok(());
        }
        // This attempt is still running in the store: it is counted by hand.
        let out_of_memory_attempts = 1 + self
            .store
            .list_attempts(&job.id)
            .await?
            .iter()
            .filter(|stored| {
                stored.outcome == AttemptOutcome::OutOfMemory
                    && stored.attempt_number != end.attempt_number
            })
            .count();
        let observation = OomObservation {
            report,
            estimated_required_bytes: running.estimate_bytes,
        };
        let slice_bytes = running.slice_bytes;
        let workload = self.stored_workload(&job).await?;
        // A command job's memory model (by its command's shape) is raised to what this
        // attempt showed it needed; without one, the planner works from the OOM alone.
        let measured = match workload.memory_model_key() {
            Some(key) => {
                let needed = report.in_use.saturating_add(report.requested);
                self.refine_command_memory_model(
                    &job.tenant,
                    &job.id,
                    attempt.attempt_number,
                    &key.shape_key,
                    &old_config,
                    Measurement::OutOfMemory(needed),
                )
                .await?
            }
            None => None,
        };
        let max_retries = workload.max_oom_retries();
        // The shrink planner grows with the model: the compute pool runs it.
        let planned = self
            .compute
            .run_for_scheduler(move || {
                workload.plan_shrink(
                    &old_config,
                    Some(&observation),
                    slice_bytes,
                    measured.as_ref(),
                )
            })
            .await?;
        let retries_left = out_of_memory_attempts <= max_retries as usize;
        match planned {
            Ok(decision) if retries_left && decision.config != old_config => {
                job.config_json = config_to_json(&decision.config);
                job.estimate_json = estimate_to_json(&decision.estimate);
                job.required_bytes =
                    running.slice_bytes.max(decision.estimate.required_bytes) as i64;
                job.waiting_reason = String::new();
                let event = JobEvent::AttemptOutOfMemory {
                    retry_allowed: true,
                };
                let change = self
                    .end_attempt_with_job(&end, &mut job, Some(event))
                    .await?;
                self.live().running.remove(&attempt.job_id);
                announce_out_of_memory(old_config);
                // The decision's event comes first: the log tells the shrink, then the
                // job's return to the queue with it.
                self.emit(
                    &job.id,
                    JobUpdateKind::Shrink {
                        old_config,
                        decision: decision.clone(),
                    },
                );
                if let Some(change) = change {
                    let reason = "out of memory: retrying with a smaller configuration";
                    self.emit_state(&job.id, change, reason);
                }
                Metrics::count(&self.metrics.retries);
            }
            outcome => {
                let why = match outcome {
                    Err(error) => error.to_string(),
                    Ok(_) if !retries_left => {
                        format!("the retry limit of {max_retries} is reached")
                    }
                    Ok(_) => "the shrink planner found nothing smaller that fits".to_string(),
                };
                let message = format!("out of memory ({report}); {why}");
                job.message.clone_from(&message);
                job.finished_at_ms = Some(now);
                let event = JobEvent::AttemptOutOfMemory {
                    retry_allowed: false,
                };
                let change = self
                    .end_attempt_with_job(&end, &mut job, Some(event))
                    .await?;
                self.live().running.remove(&attempt.job_id);
                announce_out_of_memory(old_config);
                if let Some(change) = change {
                    self.emit_state(&job.id, change, &message);
                }
                Metrics::count(&self.metrics.jobs_failed);
                Metrics::count(&self.metrics.oom_retries_exhausted);
            }
        }
        self.wake();
        Ok(())
    }

    pub(super) async fn handle_finished(
        &self,
        worker_id: &str,
        attempt: AttemptRef,
        outcome: Option<AttemptOutcome>,
        measured_peak_bytes: u64,
        message: &str,
        mut results: AttemptResults,
    ) -> Result<(), SchedulerError> {
        let _guard = self.job_changes.lock().await;
        let running = self
            .current_attempt(worker_id, &attempt)
            .ok_or_else(|| self.fenced(&attempt))?;
        let outcome = match outcome {
            Some(
                outcome @ (AttemptOutcome::Succeeded
                | AttemptOutcome::Cancelled
                | AttemptOutcome::Failed
                | AttemptOutcome::Interrupted),
            ) => outcome,
            _ => {
                return Err(ApiError::InvalidArgument {
                    field: "attempt_finished.outcome".into(),
                    reason: "must be succeeded, failed, cancelled or interrupted (out-of-memory goes in an oom report)".into(),
                }.into());
            }
        };
        let now = now_ms();
        // Read, not taken: the book (and the store) forget the eviction only once the
        // end is stored, so a report that fails here and comes again is still read as
        // preempted.
        let eviction = self
            .live()
            .preemption
            .eviction(&attempt.job_id)
            .filter(|eviction| eviction.attempt_number == attempt.attempt_number)
            .cloned();
        // A victim that stopped when told (or was killed after the grace) was preempted;
        // one that ended on its own first ends as it says.
        let (outcome, message) = match (&eviction, outcome) {
            (Some(eviction), AttemptOutcome::Cancelled | AttemptOutcome::Interrupted) => {
                (AttemptOutcome::Preempted, eviction.message.as_str())
            }
            _ => (outcome, message),
        };
        let measured = (measured_peak_bytes > 0).then_some(measured_peak_bytes as i64);
        results.steps_done = results.steps_done.or(running.results_so_far().steps_done);
        let end = AttemptEnd {
            job_id: attempt.job_id.clone(),
            attempt_number: i64::from(attempt.attempt_number),
            outcome,
            measured_peak_bytes: measured,
            oom: None,
            message: message.to_string(),
            finished_at_ms: now,
            results: results.clone(),
            details: AttemptEndDetails::default(),
        };
        let mut job = self.store.get_job(&attempt.job_id).await?;
        // The job's move is decided before anything is written, and stored with the
        // attempt's end in one transaction.
        let mut backoff = None;
        let (event, reason) = if job.state.is_terminal() {
            (None, String::new())
        } else {
            match outcome {
                AttemptOutcome::Preempted => {
                    // Back to the queue at once (no backoff), keeping its submit sequence:
                    // it is ahead of its younger peers, and resumes from its checkpoint.
                    job.waiting_reason = format!(
                        "preempted: resumes from the checkpoint of step {}",
                        job.checkpoint_step
                    );
                    job.message = message.to_string();
                    let note = format!(
                        "attempt {} {message}; attempt {} resumes from step {}",
                        attempt.attempt_number,
                        attempt.attempt_number + 1,
                        job.checkpoint_step
                    );
                    (Some(JobEvent::AttemptLost), note)
                }
                AttemptOutcome::Interrupted => {
                    let what_happened = format!(
                        "attempt {} was interrupted: {}",
                        attempt.attempt_number, message
                    );
                    let retry = self
                        .plan_infrastructure_retry(&mut job, &end, &what_happened, now)
                        .await?;
                    backoff = retry.backoff;
                    (Some(retry.event), retry.reason)
                }
                _ => {
                    job.finished_at_ms = Some(now);
                    if outcome == AttemptOutcome::Failed {
                        job.message =
                            format!("attempt {} failed: {}", attempt.attempt_number, message);
                    }
                    let event = match outcome {
                        AttemptOutcome::Succeeded => JobEvent::AttemptSucceeded,
                        AttemptOutcome::Cancelled => JobEvent::CancelRequested,
                        _ => JobEvent::AttemptFailed,
                    };
                    (Some(event), message.to_string())
                }
            }
        };
        let change = self.end_attempt_with_job(&end, &mut job, event).await?;
        // After the end is stored: a scheduler that stops in between still reads this
        // victim's report as preempted, and drops the stale row at recovery.
        self.end_eviction(&attempt.job_id, attempt.attempt_number)
            .await;
        self.log_results(&attempt.job_id, attempt.attempt_number, &results);
        self.live().running.remove(&attempt.job_id);
        if let Some(change) = change {
            self.emit_state(&job.id, change, &reason);
            self.count_job_change(change);
        }
        self.back_off(&job.id, backoff);
        if let (Some(measured), AttemptOutcome::Succeeded) = (measured, outcome) {
            let config = job.config()?;
            let workload = self.stored_workload(&job).await?;
            if let Some(key) = workload.memory_model_key() {
                self.refine_command_memory_model(
                    &job.tenant,
                    &job.id,
                    attempt.attempt_number,
                    &key.shape_key,
                    &config,
                    Measurement::Peak(measured as u64),
                )
                .await?;
            }
            let shape_key = workload.peak_key(&config);
            self.store
                .record_peak(&shape_key, running.estimate_bytes as i64, measured, now)
                .await?;
            self.lookups.peak_corrections.invalidate(&shape_key);
        }
        self.wake();
        Ok(())
    }

    /// Counts a job's change that an attempt's end made in the metrics of ended jobs.
    pub(super) fn count_job_change(&self, change: StateChange) {
        match change.next {
            JobState::Succeeded => Metrics::count(&self.metrics.jobs_succeeded),
            JobState::Cancelled => Metrics::count(&self.metrics.jobs_cancelled),
            JobState::Failed => Metrics::count(&self.metrics.jobs_failed),
            _ => {}
        }
    }

    /// Workers silent for longer than the lease lose their attempts, which go back to
    /// the queue and resume from their last checkpoint.
    ///
    /// A scheduler that could not run this check for half a lease (its host stalled, or
    /// it was starved) cannot tell silent workers from heartbeats it did not get to
    /// read: it gives every worker a fresh lease instead of declaring any lost.
    pub async fn expire_leases(&self) -> Result<(), SchedulerError> {
        let lease = self.settings.lease_duration;
        let checked_at = Instant::now();
        let previous_check = self
            .last_lease_check
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .replace(checked_at);
        if previous_check.is_some_and(|previous| checked_at - previous > lease / 2) {
            tracing::warn!(
                since_last_check = ?previous_check.map(|previous| checked_at - previous),
                "the lease check was late: every worker gets a fresh lease"
            );
            for worker in self.live().workers.values_mut() {
                worker.last_heartbeat = worker.last_heartbeat.max(checked_at);
            }
            return Ok(());
        }
        let expired: Vec<String> = {
            let live = self.live();
            live.workers
                .iter()
                .filter(|(_, worker)| {
                    worker.state != WorkerState::Lost && worker.last_heartbeat.elapsed() > lease
                })
                .map(|(id, _)| id.clone())
                .collect()
        };
        if expired.is_empty() {
            return Ok(());
        }
        let _guard = self.job_changes.lock().await;
        let now = now_ms();
        for worker_id in expired {
            let lost_attempts: Vec<(String, RunningAttempt)> = {
                let mut live = self.live();
                if let Some(worker) = live.workers.get_mut(&worker_id) {
                    worker.state = WorkerState::Lost;
                    if let Some(session) = worker.session.take() {
                        session.end(SchedulerError::Api(ApiError::Unavailable(format!(
                            "no heartbeat for longer than the lease ({lease:?}): this \
                             worker's attempts were requeued; register again"
                        ))));
                    }
                }
                let lost: Vec<String> = live
                    .running
                    .iter()
                    .filter(|(_, running)| running.worker_id == worker_id)
                    .map(|(job_id, _)| job_id.clone())
                    .collect();
                lost.into_iter()
                    .filter_map(|job_id| {
                        live.running
                            .remove(&job_id)
                            .map(|running| (job_id, running))
                    })
                    .collect()
            };
            self.store
                .set_worker_state(&worker_id, WorkerState::Lost)
                .await?;
            for (job_id, running) in lost_attempts {
                self.lose_attempt(
                    &job_id,
                    &running,
                    &format!("worker {worker_id} stopped heartbeating"),
                    &format!(
                        "lease lost: worker {worker_id} stopped heartbeating during \
                         attempt {}",
                        running.attempt_number
                    ),
                    now,
                )
                .await?;
            }
        }
        self.wake();
        Ok(())
    }

    /// Ends `running` (already taken out of the live state) as lost with `message`, and
    /// retries its job after the infrastructure backoff for `reason`, both in one write.
    /// An attempt that already ended or was reassigned is left as it is: whoever ended
    /// or reassigned it moved its job with it. Called under `job_changes`.
    pub(super) async fn lose_attempt(
        &self,
        job_id: &str,
        running: &RunningAttempt,
        message: &str,
        reason: &str,
        now: i64,
    ) -> Result<(), SchedulerError> {
        Metrics::count(&self.metrics.attempts_lost);
        let end = AttemptEnd {
            job_id: job_id.to_string(),
            attempt_number: i64::from(running.attempt_number),
            outcome: AttemptOutcome::Lost,
            measured_peak_bytes: None,
            oom: None,
            message: message.to_string(),
            finished_at_ms: now,
            results: running.results_so_far(),
            details: AttemptEndDetails::default(),
        };
        let mut job = self.store.get_job(job_id).await?;
        let retry = if job.state.is_terminal() {
            None
        } else {
            Some(
                self.plan_infrastructure_retry(&mut job, &end, reason, now)
                    .await?,
            )
        };
        let event = retry.as_ref().map(|retry| retry.event);
        match self.end_attempt_with_job(&end, &mut job, event).await {
            Ok(change) => {
                if let (Some(change), Some(retry)) = (change, retry) {
                    self.emit_state(&job.id, change, &retry.reason);
                    self.count_job_change(change);
                    self.back_off(&job.id, retry.backoff);
                }
                Ok(())
            }
            Err(SchedulerError::Conflict(_)) => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// What an infrastructure failure (an attempt `end` says was lost or interrupted)
    /// does to its job, decided before anything is written: back to the queue to resume
    /// from its checkpoint after a backoff that doubles with each such failure, or failed
    /// once it has had [`INFRASTRUCTURE_RETRIES`] retries. Sets the job's waiting reason
    /// or its message and end. Called under `job_changes`.
    async fn plan_infrastructure_retry(
        &self,
        job: &mut JobRecord,
        end: &AttemptEnd,
        what_happened: &str,
        now: i64,
    ) -> Result<InfrastructureRetry, SchedulerError> {
        // The attempt that ends now is still running in the store: counted by hand.
        let failures = 1 + self
            .store
            .list_attempts(&job.id)
            .await?
            .iter()
            .filter(|stored| {
                matches!(
                    stored.outcome,
                    AttemptOutcome::Lost | AttemptOutcome::Interrupted
                ) && stored.attempt_number != end.attempt_number
            })
            .count();
        if failures > INFRASTRUCTURE_RETRIES {
            let message = format!(
                "{what_happened}; it was the job's {failures}th infrastructure failure, and \
                 it is retried only {INFRASTRUCTURE_RETRIES} times"
            );
            job.message.clone_from(&message);
            job.finished_at_ms = Some(now);
            return Ok(InfrastructureRetry {
                event: JobEvent::AttemptFailed,
                reason: message,
                backoff: None,
            });
        }
        let backoff = self
            .settings
            .infrastructure_retry_backoff
            .saturating_mul(1 << (failures - 1));
        job.waiting_reason = format!(
            "backing off for {backoff:?} after an infrastructure failure ({failures} of \
             {INFRASTRUCTURE_RETRIES} retries)"
        );
        Ok(InfrastructureRetry {
            event: JobEvent::AttemptLost,
            reason: format!(
                "{what_happened}; attempt {} resumes from the checkpoint after {backoff:?}",
                end.attempt_number + 1
            ),
            backoff: Some(backoff),
        })
    }

    /// Holds a job back from placement for `backoff`, once its return to the queue is
    /// stored. Under `job_changes`, like every pass: none reads the queue before this
    /// is set.
    fn back_off(&self, job_id: &str, backoff: Option<Duration>) {
        if let Some(backoff) = backoff {
            self.live()
                .backing_off
                .insert(job_id.to_string(), Instant::now() + backoff);
        }
    }
}

/// What an infrastructure failure does to its job ([`Scheduler::plan_infrastructure_retry`]):
/// its move, the reason its log gives, and the wait before it is placed again (none when
/// it fails).
struct InfrastructureRetry {
    event: JobEvent,
    reason: String,
    backoff: Option<Duration>,
}
