//! Conversions between the generated `carve.v1` types and carve-core's.
//!
//! Core types carry no prost or serde derives for the wire (docs/design.md: generated types
//! stop at the service handlers), so every translation lives here, in one place, with the
//! checks a value from the network needs. Reading a value from the wire can fail and
//! names the field it is about (an [`ApiError::InvalidArgument`]); writing one cannot.
//!
//! Enum fields are `i32` in the generated messages (proto3 keeps numbers it does not know),
//! so reading one goes through [`required_enum`] or [`precision_from_proto`], which reject
//! both the `*_UNSPECIFIED` zero and numbers this version does not know.

use carve_core::FieldError;
use carve_core::allocator::OutOfMemory;
use carve_core::command::memory_model::{CommandMemoryModel, ProfilePoint};
use carve_core::estimator::MemoryEstimate;
use carve_core::plan::{EngineSettings, RunConfig};
use carve_core::shrink::{ShrinkDecision, ShrinkStep};
use carve_core::spec::{JobSpec, Precision};
use carve_core::validate::{ValidatedJob, parse_job_spec_json, validate_job_spec};
use carve_core::workload::{JobKind, SpecFormat, Workload};

use crate::status::{ApiError, join_field};
use crate::v1;

/// The field that names a job spec in error paths: a spec error about
/// `training.batch_size` is reported as `spec.training.batch_size`.
pub const SPEC_FIELD: &str = "spec";

impl From<Precision> for v1::Precision {
    fn from(precision: Precision) -> Self {
        match precision {
            Precision::Fp32 => v1::Precision::Fp32,
            Precision::Fp16 => v1::Precision::Fp16,
            Precision::Bf16 => v1::Precision::Bf16,
        }
    }
}

/// Reads a precision from the wire. `field` names it in the error: unspecified or
/// unknown values are [`ApiError::InvalidArgument`].
pub fn precision_from_proto(value: i32, field: &str) -> Result<Precision, ApiError> {
    const EXPECTED: &str = "expected PRECISION_FP32, PRECISION_FP16 or PRECISION_BF16";
    match v1::Precision::try_from(value) {
        Ok(v1::Precision::Fp32) => Ok(Precision::Fp32),
        Ok(v1::Precision::Fp16) => Ok(Precision::Fp16),
        Ok(v1::Precision::Bf16) => Ok(Precision::Bf16),
        Ok(v1::Precision::Unspecified) => Err(ApiError::invalid_argument(
            field,
            format!("must be set; {EXPECTED}"),
        )),
        Err(_) => Err(ApiError::invalid_argument(
            field,
            format!("{value} is not a known precision; {EXPECTED}"),
        )),
    }
}

/// Unwraps a message field, which prost makes an `Option` because proto3 message fields
/// may be absent: absent is [`ApiError::InvalidArgument`] naming `field`.
pub fn required<T>(value: Option<T>, field: &str) -> Result<T, ApiError> {
    value.ok_or_else(|| ApiError::invalid_argument(field, "must be set"))
}

/// Reads any generated enum from the wire, rejecting its `*_UNSPECIFIED` zero and numbers
/// this version does not know, naming `field`. For example
/// `required_enum::<v1::JobState>(request.state, "state")`.
pub fn required_enum<E>(value: i32, field: &str) -> Result<E, ApiError>
where
    E: TryFrom<i32>,
{
    if value == 0 {
        return Err(ApiError::invalid_argument(field, "must be set"));
    }
    E::try_from(value)
        .map_err(|_| ApiError::invalid_argument(field, format!("{value} is not a known value")))
}

impl From<OutOfMemory> for v1::OutOfMemoryReport {
    fn from(out_of_memory: OutOfMemory) -> Self {
        v1::OutOfMemoryReport {
            requested_bytes: out_of_memory.requested,
            in_use_bytes: out_of_memory.in_use,
            limit_bytes: out_of_memory.limit,
            largest_free_bytes: out_of_memory.largest_free,
            peak_bytes: out_of_memory.peak,
        }
    }
}

