//! The trace format of the simulator: a CSV text with a header, one job per row, parsed
//! from a `&str` (the CLI reads the file), and the built-in model family a row can name
//! instead of a job file.
//!
//! Columns (any order, named in the header; `#` lines and blank lines are skipped):
//!
//! | column              | required | meaning                                                       |
//! |---------------------|----------|---------------------------------------------------------------|
//! | `submit_time_s`     | yes      | seconds since the start of the trace (>= 0)                   |
//! | `duration_s`        | yes      | run time at the job's own configuration on a whole GPU (> 0)  |
//! | `tenant`            | yes      | who submits it (fair share is between tenants)                |
//! | `gpus`              | yes      | slices per job, each on a distinct GPU (1 to 64; above 1 a gang, placed by `crate::gang`; only for rows without a model job) |
//! | `requested_bytes`   | yes      | what the user declares to a memory-sharing scheduler, `16GiB` or bytes |
//! | `spec`              | no       | a job TOML file, relative to the trace file                   |
//! | `model`             | no       | the built-in CNN family: `cnn:width=64:depth=8:batch=128:image=64` |
//! | `actual_peak_bytes` | no       | the job's true need when the estimator does not see all of it |
//! | `command_model`     | no       | a command job's memory, `fixed=1GiB:per_sample=35MiB` (with `spec`) |
//! | `priority`          | no       | the job's priority (a whole number, higher first); overrides the spec's |
//!
//! A row names its model with `spec` or `model` (not both) or with neither, and then it
//! must give `actual_peak_bytes`. A `spec` that is a command job (`[command]`) needs
//! `command_model`: what its profile would measure, since the simulator runs no program.
//! A value may be quoted as a spreadsheet writes it
//! (`"team a, west"`, a quote inside doubled), so it can hold a comma; it cannot span
//! lines. The `csv` crate splits the fields; this module keeps the trace's own line
//! rules (comments, blank lines, surrounding spaces). Errors name the row (the line
//! number in the text, the header being row 1) and the column.

use std::collections::BTreeSet;
use std::fmt;

use csv::StringRecord;

use crate::bytes::parse_byte_size;
use crate::error::{CoreError, FieldError};
use crate::spec::MAX_GANG_MEMBERS;

/// The columns a trace may have, in the order the generator writes them.
pub const TRACE_COLUMNS: [&str; 10] = [
    "submit_time_s",
    "duration_s",
    "tenant",
    "gpus",
    "requested_bytes",
    "spec",
    "model",
    "actual_peak_bytes",
    "command_model",
    "priority",
];

const REQUIRED_COLUMNS: [&str; 5] = [
    "submit_time_s",
    "duration_s",
    "tenant",
    "gpus",
    "requested_bytes",
];

/// Where a row's model comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ModelSource {
    /// A job file, as written in the trace (the CLI resolves it relative to the trace).
    SpecFile(String),
    /// The built-in CNN family.
    Family(ModelFamilyParameters),
    /// No model: only `actual_peak_bytes` says what the job needs, so Carve cannot
    /// estimate it and admits it by its declaration.
    None,
}

/// One job of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRow {
    /// The line number in the trace text (the header is row 1).
    pub row: usize,
    pub submit_time_s: f64,
    pub duration_s: f64,
    pub tenant: String,
    /// Slices, each on a distinct GPU; `requested_bytes` and the need are per slice.
    pub gpus: u32,
    pub requested_bytes: u64,
    pub model: ModelSource,
    pub actual_peak_bytes: Option<u64>,
    /// A command job's memory (only with a `spec`).
    pub command_model: Option<CommandModelParameters>,
    /// The row's own priority; without it, the spec's (0 without a model).
    pub priority: Option<i32>,
}

/// A command job's memory as a trace row gives it: `need(micro) = fixed + per_sample x
/// micro` at the job's own precision, without recomputation (what a profile measures).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CommandModelParameters {
    pub fixed_bytes: u64,
    pub per_sample_bytes: u64,
}

