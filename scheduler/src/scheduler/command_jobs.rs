//! Command jobs in the scheduler: a profile's end (the model fitted, or the profile found
//! unmeasured and a fallback kept; the job sized and queued to train) and the profiles
//! made to fit the cluster. The memory models themselves, per tenant, are
//! `memory_models.rs`'s. Every decision is core's (`carve_core::command`).

use carve_core::admission::size_slice_at_admission;
use carve_core::bytes::HumanBytes;
use carve_core::command::memory_model::ProfilePoint;
use carve_core::command::memory_model::learning::{
    LearnedModel, ProfileAssessment, assess_profile,
};
use carve_core::command::oom::OomSource;
use carve_core::command::render::RenderedCommand;
use carve_core::job_state::{AttemptOutcome, JobEvent};
use carve_core::spec::VramRequest;

use crate::error::SchedulerError;
use crate::store::{
    AttemptEnd, AttemptEndDetails, AttemptResults, config_to_json, estimate_to_json,
};

use super::admission::largest_usable_gpu;
use super::worker_reports::AttemptRef;
use super::{Scheduler, now_ms};

/// A rendered argv as one line a person can read.
pub(super) fn display_argv(argv: &[String]) -> String {
    RenderedCommand {
        argv: argv.to_vec(),
        env: Default::default(),
        working_directory: None,
    }
    .display_line()
}

/// Who detected an attempt's out-of-memory, and what they said.
#[derive(Debug, Clone)]
pub(super) struct OomDetected {
    pub by: OomSource,
    /// The guard's numbers or the framework's line; may be empty.
    pub evidence: String,
}

impl Scheduler {
    /// Gives the profile of each job in `waiting` (queued jobs larger than every GPU,
    /// with the largest GPU's usable bytes) that is a command job still to be profiled
    /// the largest slice the cluster has: its slice was chosen at submit, roomy for the
    /// GPUs known then (or `workload::PROFILE_SLICE_WITHOUT_GPUS` before any registered), and a
    /// profile needs room, not a size. Returns how many it changed.
    pub(super) async fn fit_profiles_to_the_cluster(
        &self,
        waiting: &[(String, u64)],
    ) -> Result<usize, SchedulerError> {
        let mut refitted = 0;
        for (job_id, largest_gpu) in waiting {
            let mut job = self.store.get_job(job_id).await?;
            // Only a kind whose memory is measured has a profile to make room for.
            if job.state != carve_core::job_state::JobState::Queued
                || !job.kind.memory_is_measured()
            {
                continue;
            }
            let workload = self.stored_workload(&job).await?;
            let measured = self.measured_memory_model(&job.tenant, &workload).await?;
            if !workload.needs_profile(measured.as_ref()) {
                continue;
            }
            let config = job.config()?;
            // A profile's estimate is the slice it runs in: the largest GPU's.
            let estimate = workload
                .estimate(&config, measured.as_ref(), Some(*largest_gpu))
                .map_err(|error| {
                    SchedulerError::invalid_argument(format!("spec.{}", error.field), error.reason)
                })?;
            job.required_bytes = estimate.required_bytes as i64;
            job.estimate_json = estimate_to_json(&estimate);
            job.waiting_reason.clear();
            self.update_job(&job).await?;
            refitted += 1;
        }
        Ok(refitted)
    }