/// Every combination of numbers is a possible allocator state to report (a worker may
/// even send a peak below in-use after a restart), so this does not judge them.
impl From<v1::OutOfMemoryReport> for OutOfMemory {
    fn from(report: v1::OutOfMemoryReport) -> Self {
        OutOfMemory {
            requested: report.requested_bytes,
            in_use: report.in_use_bytes,
            limit: report.limit_bytes,
            largest_free: report.largest_free_bytes,
            peak: report.peak_bytes,
        }
    }
}

/// Parses a job spec from the API's `spec_json`, strictly (unknown fields are errors).
/// Errors name the field under [`SPEC_FIELD`]: `spec.model.layers[3].conv2d.kernel`.
/// This only parses; [`validated_job_from_json`] also runs every semantic check.
pub fn job_spec_from_json(spec_json: &str) -> Result<JobSpec, ApiError> {
    parse_job_spec_json(spec_json).map_err(|error| ApiError::from(error).prefix_field(SPEC_FIELD))
}

/// Parses and validates a job spec from the API's `spec_json`, returning the model graph
/// with its shapes. Errors name the field under [`SPEC_FIELD`].
pub fn validated_job_from_json(spec_json: &str) -> Result<ValidatedJob, ApiError> {
    let spec = job_spec_from_json(spec_json)?;
    validate_job_spec(spec).map_err(|error| ApiError::from(error).prefix_field(SPEC_FIELD))
}

/// Why a command job has no estimate ahead of time, for the commands that estimate or
/// train model jobs (`carve estimate`, `carve run`, EstimateJob).
pub const COMMAND_JOB_HAS_NO_ESTIMATE: &str = "is a command job: Carve cannot see inside \
     the program, so its memory is measured by a short profile when it is submitted \
     (carve submit), or taken from resources.vram; there is nothing to estimate or train \
     here";

/// The kind of job the API's `spec_json` is: a command job when it has a top-level
/// `command`, read without validating it. The protocol's one reading of a kind from text
/// ([`JobKind::of_spec_text`]); past admission the kind is stored with the job.
pub fn spec_kind_from_json(spec_json: &str) -> JobKind {
    JobKind::of_spec_text(spec_json, SpecFormat::Json)
}

/// Whether the API's `spec_json` is a command job's ([`spec_kind_from_json`]).
pub fn is_command_spec_json(spec_json: &str) -> bool {
    spec_kind_from_json(spec_json) == JobKind::Command
}

/// The model job spec an estimate works on (EstimateJob), from the API's `spec_json`,
/// parsed but not validated: a spec of a kind whose memory is measured (a command job's)
/// has nothing to estimate and is refused naming [`SPEC_FIELD`]
/// ([`COMMAND_JOB_HAS_NO_ESTIMATE`]); other errors name the field under it.
pub fn estimable_job_spec_from_json(spec_json: &str) -> Result<JobSpec, ApiError> {
    if spec_kind_from_json(spec_json).memory_is_measured() {
        return Err(ApiError::invalid_argument(
            SPEC_FIELD,
            COMMAND_JOB_HAS_NO_ESTIMATE,
        ));
    }
    job_spec_from_json(spec_json)
}

/// Parses and validates a spec of either kind (a model job, or a command job: one with a
/// `command` table) from the API's `spec_json` ([`Workload::from_json`]). Errors name the
/// field under [`SPEC_FIELD`].
pub fn validated_spec_from_json(spec_json: &str) -> Result<Workload, ApiError> {
    Workload::from_json(spec_json).map_err(|error| ApiError::from(error).prefix_field(SPEC_FIELD))
}

impl From<CommandMemoryModel> for v1::CommandMemoryModel {
    fn from(model: CommandMemoryModel) -> Self {
        v1::CommandMemoryModel {
            fixed_bytes: model.fixed_bytes,
            per_sample_bytes: model.per_sample_bytes,
            precision: v1::Precision::from(model.precision).into(),
            recompute: model.recompute,
            // A bare model says nothing of where it came from: the scheduler, which
            // knows, sets these.
            basis: String::new(),
            measured: true,
        }
    }
}

impl From<ProfilePoint> for v1::ProfilePoint {
    fn from(point: ProfilePoint) -> Self {
        v1::ProfilePoint {
            micro_batch: point.micro_batch,
            peak_bytes: point.peak_bytes,
            ran_out: point.ran_out,
        }
    }
}

