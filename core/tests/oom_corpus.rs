//! The OOM corpus (`tests/oom_corpus/`, see its README): real framework output, each case
//! labelled fatal or not, classified as the worker classifies a command's end. Every case
//! must come out as labelled: no false alarm, no miss. Run with `--nocapture` for the
//! counts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use carve_core::command::oom::{
    CommandExit, CommandRunEnd, OomSource, classify_command_exit, find_framework_oom,
};

/// The lines of stderr the worker keeps (`carve_worker::command_output::STDERR_TAIL_LINES`;
/// core cannot depend on the worker).
const STDERR_TAIL_LINES: usize = 50;

const GIB: u64 = 1 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Label {
    Fatal,
    NotFatal,
}

#[derive(Debug)]
struct Case {
    name: String,
    label: Label,
    source: Option<OomSource>,
    exit_code: Option<i32>,
    signal: Option<i32>,
    requested_bytes: Option<u64>,
    host_memory_limit_reached: Option<u64>,
    stderr: Vec<String>,
}

fn corpus_directory() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oom_corpus")
}

/// One case file: its header (`key: value` lines), `---`, its stderr.
fn parse_case(name: &str, text: &str) -> Result<Case, String> {
    let (header, stderr) = text
        .split_once("\n---\n")
        .ok_or_else(|| format!("{name}: no `---` line after the header"))?;
    let mut fields = BTreeMap::new();
    for line in header.lines() {
        let (key, value) = line
            .split_once(": ")
            .ok_or_else(|| format!("{name}: header line {line:?} is not `key: value`"))?;
        if fields.insert(key, value.trim()).is_some() {
            return Err(format!("{name}: {key} twice"));
        }
    }
    let known = [
        "framework",
        "label",
        "source",
        "exit",
        "signal",
        "requested_bytes",
        "host_memory_limit_reached",
        "why",
    ];
    if let Some(unknown) = fields.keys().find(|key| !known.contains(key)) {
        return Err(format!("{name}: unknown header field {unknown}"));
    }
    for required in ["framework", "label", "why"] {
        if fields.get(required).is_none_or(|value| value.is_empty()) {
            return Err(format!("{name}: no {required}"));
        }
    }
    let label = match fields["label"] {
        "fatal" => Label::Fatal,
        "not-fatal" => Label::NotFatal,
        other => return Err(format!("{name}: label {other:?} is not fatal or not-fatal")),
    };
    let number = |key: &str| -> Result<Option<u64>, String> {
        fields
            .get(key)
            .map(|value| {
                value
                    .parse::<u64>()
                    .map_err(|error| format!("{name}: {key} {value:?}: {error}"))
            })
            .transpose()
    };
    let exit_code = number("exit")?.map(|code| code as i32);
    let signal = number("signal")?.map(|signal| signal as i32);
    if exit_code.is_some() == signal.is_some() {
        return Err(format!("{name}: exactly one of exit and signal"));
    }
    let source = fields
        .get("source")
        .map(|source| OomSource::from_name(source).map_err(|error| format!("{name}: {error:?}")))
        .transpose()?;
    if (label == Label::Fatal) != source.is_some() {
        return Err(format!(
            "{name}: a fatal case names its source, no other does"
        ));
    }
    Ok(Case {
        name: name.to_string(),
        label,
        source,
        exit_code,
        signal,
        requested_bytes: number("requested_bytes")?,
        host_memory_limit_reached: number("host_memory_limit_reached")?,
        stderr: stderr.lines().map(str::to_string).collect(),
    })
}

fn load_corpus() -> Vec<Case> {
    let mut names: Vec<String> = std::fs::read_dir(corpus_directory())
        .expect("tests/oom_corpus is readable")
        .map(|entry| entry.expect("a directory entry").file_name())
        .map(|name| name.into_string().expect("a UTF-8 file name"))
        .filter(|name| name.ends_with(".txt"))
        .collect();
    names.sort();
    names
        .iter()
        .map(|name| {
            let text = std::fs::read_to_string(corpus_directory().join(name))
                .unwrap_or_else(|error| panic!("{name}: {error}"));
            parse_case(name, &text).unwrap_or_else(|error| panic!("{error}"))
        })
        .collect()
}

