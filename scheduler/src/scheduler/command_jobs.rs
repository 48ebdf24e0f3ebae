//! Command jobs in the scheduler: the memory models of commands (by shape, fitted from
//! profiles and raised by what later runs measured), a profile's end (the model fitted,
//! the job sized and queued to train), and the small helpers the session and placement
//! code share for them. Every decision is core's (`carve_core::command`).

use carve_core::admission::size_slice_at_admission;
use carve_core::command::memory_model::{CommandMemoryModel, ProfilePoint};
use carve_core::command::oom::OomSource;
use carve_core::command::render::RenderedCommand;
use carve_core::command::shrink::plan_command_shrink;
use carve_core::command::spec::CommandSpec;
use carve_core::command::validate::ValidatedCommandJob;
use carve_core::job_state::{AttemptOutcome, JobEvent};
use carve_core::plan::RunConfig;
use carve_core::spec::VramRequest;
use carve_core::workload::{JobKind, Workload};
use sha2::{Digest, Sha256};

use crate::error::SchedulerError;
use crate::store::{
    AttemptEnd, AttemptEndDetails, AttemptResults, config_to_json, estimate_to_json,
};

use super::admission::largest_usable_gpu;
use super::worker_reports::AttemptRef;
use super::{Scheduler, now_ms};

/// Who detected an attempt's out-of-memory, and what they said.
#[derive(Debug, Clone)]
pub(super) struct OomDetected {
    pub by: OomSource,
    /// The guard's numbers or the framework's line; may be empty.
    pub evidence: String,
}

/// A rendered argv as one line a person can read.
pub(super) fn display_argv(argv: &[String]) -> String {
    RenderedCommand {
        argv: argv.to_vec(),
        env: Default::default(),
        working_directory: None,
    }
    .display_line()
}

