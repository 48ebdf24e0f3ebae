//! The JSON columns of a job's run, one encoder and one decoder each: `config_json` (a
//! job's run config, and the one each attempt ran with), `estimate_json` (a job's
//! estimate of that config) and `workload_json` (the validated job admission stored, in
//! core's stored form, so nothing reads its spec again). Like `columns.rs`, this is the row boundary: the scheduler
//! writes and reads these columns only through here, and the wire conversions
//! (`convert.rs`) read them through here for the API.
//!
//! A text a decoder cannot read is a [`CorruptColumn`] naming the column, and the row
//! where the caller knows it (`JobRecord::config`, `JobRecord::estimate`,
//! `AttemptRecord::config`); it becomes the same "corrupt row" error as a state column
//! this build cannot read, never a default: a corrupt row must not read as some other
//! configuration, or as a job that needs no memory.

use std::fmt;

use carve_core::estimator::MemoryEstimate;
use carve_core::plan::{EngineSettings, RunConfig};
use carve_core::spec::Precision;
use carve_core::workload::{JobKind, Workload};
use carve_proto::ApiError;
use serde::{Deserialize, Serialize};

use super::records::{AttemptRecord, JobRecord, attempt_display_id};
use crate::error::SchedulerError;

/// The column of a job's (and an attempt's) run config.
pub const CONFIG_COLUMN: &str = "config_json";
/// The column of a job's estimate.
pub const ESTIMATE_COLUMN: &str = "estimate_json";
/// The column of a job's validated workload (migration 20261220000000_job_workloads).
pub const WORKLOAD_COLUMN: &str = "workload_json";

/// A JSON column whose text this build cannot read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptColumn {
    pub column: &'static str,
    /// The row, when the caller knows it: `job "j"`, `attempt "j/2"`.
    pub row: Option<String>,
    /// What is wrong with the text.
    pub reason: String,
}

impl CorruptColumn {
    fn new(column: &'static str, reason: String) -> Self {
        CorruptColumn {
            column,
            row: None,
            reason,
        }
    }

    /// The same error, naming the job whose row holds the column.
    pub fn of_job(self, job_id: &str) -> Self {
        CorruptColumn {
            row: Some(format!("job {job_id:?}")),
            ..self
        }
    }

    /// The same error, naming the attempt whose row holds the column.
    pub fn of_attempt(self, job_id: &str, attempt_number: i64) -> Self {
        CorruptColumn {
            row: Some(format!(
                "attempt {:?}",
                attempt_display_id(job_id, attempt_number)
            )),
            ..self
        }
    }
}

/// `corrupt row: column "estimate_json" of job "j": ...`, as a state column's decode
/// error reads (`error.rs`).
impl fmt::Display for CorruptColumn {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "corrupt row: column {:?}", self.column)?;
        if let Some(row) = &self.row {
            write!(formatter, " of {row}")?;
        }
        write!(formatter, ": {}", self.reason)
    }
}

impl std::error::Error for CorruptColumn {}

/// Retrying will not help: an internal error, as a corrupt state column is.
impl From<CorruptColumn> for SchedulerError {
    fn from(error: CorruptColumn) -> Self {
        SchedulerError::Api(ApiError::Internal(error.to_string()))
    }
}

/// A run config as job and attempt rows store it. The keys are in alphabetical order,
/// as the text has always been written (the admission cache keys hash it).
///
/// The engine's knobs (`prefetch_batches`, `workspace_limit_bytes`) are written only for
/// a config that has them (a model job's); a command job's config lacks both. Rows
/// written before the engine's knobs were optional hold both as 0 for a command job,
/// which reads as "none" (a model job prefetches at least one batch, so two 0s were
/// never a model job's); one knob without the other is a corrupt row.
#[derive(Debug, Serialize, Deserialize)]
struct StoredRunConfig {
    batch_size: u64,
    micro_batch_size: u64,
    precision: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    prefetch_batches: Option<u64>,
    recompute_segment_layers: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    workspace_limit_bytes: Option<u64>,
}

/// A run config as its column ([`CONFIG_COLUMN`]) stores it.
pub fn config_to_json(config: &RunConfig) -> String {
    let stored = StoredRunConfig {
        batch_size: config.batch_size,
        micro_batch_size: config.micro_batch_size,
        precision: config.precision.name().to_string(),
        prefetch_batches: config.engine.map(|engine| engine.prefetch_batches),
        recompute_segment_layers: config.recompute_segment_layers,
        workspace_limit_bytes: config.engine.map(|engine| engine.workspace_limit_bytes),
    };
    // Numbers and a string: serializing them cannot fail.
    serde_json::to_string(&stored).unwrap_or_default()
}

