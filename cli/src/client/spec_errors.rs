//! Pointing the scheduler's answer about a submitted spec at what the person wrote.
//!
//! `carve submit` sends the job file as JSON it built, so the scheduler's reading of it
//! names the field (`spec.training.batch_size`) and, for a value of the wrong type, a
//! place in that JSON ("at line 1 column 558") that the person never saw. The place is
//! dropped and the field found again: in a `--set` that wrote it, or on its line of the
//! job file, said as `carve estimate` says it ("(line 24)").

use carve_proto::status::status_field;

use super::overrides::SpecOverride;

/// The prefix the scheduler gives the fields of a submitted spec.
const SPEC_FIELD_PREFIX: &str = "spec.";

/// `status` with its message about a field of the spec pointed at `text` (the job file
/// as read) or at the `overrides` applied to it; any other status as it came.
pub fn spec_error_in_file(
    status: &tonic::Status,
    text: &str,
    overrides: &[SpecOverride],
) -> tonic::Status {
    let Some(field) = status_field(status).and_then(|field| field.strip_prefix(SPEC_FIELD_PREFIX))
    else {
        return status.clone();
    };
    let message = without_json_position(status.message());
    let place = match overrides.iter().rev().find(|written| written.covers(field)) {
        Some(written) => Some(format!("(--set {})", written.key())),
        None => line_of_field(text, field).map(|line| format!("(line {line})")),
    };
    let message = match place {
        Some(place) => format!("{message} {place}"),
        None => message.to_string(),
    };
    tonic::Status::with_metadata(status.code(), message, status.metadata().clone())
}

/// `message` without the place serde_json adds to what it reports ("... at line 1
/// column 558"), which names a spot in the JSON the client built.
fn without_json_position(message: &str) -> &str {
    let Some((before, position)) = message.rsplit_once(" at line ") else {
        return message;
    };
    let is_position = position
        .split_once(" column ")
        .is_some_and(|(line, column)| {
            !line.is_empty()
                && !column.is_empty()
                && line.bytes().all(|byte| byte.is_ascii_digit())
                && column.bytes().all(|byte| byte.is_ascii_digit())
        });
    if is_position { before } else { message }
}

/// The line of the TOML document `text` on which `field` (a dotted path with `[N]` for
/// array entries, as the scheduler names fields) is written; when the field itself is
/// not (a missing one), the line of the nearest table or entry around it that is. None
/// when the text does not parse or nothing of the path is in it.
pub fn line_of_field(text: &str, field: &str) -> Option<usize> {
    let document = toml::de::DeTable::parse(text).ok()?;
    let mut offset = None;
    let mut place = Place::Table(document.get_ref());
    for step in field_steps(field) {
        let (found_at, next) = match (place, step) {
            (Place::Table(table), Step::Key(name)) => {
                match table.iter().find(|(key, _)| key.get_ref() == name) {
                    Some((key, value)) => (key.span().start, value),
                    None => break,
                }
            }
            (Place::Array(array), Step::Index(index)) => match array.get(index) {
                Some(value) => (value.span().start, value),
                None => break,
            },
            _ => break,
        };
        offset = Some(found_at);
        place = match next.get_ref() {
            toml::de::DeValue::Table(table) => Place::Table(table),
            toml::de::DeValue::Array(array) => Place::Array(array),
            _ => Place::Value,
        };
    }
    let offset = offset?.min(text.len());
    Some(text[..offset].matches('\n').count() + 1)
}

/// Where a walk down a field path stands.
#[derive(Clone, Copy)]
enum Place<'document, 'text> {
    Table(&'document toml::de::DeTable<'text>),
    Array(&'document toml::de::DeArray<'text>),
    Value,
}

/// One step of a field path.
#[derive(Debug, PartialEq)]
enum Step<'field> {
    Key(&'field str),
    Index(usize),
}