    /// A command job's profile ended with its points: the attempt is stored as a
    /// succeeded profile, the model is fitted and kept for the command's shape, and the
    /// job, sized by it (shrunk ahead of time when it cannot fit as written), is queued
    /// to train. A model that cannot be fitted, or a job that cannot fit, fails it.
    pub(super) async fn handle_profile_finished(
        &self,
        worker_id: &str,
        attempt: AttemptRef,
        points: Vec<ProfilePoint>,
    ) -> Result<(), SchedulerError> {
        let _guard = self.job_changes.lock().await;
        let Some(running) = self.current_attempt(worker_id, &attempt) else {
            return Err(self.fenced(&attempt));
        };
        let mut job = self.store.get_job(&attempt.job_id).await?;
        let workload = self.stored_workload(&job).await?;
        // Only a job whose memory is measured has a memory model for a profile to fit.
        let key = workload.memory_model_key().ok_or_else(|| {
            SchedulerError::Api(carve_proto::ApiError::FailedPrecondition(format!(
                "job {} is a {} job: only a command job's attempt is a profile",
                job.id, job.kind
            )))
        })?;
        let config = job.config()?;
        let gpus = self.gpu_states();
        let largest_gpu = largest_usable_gpu(&gpus);
        // What the profile measured, judged by core: points of 0 B or past every GPU are
        // no measurement, and a profile left with none is unmeasured (a fallback, said
        // so), never a 0-byte model.
        let assessment = assess_profile(
            &points,
            config.precision,
            config.recompute_segment_layers.is_some(),
            running.slice_bytes,
            largest_gpu,
            key.declared_bytes,
        );
        let points_text = points
            .iter()
            .map(|point| {
                format!(
                    "micro-batch {}: {}{}",
                    point.micro_batch,
                    HumanBytes(point.peak_bytes),
                    if point.ran_out { " (ran out)" } else { "" }
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        let now = now_ms();
        let peak = points
            .iter()
            .map(|point| point.peak_bytes)
            .max()
            .unwrap_or(0);
        let end = AttemptEnd {
            job_id: attempt.job_id.clone(),
            attempt_number: i64::from(attempt.attempt_number),
            outcome: AttemptOutcome::Succeeded,
            measured_peak_bytes: Some(peak as i64),
            oom: None,
            message: format!("profile measured {points_text}"),
            finished_at_ms: now,
            results: AttemptResults::default(),
            details: AttemptEndDetails {
                profile_points: points.clone(),
                oom_detected_by: None,
            },
        };
        if job.state.is_terminal() {
            // Cancelled meanwhile: the slice is free, nothing to size.
            self.end_attempt_with_job(&end, &mut job, None).await?;
            self.live().running.remove(&attempt.job_id);
            self.emit_attempt_line(&attempt, end.message);
            self.wake();
            return Ok(());
        }
        let source = format!("{} attempt {}'s profile", job.id, attempt.attempt_number);
        let (learned, basis) = match assessment {
            ProfileAssessment::Measured { model, ignored } => (
                LearnedModel {
                    model,
                    measured: true,
                },
                format!(
                    "fitted from {source} ({points_text}){}",
                    if ignored.is_empty() {
                        String::new()
                    } else {
                        format!("; left out: {}", ignored.join(", "))
                    }
                ),
            ),
            ProfileAssessment::Unmeasured { fallback, why } => {
                (fallback, format!("{why} (from {source}: {points_text})"))
            }
        };
        let model = learned.model;
        let floor = self.settings.min_slice_bytes;
        let sized = size_slice_at_admission(
            VramRequest::Auto,
            config,
            model.need_bytes(&config),
            1.0,
            largest_gpu,
            |current, limit| {
                workload
                    .plan_shrink(current, None, limit, Some(&model))
                    .map(|decision| (decision.config, decision.estimate.required_bytes))
            },
        )
        .map_err(|error| error.to_string());
        // The job's move is decided first and stored with the profile's end in one
        // transaction.
        let (event, reason) = match sized {
            Ok(admitted) => {
                self.put_command_memory_model(&job.tenant, &key.shape_key, &learned, &basis)
                    .await?;
                // No slice below the operator's floor, whatever was measured.
                let slice_bytes =
                    workload.slice_with_floor(admitted.slice_bytes, floor, largest_gpu);
                let estimate = model.estimate(&admitted.config);
                job.config_json = config_to_json(&admitted.config);
                job.estimate_json = estimate_to_json(&estimate);
                job.required_bytes = slice_bytes as i64;
                job.waiting_reason.clear();
                let change = admitted.config.describe_change_from(&config);
                let message = format!(
                    "profile: {}; slice {}{}{}",
                    if learned.measured {
                        format!(
                            "needs {} + {} per sample",
                            HumanBytes(model.fixed_bytes),
                            HumanBytes(model.per_sample_bytes)
                        )
                    } else {
                        basis.clone()
                    },
                    HumanBytes(slice_bytes),
                    if slice_bytes > admitted.slice_bytes {
                        format!(
                            " (the floor; the model needs {})",
                            HumanBytes(admitted.slice_bytes)
                        )
                    } else {
                        String::new()
                    },
                    if change.is_empty() {
                        String::new()
                    } else {
                        format!(", shrunk to fit: {change}")
                    }
                );
                (JobEvent::ProfileMeasured, message)
            }
            Err(why) => {
                let message = format!("the profile cannot size the job: {why}");
                job.message.clone_from(&message);
                job.finished_at_ms = Some(now);
                (JobEvent::AttemptFailed, message)
            }
        };
        let change = self
            .end_attempt_with_job(&end, &mut job, Some(event))
            .await?;
        self.live().running.remove(&attempt.job_id);
        self.emit_attempt_line(&attempt, end.message);
        if let Some(change) = change {
            self.emit_state(&job.id, change, &reason);
            self.count_job_change(change);
        }
        self.wake();
        Ok(())
    }
}
