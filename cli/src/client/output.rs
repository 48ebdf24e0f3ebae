//! How client commands print: aligned tables for people, and the API's messages as JSON
//! or YAML for scripts, plus the small words (state names, configs, sizes, ages, attempt
//! notes) that tables and lines share.
//!
//! JSON is the protobuf JSON mapping with the proto field names (`job_id`, not `jobId`),
//! every field present (defaults included, so a script never meets a missing key), enums
//! by name (`JOB_STATE_RUNNING`), timestamps in RFC 3339 and 64-bit integers as numbers.
//! It is produced from the API's own descriptors (prost-reflect), so it follows the
//! `.proto` files without a hand-written copy of every message.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use carve_core::bytes::HumanBytes;
use carve_proto::v1;
use prost_reflect::{DescriptorPool, DynamicMessage, SerializeOptions};

/// How a command prints its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Aligned columns for people.
    Table,
    /// The API's messages as JSON (proto field names).
    Json,
    /// The same as YAML.
    Yaml,
}

/// The descriptors of the v1 API, decoded once.
fn descriptor_pool() -> Result<&'static DescriptorPool> {
    static POOL: OnceLock<Result<DescriptorPool, String>> = OnceLock::new();
    POOL.get_or_init(|| {
        DescriptorPool::decode(carve_proto::FILE_DESCRIPTOR_SET).map_err(|error| error.to_string())
    })
    .as_ref()
    .map_err(|error| anyhow::anyhow!("the api descriptors do not decode: {error}"))
}

/// `message` (of the proto type `full_name`, such as `carve.v1.Job`) as JSON.
pub fn message_json<M: prost::Message>(message: &M, full_name: &str) -> Result<serde_json::Value> {
    let descriptor = descriptor_pool()?
        .get_message_by_name(full_name)
        .with_context(|| format!("no message {full_name} in the api descriptors"))?;
    let dynamic = DynamicMessage::decode(descriptor, message.encode_to_vec().as_slice())
        .with_context(|| format!("cannot read a {full_name} back"))?;
    let options = SerializeOptions::new()
        .use_proto_field_name(true)
        .skip_default_fields(false)
        .stringify_64_bit_integers(false);
    dynamic
        .serialize_with_options(serde_json::value::Serializer, &options)
        .with_context(|| format!("cannot write a {full_name} as json"))
}

/// Prints `value` as JSON or YAML; tables are each command's own business.
pub fn print_structured(value: &serde_json::Value, format: OutputFormat) -> Result<()> {
    match format {
        OutputFormat::Json | OutputFormat::Table => {
            println!("{}", serde_json::to_string_pretty(value)?);
        }
        OutputFormat::Yaml => {
            print!("{}", serde_norway::to_string(value)?);
        }
    }
    Ok(())
}

/// Prints `message` in `format` (which must not be `Table`).
pub fn print_message<M: prost::Message>(
    message: &M,
    full_name: &str,
    format: OutputFormat,
) -> Result<()> {
    print_structured(&message_json(message, full_name)?, format)
}

/// A protobuf enum value as a lowercase word, its name without `prefix`
/// (`JOB_STATE_RUNNING` -> `running`), or `"{unknown} {value}"` for a value this build
/// does not know.
fn enum_word<E: TryFrom<i32>>(
    value: i32,
    name: fn(&E) -> &'static str,
    prefix: &str,
    unknown: &str,
) -> String {
    E::try_from(value).map_or_else(
        |_| format!("{unknown} {value}"),
        |known| name(&known).trim_start_matches(prefix).to_lowercase(),
    )
}

pub fn job_state_name(state: i32) -> String {
    enum_word(state, v1::JobState::as_str_name, "JOB_STATE_", "state")
}

pub fn outcome_name(outcome: i32) -> String {
    enum_word(
        outcome,
        v1::AttemptOutcome::as_str_name,
        "ATTEMPT_OUTCOME_",
        "outcome",
    )
}

pub fn precision_name(precision: i32) -> String {
    enum_word(
        precision,
        v1::Precision::as_str_name,
        "PRECISION_",
        "precision",
    )
}

pub fn worker_state_name(state: i32) -> String {
    enum_word(
        state,
        v1::WorkerState::as_str_name,
        "WORKER_STATE_",
        "state",
    )
}

pub fn role_name(role: i32) -> String {
    enum_word(role, v1::Role::as_str_name, "ROLE_", "role")
}

