//! The workspace's own source, as the tests that keep ARCHITECTURE.md's rules true read
//! it: where the workspace is, its members, its Rust files, and a file's code without its
//! comments and literals (so text that merely mentions a rule does not trip it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The workspace's root directory (carve-testing lives one directory below it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("carve-testing lives one directory below the workspace root")
        .to_path_buf()
}

/// The `members = [...]` list of the workspace's Cargo.toml, read without a TOML parser
/// (the list is one array of plain strings).
pub fn workspace_members(cargo_toml: &str) -> Vec<String> {
    let start = cargo_toml
        .find("members")
        .expect("the workspace Cargo.toml has a members list");
    let open = start + cargo_toml[start..].find('[').expect("members is an array");
    let close = open
        + cargo_toml[open..]
            .find(']')
            .expect("members array is closed");
    cargo_toml[open + 1..close]
        .split(',')
        .map(|entry| entry.trim().trim_matches('"').to_string())
        .filter(|entry| !entry.is_empty())
        .collect()
}

/// Every `.rs` file under `directory` (build outputs in `target/` left out), as paths
/// from `root` written with `/`.
pub fn rust_files_under(root: &Path, directory: &Path, found: &mut BTreeSet<String>) {
    let entries = std::fs::read_dir(directory)
        .unwrap_or_else(|error| panic!("reading {}: {error}", directory.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            if path.file_name().is_some_and(|name| name == "target") {
                continue;
            }
            rust_files_under(root, &path, found);
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            let relative = path.strip_prefix(root).expect("under the root");
            found.insert(
                relative
                    .components()
                    .map(|component| component.as_os_str().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join("/"),
            );
        }
    }
}

/// `source` with comments, string literals and character literals replaced by spaces
/// (line breaks kept, so line numbers still hold). Lifetimes (`'a`) stay.
pub fn code_only(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let blank = |out: &mut String, character: char| {
        out.push(if character == '\n' { '\n' } else { ' ' });
    };
    let mut index = 0;
    while index < chars.len() {
        let character = chars[index];
        let next = chars.get(index + 1).copied();
        let previous_is_identifier =
            index > 0 && (chars[index - 1].is_alphanumeric() || chars[index - 1] == '_');
        if character == '/' && next == Some('/') {
            while index < chars.len() && chars[index] != '\n' {
                blank(&mut out, chars[index]);
                index += 1;
            }
        } else if character == '/' && next == Some('*') {
            let mut depth = 0;
            while index < chars.len() {
                if chars[index] == '/' && chars.get(index + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    index += 2;
                } else if chars[index] == '*' && chars.get(index + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    index += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, chars[index]);
                    index += 1;
                }
            }
        } else if !previous_is_identifier
            && (character == 'r' || character == 'b')
            && raw_string_hashes(&chars, index).is_some()
        {
            // r"..", r#".."#, br"..": no escapes; ends at a quote and as many hashes.
            let (start, hashes) = raw_string_hashes(&chars, index).expect("checked");
            for &skipped in &chars[index..start + 1] {
                blank(&mut out, skipped);
            }
            index = start + 1;
            while index < chars.len() {
                if chars[index] == '"'
                    && chars[index + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&hash| hash == '#')
                        .count()
                        == hashes
                {
                    for _ in 0..=hashes {
                        out.push(' ');
                    }
                    index += 1 + hashes;
                    break;
                }
                blank(&mut out, chars[index]);
                index += 1;
            }
        } else if character == '"' {
            out.push(' ');
            index += 1;
            while index < chars.len() && chars[index] != '"' {
                if chars[index] == '\\' {
                    blank(&mut out, chars[index]);
                    index += 1;
                }
                if index < chars.len() {
                    blank(&mut out, chars[index]);
                    index += 1;
                }
            }
            out.push(' ');
            index += 1;
        } else if character == '\'' && next == Some('\\') {
            // An escaped character literal: '\n', '\'', '\u{..}'.
            out.push_str("  ");
            index += 2;
            while index < chars.len() && chars[index] != '\'' {
                blank(&mut out, chars[index]);
                index += 1;
            }
            out.push(' ');
            index += 1;
        } else if character == '\'' && chars.get(index + 2) == Some(&'\'') {
            // A plain character literal: 'x', '"'.
            out.push_str("   ");
            index += 3;
        } else {
            out.push(character);
            index += 1;
        }
    }
    out
}

/// Where a raw string literal starting at `index` opens: the index of its opening quote
/// and its number of hashes, or `None` when none starts there.
fn raw_string_hashes(chars: &[char], index: usize) -> Option<(usize, usize)> {
    let mut at = index;
    if chars.get(at) == Some(&'b') {
        at += 1;
    }
    if chars.get(at) != Some(&'r') {
        return None;
    }
    at += 1;
    let mut hashes = 0;
    while chars.get(at) == Some(&'#') {
        hashes += 1;
        at += 1;
    }
    (chars.get(at) == Some(&'"')).then_some((at, hashes))
}