impl From<v1::ProfilePoint> for ProfilePoint {
    fn from(point: v1::ProfilePoint) -> Self {
        ProfilePoint {
            micro_batch: point.micro_batch,
            peak_bytes: point.peak_bytes,
            ran_out: point.ran_out,
        }
    }
}

/// Writes a job spec as the API's `spec_json`; [`job_spec_from_json`] reads it back to an
/// equal spec.
pub fn job_spec_to_json(spec: &JobSpec) -> Result<String, ApiError> {
    // Serializing a spec only fails on a bug (the spec types have no maps with non-string
    // keys and no fallible serializers), so that is what it reports.
    serde_json::to_string(spec)
        .map_err(|error| ApiError::Internal(format!("cannot write the job spec as json: {error}")))
}

impl From<RunConfig> for v1::RunConfig {
    fn from(config: RunConfig) -> Self {
        v1::RunConfig {
            batch_size: config.batch_size,
            micro_batch_size: config.micro_batch_size,
            precision: v1::Precision::from(config.precision).into(),
            recompute_segment_layers: config.recompute_segment_layers,
            // A config without the engine's knobs (a command job's) sends neither: proto3
            // leaves a 0 off the wire, and the reader takes two 0s as "none".
            workspace_limit_bytes: config.workspace_limit_bytes(),
            prefetch_batches: config.engine.map_or(0, |engine| engine.prefetch_batches),
        }
    }
}

/// Reads a run config without a model to check it against; errors name the bare field
/// (`micro_batch_size`). See [`run_config_from_proto`].
impl TryFrom<v1::RunConfig> for RunConfig {
    type Error = ApiError;

    fn try_from(config: v1::RunConfig) -> Result<Self, ApiError> {
        run_config_from_proto(&config, "")
    }
}

/// Reads a run config from the wire with every check that needs no model: batch and
/// micro-batch sizes at least 1, the micro-batch dividing the batch, a recompute segment
/// of at least 1 layer, 1 to 16 prefetched batches and a known precision. Errors name
/// the field under `field` (`config.micro_batch_size`). When the job is at hand, prefer
/// [`run_config_for_job`], which also checks the config against the model.
pub fn run_config_from_proto(config: &v1::RunConfig, field: &str) -> Result<RunConfig, ApiError> {
    checked_run_config(config, field, RunConfig::check_settings)
}

/// Reads a run config from the wire and checks it as `workload`'s kind reads it
/// ([`Workload::check_config`]: a model job's against its model, a command job's by the
/// knobs a command has), so one conversion serves both kinds. Errors name the field
/// under `field`.
pub fn run_config_for_workload(
    config: &v1::RunConfig,
    workload: &Workload,
    field: &str,
) -> Result<RunConfig, ApiError> {
    checked_run_config(config, field, |run_config| {
        workload.check_config(run_config)
    })
}

/// The run config `config` says, refused with `check`'s error (its field under `field`).
fn checked_run_config(
    config: &v1::RunConfig,
    field: &str,
    check: impl FnOnce(&RunConfig) -> Result<(), FieldError>,
) -> Result<RunConfig, ApiError> {
    let run_config = RunConfig {
        batch_size: config.batch_size,
        micro_batch_size: config.micro_batch_size,
        precision: precision_from_proto(config.precision, &join_field(field, "precision"))?,
        recompute_segment_layers: config.recompute_segment_layers,
        engine: engine_settings_from_proto(config),
    };
    check(&run_config).map_err(|error| ApiError::from(error).prefix_field(field))?;
    Ok(run_config)
}

/// The engine's knobs a wire config carries: none when both are 0, which is how a
/// config without them (a command job's) travels (proto3 sends no 0). A model job's
/// prefetches at least one batch, so two 0s never stand for a model job's knobs.
fn engine_settings_from_proto(config: &v1::RunConfig) -> Option<EngineSettings> {
    if config.workspace_limit_bytes == 0 && config.prefetch_batches == 0 {
        return None;
    }
    Some(EngineSettings {
        workspace_limit_bytes: config.workspace_limit_bytes,
        prefetch_batches: config.prefetch_batches,
    })
}

