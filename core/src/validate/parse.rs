//! From text to `JobSpec`: TOML (the job file) and JSON (the API), strict, with the path
//! of the field that is wrong.

use serde::de::DeserializeOwned;

use super::{ValidatedJob, validate_job_spec};
use crate::error::FieldError;
use crate::spec::JobSpec;

/// Reads a job spec from TOML, rejecting unknown fields with their path.
pub fn parse_job_spec_toml(text: &str) -> Result<JobSpec, FieldError> {
    parse_toml(text)
}

/// Reads a job spec from JSON (how it travels over the API).
pub fn parse_job_spec_json(text: &str) -> Result<JobSpec, FieldError> {
    parse_json(text)
}

/// Reads any spec type from TOML: a syntax error names no field, a bad value names its
/// path and line.
pub(crate) fn parse_toml<T: DeserializeOwned>(text: &str) -> Result<T, FieldError> {
    let deserializer = toml::Deserializer::parse(text)
        .map_err(|error| FieldError::new("", error.to_string().trim()))?;
    serde_path_to_error::deserialize(deserializer).map_err(|error| {
        let field = field_path(error.path().to_string(), error.inner().message());
        let reason = with_line_number(text, error.inner());
        FieldError::new(field, reason)
    })
}

/// Reads any spec type from JSON, a bad value naming its path.
pub(crate) fn parse_json<T: DeserializeOwned>(text: &str) -> Result<T, FieldError> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let reason = error.inner().to_string();
        FieldError::new(field_path(error.path().to_string(), &reason), reason)
    })
}

/// Parses and validates in one go.
pub fn load_job_spec_toml(text: &str) -> Result<ValidatedJob, FieldError> {
    validate_job_spec(parse_job_spec_toml(text)?)
}

/// The path serde_path_to_error reports, empty for the document itself; serde reports a
/// missing field at the table that lacks it, so the missing key is added to the path.
fn field_path(path: String, message: &str) -> String {
    let path = if path == "." { String::new() } else { path };
    match message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split_once('`'))
    {
        Some((name, _)) if path.is_empty() => name.to_string(),
        Some((name, _)) => format!("{path}.{name}"),
        None => path,
    }
}

/// The message alone (the path is reported apart), with the line it is on when known.
fn with_line_number(text: &str, error: &toml::de::Error) -> String {
    let message = error.message().trim();
    match error.span() {
        Some(span) if span.start <= text.len() => {
            let line = text[..span.start].matches('\n').count() + 1;
            format!("{message} (line {line})")
        }
        _ => message.to_string(),
    }
}
