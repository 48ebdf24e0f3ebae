//! The CI run of the fuzz targets: each target over its checked-in seed corpus
//! (`fuzz/corpus/<target>/`, which also holds the regression inputs of past findings)
//! and then a fixed number of seeded mutations of it. The same seed gives the same
//! inputs on every machine; `CARVE_FUZZ_ITERATIONS` raises the count and
//! `CARVE_FUZZ_SEED` changes the seed for a longer run without the campaign's tools.
//!
//! A finding fails the test with the target, the seed and iteration, and the input
//! written under the test's temporary directory (its path is printed), ready to add to
//! the corpus once fixed.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::Instant;

use carve_fuzz::mutate::{SeededRandom, mutate};
use carve_fuzz::{FuzzTarget, TARGETS, target};

/// Mutations per target in CI: a few seconds each on the 2-core CI machine (most
/// mutants are refused early, which is cheap; the request target's accepted calls each
/// touch the store).
fn iterations(target: &FuzzTarget) -> usize {
    if let Ok(text) = std::env::var("CARVE_FUZZ_ITERATIONS") {
        return text
            .parse()
            .unwrap_or_else(|_| panic!("CARVE_FUZZ_ITERATIONS={text:?} is not a whole number"));
    }
    match target.name {
        "request" => 20_000,
        _ => 30_000,
    }
}

fn seed() -> u64 {
    match std::env::var("CARVE_FUZZ_SEED") {
        Ok(text) => text
            .parse()
            .unwrap_or_else(|_| panic!("CARVE_FUZZ_SEED={text:?} is not a whole number")),
        Err(_) => 0x0C0A_47E5,
    }
}

fn corpus_directory(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(name)
}

/// The corpus files of a target, by name so the order is the same everywhere.
fn corpus(name: &str) -> Vec<(String, Vec<u8>)> {
    let directory = corpus_directory(name);
    let mut files: Vec<_> = std::fs::read_dir(&directory)
        .unwrap_or_else(|error| panic!("read {}: {error}", directory.display()))
        .map(|entry| entry.expect("a corpus entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let bytes = std::fs::read(&path)
                .unwrap_or_else(|error| panic!("read {}: {error}", path.display()));
            (name, bytes)
        })
        .collect()
}

/// Runs one input; on a panic, saves it and fails naming where it came from.
fn run_one(target: &FuzzTarget, input: &[u8], origin: &str) {
    let outcome = catch_unwind(AssertUnwindSafe(|| (target.run)(input)));
    if outcome.is_err() {
        let path = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join("carve-fuzz-findings")
            .join(format!(
                "{}-{}",
                target.name,
                origin.replace(['/', ' '], "_")
            ));
        std::fs::create_dir_all(path.parent().unwrap()).expect("a findings directory");
        std::fs::write(&path, input).expect("write the finding");
        panic!(
            "fuzz target {} failed on {origin} ({} bytes), saved as {}",
            target.name,
            input.len(),
            path.display()
        );
    }
}

fn bounded_run(name: &str) {
    let target = target(name).expect("a target of TARGETS");
    let corpus = corpus(name);
    assert!(!corpus.is_empty(), "the {name} corpus is empty");
    let started = Instant::now();
    for (file, input) in &corpus {
        run_one(&target, input, &format!("corpus file {file}"));
    }
    let inputs: Vec<Vec<u8>> = corpus.into_iter().map(|(_, bytes)| bytes).collect();
    let seed = seed();
    let mut random = SeededRandom::new(seed ^ name.bytes().map(u64::from).sum::<u64>());
    let count = iterations(&target);
    for iteration in 0..count {
        let parent = &inputs[random.below(inputs.len())];
        let mutant = mutate(parent, &inputs, target.dictionary, &mut random, 8 * 1024);
        run_one(
            &target,
            &mutant,
            &format!("seed {seed} iteration {iteration}"),
        );
    }
    eprintln!(
        "{name}: {} corpus inputs and {count} mutations in {:.1?}",
        inputs.len(),
        started.elapsed()
    );
    if name == "request" {
        let (handled, accepted, assignments) = carve_fuzz::requests::statistics();
        eprintln!(
            "request: {handled} calls reached a handler, {accepted} were accepted, \
             sessions received {assignments} assignments"
        );
        assert!(
            assignments > 0,
            "no session was assigned a job, so no attempt report was checked past fencing"
        );
        assert!(
            accepted >= 21,
            "the valid seed requests were not all accepted ({accepted} of {handled} calls)"
        );
    }
}

#[test]
fn spec_toml() {
    bounded_run("spec_toml");
}

#[test]
fn spec_json() {
    bounded_run("spec_json");
}

#[test]
fn trace_csv() {
    bounded_run("trace_csv");
}

#[test]
fn request() {
    bounded_run("request");
}

#[test]
fn child_line() {
    bounded_run("child_line");
}

#[test]
fn every_target_has_a_test_here() {
    let names: Vec<&str> = TARGETS.iter().map(|target| target.name).collect();
    assert_eq!(
        names,
        [
            "spec_toml",
            "spec_json",
            "trace_csv",
            "request",
            "child_line"
        ]
    );
}

/// The seeds that are made from code (valid request messages, the examples as JSON) are
/// in the checked-in corpus; `CARVE_FUZZ_WRITE_SEEDS=1` writes them there.
#[test]
fn generated_seeds_are_checked_in() {
    let write = std::env::var("CARVE_FUZZ_WRITE_SEEDS").is_ok_and(|value| value == "1");
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut expected: Vec<(&str, String, Vec<u8>)> = Vec::new();
    for (name, bytes) in carve_fuzz::requests::seed_inputs() {
        expected.push(("request", format!("{name}.bin"), bytes));
    }
    let mut example_files: Vec<_> = [examples.clone(), examples.join("command")]
        .iter()
        .flat_map(|folder| std::fs::read_dir(folder).expect("read an examples folder"))
        .map(|entry| entry.expect("an examples entry").path())
        .filter(|path| {
            path.extension()
                .is_some_and(|extension| extension == "toml")
        })
        .collect();
    example_files.sort();
    for path in example_files {
        let text = std::fs::read_to_string(&path).expect("read an example");
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let json =
            match carve_core::command::validate::load_spec_toml(&text).expect("a valid example") {
                carve_core::command::validate::ValidatedSpec::Model(job) => {
                    carve_proto::convert::job_spec_to_json(&job.spec).expect("as JSON")
                }
                carve_core::command::validate::ValidatedSpec::Command(job) => {
                    serde_json::to_string(&job.spec).expect("as JSON")
                }
            };
        expected.push(("spec_toml", format!("{stem}.toml"), text.into_bytes()));
        expected.push(("spec_json", format!("{stem}.json"), json.into_bytes()));
    }
    let mut stale = Vec::new();
    for (target, file, bytes) in expected {
        let path = corpus_directory(target).join(&file);
        if std::fs::read(&path).ok().as_deref() == Some(bytes.as_slice()) {
            continue;
        }
        if write {
            std::fs::create_dir_all(path.parent().unwrap()).expect("a corpus directory");
            std::fs::write(&path, bytes).expect("write a seed");
        } else {
            stale.push(format!("{target}/{file}"));
        }
    }
    assert!(
        stale.is_empty(),
        "seeds missing or out of date in fuzz/corpus (run with CARVE_FUZZ_WRITE_SEEDS=1): {stale:?}"
    );
}
