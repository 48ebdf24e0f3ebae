//! A parsed trace turned into what the simulator runs: every model validated once, its
//! own configuration estimated once, and each job's truth (the memory it really needs).
//!
//! Memoization lives here too ([`MemoryOracle`]): a trace of thousands of jobs has a few
//! hundred distinct models at most, so estimates and shrink plans are computed once per
//! distinct (model, configuration) and reused by every job and every policy.

use std::collections::{BTreeMap, HashMap};

use crate::command::memory_model::CommandMemoryModel;
use crate::command::validate::load_spec_toml;
use crate::error::CoreError;
use crate::plan::RunConfig;
use crate::shrink::{OomObservation, ShrinkDecision};
use crate::simulation::trace::{CommandModelParameters, ModelSource, Trace, cell_error};
use crate::spec::VramRequest;
use crate::workload::Workload as JobWorkload;

/// One distinct model of the trace.
#[derive(Debug, Clone)]
pub struct SimulatedModel {
    /// The spec path or the family parameters, as the trace wrote them.
    pub label: String,
    pub job: SimulatedSpec,
    /// The configuration the job asks for.
    pub own_config: RunConfig,
    /// The estimator's `required_bytes` at `own_config` (a command job's: its memory
    /// model's need).
    pub own_required_bytes: u64,
}

/// A job of either kind as the simulator judges it: the validated workload the scheduler
/// would run (its kind, configuration, estimate and shrink planner are the workload's),
/// and, for a kind whose memory is measured (a command job), the memory model its trace
/// row gave: what Carve's profile would have measured.
#[derive(Debug, Clone)]
pub struct SimulatedSpec {
    pub workload: JobWorkload,
    /// The row's memory model; `None` for a model job, which the estimator judges.
    pub memory: Option<CommandMemoryModel>,
}

impl SimulatedSpec {
    pub fn priority(&self) -> i32 {
        self.workload.priority()
    }

    pub fn vram(&self) -> VramRequest {
        self.workload.resources().vram
    }

    pub fn max_retries(&self) -> u32 {
        self.workload.max_oom_retries()
    }

    /// The configuration the job asks for.
    pub fn own_config(&self) -> RunConfig {
        self.workload.initial_config()
    }

    /// What Carve would size a slice by for `config`: the estimator's `required_bytes`,
    /// or the command job's modelled need.
    pub fn required_bytes(&self, config: &RunConfig) -> Result<u64, CoreError> {
        Ok(self
            .workload
            .estimate(config, self.memory.as_ref(), None)?
            .required_bytes)
    }

    /// The shrink planner of the job's kind.
    pub fn plan_shrink(
        &self,
        config: &RunConfig,
        observation: Option<&OomObservation>,
        slice_bytes: u64,
    ) -> Result<ShrinkDecision, CoreError> {
        self.workload
            .plan_shrink(config, observation, slice_bytes, self.memory.as_ref())
    }

    /// Whether the estimator sizes the job (a model job), rather than a memory model.
    pub fn sized_by_estimator(&self) -> bool {
        !self.workload.kind().memory_is_measured()
    }
}

/// One job to simulate.
#[derive(Debug, Clone)]
pub struct SimulatedJob {
    pub row: usize,
    pub submit_time_s: f64,
    pub duration_s: f64,
    pub tenant: String,
    /// Slices, each on a distinct GPU (a gang above 1); bytes and needs are per slice.
    pub gpus: u32,
    pub requested_bytes: u64,
    /// Index into [`Workload::models`]; `None` for rows with only `actual_peak_bytes`.
    pub model: Option<usize>,
    pub actual_peak_bytes: Option<u64>,
    /// The row's priority, else the spec's (0 without a model).
    pub priority: i32,
}

/// The jobs of a trace, sorted by submit time (then row), with their models.
#[derive(Debug, Clone, Default)]
pub struct Workload {
    pub jobs: Vec<SimulatedJob>,
    pub models: Vec<SimulatedModel>,
    /// Tenant names, sorted, each once.
    pub tenants: Vec<String>,
}

impl Workload {
    /// Validates every model and estimates its own configuration. `spec_texts` maps each
    /// path of [`Trace::spec_files`] to the file's text; a model that does not validate
    /// or estimate is an error naming the first row that uses it and its column.
    pub fn prepare(
        trace: &Trace,
        spec_texts: &BTreeMap<String, String>,
    ) -> Result<Workload, CoreError> {
        let mut model_index: HashMap<(ModelSource, Option<CommandModelParameters>), usize> =
            HashMap::new();
        let mut models: Vec<SimulatedModel> = Vec::new();
        let mut jobs = Vec::with_capacity(trace.rows.len());
        for row in &trace.rows {
            let model = match &row.model {
                ModelSource::None => None,
                source => match model_index.get(&(source.clone(), row.command_model)) {
                    Some(&index) => Some(index),
                    None => {
                        let model = load_model(row.row, source, row.command_model, spec_texts)?;
                        models.push(model);
                        model_index.insert((source.clone(), row.command_model), models.len() - 1);
                        Some(models.len() - 1)
                    }
                },
            };
            jobs.push(SimulatedJob {
                row: row.row,
                submit_time_s: row.submit_time_s,
                duration_s: row.duration_s,
                tenant: row.tenant.clone(),
                gpus: row.gpus,
                requested_bytes: row.requested_bytes,
                priority: row
                    .priority
                    .unwrap_or_else(|| model.map_or(0, |index| models[index].job.priority())),
                model,
                actual_peak_bytes: row.actual_peak_bytes,
            });
        }
        jobs.sort_by(|left, right| {
            left.submit_time_s
                .total_cmp(&right.submit_time_s)
                .then(left.row.cmp(&right.row))
        });
        let mut tenants: Vec<String> = jobs.iter().map(|job| job.tenant.clone()).collect();
        tenants.sort();
        tenants.dedup();
        Ok(Workload {
            jobs,
            models,
            tenants,
        })
    }
}