/// Whether a job is in a state it never leaves.
pub fn is_terminal_state(state: i32) -> bool {
    matches!(
        v1::JobState::try_from(state),
        Ok(v1::JobState::Succeeded | v1::JobState::Failed | v1::JobState::Cancelled)
    )
}

pub fn is_terminal(job: &v1::Job) -> bool {
    is_terminal_state(job.state)
}

/// A run config in a few words: `batch 64, micro 16, fp16, recompute 2`. The parts
/// that are at their plain values (no recomputation) are left out.
pub fn config_text(config: Option<&v1::RunConfig>) -> String {
    let Some(config) = config else {
        return "-".into();
    };
    let mut text = format!(
        "batch {}, micro {}, {}",
        config.batch_size,
        config.micro_batch_size,
        precision_name(config.precision)
    );
    if let Some(segment) = config.recompute_segment_layers {
        text.push_str(&format!(", recompute {segment}"));
    }
    text
}

/// A byte count for people, or `-` when there is none.
pub fn bytes_text(bytes: Option<u64>) -> String {
    bytes.map_or_else(|| "-".into(), |bytes| HumanBytes(bytes).to_string())
}

/// Seconds since the Unix epoch, now.
pub fn now_seconds() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            i64::try_from(elapsed.as_secs()).unwrap_or(i64::MAX)
        })
}

/// How long ago `then` was, in its largest unit: `42s`, `5m`, `3h`, `2d`.
pub fn age_text(then: Option<&prost_types::Timestamp>, now_seconds: i64) -> String {
    let Some(then) = then else {
        return "-".into();
    };
    let seconds = now_seconds.saturating_sub(then.seconds).max(0);
    match seconds {
        0..60 => format!("{seconds}s"),
        60..3600 => format!("{}m", seconds / 60),
        3600..86_400 => format!("{}h", seconds / 3600),
        _ => format!("{}d", seconds / 86_400),
    }
}

/// A timestamp in UTC, `2026-11-26 00:30:05Z`, or `-`.
pub fn timestamp_text(timestamp: Option<&prost_types::Timestamp>) -> String {
    let Some(timestamp) = timestamp else {
        return "-".into();
    };
    let days = timestamp.seconds.div_euclid(86_400);
    let second_of_day = timestamp.seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}Z",
        second_of_day / 3600,
        second_of_day % 3600 / 60,
        second_of_day % 60
    )
}