/// Reads a run config from the wire and checks it against `job`'s model with core's own
/// check ([`RunConfig::check`]), so the API refuses exactly what the planner would.
/// Errors name the field under `field`.
pub fn run_config_for_job(
    config: &v1::RunConfig,
    job: &ValidatedJob,
    field: &str,
) -> Result<RunConfig, ApiError> {
    checked_run_config(config, field, |run_config| run_config.check(&job.graph))
}

impl From<&MemoryEstimate> for v1::MemoryEstimate {
    fn from(estimate: &MemoryEstimate) -> Self {
        v1::MemoryEstimate {
            config: Some(estimate.config.into()),
            peak_bytes: estimate.peak_bytes,
            required_bytes: estimate.required_bytes,
            persistent_bytes: estimate.persistent_bytes,
            fragmentation_at_peak: estimate.fragmentation_at_peak,
            by_category: estimate
                .by_category
                .iter()
                .map(|(category, bytes)| v1::CategoryBytes {
                    category: category.name().to_string(),
                    bytes: *bytes,
                })
                .collect(),
            by_layer: estimate
                .by_layer
                .iter()
                .map(|layer| v1::LayerBytes {
                    layer: layer.label.clone(),
                    bytes: layer.bytes,
                })
                .collect(),
            fragmentation_bytes_at_peak: estimate.fragmentation_bytes_at_peak,
            peak_during: estimate.peak_during.clone(),
        }
    }
}

impl From<MemoryEstimate> for v1::MemoryEstimate {
    fn from(estimate: MemoryEstimate) -> Self {
        (&estimate).into()
    }
}

impl From<&ShrinkStep> for v1::ShrinkStep {
    fn from(step: &ShrinkStep) -> Self {
        v1::ShrinkStep {
            strategy: step.strategy.name().to_string(),
            description: step.description.clone(),
        }
    }
}

/// The planner's decision as the API shows it. Core's decision holds only the new
/// config; the one it replaces comes from the caller (the failed attempt's config).
pub fn shrink_decision_to_proto(
    old_config: &RunConfig,
    decision: &ShrinkDecision,
) -> v1::ShrinkDecision {
    v1::ShrinkDecision {
        old_config: Some((*old_config).into()),
        new_config: Some(decision.config.into()),
        estimate: Some((&decision.estimate).into()),
        steps: decision.steps.iter().map(v1::ShrinkStep::from).collect(),
        budget_bytes: decision.budget_bytes,
    }
}

#[cfg(test)]
mod tests {
    use carve_core::CoreError;
    use carve_core::allocator::OutOfMemory;
    use carve_core::estimator::estimate_job;
    use carve_core::plan::{MemoryCategory, RunConfig};
    use carve_core::shrink::plan_shrink;
    use carve_core::spec::Precision;
    use tonic::Code;

    use super::*;

