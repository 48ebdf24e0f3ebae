//! carve-bench: what `carve-submit-bench` and `carve-guard-bench` are made of.
//!
//! - [`pacing`] and [`latency`] are pure: the send schedule of an open-loop run and the
//!   summary of a latency histogram;
//! - [`procfs`] and [`prometheus`] read a process's CPU time and memory from `/proc` and
//!   counters from the scheduler's `/metrics` page;
//! - [`scheduler_process`] starts a real `carve-scheduler` binary as a child process;
//! - [`load`] drives it over gRPC (paced open-loop load and closed-loop saturation);
//! - [`baseline`] measures the store's own limit (plain inserts through sqlx);
//! - [`queue_memory`] fills the store with queued jobs and measures the scheduler's
//!   memory and scheduling passes over them;
//! - [`report`] holds the results and prints them as tables or JSON;
//! - [`guard_overhead`] is `carve-guard-bench`: allocations through the guard against
//!   straight into the fake CUDA driver.

pub mod baseline;
pub mod guard_overhead;
pub mod latency;
pub mod load;
pub mod pacing;
pub mod procfs;
pub mod prometheus;
pub mod queue_memory;
pub mod report;
pub mod scheduler_process;

/// Everything that can go wrong in a benchmark run, with what was being done.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A setting that cannot be used: the field and why.
    #[error("{field}: {reason}")]
    InvalidArgument { field: String, reason: String },
    /// The scheduler process did not start, or stopped, or answered wrongly.
    #[error("scheduler: {0}")]
    Scheduler(String),
    /// A database the benchmark uses directly (the store-limit baseline, the fill).
    #[error("database: {0}")]
    Database(String),
    /// Reading `/proc`, files, sockets.
    #[error("{0}")]
    Io(String),
    /// The private PostgreSQL server.
    #[error("postgres server: {0}")]
    Postgres(#[from] carve_testing::TestingError),
}

impl BenchError {
    pub fn invalid_argument(field: &str, reason: impl Into<String>) -> BenchError {
        BenchError::InvalidArgument {
            field: field.to_string(),
            reason: reason.into(),
        }
    }
}

impl From<sqlx::Error> for BenchError {
    fn from(error: sqlx::Error) -> BenchError {
        BenchError::Database(error.to_string())
    }
}

impl From<carve_scheduler::error::SchedulerError> for BenchError {
    fn from(error: carve_scheduler::error::SchedulerError) -> BenchError {
        BenchError::Database(error.to_string())
    }
}

/// Which database a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DatabaseKind {
    Sqlite,
    Postgres,
}

impl DatabaseKind {
    pub fn name(self) -> &'static str {
        match self {
            DatabaseKind::Sqlite => "sqlite",
            DatabaseKind::Postgres => "postgres",
        }
    }
}

/// Parses `sqlite,postgres` (any order, no repeats, at least one).
pub fn parse_backends(text: &str) -> Result<Vec<DatabaseKind>, BenchError> {
    let mut backends = Vec::new();
    for name in text.split(',').map(str::trim) {
        let backend = match name {
            "sqlite" => DatabaseKind::Sqlite,
            "postgres" | "postgresql" => DatabaseKind::Postgres,
            other => {
                return Err(BenchError::invalid_argument(
                    "backends",
                    format!("{other:?} is not one of sqlite, postgres"),
                ));
            }
        };
        if backends.contains(&backend) {
            return Err(BenchError::invalid_argument(
                "backends",
                format!("{name} is listed twice"),
            ));
        }
        backends.push(backend);
    }
    Ok(backends)
}

/// The job every benchmark submits: `examples/mnist-cnn.toml` as the API's JSON (a
/// two-conv CNN on 28x28 images, ~1.5 KB of spec), so admission validates, estimates
/// and stores a realistic spec.
pub const BENCH_JOB_SPEC_JSON: &str = r#"{"name":"bench-mnist-cnn","description":"two conv blocks and a dense head on 28x28x1 images","model":{"input_shape":[28,28,1],"loss":"softmax_cross_entropy","layers":[{"conv2d":{"filters":32,"kernel":3,"padding":"same"}},{"relu":{}},{"max_pool":{"size":2}},{"conv2d":{"filters":64,"kernel":3,"padding":"same"}},{"relu":{}},{"max_pool":{"size":2}},{"flatten":{}},{"dense":{"units":128}},{"relu":{}},{"dropout":{"rate":0.25}},{"dense":{"units":10}}]},"training":{"batch_size":64,"steps":200,"optimizer":{"adam":{"learning_rate":0.001}},"precision":"fp32","checkpoint_every_steps":50,"seed":7},"data":{"format":"synthetic","samples":4096,"test_samples":512},"resources":{"vram":"auto"}}"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_parse_and_reject_with_the_field_named() {
        assert_eq!(
            parse_backends("postgres, sqlite").unwrap(),
            vec![DatabaseKind::Postgres, DatabaseKind::Sqlite]
        );
        let error = parse_backends("sqlite,mysql").unwrap_err().to_string();
        assert!(error.starts_with("backends:"), "{error}");
        assert!(error.contains("mysql"), "{error}");
        assert!(parse_backends("sqlite,sqlite").is_err());
    }
}
