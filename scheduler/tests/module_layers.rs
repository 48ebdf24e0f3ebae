//! The scheduler's modules depend on one another one way (ARCHITECTURE.md, "The
//! scheduler in code"): the server wires the services, the services (and the wire
//! conversions, `convert.rs`) call the scheduler, the scheduler uses the store, and
//! never the reverse. A reading of `src/` checks it:
//!
//! - every top-level module of the library (`mod name;` in `src/lib.rs`) is in exactly
//!   one layer of [`LAYERS`], and every module a layer names exists;
//! - a file names, through `crate::` (or `super::` past its own module), only its own
//!   module, modules of its own layer and modules of layers below it; a reference to a
//!   layer above fails, naming the file and the line;
//! - the modules' graph has no cycle, within a layer either: a cycle fails, naming one
//!   reference of each of its edges.
//!
//! References are read from the code with comments, string and character literals
//! blanked out, so a doc comment or a message that says `crate::convert` is not one.
//! The binary's own modules (`src/main.rs` and the modules it declares) are left out: its
//! `crate::` is another crate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use carve_testing::source_tree::{code_only, rust_files_under};

/// The layers, top first: a module may use its own layer's modules and those below.
const LAYERS: &[(&str, &[&str])] = &[
    ("the server, which wires everything", &["server"]),
    (
        "the gRPC services and the wire conversions",
        &["services", "convert"],
    ),
    ("the scheduler's state and decisions", &["scheduler"]),
    (
        "what the scheduler uses",
        &["auth", "cache", "compute_pool", "metrics", "queue"],
    ),
    ("the store", &["store"]),
    ("the error type", &["error"]),
];

fn source_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

/// The modules a crate root declares (`mod name;`, `pub mod name;`, `pub(crate) mod
/// name;`), in the code as [`code_only`] leaves it.
fn declared_modules(root_source: &str) -> BTreeSet<String> {
    let code = code_only(root_source);
    code.lines()
        .filter_map(|line| {
            let line = line.trim();
            let rest = line
                .strip_prefix("pub(crate) ")
                .or_else(|| line.strip_prefix("pub "))
                .unwrap_or(line);
            let name = rest.strip_prefix("mod ")?.strip_suffix(';')?.trim();
            Some(name.to_string())
        })
        .collect()
}

/// The crate-level names a file's code refers to, with their 1-based lines: what
/// follows `crate::` (each top-level name of a `crate::{...}` group), and what follows a
/// chain of at least `depth` `super::`s (a file `depth` modules below the crate root
/// reaches the root with that many).
fn crate_references(code: &str, depth: usize) -> Vec<(usize, String)> {
    let tokens = tokenize(code);
    let mut found = Vec::new();
    let mut index = 0;
    while index < tokens.len() {
        let (line, token) = &tokens[index];
        let is_path_start = index == 0 || tokens[index - 1].1 != "::";
        let reaches_root = if !is_path_start {
            None
        } else if token == "crate" {
            Some(index + 1)
        } else if token == "super" {
            let mut at = index;
            let mut supers = 0;
            while tokens.get(at).is_some_and(|(_, token)| token == "super")
                && tokens.get(at + 1).is_some_and(|(_, token)| token == "::")
            {
                supers += 1;
                at += 2;
            }
            (supers >= depth).then_some(at.saturating_sub(1))
        } else {
            None
        };
        if let Some(separator) = reaches_root
            && tokens
                .get(separator)
                .is_some_and(|(_, token)| token == "::")
        {
            match tokens.get(separator + 1) {
                Some((_, open)) if open == "{" => {
                    let mut depth_in_group = 0;
                    let mut expect_name = true;
                    for (group_line, group_token) in &tokens[separator + 1..] {
                        match group_token.as_str() {
                            "{" => {
                                depth_in_group += 1;
                                if depth_in_group == 1 {
                                    expect_name = true;
                                }
                                continue;
                            }
                            "}" => {
                                depth_in_group -= 1;
                                if depth_in_group == 0 {
                                    break;
                                }
                                continue;
                            }
                            "," if depth_in_group == 1 => {
                                expect_name = true;
                                continue;
                            }
                            _ => {}
                        }
                        if depth_in_group == 1 && expect_name {
                            found.push((*group_line, group_token.clone()));
                            expect_name = false;
                        }
                    }
                }
                Some((_, name)) => found.push((*line, name.clone())),
                None => {}
            }
        }
        index += 1;
    }
    found
}