    /// A small CNN on synthetic 28x28 images: every conversion below works on it.
    const SPEC_JSON: &str = r#"{
        "name": "mnist-cnn",
        "model": {
            "input_shape": [28, 28, 1],
            "layers": [
                {"conv2d": {"filters": 8, "kernel": 3, "padding": "same"}},
                {"relu": {}},
                {"max_pool": {"size": 2}},
                {"flatten": {}},
                {"dense": {"units": 10}}
            ],
            "loss": "softmax_cross_entropy"
        },
        "training": {"batch_size": 32, "steps": 10, "optimizer": {"adam": {"learning_rate": 0.001}}},
        "data": {"format": "synthetic", "samples": 256}
    }"#;

    fn invalid_field(error: ApiError) -> (String, String) {
        match error {
            ApiError::InvalidArgument { field, reason } => (field, reason),
            other => panic!("expected invalid argument, got {other:?}"),
        }
    }

    fn sample_config() -> RunConfig {
        RunConfig {
            batch_size: 32,
            micro_batch_size: 8,
            precision: Precision::Bf16,
            recompute_segment_layers: Some(2),
            engine: Some(EngineSettings {
                workspace_limit_bytes: 64 << 20,
                prefetch_batches: 2,
            }),
        }
    }

    #[test]
    fn precision_round_trips() {
        for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
            let wire = i32::from(v1::Precision::from(precision));
            assert_eq!(precision_from_proto(wire, "precision"), Ok(precision));
        }
    }

    #[test]
    fn unknown_precision_is_invalid_argument_naming_the_field() {
        let error = precision_from_proto(7, "precision").unwrap_err();
        let status = tonic::Status::from(error.clone());
        assert_eq!(status.code(), Code::InvalidArgument);
        let (field, reason) = invalid_field(error);
        assert_eq!(field, "precision");
        assert!(reason.contains("7 is not a known precision"), "{reason}");
        assert!(
            status.message().starts_with("precision: 7"),
            "{}",
            status.message()
        );
    }

    #[test]
    fn unspecified_precision_is_invalid_argument() {
        let (field, reason) =
            invalid_field(precision_from_proto(0, "overrides.precision").unwrap_err());
        assert_eq!(field, "overrides.precision");
        assert!(reason.starts_with("must be set"), "{reason}");
    }

    #[test]
    fn required_enum_rejects_unspecified_and_unknown_values() {
        assert_eq!(
            required_enum::<v1::JobState>(v1::JobState::Running.into(), "state"),
            Ok(v1::JobState::Running)
        );
        assert_eq!(
            required_enum::<v1::Role>(0, "role"),
            Err(ApiError::invalid_argument("role", "must be set"))
        );
        assert_eq!(
            required_enum::<v1::AttemptOutcome>(42, "outcome"),
            Err(ApiError::invalid_argument(
                "outcome",
                "42 is not a known value"
            ))
        );
    }

    #[test]
    fn required_message_names_the_missing_field() {
        assert_eq!(required(Some(3), "config"), Ok(3));
        assert_eq!(
            required::<v1::RunConfig>(None, "assignment.config"),
            Err(ApiError::invalid_argument(
                "assignment.config",
                "must be set"
            ))
        );
    }

    #[test]
    fn out_of_memory_round_trips() {
        let out_of_memory = OutOfMemory {
            requested: 3 << 20,
            in_use: 5 << 30,
            limit: 6 << 30,
            largest_free: 1 << 20,
            peak: (5 << 30) + 7,
        };
        let report = v1::OutOfMemoryReport::from(out_of_memory);
        assert_eq!(report.requested_bytes, 3 << 20);
        assert_eq!(report.in_use_bytes, 5 << 30);
        assert_eq!(report.limit_bytes, 6 << 30);
        assert_eq!(report.largest_free_bytes, 1 << 20);
        assert_eq!(report.peak_bytes, (5 << 30) + 7);
        assert_eq!(OutOfMemory::from(report), out_of_memory);
    }

    #[test]
    fn job_spec_round_trips_through_json() {
        let spec = job_spec_from_json(SPEC_JSON).unwrap();
        assert_eq!(spec.name, "mnist-cnn");
        let json = job_spec_to_json(&spec).unwrap();
        assert_eq!(job_spec_from_json(&json).unwrap(), spec);
        assert_eq!(validated_job_from_json(&json).unwrap().spec, spec);
    }

    #[test]
    fn spec_parse_errors_name_the_field_under_spec() {
        let json = SPEC_JSON.replace(r#""batch_size": 32"#, r#""batch_size": "many""#);
        let (field, _) = invalid_field(job_spec_from_json(&json).unwrap_err());
        assert_eq!(field, "spec.training.batch_size");

        let json = SPEC_JSON.replace(r#""kernel": 3"#, r#""kernal": 3"#);
        let (field, reason) = invalid_field(job_spec_from_json(&json).unwrap_err());
        assert!(field.starts_with("spec.model.layers[0].conv2d"), "{field}");
        assert!(reason.contains("kernal"), "{reason}");

        let (field, _) = invalid_field(job_spec_from_json("{not json").unwrap_err());
        assert!(field == "spec" || field.starts_with("spec."), "{field}");
    }

    #[test]
    fn only_a_spec_whose_memory_is_estimated_reaches_the_estimate() {
        assert_eq!(
            estimable_job_spec_from_json(SPEC_JSON).unwrap(),
            job_spec_from_json(SPEC_JSON).unwrap()
        );
        // A command job's memory is measured, so nothing estimates it: refused naming
        // the spec and saying where its memory comes from instead.
        let command =
            r#"{"name": "c", "command": {"argv": ["python3", "t.py"], "global_batch": 8}}"#;
        let (field, reason) = invalid_field(estimable_job_spec_from_json(command).unwrap_err());
        assert_eq!(field, "spec");
        assert_eq!(reason, COMMAND_JOB_HAS_NO_ESTIMATE);
        // Anything else is read as a model job, whose parser says what is wrong.
        let (field, _) = invalid_field(estimable_job_spec_from_json("{not json").unwrap_err());
        assert!(field == "spec" || field.starts_with("spec."), "{field}");
    }

    #[test]
    fn spec_validation_errors_name_the_field_under_spec() {
        let json = SPEC_JSON
            .replace("[28, 28, 1]", "[4, 4, 1]")
            .replace(r#""kernel": 3, "padding": "same""#, r#""kernel": 5"#);
        let status = tonic::Status::from(validated_job_from_json(&json).unwrap_err());
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(
            status.message(),
            "spec.model.layers[0].conv2d.kernel: 5 is larger than the 4x4 input"
        );
    }

    #[test]
    fn run_config_round_trips() {
        for config in [
            sample_config(),
            RunConfig {
                recompute_segment_layers: None,
                precision: Precision::Fp32,
                micro_batch_size: 32,
                ..sample_config()
            },
        ] {
            let wire = v1::RunConfig::from(config);
            assert_eq!(RunConfig::try_from(wire), Ok(config));
            assert_eq!(run_config_from_proto(&wire, "config"), Ok(config));
        }
    }

    #[test]
    fn bad_run_configs_name_the_field() {
        let good = v1::RunConfig::from(sample_config());
        let cases = [
            (
                v1::RunConfig {
                    batch_size: 0,
                    ..good
                },
                "config.batch_size",
                "must be at least 1",
            ),
            (
                v1::RunConfig {
                    micro_batch_size: 0,
                    ..good
                },
                "config.micro_batch_size",
                "must be at least 1",
            ),
            (
                v1::RunConfig {
                    micro_batch_size: 3,
                    ..good
                },
                "config.micro_batch_size",
                "3 does not divide batch_size 32",
            ),
            (
                v1::RunConfig {
                    recompute_segment_layers: Some(0),
                    ..good
                },
                "config.recompute_segment_layers",
                "must be at least 1",
            ),
            (
                v1::RunConfig {
                    prefetch_batches: 17,
                    ..good
                },
                "config.prefetch_batches",
                "17 must be between 1 and 16",
            ),
            (
                v1::RunConfig {
                    precision: 9,
                    ..good
                },
                "config.precision",
                "9 is not a known precision; expected PRECISION_FP32, PRECISION_FP16 or PRECISION_BF16",
            ),
        ];
        for (wire, field, reason) in cases {
            assert_eq!(
                run_config_from_proto(&wire, "config"),
                Err(ApiError::invalid_argument(field, reason))
            );
        }
        // Without a prefix the bare field is named.
        let (field, _) = invalid_field(
            RunConfig::try_from(v1::RunConfig {
                batch_size: 0,
                ..good
            })
            .unwrap_err(),
        );
        assert_eq!(field, "batch_size");
    }

    #[test]
    fn run_config_for_job_applies_cores_model_checks() {
        let job = validated_job_from_json(SPEC_JSON).unwrap();
        let good = v1::RunConfig::from(sample_config());
        assert_eq!(
            run_config_for_job(&good, &job, "config"),
            Ok(sample_config())
        );
        let too_long = v1::RunConfig {
            recompute_segment_layers: Some(99),
            ..good
        };
        let (field, reason) =
            invalid_field(run_config_for_job(&too_long, &job, "config").unwrap_err());
        assert_eq!(field, "config.recompute_segment_layers");
        assert!(reason.contains("99"), "{reason}");
    }

    #[test]
    fn a_command_jobs_config_travels_without_the_engines_knobs() {
        let command = Workload::from_toml(
            "name = \"c\"\n[command]\nargv = [\"python3\", \"train.py\"]\n\
             steps = 10\nglobal_batch = 8\n[resources]\nvram = \"1GiB\"\n",
        )
        .unwrap();
        let config = command.initial_config();
        assert_eq!(config.engine, None);
        let wire = v1::RunConfig::from(config);
        assert_eq!((wire.workspace_limit_bytes, wire.prefetch_batches), (0, 0));
        assert_eq!(
            run_config_for_workload(&wire, &command, "config"),
            Ok(config)
        );
        // A command job has no engine knobs to set.
        let (field, _) = invalid_field(
            run_config_for_workload(
                &v1::RunConfig {
                    prefetch_batches: 2,
                    ..wire
                },
                &command,
                "config",
            )
            .unwrap_err(),
        );
        assert_eq!(field, "config.prefetch_batches");
        // The same wire config is refused for a model job, which needs them.
        let model = Workload::from_json(SPEC_JSON).unwrap();
        let (field, _) =
            invalid_field(run_config_for_workload(&wire, &model, "config").unwrap_err());
        assert_eq!(field, "config.prefetch_batches");
    }

    #[test]
    fn memory_estimate_carries_every_number() {
        let job = validated_job_from_json(SPEC_JSON).unwrap();
        let estimate = estimate_job(&job, &RunConfig::from_spec(&job.spec)).unwrap();
        let wire = v1::MemoryEstimate::from(&estimate);
        assert_eq!(wire.config, Some(v1::RunConfig::from(estimate.config)));
        assert_eq!(wire.peak_bytes, estimate.peak_bytes);
        assert_eq!(wire.required_bytes, estimate.required_bytes);
        assert_eq!(wire.persistent_bytes, estimate.persistent_bytes);
        assert_eq!(
            wire.fragmentation_bytes_at_peak,
            estimate.fragmentation_bytes_at_peak
        );
        assert_eq!(wire.fragmentation_at_peak, estimate.fragmentation_at_peak);
        assert_eq!(wire.peak_during, estimate.peak_during);
        let categories: Vec<&str> = wire
            .by_category
            .iter()
            .map(|entry| entry.category.as_str())
            .collect();
        let expected: Vec<&str> = MemoryCategory::ALL
            .iter()
            .map(|category| category.name())
            .collect();
        assert_eq!(categories, expected);
        for (entry, (_, bytes)) in wire.by_category.iter().zip(&estimate.by_category) {
            assert_eq!(entry.bytes, *bytes);
        }
        assert_eq!(wire.by_layer.len(), estimate.by_layer.len());
        assert!(
            wire.by_layer
                .iter()
                .any(|entry| entry.layer == "layers[0].conv2d" && entry.bytes > 0),
            "{:?}",
            wire.by_layer
        );
        assert!(wire.peak_bytes > 0 && wire.required_bytes >= wire.peak_bytes);
    }

    #[test]
    fn shrink_decision_shows_both_configs_and_the_steps() {
        let job = validated_job_from_json(SPEC_JSON).unwrap();
        let current = RunConfig::from_spec(&job.spec);
        let half = RunConfig {
            precision: job.spec.oom.half_precision,
            ..current
        };
        let half_required = estimate_job(&job, &half).unwrap().required_bytes;
        let full_required = estimate_job(&job, &current).unwrap().required_bytes;
        assert!(half_required < full_required);

        let decision = plan_shrink(&job, &current, None, half_required).unwrap();
        let wire = shrink_decision_to_proto(&current, &decision);
        assert_eq!(wire.old_config, Some(v1::RunConfig::from(current)));
        assert_eq!(wire.new_config, Some(v1::RunConfig::from(decision.config)));
        assert_eq!(
            wire.estimate,
            Some(v1::MemoryEstimate::from(&decision.estimate))
        );
        assert_eq!(wire.budget_bytes, decision.budget_bytes);
        assert!(!wire.steps.is_empty());
        assert_eq!(wire.steps[0].strategy, "mixed_precision");
        assert_eq!(wire.steps[0].description, decision.steps[0].description);
    }

    #[test]
    fn a_job_that_fits_nowhere_is_resource_exhausted() {
        let job = validated_job_from_json(SPEC_JSON).unwrap();
        let error = plan_shrink(&job, &RunConfig::from_spec(&job.spec), None, 1024).unwrap_err();
        assert!(matches!(error, CoreError::DoesNotFit { .. }), "{error:?}");
        let status = tonic::Status::from(ApiError::from(error));
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(
            status.message().starts_with("no configuration fits"),
            "{}",
            status.message()
        );
    }
}