impl CommandModelParameters {
    /// Reads `fixed=1GiB:per_sample=35MiB` (both keys, in any order).
    pub fn parse(text: &str) -> Result<Self, String> {
        let (mut fixed_bytes, mut per_sample_bytes) = (None, None);
        for part in text.split(':') {
            let Some((key, value)) = part.split_once('=') else {
                return Err(format!("`{part}` is not key=value"));
            };
            let slot = match key.trim() {
                "fixed" => &mut fixed_bytes,
                "per_sample" => &mut per_sample_bytes,
                other => {
                    return Err(format!(
                        "unknown key `{other}`; expected fixed and per_sample"
                    ));
                }
            };
            let bytes = parse_byte_size(value).map_err(|error| format!("{key}: {error}"))?;
            if slot.replace(bytes).is_some() {
                return Err(format!("{key} is given twice"));
            }
        }
        match (fixed_bytes, per_sample_bytes) {
            (Some(fixed_bytes), Some(per_sample_bytes)) => Ok(CommandModelParameters {
                fixed_bytes,
                per_sample_bytes,
            }),
            _ => Err("needs fixed and per_sample, e.g. fixed=1GiB:per_sample=35MiB".to_string()),
        }
    }
}

impl fmt::Display for CommandModelParameters {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "fixed={}B:per_sample={}B",
            self.fixed_bytes, self.per_sample_bytes
        )
    }
}

/// A parsed trace, rows in the order of the text.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Trace {
    pub rows: Vec<TraceRow>,
}

impl Trace {
    /// The job files the rows name, each once: what the caller must read and pass to
    /// [`crate::simulation::Workload::prepare`].
    pub fn spec_files(&self) -> BTreeSet<&str> {
        self.rows
            .iter()
            .filter_map(|row| match &row.model {
                ModelSource::SpecFile(path) => Some(path.as_str()),
                _ => None,
            })
            .collect()
    }
}

/// The error for one cell (or one row when `column` is empty).
pub(crate) fn cell_error(row: usize, column: &str, reason: impl Into<String>) -> CoreError {
    let field = if column.is_empty() {
        format!("row {row}")
    } else {
        format!("row {row} column {column}")
    };
    CoreError::InvalidSpec(FieldError::new(field, reason))
}