/// What is wrong with how `case` was classified, if anything.
fn misclassification(case: &Case) -> Option<String> {
    let skip = case.stderr.len().saturating_sub(STDERR_TAIL_LINES);
    let tail = &case.stderr[skip..];
    let end = classify_command_exit(&CommandExit {
        exit_code: case.exit_code,
        signal: case.signal,
        guard_refusal: None,
        stderr_tail: tail,
        slice_bytes: 80 * GIB,
        peak_bytes: 0,
        host_memory_limit_reached: case.host_memory_limit_reached,
    });
    match (case.label, &end) {
        (Label::Fatal, CommandRunEnd::OutOfMemory { source, .. }) => {
            if Some(*source) != case.source {
                return Some(format!(
                    "{}: an OOM of {source}, labelled {:?}",
                    case.name, case.source
                ));
            }
            let found = find_framework_oom(tail.iter().map(String::as_str))
                .expect("classified as a framework's OOM");
            if case.requested_bytes.is_some() && found.requested_bytes != case.requested_bytes {
                return Some(format!(
                    "{}: requested {:?}, labelled {:?}",
                    case.name, found.requested_bytes, case.requested_bytes
                ));
            }
            None
        }
        (
            Label::NotFatal,
            CommandRunEnd::OutOfMemory {
                source, evidence, ..
            },
        ) => Some(format!(
            "{}: labelled not fatal, read as an OOM of {source}: {evidence}",
            case.name
        )),
        (Label::Fatal, other) => Some(format!("{}: labelled fatal, read as {other:?}", case.name)),
        (Label::NotFatal, _) => None,
    }
}

#[test]
fn every_case_of_the_corpus_is_classified_as_labelled() {
    let corpus = load_corpus();
    let fatal = corpus
        .iter()
        .filter(|case| case.label == Label::Fatal)
        .count();
    let not_fatal = corpus.len() - fatal;
    let wrong: Vec<String> = corpus.iter().filter_map(misclassification).collect();
    println!(
        "OOM corpus: {} cases, {fatal} fatal, {not_fatal} not fatal, {} misclassified",
        corpus.len(),
        wrong.len()
    );
    for line in &wrong {
        println!("  {line}");
    }
    // A corpus that lost its files would pass on nothing.
    assert!(
        fatal >= 20 && not_fatal >= 20,
        "{fatal} fatal, {not_fatal} not fatal"
    );
    assert!(wrong.is_empty(), "misclassified:\n{}", wrong.join("\n"));
}

#[test]
fn every_source_a_framework_can_name_has_a_fatal_case() {
    let corpus = load_corpus();
    for source in [
        OomSource::PyTorch,
        OomSource::TensorFlow,
        OomSource::Jax,
        OomSource::Cudnn,
        OomSource::Cublas,
        OomSource::Cuda,
    ] {
        assert!(
            corpus.iter().any(|case| case.source == Some(source)),
            "no fatal case of {source}"
        );
    }
}

/// A mislabelled case fails the corpus test: each case with its label flipped is
/// reported, so the test cannot pass whatever the labels say.
#[test]
fn a_flipped_label_is_caught() {
    for case in load_corpus() {
        let flipped = Case {
            label: match case.label {
                Label::Fatal => Label::NotFatal,
                Label::NotFatal => Label::Fatal,
            },
            source: match case.label {
                Label::Fatal => None,
                Label::NotFatal => Some(OomSource::PyTorch),
            },
            ..case
        };
        assert!(
            misclassification(&flipped).is_some(),
            "{} passes with its label flipped",
            flipped.name
        );
    }
}

#[test]
fn a_malformed_case_is_refused() {
    let good = "framework: x\nlabel: fatal\nsource: pytorch\nexit: 1\nwhy: y\n---\nline\n";
    assert!(parse_case("good", good).is_ok());
    for (broken, expected) in [
        (good.replace("---", "--"), "no `---`"),
        (
            good.replace("label: fatal", "label: maybe"),
            "not fatal or not-fatal",
        ),
        (good.replace("source: pytorch\n", ""), "names its source"),
        (good.replace("exit: 1", "signal: 9\nexit: 1"), "exactly one"),
        (good.replace("why: y\n", ""), "no why"),
        (
            good.replace("framework", "framwork"),
            "unknown header field",
        ),
        (good.replace("source: pytorch", "source: abacus"), "abacus"),
    ] {
        let error = parse_case("broken", &broken).expect_err(&broken);
        assert!(error.contains(expected), "{error}");
    }
}
