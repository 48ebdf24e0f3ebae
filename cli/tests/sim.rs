//! Runs the real `carve` binary: `carve sim generate` writes a trace that `carve sim`
//! replays under every policy, as JSON (`-o json`, or the older `--json`) that parses and
//! as an SVG chart; a trace with a bad row is refused with the row and column named.

use serde_json::Value;

mod support;
use support::{carve, succeeded, write_file};

#[test]
fn a_generated_trace_simulates_to_json_and_an_svg_chart() {
    let directory = tempfile::tempdir().unwrap();
    let generate = [
        "sim",
        "generate",
        "--jobs",
        "80",
        "--seed",
        "3",
        "--tenants",
        "3",
    ];
    let generated = carve(&generate);
    let trace = write_file(directory.path(), "trace.csv", succeeded(&generated));
    let again = carve(&generate);
    assert_eq!(generated.stdout, again.stdout, "a seed gives one trace");

    let plot_path = directory.path().join("utilisation.svg");
    let output = carve(&[
        "sim",
        "--trace",
        &trace,
        "--cluster",
        "2x4x80GiB",
        "-o",
        "json",
        "--plot",
        plot_path.to_str().unwrap(),
    ]);
    let report: Value = serde_json::from_slice(succeeded(&output)).expect("stdout is JSON");
    assert_eq!(report["jobs"], 80);
    let policies = report["policies"].as_array().unwrap();
    let names: Vec<&str> = policies
        .iter()
        .map(|policy| policy["policy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["whole-gpu", "declared", "carve"]);
    for policy in policies {
        let ended = ["succeeded_jobs", "failed_jobs", "rejected_jobs"]
            .iter()
            .map(|field| policy[field].as_u64().unwrap())
            .sum::<u64>();
        assert_eq!(ended, 80, "{policy}");
        let allocated = policy["allocated_memory_utilisation"].as_f64().unwrap();
        let used = policy["used_memory_utilisation"].as_f64().unwrap();
        assert!(
            used > 0.0 && used <= allocated && allocated <= 1.0,
            "{policy}"
        );
        assert!(policy["completion_time_s"]["p99"].as_f64().unwrap() > 0.0);
        assert!(
            !policy["utilisation_over_time"]
                .as_array()
                .unwrap()
                .is_empty()
        );
    }
    // Whole GPUs hold one job each; Carve packs several on a GPU.
    assert_eq!(policies[0]["jobs_per_busy_gpu"].as_f64().unwrap(), 1.0);
    assert!(policies[2]["jobs_per_busy_gpu"].as_f64().unwrap() > 1.0);

    let svg = std::fs::read_to_string(&plot_path).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
    assert!(svg.trim_end().ends_with("</svg>"));
    assert_eq!(
        svg.matches("<polyline").count(),
        6,
        "used and allocated per policy"
    );
    assert!(svg.contains("carve used") && svg.contains("whole-gpu allocated"));

    // `--json`, the flag from before `-o`, still gives the same document.
    let old_flag = carve(&["sim", "--trace", &trace, "--cluster", "2x4x80GiB", "--json"]);
    assert_eq!(succeeded(&old_flag), output.stdout);
    let both = carve(&["sim", "--trace", &trace, "--json", "-o", "table"]);
    assert_eq!(
        both.status.code(),
        Some(2),
        "clap refuses the contradiction"
    );

    let table = carve(&["sim", "--trace", &trace, "--policy", "carve"]);
    let table = String::from_utf8(succeeded(&table).to_vec()).unwrap();
    assert!(
        table.contains("JCT p50/p95/p99") && table.contains("carve"),
        "{table}"
    );
    assert!(!table.contains("whole-gpu"), "{table}");
}

/// A trace whose one job asks for 65 GPUs, more than a gang may have, which `carve sim`
/// refuses.
const TRACE_WITH_A_SIXTY_FIVE_GPU_JOB: &str =
    "submit_time_s,duration_s,tenant,gpus,requested_bytes,spec\n0,60,alice,65,8GiB,job.toml\n";

#[test]
fn bad_rows_and_flags_are_refused_with_what_to_fix() {
    let directory = tempfile::tempdir().unwrap();
    let trace = write_file(directory.path(), "bad.csv", TRACE_WITH_A_SIXTY_FIVE_GPU_JOB);
    let output = carve(&["sim", "--trace", &trace]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("bad.csv: row 2 column gpus: 65 GPUs: must be between 1 and 64"),
        "{stderr}"
    );

    write_file(
        directory.path(),
        "bad.csv",
        "submit_time_s,duration_s,tenant,gpus,requested_bytes,spec\n0,60,alice,1,8GiB,missing.toml\n",
    );
    let output = carve(&["sim", "--trace", &trace]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("row 2 column spec: cannot read"),
        "{stderr}"
    );

    let output = carve(&["sim", "--trace", &trace, "--cluster", "8GiB"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--cluster: `8GiB` is not"), "{stderr}");
    let output = carve(&["sim", "generate", "--jobs", "0"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--jobs: 0 must be"), "{stderr}");

    // A spec is found next to the trace, wherever carve runs from.
    let example =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mnist-cnn.toml");
    std::fs::copy(example, directory.path().join("missing.toml")).unwrap();
    let output = carve(&["sim", "--trace", &trace, "--json"]);
    let report: Value = serde_json::from_slice(succeeded(&output)).unwrap();
    assert_eq!(report["policies"][2]["succeeded_jobs"], 1);
}

/// One GPU held for hours by low-priority work; urgent jobs (priority 10) arrive behind it.
const TRACE_THAT_NEEDS_PREEMPTION: &str = "\
submit_time_s,duration_s,tenant,gpus,requested_bytes,actual_peak_bytes,priority
0,20000,batch,1,60GiB,60GiB,0
10,20000,batch,1,60GiB,60GiB,0
900,300,oncall,1,40GiB,40GiB,10
2000,300,oncall,1,40GiB,40GiB,10
";

#[test]
fn preemption_shortens_the_urgent_jobs_queueing_side_by_side() {
    let directory = tempfile::tempdir().unwrap();
    let trace = write_file(directory.path(), "urgent.csv", TRACE_THAT_NEEDS_PREEMPTION);
    let arguments = [
        "sim",
        "--trace",
        &trace,
        "--cluster",
        "1x80GiB",
        "--policy",
        "declared",
        "--urgent-priority",
        "10",
        "--preemption",
    ];
    let output = carve(&[&arguments[..], &["-o", "json"]].concat());
    let report: Value = serde_json::from_slice(succeeded(&output)).unwrap();
    assert_eq!(report["urgent_priority"], 10);
    assert!(
        report["preemption"]["assumption"]
            .as_str()
            .unwrap()
            .contains("last periodic checkpoint"),
        "{report}"
    );
    let runs = report["policies"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "declared without and with preemption");
    assert_eq!(runs[0]["preemption"], false);
    assert_eq!(runs[1]["preemption"], true);
    let wait = |run: &Value, field: &str| run["urgent_queueing_s"][field].as_f64().unwrap();
    assert_eq!(runs[0]["urgent_queueing_s"]["jobs"], 2);
    assert_eq!(runs[0]["preemptions"], 0);
    assert!(runs[1]["preemptions"].as_u64().unwrap() >= 1);
    assert!(
        wait(&runs[1], "mean") < wait(&runs[0], "mean")
            && wait(&runs[1], "max") < wait(&runs[0], "max"),
        "{report}"
    );
    // Every job still finishes: the victims resume.
    for run in runs {
        assert_eq!(run["succeeded_jobs"], 4, "{run}");
    }

    let table = carve(&arguments);
    let table = String::from_utf8(succeeded(&table).to_vec()).unwrap();
    assert!(
        table.contains("declared+preempt") && table.contains("urgent wait p50/p95/max"),
        "{table}"
    );
    assert!(table.contains("urgent: priority >= 10"), "{table}");
}
