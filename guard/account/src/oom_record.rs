//! The OOM record: one JSON object a line, one line per refused allocation, appended by
//! any process of the attempt and read by the worker when the attempt ends.

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::AccountError;

/// One allocation the guard refused, with the numbers the shrink planner and the user
/// need: what was asked, what the attempt held, its limit and its peak.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OomRecordLine {
    /// The entry point as the program called it, e.g. "cuMemAlloc_v2",
    /// "cuMemAllocAsync_ptsz", "cuMemCreate".
    pub entry_point: String,
    pub requested_bytes: u64,
    /// What the whole attempt (all its processes) held when the request came.
    pub in_use_bytes: u64,
    pub limit_bytes: u64,
    pub peak_bytes: u64,
    pub process_id: u32,
    pub time_unix_ms: u64,
}

impl OomRecordLine {
    /// The line as written to the record, newline included.
    pub fn to_json_line(&self) -> String {
        let mut line = serde_json::to_string(self)
            .expect("a struct of strings and integers always serializes");
        line.push('\n');
        line
    }

    /// Every line of a record; blank lines are skipped, anything else unreadable is an
    /// error naming its line.
    pub fn parse_record(text: &str) -> Result<Vec<OomRecordLine>, AccountError> {
        text.lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(index, line)| {
                serde_json::from_str(line).map_err(|error| AccountError::BadRecordLine {
                    line_number: index + 1,
                    reason: error.to_string(),
                })
            })
            .collect()
    }
}

/// Appends one line with a single `write` on an `O_APPEND` file, so lines from several
/// processes never interleave.
pub fn append_oom_record(path: &Path, line: &OomRecordLine) -> Result<(), AccountError> {
    let io_error = |source| AccountError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io_error)?;
    let text = line.to_json_line();
    let written = file.write(text.as_bytes()).map_err(io_error)?;
    if written != text.len() {
        return Err(io_error(std::io::Error::new(
            std::io::ErrorKind::WriteZero,
            format!("wrote {written} of {} bytes", text.len()),
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(process_id: u32) -> OomRecordLine {
        OomRecordLine {
            entry_point: "cuMemAlloc_v2".into(),
            requested_bytes: 3 << 30,
            in_use_bytes: 5 << 30,
            limit_bytes: 6 << 30,
            peak_bytes: 5 << 30,
            process_id,
            time_unix_ms: 1_790_000_000_000,
        }
    }

    #[test]
    fn lines_appended_by_several_writers_read_back_in_order() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("gpu-oom.jsonl");
        append_oom_record(&path, &line(10)).unwrap();
        append_oom_record(&path, &line(11)).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 2);
        assert_eq!(
            OomRecordLine::parse_record(&text).unwrap(),
            vec![line(10), line(11)]
        );
    }

    #[test]
    fn an_unreadable_line_is_named_by_its_number() {
        let text = format!("{}\nnot json\n", line(1).to_json_line());
        let error = OomRecordLine::parse_record(&text).unwrap_err();
        assert!(
            error.to_string().starts_with("OOM record line 3:"),
            "{error}"
        );
    }
}
