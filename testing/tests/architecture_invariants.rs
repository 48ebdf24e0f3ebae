//! ARCHITECTURE.md's invariants that a reading of the source can check, checked:
//!
//! - `unsafe_code` is denied workspace-wide, and the invariant's nested list names every
//!   file that allows it anyway (a path, or a directory ending in `/` for a whole crate
//!   that allows it at its root). A file that allows it without being listed fails, and
//!   so does a listed file or directory that no longer allows it, so the list is the
//!   audit's starting point and stays exact.
//! - Every `carve` exit code is chosen in `cli/src/client/failure.rs`: no other file of
//!   `cli/src/` writes an exit number (`ExitCode::from(3)`, `ExitCode::FAILURE`,
//!   `process::exit(1)`); they name a `FailureKind` instead.
//! - A plan's phases, as core's module doc and ARCHITECTURE.md count and name them, are
//!   `StepPlan`'s lists of plan steps.
//!
//! "Allows" means a lint attribute (`allow`, `expect` or `warn`, inner or outer, in
//! `cfg_attr` too) whose list holds `unsafe_code`, outside `//` comments.

use std::collections::BTreeSet;
use std::path::Path;

use carve_testing::source_tree::{code_only, rust_files_under, workspace_members, workspace_root};

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

/// Every Rust file of every workspace member: `src/`, `tests/`, `benches/`, build scripts.
fn workspace_rust_files(root: &Path) -> BTreeSet<String> {
    let members = workspace_members(&read(&root.join("Cargo.toml")));
    assert!(
        members.len() >= 5,
        "read only {members:?} as workspace members"
    );
    let mut files = BTreeSet::new();
    for member in members {
        rust_files_under(root, &root.join(member), &mut files);
    }
    files
}

/// The numbered lines of `source`'s code (see [`code_only`]).
fn code_lines(source: &str) -> Vec<(usize, String)> {
    code_only(source)
        .lines()
        .enumerate()
        .map(|(index, line)| (index + 1, line.to_string()))
        .collect()
}

fn is_identifier_character(character: char) -> bool {
    character.is_alphanumeric() || character == '_'
}

/// Whether `source` has a lint attribute that lets `unsafe_code` through: the word
/// `unsafe_code` inside the parentheses of `allow`, `expect` or `warn`, possibly after
/// other lints (`allow(dead_code, unsafe_code)`), the attribute on one or several lines.
fn allows_unsafe_code(source: &str) -> bool {
    let code = code_only(source);
    let lint = "unsafe_code";
    let mut from = 0;
    while let Some(offset) = code[from..].find(lint) {
        let start = from + offset;
        from = start + lint.len();
        let after = code[from..].chars().next();
        if after.is_some_and(is_identifier_character) {
            continue;
        }
        // Back over the list before it (other lint names, commas, spaces) to its `(`.
        let before = code[..start].trim_end_matches(|character: char| {
            is_identifier_character(character)
                || character == ','
                || character == ':'
                || character.is_whitespace()
        });
        let Some(before_list) = before.strip_suffix('(') else {
            continue;
        };
        let level = before_list
            .trim_end()
            .rsplit(|character: char| !is_identifier_character(character))
            .next()
            .unwrap_or_default();
        if matches!(level, "allow" | "expect" | "warn") {
            return true;
        }
    }
    false
}

/// The paths listed in the nested bullets of ARCHITECTURE.md's invariant that begins
/// "- `unsafe_code` is denied": every backticked word with a `/` that ends in `.rs`
/// (a file) or `/` (a directory, all of it).
fn listed_unsafe_exceptions(architecture: &str) -> Vec<String> {
    let mut lines = architecture
        .lines()
        .skip_while(|line| !line.starts_with("- `unsafe_code` is denied"));
    lines
        .next()
        .expect("ARCHITECTURE.md has the invariant \"- `unsafe_code` is denied workspace-wide\"");
    let bullet: Vec<&str> = lines
        .take_while(|line| line.starts_with(char::is_whitespace) && !line.trim().is_empty())
        .collect();
    let list_start = bullet
        .iter()
        .position(|line| line.trim_start().starts_with("- "))
        .expect("the unsafe_code invariant lists its exceptions as nested bullets");
    bullet[list_start..]
        .join(" ")
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|word| word.contains('/') && (word.ends_with(".rs") || word.ends_with('/')))
        .map(str::to_string)
        .collect()
}

/// What is wrong between the files that allow unsafe code and the list that should name
/// them: unlisted files, and listed paths that allow nothing (any more).
fn unsafe_list_problems(allowing: &BTreeSet<String>, listed: &[String]) -> Vec<String> {
    let covers = |entry: &String, file: &String| {
        if entry.ends_with('/') {
            file.starts_with(entry.as_str())
        } else {
            file == entry
        }
    };
    let mut problems = Vec::new();
    for file in allowing {
        if !listed.iter().any(|entry| covers(entry, file)) {
            problems.push(format!(
                "{file} allows unsafe_code but ARCHITECTURE.md's list of exceptions does not name it (add it, saying why, or remove the allow)"
            ));
        }
    }
    for entry in listed {
        if !allowing.iter().any(|file| covers(entry, file)) {
            problems.push(format!(
                "ARCHITECTURE.md lists {entry} as an unsafe_code exception, but no file there allows it (take it off the list)"
            ));
        }
    }
    problems
}

