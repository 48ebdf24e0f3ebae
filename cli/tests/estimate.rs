//! Runs the real `carve` binary: `carve estimate` on every example, JSON that parses and
//! adds up, the shrink plan for a slice, and errors a person can act on.

use std::path::Path;
use std::process::Output;

use carve_testing::examples::example_spec_files;
use serde_json::Value;

mod support;
use support::{carve, carve_with_stdin, succeeded, write_file};

fn json_of(output: &Output) -> Value {
    serde_json::from_slice(succeeded(output)).expect("stdout is JSON")
}

#[test]
fn every_example_estimates_as_json_with_consistent_breakdowns() {
    let examples = example_spec_files();
    assert!(examples.len() >= 6, "examples: {examples:?}");
    for example in examples {
        let report = json_of(&carve(&[
            "estimate",
            example.to_str().unwrap(),
            "-o",
            "json",
        ]));
        let peak = report["peak_bytes"].as_u64().unwrap();
        assert!(peak > 0, "{}", example.display());
        assert!(report["required_bytes"].as_u64().unwrap() >= peak);
        let by_category: u64 = report["by_category"]
            .as_object()
            .unwrap()
            .values()
            .map(|bytes| bytes.as_u64().unwrap())
            .sum();
        let by_layer: u64 = report["by_layer"]
            .as_array()
            .unwrap()
            .iter()
            .map(|layer| layer["bytes"].as_u64().unwrap())
            .sum();
        assert_eq!(by_category, peak, "{}", example.display());
        assert_eq!(by_layer, peak, "{}", example.display());
        // Every example with a fixed slice fits it, shrunk where needed.
        if let Some(slice) = report.get("slice") {
            assert_eq!(slice["fits"], true, "{}: {slice}", example.display());
        }
    }
}

#[test]
fn the_tensorflow_seed_case_is_shrunk_into_sixteen_gib() {
    let example =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tf-conv2d-1024px-batch256.toml");
    let report = json_of(&carve(&[
        "estimate",
        example.to_str().unwrap(),
        "-o",
        "json",
    ]));
    let sixteen_gib = 16u64 << 30;
    assert!(report["required_bytes"].as_u64().unwrap() > sixteen_gib);
    let slice = &report["slice"];
    assert_eq!(slice["slice_bytes"].as_u64().unwrap(), sixteen_gib);
    assert_eq!(slice["changed"], true);
    assert!(slice["estimate"]["required_bytes"].as_u64().unwrap() <= sixteen_gib);
    assert_eq!(
        slice["estimate"]["config"]["batch_size"].as_u64().unwrap(),
        256
    );
    assert_eq!(slice["steps"][0]["strategy"], "mixed_precision");
}

#[test]
fn overrides_change_the_estimate() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mnist-cnn.toml");
    let path = example.to_str().unwrap();
    let base = json_of(&carve(&["estimate", path, "-o", "json"]));
    let half = json_of(&carve(&[
        "estimate",
        path,
        "--precision",
        "bf16",
        "-o",
        "json",
    ]));
    let small = json_of(&carve(&[
        "estimate",
        path,
        "--batch-size",
        "8",
        "-o",
        "json",
    ]));
    assert_eq!(half["config"]["precision"], "bf16");
    assert_eq!(small["config"]["batch_size"].as_u64().unwrap(), 8);
    assert!(small["peak_bytes"].as_u64().unwrap() < base["peak_bytes"].as_u64().unwrap());
}

#[test]
fn a_slice_nothing_fits_exits_three_with_the_numbers() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mnist-cnn.toml");
    let output = carve(&["estimate", example.to_str().unwrap(), "--slice", "1MiB"]);
    assert_eq!(output.status.code(), Some(3));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("does not fit in a 1 MiB slice"), "{stdout}");
}

/// A spec whose 5x5 convolution does not fit its 4x4 input.
const KERNEL_LARGER_THAN_ITS_INPUT: &str = "name = \"bad\"\n[model]\ninput_shape = [4, 4, 1]\nloss = \"mse\"\nlayers = [{ conv2d = { filters = 2, kernel = 5 } }]\n[training]\nbatch_size = 2\nsteps = 1\noptimizer = { sgd = { learning_rate = 0.1 } }\n[data]\nformat = \"synthetic\"\nsamples = 8\n";

#[test]
fn a_bad_spec_names_the_file_and_the_field() {
    let directory = tempfile::tempdir().unwrap();
    let path = write_file(directory.path(), "bad.toml", KERNEL_LARGER_THAN_ITS_INPUT);
    let output = carve(&["estimate", &path]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("bad.toml"), "{stderr}");
    assert!(
        stderr.contains("model.layers[0].conv2d.kernel: 5 is larger than the 4x4 input"),
        "{stderr}"
    );

    let missing = carve(&["estimate", "/nonexistent/job.toml"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("cannot read /nonexistent/job.toml"));

    let bad_slice = carve(&["estimate", &path, "--slice", "lots"]);
    assert_eq!(
        bad_slice.status.code(),
        Some(2),
        "clap rejects it before anything runs"
    );
}

#[test]
fn a_channels_first_input_shape_estimates_with_a_warning() {
    let directory = tempfile::tempdir().unwrap();
    let channels_first = KERNEL_LARGER_THAN_ITS_INPUT
        .replace("[4, 4, 1]", "[3, 32, 32]")
        .replace("kernel = 5", "kernel = 3");
    let path = write_file(directory.path(), "chw.toml", &channels_first);
    let output = carve(&["estimate", &path]);
    succeeded(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("chw.toml: warning: model.input_shape: [3, 32, 32] looks channels-first"),
        "{stderr}"
    );
}

/// Runs `carve arguments` with its stdout a pipe whose read end is already closed, as
/// `carve … | head -1` leaves it once `head` has its line.
fn carve_into_a_closed_pipe(arguments: &[&str]) -> std::process::Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    std::process::Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(arguments)
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("the carve binary runs")
}

#[test]
fn a_closed_stdout_ends_carve_quietly_without_a_panic() {
    use std::os::unix::process::ExitStatusExt as _;

    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mnist-cnn.toml");
    for arguments in [
        vec!["estimate", example.to_str().unwrap(), "-o", "json"],
        vec!["completions", "bash"],
    ] {
        let output = carve_into_a_closed_pipe(&arguments);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.is_empty(), "{arguments:?}: {stderr}");
        assert_ne!(output.status.code(), Some(101), "{arguments:?}: a panic");
        // Ended by SIGPIPE, as `cat` or `grep` would be.
        assert_eq!(output.status.signal(), Some(13), "{arguments:?}");
    }
}

#[test]
fn a_spec_from_stdin_estimates_as_its_file_does() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mnist-cnn.toml");
    let from_file = json_of(&carve(&[
        "estimate",
        example.to_str().unwrap(),
        "-o",
        "json",
    ]));
    let directory = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(&example).unwrap();
    let from_stdin = json_of(&carve_with_stdin(
        &["estimate", "-", "-o", "json"],
        directory.path(),
        &text,
    ));
    assert_eq!(from_stdin, from_file);

    // A bad spec from stdin is named as such, since it has no file name.
    let bad = carve_with_stdin(
        &["estimate", "-"],
        directory.path(),
        KERNEL_LARGER_THAN_ITS_INPUT,
    );
    assert_eq!(bad.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("<stdin>: model.layers[0].conv2d.kernel"),
        "{stderr}"
    );
}
