//! The kinds of job as types: what a job is (a [`JobKind`], stored with it) and the one
//! value every decision about it goes through (a [`Workload`], its validated spec).
//!
//! Carve runs two kinds of job:
//! - a model job: a model Carve's own engine trains ([`crate::validate::ValidatedJob`]),
//!   whose memory the estimator computes from its plan;
//! - a command job: a user's own program under the guard
//!   ([`crate::command::validate::ValidatedCommandJob`]), whose memory a short profile
//!   measures (or its declared `resources.vram` gives) as a
//!   [`CommandMemoryModel`].
//!
//! Everything that differs between them is answered here, by one method each kind
//! answers: the configuration of the first attempt ([`Workload::initial_config`]), the
//! estimate ([`Workload::estimate`]), whether a profile must measure it first
//! ([`Workload::profile_plan`]), the next configuration after an out-of-memory
//! ([`Workload::plan_shrink`]), the retry limit ([`Workload::max_oom_retries`]), the
//! key measured peaks are kept under ([`Workload::peak_key`], see [`peak_key`]), the key
//! its memory model is kept under ([`Workload::memory_model_key`], see
//! [`memory_model_key`]), and how admission sizes it
//! ([`Workload::takes_peak_corrections`], [`Workload::check_fits_largest_gpu`],
//! [`Workload::slice_with_floor`]). The
//! scheduler and the worker call these and never branch on a spec's text; the one place
//! a spec's text says its kind is [`JobKind::of_spec_text`]. What admission validated is
//! stored as it is ([`stored`]: [`Workload::to_stored_form`]), so a stored job is never
//! parsed or checked again.
//!
//! Multi-GPU jobs (issue 31) are command jobs with `resources.gpus` above 1: a gang of
//! that many slices of one member's size, each on a distinct GPU
//! ([`Workload::gang_shape`], placed by `crate::gang`). Every question above is answered
//! per member (the estimate, the profile and the shrink plan are one member's; the
//! global batch is kept by the worker's launch, which renders the world size), and the
//! stored form carries the members and placement (version 2, `stored.rs`). Model jobs
//! keep one slice.

use std::fmt;
use std::str::FromStr;

use serde::Deserialize;
use serde::de::IgnoredAny;

use crate::command::memory_model::CommandMemoryModel;
use crate::command::memory_model::learning::{check_declared_vram, floored_slice_bytes};
use crate::command::shrink::plan_command_shrink;
use crate::command::spec::CommandJobSpec;
use crate::command::validate::{ValidatedCommandJob, validate_command_job_spec};
use crate::error::{CoreError, FieldError};
use crate::estimator::{MemoryEstimate, estimate_job};
use crate::gang::GangShape;
use crate::plan::{MemoryCategory, RunConfig};
use crate::shrink::{OomObservation, ShrinkDecision, strategy_names};
use crate::spec::{OomPolicySpec, ResourcesSpec, VramRequest};
use crate::validate::{
    SpecWarning, ValidatedJob, load_job_spec_toml, parse_job_spec_json, parse_json, parse_toml,
    require_absolute_data_paths, validate_job_spec,
};

pub mod memory_model_key;
pub mod peak_key;
pub mod stored;

pub use memory_model_key::{MemoryModelKey, stored_memory_model_key};
pub use stored::{OLDEST_READ_STORED_FORM_VERSION, STORED_FORM_VERSION};

/// What kind of job a spec describes. Stored with the job by [`JobKind::name`]; read back
/// with [`JobKind::from_name`], which refuses a name it does not know rather than
/// guessing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobKind {
    /// A model Carve's engine trains (`[model]`, `[training]`, `[data]`).
    Model,
    /// A user's own program under the guard (`[command]`).
    Command,
}

impl JobKind {
    pub const ALL: [JobKind; 2] = [JobKind::Model, JobKind::Command];