/// Parses a trace. Rows need not be sorted by submit time.
pub fn parse_trace(text: &str) -> Result<Trace, CoreError> {
    let mut records = read_records(text)?.into_iter();
    let Some((header_row, header)) = records.next() else {
        return Err(cell_error(
            1,
            "",
            "the trace is empty: expected a header row",
        ));
    };
    if header.iter().any(|column| column.contains('\n')) {
        return Err(cell_error(
            header_row,
            "",
            "a column name cannot span lines (a line break inside quotes)",
        ));
    }
    let columns: Vec<&str> = header.iter().map(str::trim).collect();
    let mut seen = BTreeSet::new();
    for column in &columns {
        if !TRACE_COLUMNS.contains(column) {
            return Err(cell_error(
                header_row,
                column,
                format!(
                    "unknown column; expected some of {}",
                    TRACE_COLUMNS.join(", ")
                ),
            ));
        }
        if !seen.insert(*column) {
            return Err(cell_error(
                header_row,
                column,
                "appears twice in the header",
            ));
        }
    }
    if let Some(missing) = REQUIRED_COLUMNS
        .iter()
        .find(|column| !seen.contains(*column))
    {
        return Err(cell_error(
            header_row,
            missing,
            "is missing from the header (it is required)",
        ));
    }
    let mut rows = Vec::new();
    for (row, record) in records {
        let cells: Vec<&str> = record.iter().map(str::trim).collect();
        if cells.len() != columns.len() {
            return Err(cell_error(
                row,
                "",
                format!(
                    "has {} values but the header names {} columns",
                    cells.len(),
                    columns.len()
                ),
            ));
        }
        // Checked before trimming, which would hide a line break at either end.
        if let Some(index) = record.iter().position(|value| value.contains('\n')) {
            return Err(cell_error(
                row,
                columns[index],
                "a value cannot span lines (a line break inside quotes)",
            ));
        }
        let cell = |name: &str| -> Option<&str> {
            columns
                .iter()
                .position(|column| *column == name)
                .map(|index| cells[index])
                .filter(|value| !value.is_empty())
        };
        let required = |name: &str| -> Result<&str, CoreError> {
            cell(name).ok_or_else(|| cell_error(row, name, "is empty (it is required)"))
        };
        let submit_time_s = parse_seconds(row, "submit_time_s", required("submit_time_s")?)?;
        let duration_s = parse_seconds(row, "duration_s", required("duration_s")?)?;
        if duration_s <= 0.0 {
            return Err(cell_error(row, "duration_s", "must be greater than 0"));
        }
        let tenant = required("tenant")?.to_string();
        let gpus_text = required("gpus")?;
        let gpus: u64 = gpus_text
            .parse()
            .map_err(|_| cell_error(row, "gpus", format!("`{gpus_text}` is not a whole number")))?;
        if !(1..=MAX_GANG_MEMBERS).contains(&gpus) {
            return Err(cell_error(
                row,
                "gpus",
                format!("{gpus} GPUs: must be between 1 and {MAX_GANG_MEMBERS}"),
            ));
        }
        let requested_bytes = parse_bytes(row, "requested_bytes", required("requested_bytes")?)?;
        let actual_peak_bytes = cell("actual_peak_bytes")
            .map(|text| parse_bytes(row, "actual_peak_bytes", text))
            .transpose()?;
        let command_model = cell("command_model")
            .map(|text| {
                CommandModelParameters::parse(text)
                    .map_err(|reason| cell_error(row, "command_model", reason))
            })
            .transpose()?;
        let priority = cell("priority")
            .map(|text| {
                text.parse::<i32>().map_err(|_| {
                    cell_error(row, "priority", format!("`{text}` is not a whole number"))
                })
            })
            .transpose()?;
        let model = match (cell("spec"), cell("model")) {
            (Some(_), Some(_)) => {
                return Err(cell_error(
                    row,
                    "model",
                    "a row names its model with spec or with model, not both",
                ));
            }
            (Some(path), None) => ModelSource::SpecFile(path.to_string()),
            (None, Some(_)) if command_model.is_some() => {
                return Err(cell_error(
                    row,
                    "command_model",
                    "is for a command job's spec, not a model family",
                ));
            }
            (None, Some(_)) if gpus > 1 => {
                return Err(cell_error(
                    row,
                    "gpus",
                    format!(
                        "{gpus} GPUs: a model family is a model job, and model jobs keep one \
                         slice; give a gang actual_peak_bytes (per slice) instead"
                    ),
                ));
            }
            (None, Some(text)) => ModelSource::Family(
                ModelFamilyParameters::parse(text)
                    .map_err(|reason| cell_error(row, "model", reason))?,
            ),
            (None, None) => {
                if command_model.is_some() {
                    return Err(cell_error(
                        row,
                        "command_model",
                        "needs a spec naming the command job it is the memory of",
                    ));
                }
                if actual_peak_bytes.is_none() {
                    return Err(cell_error(
                        row,
                        "actual_peak_bytes",
                        "is required when the row has neither spec nor model",
                    ));
                }
                ModelSource::None
            }
        };
        rows.push(TraceRow {
            row,
            submit_time_s,
            duration_s,
            tenant,
            gpus: gpus as u32,
            requested_bytes,
            model,
            actual_peak_bytes,
            command_model,
            priority,
        });
    }
    Ok(Trace { rows })
}

