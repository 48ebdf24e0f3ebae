//! `carve submit --set KEY=VALUE`: changes to a job file made on the command line, and
//! the TOML-to-JSON step that turns the file into the API's `spec_json`.
//!
//! Keys are dotted paths into the TOML document, with `[N]` for array entries
//! (`training.batch_size`, `model.layers[0].conv2d.filters`). Values are read as TOML
//! values (`32`, `true`, `0.5`, `"fp16"`, `[1, 2]`) and, when that fails, taken as a
//! string, so `resources.vram=8GiB` needs no quotes. The client does not check the spec
//! itself: the scheduler does, and names the field it rejects.

use std::fmt;

/// One step of a key path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PathStep {
    Key(String),
    Index(usize),
}

impl fmt::Display for PathStep {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathStep::Key(key) => write!(formatter, ".{key}"),
            PathStep::Index(index) => write!(formatter, "[{index}]"),
        }
    }
}

/// A parsed `--set KEY=VALUE`.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecOverride {
    key: String,
    path: Vec<PathStep>,
    value: toml::Value,
}

impl SpecOverride {
    /// The key as it was typed.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Whether this override wrote `field` (a field path as the scheduler names one,
    /// without `spec.`): the key is the field or a table or entry around it. A field
    /// that is no path (`parse_key` refuses it) is not covered.
    pub fn covers(&self, field: &str) -> bool {
        parse_key(field).is_ok_and(|field| field.starts_with(&self.path))
    }
}

/// Parses `KEY=VALUE` (clap's value parser for `--set`).
pub fn parse_override(text: &str) -> Result<SpecOverride, String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not KEY=VALUE"))?;
    let key = key.trim();
    let path = parse_key(key)?;
    Ok(SpecOverride {
        key: key.to_string(),
        path,
        value: parse_value(value.trim()),
    })
}

fn parse_key(key: &str) -> Result<Vec<PathStep>, String> {
    let mut path = Vec::new();
    for part in key.split('.') {
        let (name, mut indexes) = match part.find('[') {
            Some(bracket) => (&part[..bracket], &part[bracket..]),
            None => (part, ""),
        };
        if name.is_empty()
            || !name.chars().all(|character| {
                character.is_ascii_alphanumeric() || character == '_' || character == '-'
            })
        {
            return Err(format!(
                "key {key:?}: {part:?} is not a name (letters, digits, '_' and '-', with [N] for array entries)"
            ));
        }
        path.push(PathStep::Key(name.to_string()));
        while !indexes.is_empty() {
            let close = indexes
                .find(']')
                .filter(|_| indexes.starts_with('['))
                .ok_or_else(|| format!("key {key:?}: {part:?} has an unclosed or stray bracket"))?;
            let index = indexes[1..close].parse::<usize>().map_err(|_| {
                format!(
                    "key {key:?}: {:?} is not an array index",
                    &indexes[1..close]
                )
            })?;
            path.push(PathStep::Index(index));
            indexes = &indexes[close + 1..];
        }
    }
    Ok(path)
}

/// A TOML value, or the text itself as a string when it is not one.
fn parse_value(text: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("value = {text}"))
        .ok()
        .and_then(|mut table| table.remove("value"))
        .unwrap_or_else(|| toml::Value::String(text.to_string()))
}

/// Sets every override in `document`, in order. Missing tables on the way are created;
/// array entries must exist. The error names the key and why it cannot be set.
pub fn apply_overrides(
    document: &mut toml::Table,
    overrides: &[SpecOverride],
) -> Result<(), String> {
    for spec_override in overrides {
        apply_override(document, spec_override)?;
    }
    Ok(())
}

