//! Command jobs' memory models in the scheduler: one per tenant and command shape, so a
//! tenant's runs size only that tenant's later runs of the same command. Read for
//! sizing and for reads (with what each rests on), taught by measurements through
//! core's rules (`carve_core::command::memory_model::learning`: outliers never move a
//! model, an unmeasured fallback gives way to the first real measurement), and reset by
//! the tenant (ResetMemoryModels).

use carve_core::bytes::HumanBytes;
use carve_core::command::memory_model::CommandMemoryModel;
use carve_core::command::memory_model::learning::{
    LearnedModel, Measurement, Refinement, refine_learned,
};
use carve_core::plan::RunConfig;
use carve_core::workload::{Workload, stored_memory_model_key};

use crate::auth::{Caller, Role};
use crate::error::SchedulerError;
use crate::store::{JobRecord, StoredMemoryModel};

use super::admission::largest_usable_gpu;
use super::{Scheduler, now_ms};

/// A command's memory model as reads show it: the model, whether anything measured it
/// (false: the fallback of an unmeasured profile), and what it rests on, for people.
#[derive(Debug, Clone, PartialEq)]
pub struct KnownMemoryModel {
    pub learned: LearnedModel,
    pub basis: String,
}

impl KnownMemoryModel {
    pub fn model(&self) -> CommandMemoryModel {
        self.learned.model
    }
}

/// The most a model's basis keeps: its origin and the latest change, never an unbounded
/// history (every measured run may raise a model).
const BASIS_MOST_BYTES: usize = 1024;

/// What changed with a measurement, appended to a basis that keeps its origin (the text
/// before the first "; then ") and this latest change.
fn basis_after(previous: &str, change: &str) -> String {
    let origin = previous.split("; then ").next().unwrap_or(previous);
    let mut basis = format!("{origin}; then {change}");
    if basis.len() > BASIS_MOST_BYTES {
        let mut end = BASIS_MOST_BYTES;
        while !basis.is_char_boundary(end) {
            end -= 1;
        }
        basis.truncate(end);
    }
    basis
}

/// The key of the memory model of a stored job's command (core's
/// [`stored_memory_model_key`]: only the `command` table read, nothing checked again, so
/// reads never validate). `None` for a kind without a memory model; a command that no
/// longer reads is a corrupt row, named.
pub(super) fn stored_shape_key(job: &JobRecord) -> Result<Option<String>, SchedulerError> {
    stored_memory_model_key(job.kind, &job.spec_json).map_err(|error| {
        SchedulerError::Api(carve_proto::ApiError::Internal(format!(
            "corrupt row: jobs {:?} spec_json: {error}",
            job.id
        )))
    })
}

/// A command shape's memory model from its stored row: the one decoder, an unreadable row
/// an error naming it.
pub(super) fn stored_memory_model(
    tenant: &str,
    shape_key: &str,
    stored: &StoredMemoryModel,
) -> Result<KnownMemoryModel, SchedulerError> {
    let learned = serde_json::from_str(&stored.model_json).map_err(|error| {
        SchedulerError::Api(carve_proto::ApiError::Internal(format!(
            "corrupt row: command_memory_models ({tenant:?}, {shape_key:?}): {error}"
        )))
    })?;
    Ok(KnownMemoryModel {
        learned,
        basis: stored.basis.clone(),
    })
}

impl Scheduler {
    /// What has been measured of a workload's memory: for a command job of `tenant`, the
    /// memory model `tenant`'s runs of its command left (`None` before one); `None` for
    /// a model job, which the estimator sizes. What `Workload`'s methods take as
    /// `measured`. An unmeasured fallback (a profile that measured nothing) sizes only
    /// `vram = "auto"` jobs, which it spares a profile that would measure nothing again:
    /// a job that declares its size is sized as declared, not by a guess.
    pub(super) async fn measured_memory_model(
        &self,
        tenant: &str,
        workload: &Workload,
    ) -> Result<Option<CommandMemoryModel>, SchedulerError> {
        let Some(key) = workload.memory_model_key() else {
            return Ok(None);
        };
        let declared = key.declared_bytes.is_some();
        Ok(self
            .command_memory_model(tenant, &key.shape_key)
            .await?
            .filter(|known| known.learned.measured || !declared)
            .map(|known| known.model()))
    }

    /// `tenant`'s memory model of a command shape, if one was learned.
    pub(super) async fn command_memory_model(
        &self,
        tenant: &str,
        shape_key: &str,
    ) -> Result<Option<KnownMemoryModel>, SchedulerError> {
        let Some(stored) = self.store.command_memory_model(tenant, shape_key).await? else {
            return Ok(None);
        };
        stored_memory_model(tenant, shape_key, &stored).map(Some)
    }