/// The trace's records with the line each starts on, header first, comment and blank
/// lines left out.
///
/// The trace's own rule is by line: a line that is empty or starts with `#` once its
/// spaces are trimmed is skipped. The `csv` crate only skips a `#` in the first column
/// and lines with nothing on them, so such lines are emptied first (keeping their line
/// breaks, so the line numbers stay those of the text). A quoted value that spans lines
/// is refused by the caller, so emptying a line never changes a row that is accepted.
/// Only `\n` ends a record, as for [`str::lines`]: a `\r` before it is trimmed with the
/// value.
fn read_records(text: &str) -> Result<Vec<(usize, StringRecord)>, CoreError> {
    let csv_text: String = text
        .split_inclusive('\n')
        .map(|line| {
            let content = line.trim();
            if content.is_empty() || content.starts_with('#') {
                if line.ends_with('\n') { "\n" } else { "" }
            } else {
                line
            }
        })
        .collect();
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .terminator(csv::Terminator::Any(b'\n'))
        .from_reader(csv_text.as_bytes());
    let line_of = |position: Option<&csv::Position>| {
        position.map_or(1, |position| first_line_of_record(&csv_text, position))
    };
    reader
        .records()
        .map(|record| match record {
            Ok(record) => Ok((line_of(record.position()), record)),
            // Unreachable from a `&str` with `flexible` (the fields are cut at ASCII
            // bytes, so they stay UTF-8), but named like every other error if it comes.
            Err(error) => Err(cell_error(
                line_of(error.position()),
                "",
                format!("is not valid CSV: {error}"),
            )),
        })
        .collect()
}

/// The line a record starts on. The reader gives the position where it began to read the
/// record, which is before the empty lines it skipped on the way.
fn first_line_of_record(csv_text: &str, position: &csv::Position) -> usize {
    let skipped_lines = csv_text
        .as_bytes()
        .get(usize::try_from(position.byte()).unwrap_or(usize::MAX)..)
        .unwrap_or_default()
        .iter()
        .take_while(|byte| **byte == b'\n')
        .count();
    usize::try_from(position.line())
        .unwrap_or(usize::MAX)
        .saturating_add(skipped_lines)
}

fn parse_seconds(row: usize, column: &str, text: &str) -> Result<f64, CoreError> {
    let value: f64 = text
        .parse()
        .map_err(|_| cell_error(row, column, format!("`{text}` is not a number of seconds")))?;
    if !value.is_finite() || value < 0.0 {
        return Err(cell_error(
            row,
            column,
            format!("`{text}` must be a finite number of seconds, at least 0"),
        ));
    }
    Ok(value)
}

fn parse_bytes(row: usize, column: &str, text: &str) -> Result<u64, CoreError> {
    let bytes =
        parse_byte_size(text).map_err(|error| cell_error(row, column, error.to_string()))?;
    if bytes == 0 {
        return Err(cell_error(row, column, "must be more than 0 bytes"));
    }
    Ok(bytes)
}

/// The built-in model family: a ResNet-style CNN (conv-batchnorm-relu blocks in four
/// stages that halve the resolution and double the filters, then global average pooling
/// and a 100-way classifier), trained with Adam in fp32. Memory grows with every knob, so
/// a few numbers span jobs from megabytes to beyond one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelFamilyParameters {
    /// Filters of the first stage (later stages double it, up to 8x).
    pub width: u64,
    /// Conv-batchnorm-relu blocks.
    pub depth: u64,
    pub batch: u64,
    /// Input images are `image x image x 3`.
    pub image: u64,
}