#[test]
fn every_file_that_allows_unsafe_code_is_in_architecture_md_and_every_listed_one_does() {
    let root = workspace_root();
    let architecture = read(&root.join("ARCHITECTURE.md"));
    let cargo_toml = read(&root.join("Cargo.toml"));
    assert!(
        cargo_toml.contains("[workspace.lints.rust]\nunsafe_code = \"deny\""),
        "the workspace denies unsafe_code in [workspace.lints.rust]"
    );
    let allowing: BTreeSet<String> = workspace_rust_files(&root)
        .into_iter()
        .filter(|file| allows_unsafe_code(&read(&root.join(file))))
        .collect();
    assert!(
        allowing.contains("engine/src/kernels/gemm.rs"),
        "the scan found {allowing:?}, not even gemm.rs"
    );
    let listed = listed_unsafe_exceptions(&architecture);
    let problems = unsafe_list_problems(&allowing, &listed);
    assert!(
        problems.is_empty(),
        "ARCHITECTURE.md's unsafe_code exceptions are out of date:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn every_member_inherits_the_workspace_lints() {
    let root = workspace_root();
    let mut problems = Vec::new();
    for member in workspace_members(&read(&root.join("Cargo.toml"))) {
        let manifest = read(&root.join(&member).join("Cargo.toml"));
        if !manifest.contains("[lints]\nworkspace = true") {
            problems.push(format!(
                "{member}/Cargo.toml lacks `[lints]\\nworkspace = true`, so unsafe_code is not denied there"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The places in `source` that write a process exit number rather than naming a
/// `FailureKind`: `ExitCode::from(<number>`, `ExitCode::FAILURE`, `exit(<number>`.
fn numeric_exit_codes(source: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (number, line) in code_lines(source) {
        let starts_with_a_number = |rest: &str| {
            rest.trim_start()
                .starts_with(|character: char| character.is_ascii_digit() || character == '-')
        };
        let from_number = line
            .match_indices("ExitCode::from(")
            .any(|(index, call)| starts_with_a_number(&line[index + call.len()..]));
        let exit_number = line.match_indices("exit(").any(|(index, call)| {
            let bare = !line[..index]
                .chars()
                .next_back()
                .is_some_and(is_identifier_character);
            bare && starts_with_a_number(&line[index + call.len()..])
        });
        if from_number || exit_number || line.contains("ExitCode::FAILURE") {
            found.push((number, line.trim().to_string()));
        }
    }
    found
}

#[test]
fn every_carve_exit_code_is_chosen_in_failure_rs() {
    let root = workspace_root();
    let mut files = BTreeSet::new();
    rust_files_under(&root, &root.join("cli/src"), &mut files);
    assert!(files.contains("cli/src/client/failure.rs"));
    let mut problems = Vec::new();
    for file in files
        .iter()
        .filter(|file| *file != "cli/src/client/failure.rs")
    {
        for (line, text) in numeric_exit_codes(&read(&root.join(file))) {
            problems.push(format!("{file}:{line}: {text}"));
        }
    }
    assert!(
        problems.is_empty(),
        "exit numbers written outside cli/src/client/failure.rs (name a FailureKind: \
         `ExitCode::from(FailureKind::OutOfMemory)`, adding a kind there if none fits):\n  {}",
        problems.join("\n  ")
    );
}

/// The phases of a step plan: the fields of `StepPlan` that are lists of plan steps.
fn step_plan_phases(plan_rs: &str) -> Vec<String> {
    let body = plan_rs
        .split_once("pub struct StepPlan {")
        .expect("core/src/plan.rs defines StepPlan")
        .1
        .split_once("\n}")
        .expect("StepPlan's body ends")
        .0;
    body.lines()
        .filter_map(|line| {
            line.trim()
                .strip_prefix("pub ")?
                .strip_suffix(": Vec<PlanStep>,")
                .map(str::to_string)
        })
        .collect()
}

#[test]
fn a_plans_phases_are_counted_and_named_as_step_plan_has_them() {
    const COUNTS: [&str; 8] = [
        "zero", "one", "two", "three", "four", "five", "six", "seven",
    ];
    let root = workspace_root();
    let plan_rs = read(&root.join("core/src/plan.rs"));
    let phases = step_plan_phases(&plan_rs);
    assert!(
        phases.len() >= 3 && phases.contains(&"micro_batch".to_string()),
        "read {phases:?} as StepPlan's phases"
    );
    let count = COUNTS[phases.len()];
    let words = |text: &str| text.split_whitespace().collect::<Vec<_>>().join(" ");
    let architecture = words(&read(&root.join("ARCHITECTURE.md")));
    let module_doc = words(
        &plan_rs
            .lines()
            .filter_map(|line| line.strip_prefix("//!"))
            .collect::<Vec<_>>()
            .join("\n"),
    );
    let mut problems = Vec::new();
    for (name, text) in [
        ("core/src/plan.rs's module doc", &module_doc),
        ("ARCHITECTURE.md", &architecture),
    ] {
        if !text.contains(&format!("{count} phases")) {
            problems.push(format!("{name} does not say \"{count} phases\""));
        }
        for other in COUNTS.iter().filter(|other| **other != count) {
            if text.contains(&format!("{other} phases")) {
                problems.push(format!(
                    "{name} says \"{other} phases\"; StepPlan has {count}: {phases:?}"
                ));
            }
        }
    }
    let memory_model = architecture
        .split_once("## The memory model in code")
        .expect("ARCHITECTURE.md has a memory model section")
        .1
        .split(" ## ")
        .next()
        .unwrap_or_default();
    for phase in &phases {
        if !module_doc.contains(&format!("- `{phase}`")) {
            problems.push(format!(
                "core/src/plan.rs's module doc does not list `{phase}`"
            ));
        }
        if !memory_model.contains(&format!("`{phase}`")) {
            problems.push(format!(
                "ARCHITECTURE.md's memory model section does not name `{phase}`"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_unsafe_scan_reads_attributes_not_words() {
    assert!(allows_unsafe_code("#![allow(unsafe_code)]\nfn f() {}"));
    assert!(allows_unsafe_code("#[allow(unsafe_code)]\nfn f() {}"));
    assert!(allows_unsafe_code("#![allow(unsafe_code, dead_code)]"));
    assert!(allows_unsafe_code("#![allow(dead_code, unsafe_code)]"));
    assert!(allows_unsafe_code(
        "#[expect(\n    unsafe_code,\n    reason = \"x\"\n)]"
    ));
    assert!(allows_unsafe_code("#[cfg_attr(test, allow(unsafe_code))]"));
    assert!(allows_unsafe_code("#![allow(unsafe_code)] // FFI"));
    assert!(!allows_unsafe_code(
        "// The workspace denies `unsafe_code`."
    ));
    assert!(!allows_unsafe_code("//! #![allow(unsafe_code)] in a doc"));
    assert!(!allows_unsafe_code("#![deny(unsafe_code)]"));
    assert!(!allows_unsafe_code("#![allow(unsafe_code_x)]"));
    assert!(!allows_unsafe_code("let x = find(\"unsafe_code\");"));
    assert!(!allows_unsafe_code(
        "let help = \"#![allow(unsafe_code)]\";"
    ));
    assert!(!allows_unsafe_code(
        "let help = r#\"#![allow(unsafe_code)]\"#;"
    ));
    assert!(!allows_unsafe_code(
        "/* #![allow(unsafe_code)] */ fn f() {}"
    ));
    assert!(allows_unsafe_code(
        "let q = '\"'; let s = \"\\\"\"; #![allow(unsafe_code)]"
    ));
    assert!(allows_unsafe_code(
        "fn f<'a>(x: &'a str) {}\n#[allow(unsafe_code)]"
    ));
}

#[test]
fn the_unsafe_list_is_read_from_the_nested_bullets_and_compared_both_ways() {
    let architecture = "\
## Invariants
- Something else `a/b.rs`.
- `unsafe_code` is denied workspace-wide; `testing/tests/x.rs` checks
  the list:
  - `engine/src/gemm.rs`, a wrapper;
  - the fake driver, `fake/` whole (`fake/src/lib.rs` at its root), `not a path`;
- Next invariant `c/d.rs`.
";
    let listed = listed_unsafe_exceptions(architecture);
    assert_eq!(listed, ["engine/src/gemm.rs", "fake/", "fake/src/lib.rs"]);

    let allowing: BTreeSet<String> = ["engine/src/gemm.rs", "fake/src/lib.rs", "fake/tests/a.rs"]
        .map(String::from)
        .into();
    assert!(unsafe_list_problems(&allowing, &listed).is_empty());

    let with_a_new_file = allowing
        .iter()
        .cloned()
        .chain(["cli/src/main.rs".to_string()])
        .collect();
    let problems = unsafe_list_problems(&with_a_new_file, &listed);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].starts_with("cli/src/main.rs allows"));

    let without_gemm = allowing
        .iter()
        .filter(|file| !file.contains("gemm"))
        .cloned()
        .collect();
    let problems = unsafe_list_problems(&without_gemm, &listed);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("lists engine/src/gemm.rs"));
}

#[test]
fn the_exit_code_scan_finds_numbers_not_kinds() {
    let source = "\
fn a() -> ExitCode { ExitCode::from(130) }
fn b() -> ExitCode { ExitCode::from( 3 ) }
fn c() { std::process::exit(2) }
fn d() -> ExitCode { ExitCode::FAILURE }
fn e() -> ExitCode { ExitCode::from(FailureKind::OutOfMemory) }
fn f() -> ExitCode { ExitCode::SUCCESS }
fn g() -> Result<ExitCode> { job_exit(1) }
// ExitCode::from(3) in a comment
";
    let lines: Vec<usize> = numeric_exit_codes(source)
        .into_iter()
        .map(|(line, _)| line)
        .collect();
    assert_eq!(lines, [1, 2, 3, 4]);
}
