//! carve-fuzz: one entry point per fuzz target, each taking arbitrary bytes and feeding
//! them to the real code that reads that input from outside Carve:
//!
//! - `spec_toml`, `spec_json`: a job file and the API's `spec_json` through parsing,
//!   validation and the estimate, and the TOML-to-JSON path a submit takes;
//! - `trace_csv`: a simulator trace through `parse_trace` and `Workload::prepare`;
//! - `request`: every request message of the four gRPC services, decoded with prost and
//!   handed to its real handler on an in-process scheduler over a temporary SQLite store,
//!   with an admin token;
//! - `child_line`: the lines an attempt process writes and the worker reads (and the run
//!   config argument the child reads).
//!
//! A target returns normally for any input that Carve handles: a rejection with a clear
//! error is fine. It panics on a finding: a panic inside Carve, an `INTERNAL`/`UNKNOWN`
//! status for bad input, a broken round trip, or a handler that does not answer.
//!
//! Two drivers run these functions. `tests/bounded_run.rs` is the CI run: each target
//! over its checked-in seed corpus (`corpus/<target>/`) and a fixed number of seeded
//! mutations of it, under `cargo test`. `campaign/` is the coverage-guided campaign on
//! libFuzzer (its own workspace, because it builds with coverage instrumentation);
//! `docs/fuzzing.md` says how to run it.

pub mod child_line;
pub mod mutate;
pub mod requests;
pub mod spec;
pub mod trace;

/// A fuzz target: its name (also its corpus folder and campaign binary) and its entry
/// point.
#[derive(Debug, Clone, Copy)]
pub struct FuzzTarget {
    pub name: &'static str,
    pub run: fn(&[u8]),
    /// Tokens the CI mutator splices in, so mutations reach past the first syntax check.
    pub dictionary: &'static [&'static [u8]],
}

/// Every target, in the order the CI run takes them.
pub const TARGETS: [FuzzTarget; 5] = [
    FuzzTarget {
        name: "spec_toml",
        run: spec::fuzz_spec_toml,
        dictionary: spec::SPEC_DICTIONARY,
    },
    FuzzTarget {
        name: "spec_json",
        run: spec::fuzz_spec_json,
        dictionary: spec::SPEC_DICTIONARY,
    },
    FuzzTarget {
        name: "trace_csv",
        run: trace::fuzz_trace_csv,
        dictionary: trace::TRACE_DICTIONARY,
    },
    FuzzTarget {
        name: "request",
        run: requests::fuzz_request,
        dictionary: requests::REQUEST_DICTIONARY,
    },
    FuzzTarget {
        name: "child_line",
        run: child_line::fuzz_child_line,
        dictionary: child_line::CHILD_LINE_DICTIONARY,
    },
];

/// The target of that name.
pub fn target(name: &str) -> Option<FuzzTarget> {
    TARGETS.iter().copied().find(|target| target.name == name)
}

/// Inputs longer than this are ignored by every target: a bound on a run's time that
/// says nothing about Carve (the API's own size limits are the scheduler's business, and
/// the request target still sees messages up to this size).
pub const MAX_INPUT_BYTES: usize = 64 * 1024;

/// Whether two floats are the same as far as a JSON round trip promises: both non-finite,
/// or within two units in the last place. serde_json's reader without its
/// `float_roundtrip` feature (the workspace's build) may be off by one unit: the
/// campaign found `"beta2": 0.99911111111111111111…` read as 0.9991111111111112 and
/// that written and read again as 0.9991111111111111 (`fuzz/corpus/spec_*/regression-float-last-bit*`).
pub(crate) fn floats_close(left: f64, right: f64) -> bool {
    if !left.is_finite() || !right.is_finite() {
        return !left.is_finite() && !right.is_finite();
    }
    left == right
        || (left.is_sign_negative() == right.is_sign_negative()
            && left.to_bits().abs_diff(right.to_bits()) <= 2)
}
