//! How attempts and jobs end: a cancel, an attempt's finish, an out-of-memory report and
//! its retry through the shrink planner, a lost lease, and the retries after
//! infrastructure failures with their backoff.

use std::time::Duration;

use carve_core::allocator::OutOfMemory;
use carve_core::command::memory_model::CommandMemoryModel;
use carve_core::command::shrink::plan_command_shrink;
use carve_core::job_state::{AttemptOutcome, JobEvent, JobState};
use carve_core::shrink::{OomObservation, plan_shrink};
use carve_proto::ApiError;
use tokio::time::Instant;

use crate::auth::Caller;
use crate::convert::{config_from_json, config_to_json, estimate_to_json};
use crate::error::SchedulerError;
use crate::metrics::Metrics;
use crate::store::{AttemptEndDetails, AttemptResults, JobRecord};

use super::admission::shape_key;
use super::command_jobs::{OomDetected, command_peak_key, is_command_spec, stored_command_job};
use super::logs::JobUpdateKind;
use super::worker_reports::{AttemptRef, Checkpoint, WorkerCommand};
use super::{
    INFRASTRUCTURE_RETRIES, RunningAttempt, Scheduler, WorkerState, now_ms, spec_error,
    stored_spec_text,
};

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
        self.store
            .finish_attempt(
                &attempt.job_id,
                i64::from(attempt.attempt_number),
                attempt.lease_epoch as i64,
                AttemptOutcome::OutOfMemory,
                Some(report.peak as i64),
                Some(&report),
                &if detected.evidence.is_empty() {
                    report.to_string()
                } else {
                    detected.evidence.clone()
                },
                now,
                &running.results_so_far(),
                &AttemptEndDetails {
                    profile_points_json: String::new(),
                    oom_detected_by: detected.by.clone(),
                },
            )
            .await?;
        self.live().running.remove(&attempt.job_id);
        Metrics::count(&self.metrics.out_of_memory_reports);
        let mut job = self.store.get_job(&attempt.job_id).await?;
        if let Some(checkpoint) = checkpoint.filter(|checkpoint| !checkpoint.location.is_empty()) {
            job.checkpoint_location = Some(checkpoint.location);
            job.checkpoint_step = checkpoint.step as i64;
        }
        let old_config = config_from_json(&job.config_json)?;
        self.emit(
            &job.id,
            JobUpdateKind::OutOfMemory {
                attempt_number: attempt.attempt_number,
                config: old_config,
                report,
            },
        );
        if job.state.is_terminal() {
            // Cancelled meanwhile: the slice is free, nothing to retry.
            self.wake();
            return Ok(());
        }
        let attempts = self.store.list_attempts(&job.id).await?;
        let out_of_memory_attempts = attempts
            .iter()
            .filter(|attempt| attempt.outcome == AttemptOutcome::OutOfMemory)
            .count();
        let observation = OomObservation {
            report,
            estimated_required_bytes: running.estimate_bytes,
        };
        let slice_bytes = running.slice_bytes;
        let (max_retries, planned) = if is_command_spec(&job.spec_json) {
            // A command job's next configuration comes from its memory model, raised to
            // what this attempt showed it needed (without a profile, from the OOM alone).
            let command = stored_command_job(&job.spec_json)?;
            let needed = report.in_use.saturating_add(report.requested);
            let model = self
                .refine_command_memory_model(&command, &old_config, needed)
                .await?
                .unwrap_or_else(|| CommandMemoryModel::from_out_of_memory(&old_config, &report));
            let planned = plan_command_shrink(
                &command,
                &model,
                &old_config,
                Some(&observation),
                slice_bytes,
            );
            (command.spec.oom.max_retries, planned)
        } else {
            // Validation and the shrink planner grow with the model: the compute pool
            // runs them (the scheduler's own work, charged to no tenant's budget).
            let spec_json = job.spec_json.clone();
            self.compute
                .run_for_scheduler(move || {
                    let validated = stored_spec_text(&spec_json)?;
                    let planned =
                        plan_shrink(&validated, &old_config, Some(&observation), slice_bytes);
                    Ok::<_, SchedulerError>((validated.spec.oom.max_retries, planned))
                })
                .await??
        };
        let retries_left = out_of_memory_attempts <= max_retries as usize;
        match planned {
            Ok(decision) if retries_left && decision.config != old_config => {
                job.config_json = config_to_json(&decision.config);
                job.estimate_json = estimate_to_json(&decision.estimate);
                job.required_bytes =
                    running.slice_bytes.max(decision.estimate.required_bytes) as i64;
                job.waiting_reason = String::new();
                // The decision's event comes first: the log tells the shrink, then the
                // job's return to the queue with it.
                self.emit(
                    &job.id,
                    JobUpdateKind::Shrink {
                        old_config,
                        decision: decision.clone(),
                    },
                );
                self.move_job(
                    &mut job,
                    JobEvent::AttemptOutOfMemory {
                        retry_allowed: true,
                    },
                    "out of memory: retrying with a smaller configuration",
                )
                .await?;
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
                self.move_job(
                    &mut job,
                    JobEvent::AttemptOutOfMemory {
                        retry_allowed: false,
                    },
                    &message,
                )
                .await?;
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
        let eviction = self
            .live()
            .preemption
            .take_eviction(&attempt.job_id, attempt.attempt_number);
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
        self.store
            .finish_attempt(
                &attempt.job_id,
                i64::from(attempt.attempt_number),
                attempt.lease_epoch as i64,
                outcome,
                measured,
                None,
                message,
                now,
                &results,
                &AttemptEndDetails::default(),
            )
            .await?;
        self.log_results(&attempt.job_id, attempt.attempt_number, &results);
        self.live().running.remove(&attempt.job_id);
        let mut job = self.store.get_job(&attempt.job_id).await?;
        if let (Some(measured), AttemptOutcome::Succeeded) = (measured, outcome) {
            let config = config_from_json(&job.config_json)?;
            let shape_key = if is_command_spec(&job.spec_json) {
                let command = stored_command_job(&job.spec_json)?;
                self.refine_command_memory_model(&command, &config, measured as u64)
                    .await?;
                command_peak_key(&command, &config)
            } else {
                // The model as written is all the key needs: parsed, not validated again.
                let spec =
                    carve_proto::convert::job_spec_from_json(&job.spec_json).map_err(spec_error)?;
                shape_key(&spec.model, &config)
            };
            self.store
                .record_peak(&shape_key, running.estimate_bytes as i64, measured, now)
                .await?;
            self.lookups.peak_corrections.invalidate(&shape_key);
        }
        if outcome == AttemptOutcome::Preempted {
            if !job.state.is_terminal() {
                // Back to the queue at once (no backoff), keeping its submit sequence: it
                // is ahead of its younger peers, and resumes from its checkpoint.
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
                self.move_job(&mut job, JobEvent::AttemptLost, &note)
                    .await?;
            }
        } else if outcome == AttemptOutcome::Interrupted {
            if !job.state.is_terminal() {
                self.retry_after_infrastructure_failure(
                    &mut job,
                    attempt.attempt_number,
                    &format!(
                        "attempt {} was interrupted: {}",
                        attempt.attempt_number, message
                    ),
                    now,
                )
                .await?;
            }
        } else if !job.state.is_terminal() {
            let event = match outcome {
                AttemptOutcome::Succeeded => JobEvent::AttemptSucceeded,
                AttemptOutcome::Cancelled => JobEvent::CancelRequested,
                _ => JobEvent::AttemptFailed,
            };
            job.finished_at_ms = Some(now);
            if outcome == AttemptOutcome::Failed {
                job.message = format!("attempt {} failed: {}", attempt.attempt_number, message);
            }
            let change = self.move_job(&mut job, event, message).await?;
            Metrics::count(match change.next {
                JobState::Succeeded => &self.metrics.jobs_succeeded,
                JobState::Cancelled => &self.metrics.jobs_cancelled,
                _ => &self.metrics.jobs_failed,
            });
        }
        self.wake();
        Ok(())
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
    /// retries its job after the infrastructure backoff for `reason`. Called under
    /// `job_changes`.
    pub(super) async fn lose_attempt(
        &self,
        job_id: &str,
        running: &RunningAttempt,
        message: &str,
        reason: &str,
        now: i64,
    ) -> Result<(), SchedulerError> {
        Metrics::count(&self.metrics.attempts_lost);
        let fenced = self
            .store
            .finish_attempt(
                job_id,
                i64::from(running.attempt_number),
                running.lease_epoch as i64,
                AttemptOutcome::Lost,
                None,
                None,
                message,
                now,
                &running.results_so_far(),
                &AttemptEndDetails::default(),
            )
            .await;
        if let Err(error) = fenced
            && !matches!(error, SchedulerError::Conflict(_))
        {
            return Err(error);
        }
        let mut job = self.store.get_job(job_id).await?;
        if !job.state.is_terminal() {
            self.retry_after_infrastructure_failure(&mut job, running.attempt_number, reason, now)
                .await?;
        }
        Ok(())
    }

    /// After an attempt died of an infrastructure failure (its outcome, `lost` or
    /// `interrupted`, already stored): the job goes back to the queue to resume from its
    /// checkpoint after a backoff that doubles with each such failure, or fails once it
    /// has had [`INFRASTRUCTURE_RETRIES`] retries. Called under `job_changes`.
    async fn retry_after_infrastructure_failure(
        &self,
        job: &mut JobRecord,
        attempt_number: u32,
        what_happened: &str,
        now: i64,
    ) -> Result<(), SchedulerError> {
        let failures = self
            .store
            .list_attempts(&job.id)
            .await?
            .iter()
            .filter(|attempt| {
                matches!(
                    attempt.outcome,
                    AttemptOutcome::Lost | AttemptOutcome::Interrupted
                )
            })
            .count()
            .max(1);
        if failures > INFRASTRUCTURE_RETRIES {
            let message = format!(
                "{what_happened}; it was the job's {failures}th infrastructure failure, and \
                 it is retried only {INFRASTRUCTURE_RETRIES} times"
            );
            job.message.clone_from(&message);
            job.finished_at_ms = Some(now);
            self.move_job(job, JobEvent::AttemptFailed, &message)
                .await?;
            Metrics::count(&self.metrics.jobs_failed);
            return Ok(());
        }
        let backoff = self
            .settings
            .infrastructure_retry_backoff
            .saturating_mul(1 << (failures - 1));
        job.waiting_reason = format!(
            "backing off for {backoff:?} after an infrastructure failure ({failures} of \
             {INFRASTRUCTURE_RETRIES} retries)"
        );
        self.move_job(
            job,
            JobEvent::AttemptLost,
            &format!(
                "{what_happened}; attempt {} resumes from the checkpoint after {backoff:?}",
                attempt_number + 1
            ),
        )
        .await?;
        // Under `job_changes`, like every pass: none reads the queue before this is set.
        self.live()
            .backing_off
            .insert(job.id.clone(), Instant::now() + backoff);
        Ok(())
    }
}