/// The day of a timestamp in UTC, `2026-11-26`, or `-`: where a table has no room for
/// the time.
pub fn date_text(timestamp: Option<&prost_types::Timestamp>) -> String {
    let text = timestamp_text(timestamp);
    text.split_once(' ')
        .map_or(text.clone(), |(date, _)| date.to_string())
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`), so printing a date needs no calendar crate.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// How a list command prints: `table` fits [`TABLE_WIDTH`] columns, `wide` shows more
/// columns and every cell whole, `json` and `yaml` are the API's messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ListFormat {
    /// Aligned columns that fit 100 characters; long cells are cut with `…`.
    Table,
    /// More columns, nothing cut.
    Wide,
    /// The API's messages as JSON (proto field names).
    Json,
    /// The same as YAML.
    Yaml,
}

impl ListFormat {
    /// The document format, or `None` for the tables.
    pub fn document(self) -> Option<OutputFormat> {
        match self {
            ListFormat::Table | ListFormat::Wide => None,
            ListFormat::Json => Some(OutputFormat::Json),
            ListFormat::Yaml => Some(OutputFormat::Yaml),
        }
    }
}

/// The width default tables fit in: a terminal of 100 columns shows every row on one line.
pub const TABLE_WIDTH: usize = 100;

/// The narrowest a column is cut to: its header, or this many characters if more.
const NARROWEST_COLUMN: usize = 6;

/// Prints rows under a header in aligned columns that fit [`TABLE_WIDTH`]: when they do
/// not, the widest columns are cut first, their long cells ending in `…`. The first
/// column, which names the row (an id to copy), is never cut. See [`table_lines`].
pub fn print_table<const COLUMNS: usize>(header: [&str; COLUMNS], rows: &[[String; COLUMNS]]) {
    for line in table_lines(header, rows, Some(TABLE_WIDTH)) {
        println!("{line}");
    }
}

/// Prints rows under a header in aligned columns, every cell whole (`-o wide`).
pub fn print_wide_table<const COLUMNS: usize>(header: [&str; COLUMNS], rows: &[[String; COLUMNS]]) {
    for line in table_lines(header, rows, None) {
        println!("{line}");
    }
}

/// The lines of a table, within `max_width` characters when given (as far as cutting
/// every column but the first to its narrowest allows). The last column is not padded, so
/// a long reason does not push trailing spaces.
pub fn table_lines<const COLUMNS: usize>(
    header: [&str; COLUMNS],
    rows: &[[String; COLUMNS]],
    max_width: Option<usize>,
) -> Vec<String> {
    let mut widths = header.map(|cell| cell.chars().count());
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    if let Some(max_width) = max_width {
        let narrowest = header.map(|cell| cell.chars().count().max(NARROWEST_COLUMN));
        let gaps = 2 * COLUMNS.saturating_sub(1);
        while widths.iter().sum::<usize>() + gaps > max_width {
            // The widest column that may still be cut; later ones first among equals, so
            // a reason at the end gives way before a name.
            let widest = (1..COLUMNS)
                .filter(|&index| widths[index] > narrowest[index])
                .max_by_key(|&index| (widths[index], index));
            match widest {
                Some(index) => widths[index] -= 1,
                None => break,
            }
        }
    }
    let line = |cells: [&str; COLUMNS]| {
        let mut text = String::new();
        for (index, (cell, width)) in cells.iter().zip(widths).enumerate() {
            let cell = elide(cell, width);
            text.push_str(&cell);
            if index + 1 < COLUMNS {
                text.push_str(&" ".repeat(width - cell.chars().count() + 2));
            }
        }
        text.trim_end().to_string()
    };
    let mut lines = vec![line(header)];
    lines.extend(
        rows.iter()
            .map(|row| line(std::array::from_fn(|index| row[index].as_str()))),
    );
    lines
}

/// `text` in at most `width` characters: whole, or cut with `…` as its last character.
fn elide(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_string();
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// What to say about an attempt beyond its outcome: the out-of-memory numbers, why it
/// failed, or the checkpoint it resumed from.
pub fn attempt_note(attempt: &v1::Attempt) -> String {
    let mut notes = Vec::new();
    if let Some(oom) = &attempt.oom {
        notes.push(oom_text(oom));
    }
    if !attempt.failure_message.is_empty() {
        notes.push(attempt.failure_message.clone());
    }
    if let Some(checkpoint) = &attempt.resumed_from {
        notes.push(format!("resumed from step {}", checkpoint.step));
    }
    notes.join("; ")
}

/// The allocator's numbers at an out-of-memory, for people.
pub fn oom_text(report: &v1::OutOfMemoryReport) -> String {
    format!(
        "requested {} with {} of {} in use (largest free {}, peak {})",
        bytes_text(Some(report.requested_bytes)),
        bytes_text(Some(report.in_use_bytes)),
        bytes_text(Some(report.limit_bytes)),
        bytes_text(Some(report.largest_free_bytes)),
        bytes_text(Some(report.peak_bytes))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_become_json_with_proto_field_names_and_enum_names() {
        let job = v1::Job {
            id: "j-1".into(),
            state: v1::JobState::Running as i32,
            current_config: Some(v1::RunConfig {
                batch_size: 64,
                micro_batch_size: 16,
                precision: v1::Precision::Fp16 as i32,
                ..v1::RunConfig::default()
            }),
            ..v1::Job::default()
        };
        let json = message_json(&job, "carve.v1.Job").unwrap();
        assert_eq!(json["id"], "j-1");
        assert_eq!(json["state"], "JOB_STATE_RUNNING");
        assert_eq!(json["current_config"]["micro_batch_size"], 16);
        assert_eq!(json["current_config"]["precision"], "PRECISION_FP16");
        // Defaults are present, so scripts never meet a missing key.
        assert_eq!(json["waiting_reason"], "");
        assert!(json["attempts"].as_array().unwrap().is_empty());
    }

    #[test]
    fn yaml_output_reads_back_to_the_same_value() {
        let job = v1::Job {
            id: "j-2".into(),
            name: "needs: quoting # here".into(),
            ..v1::Job::default()
        };
        let json = message_json(&job, "carve.v1.Job").unwrap();
        let yaml = serde_norway::to_string(&json).unwrap();
        let back: serde_json::Value = serde_norway::from_str(&yaml).unwrap();
        assert_eq!(back, json);
    }

    #[test]
    fn timestamps_print_as_utc_dates() {
        let at = |seconds| prost_types::Timestamp { seconds, nanos: 0 };
        assert_eq!(timestamp_text(Some(&at(0))), "1970-01-01 00:00:00Z");
        assert_eq!(
            timestamp_text(Some(&at(1_795_653_005))),
            "2026-11-26 00:30:05Z"
        );
        assert_eq!(
            timestamp_text(Some(&at(951_782_400))),
            "2000-02-29 00:00:00Z"
        );
        assert_eq!(timestamp_text(None), "-");
        assert_eq!(date_text(Some(&at(1_795_653_005))), "2026-11-26");
        assert_eq!(date_text(None), "-");
    }

    #[test]
    fn ages_use_their_largest_unit() {
        let at = |seconds| prost_types::Timestamp { seconds, nanos: 0 };
        assert_eq!(age_text(Some(&at(100)), 142), "42s");
        assert_eq!(age_text(Some(&at(0)), 600), "10m");
        assert_eq!(age_text(Some(&at(0)), 7200), "2h");
        assert_eq!(age_text(Some(&at(0)), 3 * 86_400), "3d");
        // A clock behind the server's never shows a negative age.
        assert_eq!(age_text(Some(&at(500)), 100), "0s");
    }

    #[test]
    fn a_table_too_wide_cuts_its_widest_columns_but_never_the_first() {
        let id = "job-0123456789abcdef0123456789abcdef".to_string();
        let rows = [[
            id.clone(),
            "a-rather-long-job-name-for-a-table".to_string(),
            "queued".to_string(),
            "no gpu has 6 GiB free (largest hole 4 GiB on node-3); tenant quota: 30 GiB of 32 GiB"
                .to_string(),
        ]];
        let header = ["ID", "NAME", "STATE", "WAITING"];
        let lines = table_lines(header, &rows, Some(TABLE_WIDTH));
        for line in &lines {
            assert!(line.chars().count() <= TABLE_WIDTH, "{line}");
        }
        assert!(
            lines[1].starts_with(&format!("{id}  a-rather-long-job-name")),
            "{lines:?}"
        );
        assert!(lines[1].contains("  queued  no gpu has"), "{lines:?}");
        assert!(lines[1].ends_with('…'), "{lines:?}");
        // Wide tables, and tables that fit, keep every cell whole.
        let wide = table_lines(header, &rows, None);
        assert!(wide[1].ends_with("30 GiB of 32 GiB"), "{wide:?}");
        let narrow = [[
            "j".to_string(),
            "n".to_string(),
            "s".to_string(),
            "w".to_string(),
        ]];
        assert_eq!(
            table_lines(header, &narrow, Some(TABLE_WIDTH)),
            ["ID  NAME  STATE  WAITING", "j   n     s      w"]
        );
    }

    #[test]
    fn a_table_that_cannot_fit_stops_at_its_narrowest_columns() {
        let rows = [std::array::from_fn::<String, 12, _>(|_| "x".repeat(40))];
        let header = ["COLUMN"; 12];
        let lines = table_lines(header, &rows, Some(TABLE_WIDTH));
        // The first column whole, every other one cut to its header's width.
        assert!(
            lines[1].starts_with(&format!("{}  xxxxx…  ", "x".repeat(40))),
            "{lines:?}"
        );
        assert_eq!(elide("abcdef", 3), "ab…");
        assert_eq!(elide("abc", 3), "abc");
    }

    #[test]
    fn enum_values_read_as_words_and_unknown_ones_say_their_number() {
        assert_eq!(job_state_name(v1::JobState::Running as i32), "running");
        assert_eq!(
            outcome_name(v1::AttemptOutcome::OutOfMemory as i32),
            "out_of_memory"
        );
        assert_eq!(role_name(v1::Role::Worker as i32), "worker");
        assert_eq!(job_state_name(99), "state 99");
    }

    #[test]
    fn configs_read_in_a_few_words() {
        let config = v1::RunConfig {
            batch_size: 32,
            micro_batch_size: 8,
            precision: v1::Precision::Bf16 as i32,
            recompute_segment_layers: Some(2),
            ..v1::RunConfig::default()
        };
        assert_eq!(
            config_text(Some(&config)),
            "batch 32, micro 8, bf16, recompute 2"
        );
        assert_eq!(config_text(None), "-");
    }
}