    /// Stores `tenant`'s model of a command shape, replacing the one it had.
    pub(super) async fn put_command_memory_model(
        &self,
        tenant: &str,
        shape_key: &str,
        learned: &LearnedModel,
        basis: &str,
    ) -> Result<(), SchedulerError> {
        let json = serde_json::to_string(learned).map_err(|error| {
            SchedulerError::Api(carve_proto::ApiError::Internal(format!(
                "cannot write a memory model: {error}"
            )))
        })?;
        self.store
            .put_command_memory_model(tenant, shape_key, &json, basis, now_ms())
            .await
    }

    /// Teaches `tenant`'s model of a command shape (`shape_key`, the job's
    /// [`Workload::memory_model_key`]) what a run with `config` showed
    /// (`measurement`: a measured peak, or what an out-of-memory showed was needed), and
    /// returns the model as it now stands. A shape with no model yet gets none: only a
    /// profile fits one. An outlier (0 B, more than the largest GPU) changes nothing and
    /// is said in the job's log (`job_id`, `attempt_number`).
    pub(super) async fn refine_command_memory_model(
        &self,
        tenant: &str,
        job_id: &str,
        attempt_number: u32,
        shape_key: &str,
        config: &RunConfig,
        measurement: Measurement,
    ) -> Result<Option<CommandMemoryModel>, SchedulerError> {
        let Some(known) = self.command_memory_model(tenant, shape_key).await? else {
            return Ok(None);
        };
        let largest = largest_usable_gpu(&self.gpu_states());
        let what = measurement.describe();
        match refine_learned(&known.learned, config, measurement, largest) {
            Refinement::Unchanged => Ok(Some(known.model())),
            Refinement::Changed(learned) => {
                let change = format!(
                    "{} by {job_id} attempt {attempt_number}'s {what} of {} at micro-batch {}",
                    if known.learned.measured {
                        "raised"
                    } else {
                        "measured"
                    },
                    HumanBytes(measurement.bytes()),
                    config.micro_batch_size
                );
                let basis = basis_after(&known.basis, &change);
                self.put_command_memory_model(tenant, shape_key, &learned, &basis)
                    .await?;
                Ok(Some(learned.model))
            }
            Refinement::Rejected(why) => {
                let attempt = super::worker_reports::AttemptRef {
                    job_id: job_id.to_string(),
                    attempt_number,
                    lease_epoch: 0,
                };
                self.emit_attempt_line(
                    &attempt,
                    format!("the memory model is not changed by this attempt's {what}: {why}"),
                );
                Ok(Some(known.model()))
            }
        }
    }

    /// The memory model a command job is sized by (its tenant's model of its command);
    /// `None` for model jobs and before the profile. The spec is read as stored, not
    /// validated again (a page of jobs reads its models at once instead:
    /// `Scheduler::job_views`).
    pub async fn job_memory_model(
        &self,
        job: &JobRecord,
    ) -> Result<Option<KnownMemoryModel>, SchedulerError> {
        let Some(shape_key) = stored_shape_key(job)? else {
            return Ok(None);
        };
        self.command_memory_model(&job.tenant, &shape_key).await
    }

    /// Forgets memory models: the model of the command of the job `job_reference` names
    /// (the job's tenant's), or with `all`, every model of `tenant` (empty: the
    /// caller's own; another tenant's for admins only). The next `vram = "auto"` job of
    /// each command profiles again. Returns how many models were deleted.
    pub async fn reset_memory_models(
        &self,
        caller: &Caller,
        job_reference: &str,
        all: bool,
        tenant: &str,
    ) -> Result<u64, SchedulerError> {
        caller.require(&[Role::User, Role::Admin])?;
        match (job_reference.is_empty(), all) {
            (false, false) => {
                if !tenant.is_empty() {
                    return Err(SchedulerError::invalid_argument(
                        "tenant",
                        "must be empty with job_id: the job's tenant's model is reset",
                    ));
                }
                let job = self.visible_job(caller, job_reference).await?;
                let Some(shape_key) = stored_shape_key(&job)? else {
                    return Err(SchedulerError::invalid_argument(
                        "job_id",
                        format!(
                            "{} is a {} job: only command jobs have memory models",
                            job.id, job.kind
                        ),
                    ));
                };
                self.store
                    .delete_command_memory_models(&job.tenant, Some(&shape_key))
                    .await
            }
            (true, true) => {
                let tenant = if tenant.is_empty() {
                    caller.tenant.as_str()
                } else {
                    tenant
                };
                if !caller.may_access_tenant(tenant) {
                    return Err(SchedulerError::Api(
                        carve_proto::ApiError::PermissionDenied(format!(
                            "tenant: only admins may reset another tenant's ({tenant:?}) models"
                        )),
                    ));
                }
                self.store.delete_command_memory_models(tenant, None).await
            }
            (false, true) => Err(SchedulerError::invalid_argument(
                "all",
                "name a job or ask for all of a tenant's models, not both",
            )),
            (true, false) => Err(SchedulerError::invalid_argument(
                "job_id",
                "must name a job (or set all to reset every model of the tenant)",
            )),
        }
    }
}