fn short_digest(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .take(16)
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// The command of a stored job's spec (job `job_id`'s, of `kind`), read as it was
/// admitted: only the `command` table is parsed (the rest of the spec is skipped,
/// whatever its size) and nothing is checked again, so reads never validate. `None` for
/// a kind without a command. A command job whose command no longer parses is a corrupt
/// row.
pub(super) fn stored_command(
    job_id: &str,
    kind: JobKind,
    spec_json: &str,
) -> Result<Option<CommandSpec>, SchedulerError> {
    #[derive(serde::Deserialize)]
    struct CommandOnly {
        command: CommandSpec,
    }
    match kind {
        JobKind::Model => Ok(None),
        JobKind::Command => serde_json::from_str::<CommandOnly>(spec_json)
            .map(|spec| Some(spec.command))
            .map_err(|error| {
                SchedulerError::Api(carve_proto::ApiError::Internal(format!(
                    "corrupt row: jobs {job_id:?} spec_json: {error}"
                )))
            }),
    }
}

/// A command shape's memory model from its stored row: the one decoder, an unreadable row
/// an error naming it.
pub(super) fn stored_memory_model(
    shape_key: &str,
    json: &str,
) -> Result<CommandMemoryModel, SchedulerError> {
    serde_json::from_str(json).map_err(|error| {
        SchedulerError::Api(carve_proto::ApiError::Internal(format!(
            "corrupt row: command_memory_models {shape_key:?}: {error}"
        )))
    })
}

/// The key a command's memory model is stored under: what decides its memory apart from
/// the knobs Carve turns (argv, environment, working directory, the precisions and the
/// recompute arguments); not its name, priority or batch sizes.
pub(super) fn command_shape_key(job: &ValidatedCommandJob) -> String {
    shape_key_of_command(&job.spec.command)
}

/// [`command_shape_key`] of a command as stored, unvalidated (validation changes no field
/// the key reads, so both give the same key).
pub(super) fn shape_key_of_command(command: &CommandSpec) -> String {
    let shape = serde_json::json!({
        "argv": command.argv,
        "env": command.env,
        "working_directory": command.working_directory,
        "precisions": command.precisions,
        "recompute": command.recompute,
    });
    short_digest(&format!("command|{shape}"))
}

impl Scheduler {
    /// What has been measured of a workload's memory: for a command job, the memory
    /// model its command's profile stored (`None` before one); `None` for a model job,
    /// which the estimator sizes. What `Workload`'s methods take as `measured`.
    pub(super) async fn measured_memory_model(
        &self,
        workload: &Workload,
    ) -> Result<Option<CommandMemoryModel>, SchedulerError> {
        match workload.as_command() {
            Some(command) => self.command_memory_model(&command_shape_key(command)).await,
            None => Ok(None),
        }
    }

    /// The memory model stored for a command shape, if a profile measured one.
    pub(super) async fn command_memory_model(
        &self,
        shape_key: &str,
    ) -> Result<Option<CommandMemoryModel>, SchedulerError> {
        let Some(json) = self.store.command_memory_model(shape_key).await? else {
            return Ok(None);
        };
        stored_memory_model(shape_key, &json).map(Some)
    }

    /// Stores a command shape's memory model, replacing the one it had.
    pub(super) async fn put_command_memory_model(
        &self,
        shape_key: &str,
        model: &CommandMemoryModel,
    ) -> Result<(), SchedulerError> {
        let json = serde_json::to_string(model).map_err(|error| {
            SchedulerError::Api(carve_proto::ApiError::Internal(format!(
                "cannot write a memory model: {error}"
            )))
        })?;
        self.store
            .put_command_memory_model(shape_key, &json, now_ms())
            .await
    }

    /// Raises a command shape's stored model so that it covers `needed_bytes` at
    /// `config` (a measured peak, or what an out-of-memory showed was needed), and
    /// returns the model as it now stands. A shape with no model yet gets none: only a
    /// profile fits one.
    pub(super) async fn refine_command_memory_model(
        &self,
        job: &ValidatedCommandJob,
        config: &RunConfig,
        needed_bytes: u64,
    ) -> Result<Option<CommandMemoryModel>, SchedulerError> {
        let shape_key = command_shape_key(job);
        let Some(model) = self.command_memory_model(&shape_key).await? else {
            return Ok(None);
        };
        let refined = model.refined(config, needed_bytes);
        if refined != model {
            self.put_command_memory_model(&shape_key, &refined).await?;
        }
        Ok(Some(refined))
    }

    /// The memory model a command job is sized by (its command's, once a profile
    /// measured it); `None` for model jobs and before the profile. The spec is read as
    /// stored, not validated again (a page of jobs reads its models at once instead:
    /// `Scheduler::job_views`).
    pub async fn job_memory_model(
        &self,
        job: &crate::store::JobRecord,
    ) -> Result<Option<CommandMemoryModel>, SchedulerError> {
        let Some(command) = stored_command(&job.id, job.kind, &job.spec_json)? else {
            return Ok(None);
        };
        self.command_memory_model(&shape_key_of_command(&command))
            .await
    }

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
            let measured = self.measured_memory_model(&workload).await?;
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
        if self.current_attempt(worker_id, &attempt).is_none() {
            return Err(self.fenced(&attempt));
        }
        let mut job = self.store.get_job(&attempt.job_id).await?;
        let workload = self.stored_workload(&job).await?;
        let command = workload.as_command().ok_or_else(|| {
            SchedulerError::Api(carve_proto::ApiError::FailedPrecondition(format!(
                "job {} is a {} job: only a command job's attempt is a profile",
                job.id, job.kind
            )))
        })?;
        let config = job.config()?;
        let fitted = CommandMemoryModel::fit(
            &points,
            config.precision,
            config.recompute_segment_layers.is_some(),
        );
        let points_text = points
            .iter()
            .map(|point| {
                format!(
                    "micro-batch {}: {}{}",
                    point.micro_batch,
                    carve_core::bytes::HumanBytes(point.peak_bytes),
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
            lease_epoch: attempt.lease_epoch as i64,
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
        let gpus = self.gpu_states();
        let sized = fitted.map_err(|error| error.to_string()).and_then(|model| {
            let admitted = size_slice_at_admission(
                VramRequest::Auto,
                config,
                model.need_bytes(&config),
                1.0,
                largest_usable_gpu(&gpus),
                |current, limit| {
                    plan_command_shrink(command, &model, current, None, limit)
                        .map(|decision| (decision.config, decision.estimate.required_bytes))
                },
            )
            .map_err(|error| error.to_string())?;
            Ok((model, admitted))
        });
        // The job's move is decided first and stored with the profile's end in one
        // transaction.
        let (event, reason) = match sized {
            Ok((model, admitted)) => {
                self.put_command_memory_model(&command_shape_key(command), &model)
                    .await?;
                let estimate = model.estimate(&admitted.config);
                job.config_json = config_to_json(&admitted.config);
                job.estimate_json = estimate_to_json(&estimate);
                job.required_bytes = admitted.slice_bytes as i64;
                job.waiting_reason.clear();
                let change = admitted.config.describe_change_from(&config);
                let message = format!(
                    "profile: needs {} + {} per sample; slice {}{}",
                    carve_core::bytes::HumanBytes(model.fixed_bytes),
                    carve_core::bytes::HumanBytes(model.per_sample_bytes),
                    carve_core::bytes::HumanBytes(admitted.slice_bytes),
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