    /// The stable name a store keeps: `model` or `command`. Never change one; a new kind
    /// gets a new name.
    pub fn name(self) -> &'static str {
        match self {
            JobKind::Model => "model",
            JobKind::Command => "command",
        }
    }

    /// The kind [`JobKind::name`] names. Anything else is an error saying what the names
    /// are (no field: the caller knows which column or field held it).
    pub fn from_name(name: &str) -> Result<JobKind, FieldError> {
        JobKind::ALL
            .into_iter()
            .find(|kind| kind.name() == name)
            .ok_or_else(|| {
                FieldError::not_one_of(name, "a job kind", &JobKind::ALL.map(Self::name))
            })
    }

    /// The kind a spec's text declares: a command job when its top level has `command`
    /// (whatever else it holds), a model job otherwise, including text that is not a
    /// table or does not parse (the model job parser then says why). This is the one
    /// place Carve reads a kind from text; [`Workload::from_spec_text`] then reads the
    /// spec strictly as that kind.
    pub fn of_spec_text(text: &str, format: SpecFormat) -> JobKind {
        match TopLevelSections::read(text, format) {
            Some(sections) if sections.command.is_some() => JobKind::Command,
            _ => JobKind::Model,
        }
    }

    /// Whether a job of this kind learns its memory by running (a command job's profile
    /// and measured peaks) rather than from the estimator ahead of time: such a job has
    /// nothing for `carve estimate` or `carve run` to work on, and a memory model stored
    /// by its command's shape.
    pub fn memory_is_measured(self) -> bool {
        match self {
            JobKind::Model => false,
            JobKind::Command => true,
        }
    }

    /// Whether a job of this kind may name an image of its own to run in
    /// (`command.image`): a command job's program may; a model job runs in Carve's
    /// engine, in no image. Lets a reader skip jobs without decoding their workload.
    pub fn may_name_image(self) -> bool {
        match self {
            JobKind::Model => false,
            JobKind::Command => true,
        }
    }
}

impl fmt::Display for JobKind {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

impl FromStr for JobKind {
    type Err = FieldError;

    fn from_str(name: &str) -> Result<JobKind, FieldError> {
        JobKind::from_name(name)
    }
}

/// By [`JobKind::name`], as the store's typed columns read names.
impl TryFrom<&str> for JobKind {
    type Error = FieldError;

    fn try_from(name: &str) -> Result<JobKind, FieldError> {
        JobKind::from_name(name)
    }
}

/// How a spec's text is written: JSON over the API and in the store, TOML in job files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecFormat {
    Json,
    Toml,
}

/// Which sections a spec's top level has, whatever else it holds: enough to tell a
/// command job from a model job before reading either strictly.
#[derive(Deserialize)]
struct TopLevelSections {
    command: Option<IgnoredAny>,
    model: Option<IgnoredAny>,
    training: Option<IgnoredAny>,
    data: Option<IgnoredAny>,
}

impl TopLevelSections {
    /// `None` for text that is not a table of either format.
    fn read(text: &str, format: SpecFormat) -> Option<TopLevelSections> {
        match format {
            SpecFormat::Json => serde_json::from_str(text).ok(),
            SpecFormat::Toml => toml::from_str(text).ok(),
        }
    }

    /// A spec with `command` must have none of a model job's sections.
    fn check_one_kind(&self) -> Result<(), FieldError> {
        if self.command.is_some()
            && (self.model.is_some() || self.training.is_some() || self.data.is_some())
        {
            return Err(FieldError::new(
                "command",
                "a job has either [command] or [model], [training] and [data], not both",
            ));
        }
        Ok(())
    }
}

/// A job that passed every check of its kind: what the scheduler admits, places, retries
/// and keys its measurements by, and what the worker launches.
///
/// Match on it only to hand the job to code that exists for one kind (the worker's two
/// launchers); every decision Carve makes about a job is a method here.
// A model job carries its inferred graph and is the larger; a spec is read once per submit
// or stored job, so boxing it would only make every caller write `Box::new`.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Workload {
    Model(ValidatedJob),
    Command(ValidatedCommandJob),
}