fn load_model(
    row: usize,
    source: &ModelSource,
    command_model: Option<CommandModelParameters>,
    spec_texts: &BTreeMap<String, String>,
) -> Result<SimulatedModel, CoreError> {
    let (column, label, text) = match source {
        ModelSource::SpecFile(path) => {
            let text = spec_texts.get(path).ok_or_else(|| {
                cell_error(
                    row,
                    "spec",
                    format!("`{path}`: the file's text was not given"),
                )
            })?;
            ("spec", path.clone(), text.clone())
        }
        ModelSource::Family(parameters) => {
            ("model", parameters.to_string(), parameters.job_spec_toml())
        }
        ModelSource::None => return Err(cell_error(row, "", "has no model to load")),
    };
    let workload = load_spec_toml(&text)
        .map_err(|error| cell_error(row, column, format!("`{label}`: {error}")))?;
    // A row gives the memory of a job whose memory is measured, and only of such a job.
    let memory = match (workload.kind().memory_is_measured(), command_model) {
        (false, None) => None,
        (true, Some(parameters)) => Some(CommandMemoryModel {
            fixed_bytes: parameters.fixed_bytes,
            per_sample_bytes: parameters.per_sample_bytes,
            precision: workload.initial_config().precision,
            recompute: false,
        }),
        (false, Some(_)) => {
            return Err(cell_error(
                row,
                "command_model",
                format!("`{label}` is a model job; command_model is for command jobs"),
            ));
        }
        (true, None) => {
            return Err(cell_error(
                row,
                "command_model",
                format!(
                    "`{label}` is a command job: the row must give its memory, e.g. fixed=1GiB:per_sample=35MiB"
                ),
            ));
        }
    };
    let job = SimulatedSpec { workload, memory };
    let own_config = job.own_config();
    let own_required_bytes = job
        .required_bytes(&own_config)
        .map_err(|error| cell_error(row, column, format!("`{label}`: {error}")))?;
    Ok(SimulatedModel {
        label,
        job,
        own_config,
        own_required_bytes,
    })
}

/// What the shrink planner answered, reduced to what the simulator uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShrunkConfig {
    pub config: RunConfig,
    pub required_bytes: u64,
}

/// Estimates and shrink plans, memoized per distinct question.
#[derive(Debug, Default)]
pub struct MemoryOracle {
    required: HashMap<(usize, RunConfig), u64>,
    shrinks: HashMap<(usize, RunConfig, u64, u64), Option<ShrunkConfig>>,
}

impl MemoryOracle {
    /// The estimator's `required_bytes` for `model` run with `config`.
    pub fn required_bytes(&mut self, workload: &Workload, model: usize, config: &RunConfig) -> u64 {
        let entry = &workload.models[model];
        if *config == entry.own_config {
            return entry.own_required_bytes;
        }
        *self.required.entry((model, *config)).or_insert_with(|| {
            // Configs come from the shrink planner, which estimated them already.
            entry.job.required_bytes(config).unwrap_or(u64::MAX)
        })
    }

    /// The shrink planner of the model's kind for `model` at `config` in a slice of `slice_bytes`; `None` when no
    /// allowed configuration fits.
    pub fn shrink(
        &mut self,
        workload: &Workload,
        model: usize,
        config: &RunConfig,
        observation: Option<&OomObservation>,
        slice_bytes: u64,
    ) -> Option<ShrunkConfig> {
        // Both planners depend on the observation only through the limit it reports
        // (equal to the slice here) and the bytes the estimate missed, which with the
        // model and config fix `in_use + requested` too.
        let margin = observation.map_or(0, OomObservation::unaccounted_bytes);
        let key = (model, *config, margin, slice_bytes);
        if let Some(answer) = self.shrinks.get(&key) {
            return *answer;
        }
        let answer = workload.models[model]
            .job
            .plan_shrink(config, observation, slice_bytes)
            .ok()
            .map(|decision| ShrunkConfig {
                config: decision.config,
                required_bytes: decision.estimate.required_bytes,
            });
        // A model job's decision carries the estimator's answer for its config, worth
        // keeping. A command job's comes from its memory model raised by the OOM: Carve's
        // view after the failure, not the row's model that the truth is built on.
        if let Some(shrunk) = answer
            && workload.models[model].job.sized_by_estimator()
        {
            self.required
                .insert((model, shrunk.config), shrunk.required_bytes);
        }
        self.shrinks.insert(key, answer);
        answer
    }
}