/// `model.layers[3].conv2d.kernel` as its steps; a bracket that holds no number ends
/// the path there.
fn field_steps(field: &str) -> Vec<Step<'_>> {
    let mut steps = Vec::new();
    for part in field.split('.') {
        let (name, mut indexes) = part.split_once('[').unwrap_or((part, ""));
        if !name.is_empty() {
            steps.push(Step::Key(name));
        }
        while let Some((index, rest)) = indexes.split_once(']') {
            match index.parse() {
                Ok(index) => steps.push(Step::Index(index)),
                Err(_) => return steps,
            }
            indexes = rest.strip_prefix('[').unwrap_or(rest);
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::overrides::parse_override;

    const JOB_FILE: &str = "name = \"digits\"\n\
        \n\
        [model]\n\
        input_shape = [28, 28, 1]\n\
        \n\
        [[model.layers]]\n\
        conv2d = { filters = 8, kernel = \"three\" }\n\
        \n\
        [[model.layers]]\n\
        relu = {}\n\
        \n\
        [training]\n\
        batch_size = \"many\"\n";

    fn status_about(field: &str, message: &str) -> tonic::Status {
        carve_proto::ApiError::InvalidArgument {
            field: field.into(),
            reason: message.into(),
        }
        .into()
    }

    #[test]
    fn a_field_is_found_on_its_line_or_the_nearest_line_around_it() {
        assert_eq!(line_of_field(JOB_FILE, "name"), Some(1));
        assert_eq!(line_of_field(JOB_FILE, "training.batch_size"), Some(13));
        assert_eq!(
            line_of_field(JOB_FILE, "model.layers[0].conv2d.kernel"),
            Some(7)
        );
        assert_eq!(line_of_field(JOB_FILE, "model.layers[1].relu"), Some(10));
        // Missing: the table that lacks it.
        assert_eq!(line_of_field(JOB_FILE, "training.steps"), Some(12));
        assert_eq!(line_of_field(JOB_FILE, "data"), None);
        assert_eq!(line_of_field("name = [", "name"), None);
        assert_eq!(
            field_steps("model.layers[3].conv2d"),
            [
                Step::Key("model"),
                Step::Key("layers"),
                Step::Index(3),
                Step::Key("conv2d")
            ]
        );
    }

    #[test]
    fn a_spec_error_names_the_job_file_line_or_the_set_that_wrote_it_not_the_json() {
        let status = status_about(
            "spec.training.batch_size",
            "invalid type: string \"many\", expected u64 at line 1 column 558",
        );
        let pointed = spec_error_in_file(&status, JOB_FILE, &[]);
        assert_eq!(pointed.code(), tonic::Code::InvalidArgument);
        assert_eq!(
            pointed.message(),
            "spec.training.batch_size: invalid type: string \"many\", expected u64 (line 13)"
        );
        assert_eq!(status_field(&pointed), Some("spec.training.batch_size"));

        let overrides = [parse_override("training.batch_size=\"lots\"").unwrap()];
        let pointed = spec_error_in_file(&status, JOB_FILE, &overrides);
        assert_eq!(
            pointed.message(),
            "spec.training.batch_size: invalid type: string \"many\", expected u64 \
             (--set training.batch_size)"
        );
        // A --set of a whole table covers the fields in it.
        let overrides = [parse_override("training={ batch_size = 1 }").unwrap()];
        let pointed = spec_error_in_file(&status, JOB_FILE, &overrides);
        assert!(
            pointed.message().ends_with("(--set training)"),
            "{pointed:?}"
        );

        // Not about the spec, or a position that is not serde_json's: left as it is.
        let other = status_about("job_id", "is ambiguous at line 1 column 2");
        assert_eq!(
            spec_error_in_file(&other, JOB_FILE, &[]).message(),
            other.message()
        );
        assert_eq!(
            without_json_position("runs at line 4 column x"),
            "runs at line 4 column x"
        );
    }
}