/// Where a to-be-profiled command job's slice size comes from, as its estimate says.
pub const PROFILE_ESTIMATE_SOURCE: &str =
    "a profile measures it first, in the largest slice a GPU gives";

/// Where a command job's slice size comes from when it declares `resources.vram` and
/// nothing has measured it yet.
pub const DECLARED_VRAM_SOURCE: &str = "the declared vram";

/// The slice a command job's profile gets when no GPU is known (the job waits for one
/// anyway; a profile that runs out in it still gives a lower bound).
pub const PROFILE_SLICE_WITHOUT_GPUS: u64 = 16 << 30;

/// A command job's profile: `steps` optimizer steps at each of `micro_batches`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfilePlan {
    pub steps: u64,
    pub micro_batches: [u64; 2],
}

impl Workload {
    /// Reads and checks a spec of either kind: the kind its text declares
    /// ([`JobKind::of_spec_text`]), then strictly as that kind. A spec with `command` and
    /// any of `model`, `training`, `data` is refused, naming `command`.
    pub fn from_spec_text(text: &str, format: SpecFormat) -> Result<Workload, FieldError> {
        if let Some(sections) = TopLevelSections::read(text, format) {
            sections.check_one_kind()?;
        }
        match (JobKind::of_spec_text(text, format), format) {
            (JobKind::Command, SpecFormat::Json) => Workload::command(parse_json(text)?),
            (JobKind::Command, SpecFormat::Toml) => Workload::command(parse_toml(text)?),
            (JobKind::Model, SpecFormat::Json) => Ok(Workload::Model(validate_job_spec(
                parse_job_spec_json(text)?,
            )?)),
            (JobKind::Model, SpecFormat::Toml) => Ok(Workload::Model(load_job_spec_toml(text)?)),
        }
    }

    /// [`Workload::from_spec_text`] of JSON (how a spec travels over the API).
    pub fn from_json(text: &str) -> Result<Workload, FieldError> {
        Workload::from_spec_text(text, SpecFormat::Json)
    }

    /// [`Workload::from_spec_text`] of a TOML job file.
    pub fn from_toml(text: &str) -> Result<Workload, FieldError> {
        Workload::from_spec_text(text, SpecFormat::Toml)
    }

    /// Reads a stored spec (JSON) as the kind stored with it: nothing is read from the
    /// text to decide the kind, and a text of the other kind is refused by its strict
    /// parser (the fields of the other kind are unknown to it).
    pub fn from_stored(kind: JobKind, spec_json: &str) -> Result<Workload, FieldError> {
        match kind {
            JobKind::Model => Ok(Workload::Model(validate_job_spec(parse_job_spec_json(
                spec_json,
            )?)?)),
            JobKind::Command => Workload::command(parse_json(spec_json)?),
        }
    }

    fn command(spec: CommandJobSpec) -> Result<Workload, FieldError> {
        Ok(Workload::Command(validate_command_job_spec(spec)?))
    }

    pub fn kind(&self) -> JobKind {
        match self {
            Workload::Model(_) => JobKind::Model,
            Workload::Command(_) => JobKind::Command,
        }
    }

    /// The model job, for code that exists only for model jobs (the engine's launch).
    pub fn as_model(&self) -> Option<&ValidatedJob> {
        match self {
            Workload::Model(job) => Some(job),
            Workload::Command(_) => None,
        }
    }

    /// The command job, for code that exists only for command jobs (its launch, the
    /// memory model stored by its command's shape).
    pub fn as_command(&self) -> Option<&ValidatedCommandJob> {
        match self {
            Workload::Model(_) => None,
            Workload::Command(job) => Some(job),
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Workload::Model(job) => &job.spec.name,
            Workload::Command(job) => &job.spec.name,
        }
    }

    pub fn priority(&self) -> i32 {
        match self {
            Workload::Model(job) => job.spec.priority,
            Workload::Command(job) => job.spec.priority,
        }
    }

