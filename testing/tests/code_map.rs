//! ARCHITECTURE.md's code map stays true: every source file of every workspace member
//! appears in it, and every source path it names exists.
//!
//! The rule, kept simple so a failure says exactly what to write:
//!
//! - The code map is the first fenced block after the `## Code map` heading. A member's
//!   block starts at the line that begins (in column 0) with the member's directory and a
//!   slash (`scheduler/`) and runs to the next line that begins in column 0.
//! - Source files are the `.rs` files under each member's `src/` (the members listed in
//!   the workspace's `Cargo.toml`; `tests/`, `benches/` and `examples/` are not checked).
//! - A file is covered when its member's block names its path from the member's
//!   directory as one word (`src/store/logs.rs`), or names one of its ancestor
//!   directories (`src/store/` covers everything under it). A module may be named either
//!   way: `src/scheduler.rs` covers the files under `src/scheduler/`, and `src/scheduler/`
//!   covers `src/scheduler.rs`. `src/lib.rs` and `src/main.rs` are the crate itself, which
//!   the block's first line describes. A bare file name (`logs.rs`) does not count: several
//!   directories hold an `error.rs` or a `mod.rs`.
//! - Every word of a block that starts with `src/` must name a file or directory that
//!   exists (with the same module equivalence), so the map does not keep moved files.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use carve_testing::source_tree::{workspace_members, workspace_root};

/// The lines of the first fenced block after `## Code map`.
fn code_map_lines(architecture: &str) -> Vec<&str> {
    let after_heading = architecture
        .split_once("## Code map")
        .expect("ARCHITECTURE.md has a `## Code map` section")
        .1;
    let mut lines = after_heading
        .lines()
        .skip_while(|line| !line.starts_with("```"));
    lines
        .next()
        .expect("the code map section has a fenced block");
    lines.take_while(|line| !line.starts_with("```")).collect()
}

/// The words of one member's block: whitespace-separated, without surrounding
/// punctuation (backticks, parentheses, commas, colons, ...).
fn member_block_words(code_map: &[&str], member: &str) -> Option<BTreeSet<String>> {
    let header = format!("{member}/");
    let start = code_map
        .iter()
        .position(|line| line.split_whitespace().next() == Some(header.as_str()))?;
    let block_end = code_map[start + 1..]
        .iter()
        .position(|line| !line.is_empty() && !line.starts_with(char::is_whitespace))
        .map_or(code_map.len(), |offset| start + 1 + offset);
    let words = code_map[start..block_end]
        .iter()
        .flat_map(|line| line.split_whitespace())
        .map(|word| {
            word.trim_matches(|character: char| {
                !(character.is_alphanumeric() || matches!(character, '_' | '/' | '.' | '-'))
            })
            .trim_end_matches(['.', ':'])
            .to_string()
        })
        .filter(|word| !word.is_empty())
        .collect();
    Some(words)
}

fn rust_files_under(directory: &Path, found: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(directory)
        .unwrap_or_else(|error| panic!("reading {}: {error}", directory.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files_under(&path, found);
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            found.push(path);
        }
    }
}

/// The words that cover `relative` (a path like `src/store/logs.rs`, with `/`).
fn covering_words(relative: &str) -> Vec<String> {
    let mut words = vec![relative.to_string()];
    // A module file `src/a.rs` and its directory `src/a/` name the same module.
    if let Some(module) = relative.strip_suffix(".rs") {
        words.push(format!("{module}/"));
    }
    let components: Vec<&str> = relative.split('/').collect();
    for depth in 2..components.len() {
        let ancestor = components[..depth].join("/");
        words.push(format!("{ancestor}/"));
        words.push(format!("{ancestor}.rs"));
    }
    words
}

fn named_path_exists(member_directory: &Path, word: &str) -> bool {
    if member_directory.join(word).exists() {
        return true;
    }
    if let Some(module) = word.strip_suffix(".rs") {
        return member_directory.join(module).is_dir();
    }
    if let Some(module) = word.strip_suffix('/') {
        return member_directory.join(format!("{module}.rs")).is_file();
    }
    false
}

#[test]
fn every_source_file_is_in_the_code_map_and_every_named_path_exists() {
    let root = workspace_root();
    let cargo_toml = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
    let architecture =
        std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let code_map = code_map_lines(&architecture);
    let members = workspace_members(&cargo_toml);
    assert!(
        members.len() >= 5,
        "read only {members:?} as workspace members"
    );

    let mut problems = Vec::new();
    for member in &members {
        let member_directory = root.join(member);
        let Some(words) = member_block_words(&code_map, member) else {
            problems.push(format!(
                "{member}/ has no block in ARCHITECTURE.md's code map"
            ));
            continue;
        };
        let source_directory = member_directory.join("src");
        let mut files = Vec::new();
        if source_directory.is_dir() {
            rust_files_under(&source_directory, &mut files);
        }
        files.sort();
        for file in files {
            let relative = file
                .strip_prefix(&member_directory)
                .expect("under the member")
                .components()
                .map(|component| component.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            if relative == "src/lib.rs" || relative == "src/main.rs" {
                continue;
            }
            if !covering_words(&relative)
                .iter()
                .any(|word| words.contains(word))
            {
                problems.push(format!(
                    "{member}/{relative} is not in the code map (name it, or a directory above it, in the {member}/ block)"
                ));
            }
        }
        for word in words.iter().filter(|word| word.starts_with("src/")) {
            if !named_path_exists(&member_directory, word) {
                problems.push(format!(
                    "the code map's {member}/ block names {word}, which does not exist"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "ARCHITECTURE.md's code map is out of date:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_rule_reads_modules_either_way_and_ignores_bare_names() {
    let code_map = [
        "scheduler/      carve-scheduler",
        "  src/scheduler.rs   the live state (logs.rs: not a path)",
        "  src/store/         sqlx, (`src/auth.rs`),",
        "worker/         carve-worker",
    ];
    let words = member_block_words(&code_map, "scheduler").expect("a scheduler block");
    let covered = |relative: &str| {
        covering_words(relative)
            .iter()
            .any(|word| words.contains(word))
    };
    assert!(covered("src/scheduler.rs"));
    assert!(covered("src/scheduler/admission.rs"));
    assert!(covered("src/store/jobs.rs"));
    assert!(covered("src/store/nested/deeper.rs"));
    assert!(covered("src/auth.rs"));
    assert!(!covered("src/logs.rs"));
    assert!(!covered("src/worker.rs"), "the next block is not this one");

    let only_a_file = ["scheduler/ x", "  src/store/logs.rs  the log lines"];
    let words = member_block_words(&only_a_file, "scheduler").expect("a scheduler block");
    let covered_by_file_only = covering_words("src/store/jobs.rs")
        .iter()
        .any(|word| words.contains(word));
    assert!(
        !covered_by_file_only,
        "naming one file of a directory covers only that file"
    );
}

#[test]
fn members_are_read_from_the_workspace_manifest() {
    let manifest = "[workspace]\nresolver = \"3\"\nmembers = [\"core\", \"proto\",\n \"cli\"]\nexclude = [\"x\"]\n";
    assert_eq!(workspace_members(manifest), ["core", "proto", "cli"]);
}