impl ModelFamilyParameters {
    /// Reads `cnn:width=64:depth=8:batch=128:image=64` (keys in any order, all required).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut parts = text.split(':');
        let family = parts.next().unwrap_or_default();
        if family != "cnn" {
            return Err(format!(
                "`{family}` is not a model family; expected cnn:width=W:depth=D:batch=B:image=P"
            ));
        }
        let (mut width, mut depth, mut batch, mut image) = (None, None, None, None);
        for part in parts {
            let Some((key, value)) = part.split_once('=') else {
                return Err(format!("`{part}` is not key=value"));
            };
            let (slot, limit) = match key {
                "width" => (&mut width, 4096),
                "depth" => (&mut depth, 256),
                "batch" => (&mut batch, 65_536),
                "image" => (&mut image, 4096),
                other => {
                    return Err(format!(
                        "unknown key `{other}`; expected width, depth, batch and image"
                    ));
                }
            };
            let number: u64 = value
                .parse()
                .map_err(|_| format!("{key}: `{value}` is not a whole number"))?;
            if number == 0 || number > limit {
                return Err(format!("{key}: {number} must be between 1 and {limit}"));
            }
            if slot.replace(number).is_some() {
                return Err(format!("{key} is given twice"));
            }
        }
        match (width, depth, batch, image) {
            (Some(width), Some(depth), Some(batch), Some(image)) => Ok(ModelFamilyParameters {
                width,
                depth,
                batch,
                image,
            }),
            _ => Err(
                "needs width, depth, batch and image, e.g. cnn:width=64:depth=8:batch=128:image=64"
                    .to_string(),
            ),
        }
    }

    /// The job file this stands for, in the ordinary TOML format, so it goes through the
    /// same parser and validator as a researcher's file.
    pub fn job_spec_toml(&self) -> String {
        let stage_length = (self.depth / 4).max(1);
        let mut layers = String::new();
        for block in 0..self.depth {
            let stage = (block / stage_length).min(3);
            let filters = self.width << stage;
            let stride = if block > 0 && block % stage_length == 0 && block / stage_length <= 3 {
                2
            } else {
                1
            };
            layers.push_str(&format!(
                "  {{ conv2d = {{ filters = {filters}, kernel = 3, stride = {stride}, padding = \"same\", use_bias = false }} }},\n  {{ batch_norm = {{}} }},\n  {{ relu = {{}} }},\n"
            ));
        }
        format!(
            "name = \"cnn-w{width}-d{depth}-b{batch}-i{image}\"\n\n[model]\ninput_shape = [{image}, {image}, 3]\nloss = \"softmax_cross_entropy\"\nlayers = [\n{layers}  {{ global_avg_pool = {{}} }},\n  {{ dense = {{ units = 100 }} }},\n]\n\n[training]\nbatch_size = {batch}\nsteps = 1000\noptimizer = {{ adam = {{ learning_rate = 0.001 }} }}\n\n[data]\nformat = \"synthetic\"\nsamples = {samples}\n",
            width = self.width,
            depth = self.depth,
            batch = self.batch,
            image = self.image,
            samples = self.batch * 8,
        )
    }
}

impl fmt::Display for ModelFamilyParameters {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "cnn:width={}:depth={}:batch={}:image={}",
            self.width, self.depth, self.batch, self.image
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::load_job_spec_toml;

    const HEADER: &str =
        "submit_time_s,duration_s,tenant,gpus,requested_bytes,model,actual_peak_bytes";

    fn error_text(trace: &str) -> String {
        parse_trace(trace).unwrap_err().to_string()
    }

    #[test]
    fn reads_rows_with_each_kind_of_model() {
        let trace = format!(
            "# a comment\n{HEADER},spec\n0,60,alice,1,16GiB,cnn:width=8:depth=2:batch=4:image=8,,\n\n5.5,30,bob,1,1024,,2GiB,\n9,10,carol,1,4GiB,,,examples/mnist-cnn.toml\n"
        );
        let parsed = parse_trace(&trace).unwrap();
        assert_eq!(parsed.rows.len(), 3);
        assert_eq!(parsed.rows[0].row, 3);
        assert_eq!(parsed.rows[0].requested_bytes, 16 << 30);
        assert_eq!(
            parsed.rows[0].model,
            ModelSource::Family(ModelFamilyParameters {
                width: 8,
                depth: 2,
                batch: 4,
                image: 8
            })
        );
        assert_eq!(parsed.rows[1].row, 5);
        assert_eq!(parsed.rows[1].model, ModelSource::None);
        assert_eq!(parsed.rows[1].actual_peak_bytes, Some(2 << 30));
        assert_eq!(parsed.rows[1].submit_time_s, 5.5);
        assert_eq!(
            parsed.rows[2].model,
            ModelSource::SpecFile("examples/mnist-cnn.toml".into())
        );
        assert_eq!(
            parsed.spec_files().into_iter().collect::<Vec<_>>(),
            vec!["examples/mnist-cnn.toml"]
        );
    }