    pub fn resources(&self) -> &ResourcesSpec {
        match self {
            Workload::Model(job) => &job.spec.resources,
            Workload::Command(job) => &job.spec.resources,
        }
    }

    /// The slices each attempt takes, every member sized `member_slice_bytes` (what
    /// admission sized for one member): `resources.gpus` members (1 for a model job,
    /// which validation keeps at one slice) placed by `resources.placement`. What the
    /// gang pass ([`crate::gang::solve_gangs`]) and [`crate::gang::place_gang`] take.
    pub fn gang_shape(&self, member_slice_bytes: u64) -> GangShape {
        let resources = self.resources();
        GangShape {
            members: u32::try_from(resources.gpus).unwrap_or(u32::MAX).max(1),
            member_slice_bytes,
            policy: resources.placement,
        }
    }

    pub fn oom(&self) -> &OomPolicySpec {
        match self {
            Workload::Model(job) => &job.spec.oom,
            Workload::Command(job) => &job.spec.oom,
        }
    }

    /// The image the job's program runs in (`command.image`, a tag or digest as
    /// written); `None` for a job without one and for every model job
    /// ([`JobKind::may_name_image`]).
    pub fn image(&self) -> Option<&str> {
        match self {
            Workload::Model(_) => None,
            Workload::Command(job) => job.spec.command.image.as_deref(),
        }
    }

    /// The name of the tenant's secret the job's image pull needs
    /// (`command.image_pull_secret`); `None` when it names none, and for every model job.
    pub fn image_pull_secret(&self) -> Option<&str> {
        match self {
            Workload::Model(_) => None,
            Workload::Command(job) => job.spec.command.image_pull_secret.as_deref(),
        }
    }

    /// What is allowed but probably a mistake (model jobs: a channels-first input).
    pub fn warnings(&self) -> Vec<SpecWarning> {
        match self {
            Workload::Model(job) => job.warnings(),
            Workload::Command(_) => Vec::new(),
        }
    }

    /// The configuration the spec asks for: a model job's training settings
    /// ([`RunConfig::from_spec`]), a command job's knobs
    /// ([`ValidatedCommandJob::initial_config`]).
    pub fn initial_config(&self) -> RunConfig {
        match self {
            Workload::Model(job) => RunConfig::from_spec(&job.spec),
            Workload::Command(job) => job.initial_config(),
        }
    }

    /// Checks a configuration that came from outside (the wire, an override) as this
    /// job's kind reads it: a model job's against its model ([`RunConfig::check`], which
    /// needs the engine's knobs); a command job's by the knobs a command has
    /// ([`RunConfig::check_batch_settings`]) and without the engine's, as
    /// [`Workload::initial_config`] makes it.
    pub fn check_config(&self, config: &RunConfig) -> Result<(), FieldError> {
        match self {
            Workload::Model(job) => config.check(&job.graph),
            Workload::Command(_) => {
                config.check_batch_settings()?;
                if let Some(engine) = config.engine {
                    let (field, value) = if engine.workspace_limit_bytes != 0 {
                        ("workspace_limit_bytes", engine.workspace_limit_bytes)
                    } else {
                        ("prefetch_batches", engine.prefetch_batches)
                    };
                    return Err(FieldError::new(
                        field,
                        format!("is {value}, but a command job has no such knob: leave it out"),
                    ));
                }
                Ok(())
            }
        }
    }

    /// How many out-of-memory retries the job allows (`oom.max_retries`).
    pub fn max_oom_retries(&self) -> u32 {
        self.oom().max_retries
    }

    /// Refuses what a worker cannot run in a directory of its own: a model job's
    /// relative data paths (a command job's paths are absolute by validation).
    pub fn require_absolute_paths(&self) -> Result<(), FieldError> {
        match self {
            Workload::Model(job) => require_absolute_data_paths(&job.spec),
            Workload::Command(_) => Ok(()),
        }
    }