/// Identifiers, `::` and single punctuation characters, with their 1-based lines.
fn tokenize(code: &str) -> Vec<(usize, String)> {
    let mut tokens = Vec::new();
    for (number, line) in code.lines().enumerate() {
        let chars: Vec<char> = line.chars().collect();
        let mut index = 0;
        while index < chars.len() {
            let character = chars[index];
            if character.is_alphanumeric() || character == '_' {
                let start = index;
                while index < chars.len() && (chars[index].is_alphanumeric() || chars[index] == '_')
                {
                    index += 1;
                }
                tokens.push((number + 1, chars[start..index].iter().collect()));
            } else if character == ':' && chars.get(index + 1) == Some(&':') {
                tokens.push((number + 1, "::".to_string()));
                index += 2;
            } else {
                if !character.is_whitespace() {
                    tokens.push((number + 1, character.to_string()));
                }
                index += 1;
            }
        }
    }
    tokens
}

/// One use of another module: `from` (a top-level module) names `to` at `file`:`line`.
#[derive(Debug, Clone)]
struct Reference {
    from: String,
    to: String,
    file: String,
    line: usize,
}

/// Every reference from one top-level module of the library to another.
fn library_references() -> (BTreeSet<String>, Vec<Reference>) {
    let root = source_root();
    let modules = declared_modules(&read(&root.join("lib.rs")));
    let binary_modules = declared_modules(&read(&root.join("main.rs")));
    let mut files = BTreeSet::new();
    rust_files_under(&root, &root, &mut files);
    let mut references = Vec::new();
    for file in files {
        let parts: Vec<&str> = file.split('/').collect();
        let module = parts[0].trim_end_matches(".rs").to_string();
        if file == "lib.rs" || file == "main.rs" || binary_modules.contains(&module) {
            continue;
        }
        assert!(
            modules.contains(&module),
            "src/{file} belongs to no module that src/lib.rs declares"
        );
        // `name.rs` and `name/mod.rs` are the module itself, one below the root.
        let depth = if parts.last() == Some(&"mod.rs") {
            parts.len() - 1
        } else {
            parts.len()
        };
        let code = code_only(&read(&root.join(&file)));
        for (line, name) in crate_references(&code, depth) {
            if name != module && modules.contains(&name) {
                references.push(Reference {
                    from: module.clone(),
                    to: name,
                    file: format!("scheduler/src/{file}"),
                    line,
                });
            }
        }
    }
    (modules, references)
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS
        .iter()
        .position(|(_, modules)| modules.contains(&module))
}