fn apply_override(document: &mut toml::Table, spec_override: &SpecOverride) -> Result<(), String> {
    let key = &spec_override.key;
    let (last, parents) = spec_override
        .path
        .split_last()
        .ok_or_else(|| format!("--set {key}: the key is empty"))?;
    let mut walked = String::new();
    let mut current = DocumentPlace::Table(document);
    for step in parents {
        current = current.descend(step, &walked, key)?;
        walked.push_str(&step.to_string());
    }
    current.set(last, spec_override.value.clone(), &walked, key)
}

/// Where a path walk stands: inside a table or an array.
enum DocumentPlace<'document> {
    Table(&'document mut toml::Table),
    Array(&'document mut Vec<toml::Value>),
}

fn place_of<'document>(
    value: &'document mut toml::Value,
    walked: &str,
    key: &str,
) -> Result<DocumentPlace<'document>, String> {
    match value {
        toml::Value::Table(table) => Ok(DocumentPlace::Table(table)),
        toml::Value::Array(array) => Ok(DocumentPlace::Array(array)),
        other => Err(format!(
            "--set {key}: {} is a {}, not a table or an array",
            walked.trim_start_matches('.'),
            other.type_str()
        )),
    }
}

impl<'document> DocumentPlace<'document> {
    fn descend(
        self,
        step: &PathStep,
        walked: &str,
        key: &str,
    ) -> Result<DocumentPlace<'document>, String> {
        match (self, step) {
            (DocumentPlace::Table(table), PathStep::Key(name)) => {
                let value = table
                    .entry(name.clone())
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()));
                place_of(value, &format!("{walked}.{name}"), key)
            }
            (DocumentPlace::Array(array), PathStep::Index(index)) => {
                let length = array.len();
                let value = array.get_mut(*index).ok_or_else(|| {
                    format!(
                        "--set {key}: {} has {length} entries, so [{index}] does not exist",
                        walked.trim_start_matches('.')
                    )
                })?;
                place_of(value, &format!("{walked}[{index}]"), key)
            }
            (DocumentPlace::Table(_), PathStep::Index(index)) => Err(format!(
                "--set {key}: {} is a table, so [{index}] does not apply",
                walked.trim_start_matches('.')
            )),
            (DocumentPlace::Array(_), PathStep::Key(name)) => Err(format!(
                "--set {key}: {} is an array; use [N] before .{name}",
                walked.trim_start_matches('.')
            )),
        }
    }

    fn set(
        self,
        step: &PathStep,
        value: toml::Value,
        walked: &str,
        key: &str,
    ) -> Result<(), String> {
        match (self, step) {
            (DocumentPlace::Table(table), PathStep::Key(name)) => {
                table.insert(name.clone(), value);
                Ok(())
            }
            (DocumentPlace::Array(array), PathStep::Index(index)) => {
                let length = array.len();
                let slot = array.get_mut(*index).ok_or_else(|| {
                    format!(
                        "--set {key}: {} has {length} entries, so [{index}] does not exist",
                        walked.trim_start_matches('.')
                    )
                })?;
                *slot = value;
                Ok(())
            }
            (place, step) => place.descend(step, walked, key).map(|_| ()),
        }
    }
}