/// The run config its column ([`CONFIG_COLUMN`]) stores.
pub fn config_from_json(text: &str) -> Result<RunConfig, CorruptColumn> {
    let stored: StoredRunConfig = serde_json::from_str(text).map_err(|error| {
        CorruptColumn::new(
            CONFIG_COLUMN,
            format!("{text:?} is not a run config: {error}"),
        )
    })?;
    Ok(RunConfig {
        batch_size: stored.batch_size,
        micro_batch_size: stored.micro_batch_size,
        precision: Precision::from_name(&stored.precision).ok_or_else(|| {
            CorruptColumn::new(
                CONFIG_COLUMN,
                format!("{:?} is not a precision", stored.precision),
            )
        })?,
        recompute_segment_layers: stored.recompute_segment_layers,
        engine: match (stored.workspace_limit_bytes, stored.prefetch_batches) {
            (None, None) | (Some(0), Some(0)) => None,
            (Some(workspace_limit_bytes), Some(prefetch_batches)) => Some(EngineSettings {
                workspace_limit_bytes,
                prefetch_batches,
            }),
            _ => {
                return Err(CorruptColumn::new(
                    CONFIG_COLUMN,
                    format!(
                        "{text:?} has one of the engine's knobs (workspace_limit_bytes, \
                         prefetch_batches) without the other"
                    ),
                ));
            }
        },
    })
}

/// A validated workload as its column ([`WORKLOAD_COLUMN`]) stores it: core's stored
/// form ([`Workload::to_stored_form`]).
pub fn workload_to_json(workload: &Workload) -> String {
    workload.to_stored_form()
}

/// The workload its column ([`WORKLOAD_COLUMN`]) stores for a job of `kind`, as
/// admission validated it (nothing is parsed or checked again): `None` for a form of an
/// older version, which the caller reads from the spec instead. A text this build cannot
/// read, or of another kind than the job's, is a [`CorruptColumn`].
pub fn workload_from_json(kind: JobKind, text: &str) -> Result<Option<Workload>, CorruptColumn> {
    Workload::from_stored_form(kind, text).map_err(|error| {
        CorruptColumn::new(
            WORKLOAD_COLUMN,
            format!("not a stored {kind} job: {}: {}", error.field, error.reason),
        )
    })
}

/// A job's estimate as its column ([`ESTIMATE_COLUMN`]) stores it: everything the API
/// shows of an estimate but the configuration, which is the row's `config_json`. Rows
/// written before the breakdowns were stored hold only `peak_bytes` and
/// `required_bytes`; the other fields read as empty. The two byte counts are required,
/// so a corrupt row is an error rather than an estimate of zero bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredEstimate {
    pub peak_bytes: u64,
    pub required_bytes: u64,
    #[serde(default)]
    pub persistent_bytes: u64,
    #[serde(default)]
    pub fragmentation_bytes_at_peak: u64,
    #[serde(default)]
    pub fragmentation_at_peak: f64,
    #[serde(default)]
    pub by_category: Vec<StoredCategoryBytes>,
    #[serde(default)]
    pub by_layer: Vec<StoredLayerBytes>,
    #[serde(default)]
    pub peak_during: String,
}

/// Bytes of one memory category at the peak, by the category's name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredCategoryBytes {
    pub category: String,
    pub bytes: u64,
}

/// Bytes of one layer (owner) at the peak, by its label.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredLayerBytes {
    pub layer: String,
    pub bytes: u64,
}

/// An estimate as its column ([`ESTIMATE_COLUMN`]) stores it.
pub fn estimate_to_json(estimate: &MemoryEstimate) -> String {
    let stored = StoredEstimate {
        peak_bytes: estimate.peak_bytes,
        required_bytes: estimate.required_bytes,
        persistent_bytes: estimate.persistent_bytes,
        fragmentation_bytes_at_peak: estimate.fragmentation_bytes_at_peak,
        fragmentation_at_peak: estimate.fragmentation_at_peak,
        by_category: estimate
            .by_category
            .iter()
            .map(|(category, bytes)| StoredCategoryBytes {
                category: category.name().to_string(),
                bytes: *bytes,
            })
            .collect(),
        by_layer: estimate
            .by_layer
            .iter()
            .map(|layer| StoredLayerBytes {
                layer: layer.label.clone(),
                bytes: layer.bytes,
            })
            .collect(),
        peak_during: estimate.peak_during.clone(),
    };
    // Plain numbers, strings and lists: serializing them cannot fail (a NaN share, which
    // JSON cannot hold, becomes null and reads back as an error, not as a number).
    serde_json::to_string(&stored).unwrap_or_default()
}

/// The estimate its column ([`ESTIMATE_COLUMN`]) stores.
pub fn estimate_from_json(text: &str) -> Result<StoredEstimate, CorruptColumn> {
    serde_json::from_str(text)
        .map_err(|error| CorruptColumn::new(ESTIMATE_COLUMN, format!("not an estimate: {error}")))
}