/// The strongly connected components of more than one module (Tarjan's algorithm):
/// each is one or more cycles.
fn cycles(
    modules: &BTreeSet<String>,
    edges: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<Vec<String>> {
    struct Search<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        next_index: usize,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        on_stack: BTreeSet<String>,
        components: Vec<Vec<String>>,
    }
    impl Search<'_> {
        fn visit(&mut self, module: &str) {
            self.index.insert(module.to_string(), self.next_index);
            self.low.insert(module.to_string(), self.next_index);
            self.next_index += 1;
            self.stack.push(module.to_string());
            self.on_stack.insert(module.to_string());
            let targets: Vec<String> = self
                .edges
                .get(module)
                .map(|targets| targets.iter().cloned().collect())
                .unwrap_or_default();
            for target in targets {
                if !self.index.contains_key(&target) {
                    self.visit(&target);
                    let low = self.low[module].min(self.low[&target]);
                    self.low.insert(module.to_string(), low);
                } else if self.on_stack.contains(&target) {
                    let low = self.low[module].min(self.index[&target]);
                    self.low.insert(module.to_string(), low);
                }
            }
            if self.low[module] == self.index[module] {
                let mut component = Vec::new();
                loop {
                    let member = self.stack.pop().expect("the module is on the stack");
                    self.on_stack.remove(&member);
                    let done = member == module;
                    component.push(member);
                    if done {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.components.push(component);
                }
            }
        }
    }
    let mut search = Search {
        edges,
        next_index: 0,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for module in modules {
        if !search.index.contains_key(module) {
            search.visit(module);
        }
    }
    search.components
}

#[test]
fn every_module_is_in_exactly_one_layer() {
    let (modules, _) = library_references();
    let mut problems = Vec::new();
    for module in &modules {
        let layers: Vec<&str> = LAYERS
            .iter()
            .filter(|(_, members)| members.contains(&module.as_str()))
            .map(|(name, _)| *name)
            .collect();
        if layers.len() != 1 {
            problems.push(format!(
                "module `{module}` (src/lib.rs) is in {} layers of LAYERS ({layers:?}); \
                 put it in exactly one",
                layers.len()
            ));
        }
    }
    for (layer, members) in LAYERS {
        for member in *members {
            if !modules.contains(*member) {
                problems.push(format!(
                    "LAYERS names `{member}` ({layer}), which src/lib.rs does not declare"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn no_module_uses_a_layer_above_its_own() {
    let (_, references) = library_references();
    let upward: Vec<String> = references
        .iter()
        .filter_map(|reference| {
            let from = layer_of(&reference.from)?;
            let to = layer_of(&reference.to)?;
            (to < from).then(|| {
                format!(
                    "{}:{}: `{}` ({}) uses `crate::{}` ({}), a layer above it",
                    reference.file,
                    reference.line,
                    reference.from,
                    LAYERS[from].0,
                    reference.to,
                    LAYERS[to].0
                )
            })
        })
        .collect();
    assert!(
        upward.is_empty(),
        "the scheduler's layers run one way (services -> scheduler -> store; \
         scheduler/tests/module_layers.rs):\n{}",
        upward.join("\n")
    );
}

#[test]
fn the_modules_have_no_cycle() {
    let (modules, references) = library_references();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut first_use: BTreeMap<(String, String), &Reference> = BTreeMap::new();
    for reference in &references {
        edges
            .entry(reference.from.clone())
            .or_default()
            .insert(reference.to.clone());
        first_use
            .entry((reference.from.clone(), reference.to.clone()))
            .or_insert(reference);
    }
    let found = cycles(&modules, &edges);
    let described: Vec<String> = found
        .iter()
        .map(|component| {
            let uses: Vec<String> = first_use
                .iter()
                .filter(|((from, to), _)| component.contains(from) && component.contains(to))
                .map(|((from, to), reference)| {
                    format!("  {from} -> {to} ({}:{})", reference.file, reference.line)
                })
                .collect();
            format!("{}:\n{}", component.join(", "), uses.join("\n"))
        })
        .collect();
    assert!(
        found.is_empty(),
        "{} group(s) of modules use one another in a cycle:\n{}",
        found.len(),
        described.join("\n")
    );
}

#[test]
fn references_are_read_from_code_only() {
    let source = r##"
use crate::{auth::Caller, store::{JobRecord, Store}};
use crate::error::SchedulerError;
// use crate::convert::job_to_proto;
/* crate::services */
let text = "crate::server";
let raw = r#"crate::queue "quoted""#;
let quote = '"';
fn f<'a>(x: &'a str) -> &'a str { super::super::metrics::count(); x }
use super::views;
"##;
    let code = code_only(source);
    assert_eq!(code.lines().count(), source.lines().count());
    let names: Vec<(usize, String)> = crate_references(&code, 2);
    assert_eq!(
        names,
        [
            (2, "auth".to_string()),
            (2, "store".to_string()),
            (3, "error".to_string()),
            (9, "metrics".to_string()),
        ]
    );
    // One `super::` from a file one module below the root reaches the root.
    assert_eq!(crate_references(&code, 1).last().unwrap().1, "views");
}
