//! The trace target: a simulator trace (CSV) through `parse_trace` and, when it parses,
//! `Workload::prepare`, which validates and estimates every model the rows name (spec
//! files are given the text of an example job, as the CLI would read them).

use std::collections::BTreeMap;

use carve_core::error::CoreError;
use carve_core::simulation::trace::{TRACE_COLUMNS, parse_trace};
use carve_core::simulation::workload::Workload;

use crate::spec::text_of;

/// Column names and cell values of the trace format, for the CI mutator.
pub const TRACE_DICTIONARY: &[&[u8]] = &[
    b"submit_time_s",
    b"duration_s",
    b"tenant",
    b"gpus",
    b"requested_bytes",
    b"spec",
    b"model",
    b"actual_peak_bytes",
    b"command_model",
    b"fixed=1GiB:per_sample=35MiB",
    b"fixed=",
    b"per_sample=",
    b"cnn:width=64:depth=8:batch=128:image=64",
    b"width=",
    b"depth=",
    b"batch=",
    b"image=",
    b"4096",
    b"65536",
    b"0",
    b"-1",
    b"nan",
    b"inf",
    b"1e308",
    b"16GiB",
    b"18446744073709551615",
    b"mnist-cnn.toml",
    b",",
    b"\n",
    b"\r\n",
    b"#",
    b"\"",
    b"\"\"",
];

/// The job file every `spec` cell is given (the CLI would read the named file).
const EXAMPLE_SPEC: &str = include_str!("../../examples/mnist-cnn.toml");

pub fn fuzz_trace_csv(data: &[u8]) {
    let Some(text) = text_of(data) else { return };
    let trace = match parse_trace(text) {
        Ok(trace) => trace,
        Err(error) => return check_rejection(&error),
    };
    for row in &trace.rows {
        assert!(
            row.submit_time_s.is_finite() && row.submit_time_s >= 0.0,
            "row {} was accepted with submit_time_s {}",
            row.row,
            row.submit_time_s
        );
        assert!(
            row.duration_s.is_finite() && row.duration_s > 0.0,
            "row {} was accepted with duration_s {}",
            row.row,
            row.duration_s
        );
        assert!(row.requested_bytes > 0, "row {} requests 0 bytes", row.row);
    }
    let spec_texts: BTreeMap<String, String> = trace
        .spec_files()
        .into_iter()
        .map(|path| (path.to_string(), EXAMPLE_SPEC.to_string()))
        .collect();
    match Workload::prepare(&trace, &spec_texts) {
        Ok(workload) => assert_eq!(
            workload.jobs.len(),
            trace.rows.len(),
            "the workload lost rows"
        ),
        Err(error) => check_rejection(&error),
    }
}

fn check_rejection(error: &CoreError) {
    let CoreError::InvalidSpec(field_error) = error else {
        panic!("a bad trace is rejected with {error:?}, not a field error");
    };
    assert!(
        field_error.field.starts_with("row "),
        "a trace rejection names {:?}, not a row (columns: {})",
        field_error.field,
        TRACE_COLUMNS.join(", ")
    );
    assert!(
        !field_error.reason.trim().is_empty(),
        "a trace rejection without a reason ({})",
        field_error.field
    );
}
