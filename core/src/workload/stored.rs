//! A [`Workload`] as the store keeps it from admission on: the validated job itself (a
//! model job's spec with its inferred graph, a command job's checked spec) and its kind,
//! so nothing after admission parses, checks or infers a spec again, restarts included.
//!
//! The text is JSON, `{"version":1,"kind":"model","spec":{..},"graph":{..}}` (a command
//! job has no `graph`), written by [`Workload::to_stored_form`] and read by
//! [`Workload::from_stored_form`], which trusts it as validated: the store is the
//! scheduler's own, and admission wrote it after every check. What the reader cannot
//! take is an error, never a guess; a form older than [`OLDEST_READ_STORED_FORM_VERSION`]
//! is `None`, for the caller to read the job's spec once and store the form again.
//!
//! Version 2 added a gang's `resources.gpus` above 1 and `resources.placement` (issue 31).
//! A form is written with the lowest version that holds it: a job of one slice is still
//! a version-1 form, byte for byte, which every build reads; a gang is version 2, which a
//! build from before gangs refuses as newer rather than running it as one slice. Both
//! versions read here (a version-1 form is a one-slice job with the default placement).

use serde::Deserialize;
use serde_json::Value;

use super::{JobKind, Workload};
use crate::command::spec::CommandJobSpec;
use crate::command::validate::ValidatedCommandJob;
use crate::error::FieldError;
use crate::model::ModelGraph;
use crate::spec::JobSpec;
use crate::validate::ValidatedJob;

/// The stored form's version. Raise it when the graph's or a spec's serde form changes
/// in a way an older form does not read as: rows of an older version are then read from
/// their spec once (and stored again), instead of being misread.
pub const STORED_FORM_VERSION: u64 = 2;

/// The oldest version read as it is: every form from it to [`STORED_FORM_VERSION`] reads
/// (version 1 is version 2 without gangs).
pub const OLDEST_READ_STORED_FORM_VERSION: u64 = 1;

/// The version a workload's form is written with: 2 only for what version 1 cannot say.
fn version_for(workload: &Workload) -> u64 {
    let resources = workload.resources();
    if resources.gpus > 1 || !resources.placement.is_default() {
        STORED_FORM_VERSION
    } else {
        OLDEST_READ_STORED_FORM_VERSION
    }
}

/// The parts of a stored form every version has.
#[derive(Deserialize)]
struct Header {
    version: u64,
    kind: String,
}

impl Workload {
    /// The validated job as the store keeps it (see the module's documentation).
    pub fn to_stored_form(&self) -> String {
        let mut form = serde_json::Map::new();
        form.insert("version".into(), Value::from(version_for(self)));
        form.insert("kind".into(), Value::from(self.kind().name()));
        let (spec, graph) = match self {
            Workload::Model(job) => (serde_json::to_value(&job.spec), Some(&job.graph)),
            Workload::Command(job) => (serde_json::to_value(&job.spec), None),
        };
        // The spec and graph types have only string keys and infallible serializers;
        // `from_stored_form`'s tests read every example back.
        form.insert("spec".into(), spec.unwrap_or(Value::Null));
        if let Some(graph) = graph {
            form.insert(
                "graph".into(),
                serde_json::to_value(graph).unwrap_or(Value::Null),
            );
        }
        Value::Object(form).to_string()
    }

    /// The workload a stored form holds, for a job stored as `kind`: `Ok(None)` when the
    /// form is older than [`OLDEST_READ_STORED_FORM_VERSION`] (the caller reads the spec
    /// instead);
    /// an error, naming the part, when the text is not a form of this version, holds
    /// another kind, or a part does not read.
    pub fn from_stored_form(kind: JobKind, text: &str) -> Result<Option<Workload>, FieldError> {
        let form: Value = serde_json::from_str(text)
            .map_err(|error| FieldError::new("workload", format!("is not JSON: {error}")))?;
        let header = Header::deserialize(&form)
            .map_err(|error| FieldError::new("workload", error.to_string()))?;
        if header.version < OLDEST_READ_STORED_FORM_VERSION {
            return Ok(None);
        }
        if header.version > STORED_FORM_VERSION {
            return Err(FieldError::new(
                "version",
                format!(
                    "{} is newer than this build's {STORED_FORM_VERSION}",
                    header.version
                ),
            ));
        }
        if header.kind != kind.name() {
            return Err(FieldError::new(
                "kind",
                format!("is {:?}, but the job is stored as {kind}", header.kind),
            ));
        }
        let part = |name: &str| {
            form.get(name)
                .ok_or_else(|| FieldError::new(name, "is missing"))
        };
        let read_error =
            |name: &str, error: serde_json::Error| FieldError::new(name, error.to_string());
        Ok(Some(match kind {
            JobKind::Model => Workload::Model(ValidatedJob {
                spec: JobSpec::deserialize(part("spec")?)
                    .map_err(|error| read_error("spec", error))?,
                graph: ModelGraph::deserialize(part("graph")?)
                    .map_err(|error| read_error("graph", error))?,
            }),
            JobKind::Command => Workload::Command(ValidatedCommandJob {
                spec: CommandJobSpec::deserialize(part("spec")?)
                    .map_err(|error| read_error("spec", error))?,
            }),
        }))
    }
}