    #[test]
    fn errors_name_the_row_and_the_column() {
        let cases = [
            (
                format!("{HEADER}\n0,60,a,65,1GiB,,1GiB"),
                "row 2 column gpus: 65 GPUs: must be between 1 and 64",
            ),
            (
                format!("{HEADER}\n0,60,a,1,1GiB,,1GiB\n0,x,a,1,1GiB,,1GiB"),
                "row 3 column duration_s: `x` is not",
            ),
            (
                format!("{HEADER}\n0,0,a,1,1GiB,,1GiB"),
                "row 2 column duration_s: must be greater than 0",
            ),
            (
                format!("{HEADER}\n-1,5,a,1,1GiB,,1GiB"),
                "row 2 column submit_time_s",
            ),
            (
                format!("{HEADER}\n0,5,a,1,6 parsecs,,1GiB"),
                "row 2 column requested_bytes: unknown unit",
            ),
            (
                format!("{HEADER}\n0,5,,1,1GiB,,1GiB"),
                "row 2 column tenant: is empty",
            ),
            (
                format!("{HEADER}\n0,5,a,1,1GiB,,"),
                "row 2 column actual_peak_bytes: is required",
            ),
            (
                format!("{HEADER}\n0,5,a,1,1GiB,cnn:width=8,"),
                "row 2 column model: needs width",
            ),
            (
                format!("{HEADER}\n0,5,a,1,1GiB,rnn:x=1,"),
                "row 2 column model: `rnn` is not",
            ),
            (format!("{HEADER}\n0,5,a,1,1GiB"), "row 2: has 5 values"),
            (
                format!("{HEADER}\n0,5,\"a\nb\",1,1GiB,,1GiB"),
                "row 2 column tenant: a value cannot span lines",
            ),
            (
                format!("{HEADER}\n# a comment\n0,5,a,1,1GiB,,\"1GiB\n\""),
                "row 3 column actual_peak_bytes: a value cannot span lines",
            ),
            (
                "submit_time_s,\"duration_s\n\",tenant\n".to_string(),
                "row 1: a column name cannot span lines",
            ),
            (
                format!("{HEADER},spec\n0,5,a,1,1GiB,cnn:width=1:depth=1:batch=1:image=1,,x.toml"),
                "row 2 column model: a row names",
            ),
            (
                "submit_time_s,duration_s,tenant,gpus\n".to_string(),
                "row 1 column requested_bytes: is missing",
            ),
            (
                "submit_time_s,duration_s,tenant,gpus,requested_bytes,colour\n".to_string(),
                "row 1 column colour: unknown column",
            ),
            (String::new(), "row 1: the trace is empty"),
        ];
        for (trace, expected) in cases {
            let message = error_text(&trace);
            assert!(
                message.starts_with(expected),
                "{message:?} should start with {expected:?}"
            );
        }
    }

