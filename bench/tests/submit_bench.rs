//! One short run of `carve-submit-bench` against SQLite with `--json`: a real
//! carve-scheduler child process, paced and saturating load, the store-limit baselines,
//! and a report that parses and adds up.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The debug carve-scheduler next to the bench binary; built here when missing (it is
/// there already whenever the workspace's tests were built together).
fn scheduler_binary() -> PathBuf {
    let bench = Path::new(env!("CARGO_BIN_EXE_carve-submit-bench"));
    let scheduler = bench.with_file_name("carve-scheduler");
    if !scheduler.is_file() {
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", "carve-scheduler", "--bin", "carve-scheduler"])
            .status()
            .expect("run cargo to build carve-scheduler");
        assert!(status.success(), "cargo build -p carve-scheduler failed");
    }
    assert!(scheduler.is_file(), "no {}", scheduler.display());
    scheduler
}

fn number(value: &Value, path: &str) -> f64 {
    value
        .pointer(path)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("no number at {path} in {value:#}"))
}

#[test]
fn a_short_sqlite_run_reports_json_that_adds_up() {
    let output = Command::new(env!("CARGO_BIN_EXE_carve-submit-bench"))
        .args([
            "--backends",
            "sqlite",
            "--duration",
            "1s",
            "--rates",
            "200",
            "--concurrency",
            "4",
            "--connections",
            "2",
            "--baseline-batch",
            "16",
            "--json",
            "--scheduler-binary",
        ])
        .arg(scheduler_binary())
        .output()
        .expect("run carve-submit-bench");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "the bench failed:\n{stderr}");
    let report: Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|error| panic!("stdout is not JSON ({error}); stderr:\n{stderr}"));

    assert!(number(&report, "/machine/cpus") >= 1.0);
    let backends = report["backends"].as_array().expect("backends");
    assert_eq!(backends.len(), 1);
    let sqlite = &backends[0];
    assert_eq!(sqlite["backend"], "sqlite");
    let durability = sqlite["durability"].to_string();
    assert!(
        durability.contains(r#"["synchronous","full"]"#),
        "{durability}"
    );
    assert!(
        durability.contains(r#"["journal_mode","wal"]"#),
        "{durability}"
    );

    let phases = sqlite["phases"].as_array().expect("phases");
    assert_eq!(phases.len(), 2, "{phases:#?}");
    assert_eq!(phases[0]["mode"], "paced");
    assert_eq!(number(&phases[0], "/target_rate_per_second"), 200.0);
    assert_eq!(number(&phases[0], "/sent"), 200.0);
    assert_eq!(phases[1]["mode"], "saturation");
    assert_eq!(number(&phases[1], "/concurrency"), 4.0);
    for phase in phases {
        let succeeded = number(phase, "/succeeded");
        assert!(succeeded > 0.0, "{phase:#}");
        assert_eq!(number(phase, "/failed"), 0.0, "{phase:#}");
        assert_eq!(number(phase, "/latency/count"), succeeded, "{phase:#}");
        // Every acknowledged submit was answered from a committed group, and the
        // scheduler counted it.
        assert_eq!(number(phase, "/jobs_committed"), succeeded, "{phase:#}");
        let groups = number(phase, "/groups_committed");
        assert!(groups >= 1.0 && groups <= succeeded, "{phase:#}");
        let p50 = number(phase, "/latency/p50_ms");
        let p99 = number(phase, "/latency/p99_ms");
        let max = number(phase, "/latency/max_ms");
        assert!(0.0 < p50 && p50 <= p99 && p99 <= max, "{phase:#}");
        assert!(
            number(phase, "/server_cpu_ms_per_1000_submits") > 0.0,
            "{phase:#}"
        );
    }

    assert_eq!(
        number(
            sqlite,
            "/store_limit_one_row_per_commit/rows_per_transaction"
        ),
        1.0
    );
    assert_eq!(
        number(sqlite, "/store_limit_batched/rows_per_transaction"),
        16.0
    );
    assert!(number(sqlite, "/store_limit_one_row_per_commit/rows") >= 1.0);
    assert!(number(sqlite, "/store_limit_batched/rows") >= 16.0);
    assert!(number(sqlite, "/saturation_to_batched") > 0.0);
    let targets = sqlite["targets"].as_array().expect("targets");
    assert_eq!(
        targets.len(),
        1,
        "only the sustained target: no 1000/s phase"
    );
    assert!(targets[0]["met"].is_boolean());
}

#[test]
fn bad_flags_are_refused_with_the_field_named() {
    let output = Command::new(env!("CARGO_BIN_EXE_carve-submit-bench"))
        .args(["--rates", "1000,zero", "--backends", "sqlite"])
        .output()
        .expect("run carve-submit-bench");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("rates:") && stderr.contains("zero"),
        "{stderr}"
    );
}