    /// The estimate that is a function of the spec alone: a model job's estimator answer
    /// for `config`; `None` for a command job, whose memory is measured (or declared),
    /// so [`Workload::estimate`] needs what was measured.
    pub fn spec_estimate(&self, config: &RunConfig) -> Result<Option<MemoryEstimate>, FieldError> {
        match self {
            Workload::Model(job) => estimate_job(job, config).map(Some),
            Workload::Command(_) => Ok(None),
        }
    }

    /// What a run with `config` needs.
    ///
    /// - A model job: the estimator's answer ([`estimate_job`]); `measured` and
    ///   `largest_usable_gpu` are not used.
    /// - A command job: its command's memory model when a profile measured one
    ///   (`measured`, [`CommandMemoryModel::estimate`]); else its declared vram
    ///   ([`DECLARED_VRAM_SOURCE`]); else (`vram = "auto"`) the slice its profile runs in:
    ///   the largest usable GPU, or [`PROFILE_SLICE_WITHOUT_GPUS`] while none is known.
    pub fn estimate(
        &self,
        config: &RunConfig,
        measured: Option<&CommandMemoryModel>,
        largest_usable_gpu: Option<u64>,
    ) -> Result<MemoryEstimate, FieldError> {
        let command = match self {
            Workload::Model(job) => return estimate_job(job, config),
            Workload::Command(command) => command,
        };
        Ok(match (measured, command.spec.resources.vram) {
            (Some(model), _) => model.estimate(config),
            (None, VramRequest::Bytes(bytes)) => {
                unmeasured_estimate(*config, bytes, DECLARED_VRAM_SOURCE)
            }
            (None, VramRequest::Auto) => unmeasured_estimate(
                *config,
                largest_usable_gpu.unwrap_or(PROFILE_SLICE_WITHOUT_GPUS),
                PROFILE_ESTIMATE_SOURCE,
            ),
        })
    }

    /// The profile the job's next attempt must be, when its memory is not known yet: a
    /// command job with `vram = "auto"` whose command has no memory model (`measured`).
    /// `None` for every model job and for a command job already measured or declared.
    pub fn profile_plan(&self, measured: Option<&CommandMemoryModel>) -> Option<ProfilePlan> {
        let command = self.as_command()?;
        if command.spec.resources.vram != VramRequest::Auto || measured.is_some() {
            return None;
        }
        Some(ProfilePlan {
            steps: command.spec.command.profile.steps,
            micro_batches: command.profile_micro_batches(),
        })
    }

    /// Whether the next attempt must be a profile ([`Workload::profile_plan`]).
    pub fn needs_profile(&self, measured: Option<&CommandMemoryModel>) -> bool {
        self.profile_plan(measured).is_some()
    }

    /// The next configuration after `current` ran out of memory (with `observation`), or
    /// before a first attempt (without), in a slice of `slice_bytes`.
    ///
    /// - A model job: the shrink planner ([`crate::shrink::plan_shrink`]), judging every
    ///   candidate by the estimator; `measured` is not used.
    /// - A command job: [`plan_command_shrink`] with its command's memory model
    ///   (`measured`, which the caller has already raised by what the attempt needed);
    ///   without one, after an OOM, the worst case the report alone gives
    ///   ([`CommandMemoryModel::from_out_of_memory`]). Without a model and without an
    ///   OOM nothing predicts what a smaller configuration needs: `DoesNotFit`, needing
    ///   the declared vram.
    pub fn plan_shrink(
        &self,
        current: &RunConfig,
        observation: Option<&OomObservation>,
        slice_bytes: u64,
        measured: Option<&CommandMemoryModel>,
    ) -> Result<ShrinkDecision, CoreError> {
        let command = match self {
            Workload::Model(job) => {
                return crate::shrink::plan_shrink(job, current, observation, slice_bytes);
            }
            Workload::Command(command) => command,
        };
        let model = match (measured, observation) {
            (Some(model), _) => *model,
            (None, Some(observation)) => {
                CommandMemoryModel::from_out_of_memory(current, &observation.report)
            }
            (None, None) => {
                return Err(CoreError::DoesNotFit {
                    available_bytes: slice_bytes,
                    smallest_required_bytes: match command.spec.resources.vram {
                        VramRequest::Bytes(bytes) => bytes,
                        VramRequest::Auto => slice_bytes.saturating_add(1),
                    },
                    smallest_config: "as written: nothing has measured the program's \
                                      memory, so no smaller configuration can be predicted"
                        .to_string(),
                    strategies: strategy_names(&command.spec.oom.strategies),
                });
            }
        };
        plan_command_shrink(command, &model, current, observation, slice_bytes)
    }