/// A TOML document as JSON: the job file format is the same serde schema in both, so
/// this is the API's `spec_json`. Dates become strings (the spec has none). A float that
/// JSON cannot hold (nan, inf) is an error naming its path.
pub fn toml_to_json(value: &toml::Value, path: &str) -> Result<serde_json::Value, String> {
    Ok(match value {
        toml::Value::String(text) => serde_json::Value::String(text.clone()),
        toml::Value::Integer(number) => serde_json::Value::from(*number),
        toml::Value::Float(number) => serde_json::Number::from_f64(*number)
            .map(serde_json::Value::Number)
            .ok_or_else(|| {
                format!(
                    "{}: {number} cannot be sent as json",
                    path.trim_start_matches('.')
                )
            })?,
        toml::Value::Boolean(flag) => serde_json::Value::Bool(*flag),
        toml::Value::Datetime(datetime) => serde_json::Value::String(datetime.to_string()),
        toml::Value::Array(array) => serde_json::Value::Array(
            array
                .iter()
                .enumerate()
                .map(|(index, item)| toml_to_json(item, &format!("{path}[{index}]")))
                .collect::<Result<_, _>>()?,
        ),
        toml::Value::Table(table) => serde_json::Value::Object(
            table
                .iter()
                .map(|(name, item)| {
                    Ok((name.clone(), toml_to_json(item, &format!("{path}.{name}"))?))
                })
                .collect::<Result<_, String>>()?,
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn document() -> toml::Table {
        toml::from_str(
            r#"
            name = "job"
            [training]
            batch_size = 64
            [model]
            layers = [ { conv2d = { filters = 32 } }, { relu = {} } ]
            "#,
        )
        .unwrap()
    }

    fn set(document: &mut toml::Table, text: &str) -> Result<(), String> {
        apply_overrides(document, &[parse_override(text)?])
    }

    #[test]
    fn values_are_toml_when_they_parse_and_strings_otherwise() {
        let mut document = document();
        set(&mut document, "training.batch_size=32").unwrap();
        set(&mut document, "resources.vram=8GiB").unwrap();
        set(&mut document, "training.precision=\"fp16\"").unwrap();
        set(&mut document, "training.shuffle=true").unwrap();
        set(&mut document, "model.layers[0].conv2d.filters=8").unwrap();
        assert_eq!(document["training"]["batch_size"].as_integer(), Some(32));
        assert_eq!(document["resources"]["vram"].as_str(), Some("8GiB"));
        assert_eq!(document["training"]["precision"].as_str(), Some("fp16"));
        assert_eq!(document["training"]["shuffle"].as_bool(), Some(true));
        assert_eq!(
            document["model"]["layers"][0]["conv2d"]["filters"].as_integer(),
            Some(8)
        );
    }

    #[test]
    fn impossible_keys_are_rejected_naming_the_key_and_the_reason() {
        let mut document = document();
        let error = set(&mut document, "model.layers[5].relu={}").unwrap_err();
        assert!(error.contains("model.layers has 2 entries"), "{error}");
        let error = set(&mut document, "training.batch_size.x=1").unwrap_err();
        assert!(
            error.contains("training.batch_size is a integer"),
            "{error}"
        );
        let error = set(&mut document, "model.layers.relu=1").unwrap_err();
        assert!(error.contains("model.layers is an array"), "{error}");
        assert!(
            parse_override("training")
                .unwrap_err()
                .contains("KEY=VALUE")
        );
        assert!(parse_override("a..b=1").unwrap_err().contains("not a name"));
        assert!(
            parse_override("a[x]=1")
                .unwrap_err()
                .contains("not an array index")
        );
    }

    #[test]
    fn an_override_covers_the_field_it_sets_and_the_fields_inside_it() {
        let layer = parse_override("model.layers[0]={ relu = {} }").unwrap();
        assert_eq!(layer.key(), "model.layers[0]");
        assert!(layer.covers("model.layers[0]"));
        assert!(layer.covers("model.layers[0].relu"));
        assert!(!layer.covers("model.layers[1].relu"));
        assert!(!layer.covers("model.layers"));
        assert!(!layer.covers("model"));
        assert!(!layer.covers(""));
    }

    #[test]
    fn the_document_becomes_the_same_json_the_spec_format_reads() {
        let mut document = document();
        set(&mut document, "training.learning_rate=0.5").unwrap();
        let json = toml_to_json(&toml::Value::Table(document), "").unwrap();
        assert_eq!(json["training"]["batch_size"], 64);
        assert_eq!(json["training"]["learning_rate"], 0.5);
        assert_eq!(json["model"]["layers"][0]["conv2d"]["filters"], 32);
        let error = toml_to_json(&toml::Value::Float(f64::NAN), ".training.rate").unwrap_err();
        assert!(error.starts_with("training.rate: "), "{error}");
    }
}
