//! A parsed trace turned into what the simulator runs: every model validated once, its
//! own configuration estimated once, and each job's truth (the memory it really needs).
//!
//! Memoization lives here too ([`MemoryOracle`]): a trace of thousands of jobs has a few
//! hundred distinct models at most, so estimates and shrink plans are computed once per
//! distinct (model, configuration) and reused by every job and every policy.

use std::collections::{BTreeMap, HashMap};

use crate::error::CoreError;
use crate::estimator::estimate_job;
use crate::plan::RunConfig;
use crate::shrink::{OomObservation, plan_shrink};
use crate::simulation::trace::{ModelSource, Trace, cell_error};
use crate::validate::{ValidatedJob, parse_job_spec_toml, validate_job_spec};

/// One distinct model of the trace.
#[derive(Debug, Clone)]
pub struct SimulatedModel {
    /// The spec path or the family parameters, as the trace wrote them.
    pub label: String,
    pub job: ValidatedJob,
    /// The configuration the job asks for.
    pub own_config: RunConfig,
    /// The estimator's `required_bytes` at `own_config`.
    pub own_required_bytes: u64,
}

/// One job to simulate.
#[derive(Debug, Clone)]
pub struct SimulatedJob {
    pub row: usize,
    pub submit_time_s: f64,
    pub duration_s: f64,
    pub tenant: String,
    pub requested_bytes: u64,
    /// Index into [`Workload::models`]; `None` for rows with only `actual_peak_bytes`.
    pub model: Option<usize>,
    pub actual_peak_bytes: Option<u64>,
    /// The spec's priority (0 without a model).
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
        let mut model_index: HashMap<ModelSource, usize> = HashMap::new();
        let mut models: Vec<SimulatedModel> = Vec::new();
        let mut jobs = Vec::with_capacity(trace.rows.len());
        for row in &trace.rows {
            let model = match &row.model {
                ModelSource::None => None,
                source => match model_index.get(source) {
                    Some(&index) => Some(index),
                    None => {
                        let model = load_model(row.row, source, spec_texts)?;
                        models.push(model);
                        model_index.insert(source.clone(), models.len() - 1);
                        Some(models.len() - 1)
                    }
                },
            };
            jobs.push(SimulatedJob {
                row: row.row,
                submit_time_s: row.submit_time_s,
                duration_s: row.duration_s,
                tenant: row.tenant.clone(),
                requested_bytes: row.requested_bytes,
                priority: model.map_or(0, |index| models[index].job.spec.priority),
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
    let job = parse_job_spec_toml(&text)
        .and_then(validate_job_spec)
        .map_err(|error| cell_error(row, column, format!("`{label}`: {error}")))?;
    let own_config = RunConfig::from_spec(&job.spec);
    let estimate = estimate_job(&job, &own_config)
        .map_err(|error| cell_error(row, column, format!("`{label}`: {error}")))?;
    Ok(SimulatedModel {
        label,
        job,
        own_config,
        own_required_bytes: estimate.required_bytes,
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
            estimate_job(&entry.job, config).map_or(u64::MAX, |estimate| estimate.required_bytes)
        })
    }

    /// `plan_shrink` for `model` at `config` in a slice of `slice_bytes`; `None` when no
    /// allowed configuration fits.
    pub fn shrink(
        &mut self,
        workload: &Workload,
        model: usize,
        config: &RunConfig,
        observation: Option<&OomObservation>,
        slice_bytes: u64,
    ) -> Option<ShrunkConfig> {
        // The planner depends on the observation only through the limit it reports (equal
        // to the slice here) and the bytes the estimator missed.
        let margin = observation.map_or(0, OomObservation::unaccounted_bytes);
        let key = (model, *config, margin, slice_bytes);
        if let Some(answer) = self.shrinks.get(&key) {
            return *answer;
        }
        let answer = plan_shrink(
            &workload.models[model].job,
            config,
            observation,
            slice_bytes,
        )
        .ok()
        .map(|decision| ShrunkConfig {
            config: decision.config,
            required_bytes: decision.estimate.required_bytes,
        });
        if let Some(shrunk) = answer {
            self.required
                .insert((model, shrunk.config), shrunk.required_bytes);
        }
        self.shrinks.insert(key, answer);
        answer
    }
}