    #[test]
    fn reads_quoted_values_as_a_spreadsheet_writes_them() {
        // What a spreadsheet saves: CRLF line ends, a value with a comma in quotes, a
        // quote inside a quoted value doubled, and quotes around a value that needs none.
        let trace = format!(
            "{HEADER}\r\n0,60,\"team a, west\",1,16GiB,,2GiB\r\n1,30,\"say \"\"hi\"\"\",\"1\",\"4GiB\",\"cnn:width=8:depth=2:batch=4:image=8\",\r\n"
        );
        let parsed = parse_trace(&trace).unwrap();
        assert_eq!(parsed.rows.len(), 2);
        assert_eq!(parsed.rows[0].row, 2);
        assert_eq!(parsed.rows[0].tenant, "team a, west");
        assert_eq!(parsed.rows[0].actual_peak_bytes, Some(2 << 30));
        assert_eq!(parsed.rows[1].row, 3);
        assert_eq!(parsed.rows[1].tenant, "say \"hi\"");
        assert_eq!(parsed.rows[1].requested_bytes, 4 << 30);
        assert!(matches!(parsed.rows[1].model, ModelSource::Family(_)));
        // A quoted comma is one value: the row has as many values as the header.
        let unquoted = format!("{HEADER}\n0,60,team a, west,1,16GiB,,2GiB\n");
        assert!(error_text(&unquoted).starts_with("row 2: has 8 values"));
    }

    #[test]
    fn comments_and_blank_lines_keep_the_row_numbers_of_the_text() {
        // Indented comments, lines of spaces and a comment with an unmatched quote are
        // skipped as lines, before any quote could join them to the rows below.
        let trace = format!(
            "\n  # an indented comment\n{HEADER}\n   \n# a comment, \"with an open quote\n\t# tab, \"too\n0,60,a,1,1GiB,,1GiB\n\n\n5,60,\"b\",1,1GiB,,1GiB"
        );
        let parsed = parse_trace(&trace).unwrap();
        let rows: Vec<(usize, &str)> = parsed
            .rows
            .iter()
            .map(|row| (row.row, row.tenant.as_str()))
            .collect();
        assert_eq!(rows, vec![(7, "a"), (10, "b")]);
        let error = error_text(&format!(
            "\n\n# c\n{HEADER}\n\n0,60,a,1,1GiB,,1GiB\n\n0,60,a,0,1GiB,,1GiB\n"
        ));
        assert!(error.starts_with("row 8 column gpus: 0 GPUs"), "{error}");
        let error = error_text("\n# only comments\n  \n\"submit_time_s\",colour\n");
        assert!(
            error.starts_with("row 4 column colour: unknown column"),
            "{error}"
        );
    }

    /// Rows with more than one GPU are gangs (the Alibaba trace's multi-GPU pods), read,
    /// not dropped; a model family, a model job, keeps one slice.
    #[test]
    fn rows_with_several_gpus_are_gangs() {
        let parsed = parse_trace(&format!(
            "{HEADER}\n0,60,a,8,20GiB,,18GiB\n1,60,b,1,2GiB,,1GiB\n"
        ))
        .unwrap();
        assert_eq!(
            parsed.rows.iter().map(|row| row.gpus).collect::<Vec<_>>(),
            vec![8, 1]
        );
        let error = error_text(&format!(
            "{HEADER}\n0,60,a,2,1GiB,cnn:width=8:depth=2:batch=4:image=8,\n"
        ));
        assert!(
            error.starts_with("row 2 column gpus: 2 GPUs: a model family"),
            "{error}"
        );
    }

    #[test]
    fn model_family_round_trips_and_validates() {
        let parameters =
            ModelFamilyParameters::parse("cnn:image=32:batch=16:depth=5:width=16").unwrap();
        assert_eq!(
            parameters.to_string(),
            "cnn:width=16:depth=5:batch=16:image=32"
        );
        assert_eq!(
            ModelFamilyParameters::parse(&parameters.to_string()),
            Ok(parameters)
        );
        let job = load_job_spec_toml(&parameters.job_spec_toml()).unwrap();
        // 5 blocks of conv, batch norm, relu, then pooling and the classifier.
        assert_eq!(job.graph.layers.len(), 17);
        assert!(ModelFamilyParameters::parse("cnn:width=0:depth=1:batch=1:image=1").is_err());
        assert!(
            ModelFamilyParameters::parse("cnn:width=1:width=1:depth=1:batch=1:image=1").is_err()
        );
    }
}