    /// Whether admission scales this job's estimate by the peak corrections (measured
    /// peaks over estimates, kept by the job's shape for every tenant). A model job's
    /// estimate is the estimator's, which the corrections refine. A command job's
    /// measured peaks are already in its tenant's memory model; and since the corrections
    /// are shared by every tenant, a program's own figures (hostile, on a simulated GPU)
    /// must not scale another tenant's job.
    pub fn takes_peak_corrections(&self) -> bool {
        match self {
            Workload::Model(_) => true,
            Workload::Command(_) => false,
        }
    }

    /// Refuses, at admission, a job whose own statement of its size cannot fit the
    /// largest GPU (`largest_usable_gpu`, when any is known): a command job declaring a
    /// `resources.vram` larger than it ([`check_declared_vram`]), refused as written
    /// before any memory model could shrink it into one. A model job's size is the
    /// estimator's, which admission fits (or shrinks) to the GPUs.
    pub fn check_fits_largest_gpu(
        &self,
        largest_usable_gpu: Option<u64>,
    ) -> Result<(), FieldError> {
        match self {
            Workload::Model(_) => Ok(()),
            Workload::Command(job) => {
                check_declared_vram(job.spec.resources.vram, largest_usable_gpu)
            }
        }
    }

    /// The slice the job gets where `slice_bytes` is what it needs: a command job's never
    /// below the operator's floor (`floor_bytes`, itself never above the largest usable
    /// GPU; [`floored_slice_bytes`]), whatever its memory model says, since a model can be
    /// wrong low; a model job's as is, the estimator's exact answer for a plan Carve runs.
    pub fn slice_with_floor(
        &self,
        slice_bytes: u64,
        floor_bytes: u64,
        largest_usable_gpu: Option<u64>,
    ) -> u64 {
        match self {
            Workload::Model(_) => slice_bytes,
            Workload::Command(_) => {
                floored_slice_bytes(slice_bytes, floor_bytes, largest_usable_gpu)
            }
        }
    }

    /// The key measured peaks of this job run with `config` are kept under: versioned,
    /// built from an explicit list of what decides the job's memory (see [`peak_key`]),
    /// so a spec field that does not decide memory never changes it.
    pub fn peak_key(&self, config: &RunConfig) -> String {
        match self {
            Workload::Model(job) => peak_key::model_peak_key(job, config),
            Workload::Command(job) => peak_key::command_peak_key(job, config),
        }
    }
}

/// The estimate a command job is stored with while nothing measured its memory: `bytes`
/// (its declared vram, or its profile's slice) and where that number comes from.
pub fn unmeasured_estimate(config: RunConfig, bytes: u64, source: &str) -> MemoryEstimate {
    MemoryEstimate {
        config,
        peak_bytes: bytes,
        required_bytes: bytes,
        persistent_bytes: 0,
        fragmentation_bytes_at_peak: 0,
        fragmentation_at_peak: 0.0,
        by_category: MemoryCategory::ALL
            .iter()
            .map(|category| (*category, 0))
            .collect(),
        by_layer: Vec::new(),
        peak_during: format!("command: {source}"),
    }
}

#[cfg(test)]
mod tests;