impl JobRecord {
    /// The run config the job's next (or running) attempt uses (`config_json`); an error
    /// names the job.
    pub fn config(&self) -> Result<RunConfig, CorruptColumn> {
        config_from_json(&self.config_json).map_err(|error| error.of_job(&self.id))
    }

    /// The estimate stored with the job (`estimate_json`); an error names the job.
    pub fn estimate(&self) -> Result<StoredEstimate, CorruptColumn> {
        estimate_from_json(&self.estimate_json).map_err(|error| error.of_job(&self.id))
    }
}

impl AttemptRecord {
    /// The run config the attempt ran with (`config_json`); an error names the attempt.
    pub fn config(&self) -> Result<RunConfig, CorruptColumn> {
        config_from_json(&self.config_json)
            .map_err(|error| error.of_attempt(&self.job_id, self.attempt_number))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_config_reads_back_as_it_was_written() {
        let config = RunConfig {
            batch_size: 32,
            micro_batch_size: 8,
            precision: Precision::from_name("fp16").unwrap(),
            recompute_segment_layers: Some(2),
            engine: Some(EngineSettings {
                workspace_limit_bytes: 1 << 20,
                prefetch_batches: 2,
            }),
        };
        let text = config_to_json(&config);
        assert_eq!(
            text,
            r#"{"batch_size":32,"micro_batch_size":8,"precision":"fp16","prefetch_batches":2,"recompute_segment_layers":2,"workspace_limit_bytes":1048576}"#
        );
        assert_eq!(config_from_json(&text), Ok(config));

        // A command job's config has no engine knobs, and its text none either.
        let command = RunConfig {
            engine: None,
            ..config
        };
        let text = config_to_json(&command);
        assert_eq!(
            text,
            r#"{"batch_size":32,"micro_batch_size":8,"precision":"fp16","recompute_segment_layers":2}"#
        );
        assert_eq!(config_from_json(&text), Ok(command));
    }

    #[test]
    fn a_command_jobs_config_written_before_the_split_reads_without_engine_knobs() {
        // How rows of command jobs were written while the engine's knobs were plain
        // fields, 0 by convention.
        let old = r#"{"batch_size":256,"micro_batch_size":64,"precision":"bf16","prefetch_batches":0,"recompute_segment_layers":null,"workspace_limit_bytes":0}"#;
        let config = config_from_json(old).unwrap();
        assert_eq!(config.engine, None);
        assert_eq!((config.batch_size, config.micro_batch_size), (256, 64));
        // One knob without the other was never written.
        for text in [
            r#"{"batch_size":8,"micro_batch_size":8,"precision":"fp32","prefetch_batches":2,"recompute_segment_layers":null}"#,
            r#"{"batch_size":8,"micro_batch_size":8,"precision":"fp32","recompute_segment_layers":null,"workspace_limit_bytes":0}"#,
        ] {
            let error = config_from_json(text).unwrap_err();
            assert_eq!(error.column, CONFIG_COLUMN, "{text}");
        }
    }

    #[test]
    fn a_corrupt_run_config_is_an_error_naming_the_column_and_the_row() {
        for text in [
            "",
            "{}",
            r#"{"batch_size":32,"micro_batch_size":8,"precision":"fp33","prefetch_batches":2,"recompute_segment_layers":null,"workspace_limit_bytes":0}"#,
        ] {
            let error = config_from_json(text).unwrap_err();
            assert_eq!(
                (error.column, &error.row),
                (CONFIG_COLUMN, &None),
                "{text:?}"
            );
            let message = error.of_job("j").to_string();
            assert!(
                message.starts_with(r#"corrupt row: column "config_json" of job "j": "#),
                "{message}"
            );
        }
        let error = config_from_json("{}").unwrap_err().of_attempt("j", 2);
        assert!(error.to_string().contains(r#"of attempt "j/2""#), "{error}");
        assert!(matches!(
            SchedulerError::from(error),
            SchedulerError::Api(ApiError::Internal(_))
        ));
    }

    #[test]
    fn a_corrupt_stored_estimate_is_an_error() {
        for text in [
            "",
            "{}",
            r#"{"peak_bytes":1}"#,
            r#"{"peak_bytes":-1,"required_bytes":2}"#,
            r#"{"peak_bytes":1,"required_bytes":2,"by_layer":"x"}"#,
        ] {
            let error = estimate_from_json(text).unwrap_err();
            assert_eq!(error.column, ESTIMATE_COLUMN, "{text:?}");
        }
        // Rows written before the breakdowns were stored hold the two byte counts only.
        let legacy = estimate_from_json(r#"{"peak_bytes":3000,"required_bytes":4096}"#).unwrap();
        assert_eq!((legacy.peak_bytes, legacy.required_bytes), (3000, 4096));
        assert!(legacy.by_category.is_empty() && legacy.peak_during.is_empty());
    }
}
