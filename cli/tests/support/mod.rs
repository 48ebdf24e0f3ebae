//! What the tests of the local `carve` commands (estimate, run, sim) share: running the
//! real binary (with a stdin, if need be), checking that it succeeded, and writing its input files.
//! The client commands' tests share `carve dev` ([`dev_cluster`]).

pub mod dev_cluster;

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// Runs the real `carve` binary with `arguments`.
pub fn carve(arguments: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(arguments)
        .output()
        .expect("the carve binary runs")
}

/// Runs the real `carve` binary with `arguments` in `directory`, `stdin` as its stdin.
#[allow(dead_code, reason = "not every test file gives carve a stdin")]
pub fn carve_with_stdin(arguments: &[&str], directory: &Path, stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(arguments)
        .current_dir(directory)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the carve binary runs");
    // Written whole and closed before waiting, so carve sees the end of its input.
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// The stdout of a `carve` that exited 0; fails the test with its exit status and
/// stderr otherwise.
pub fn succeeded(output: &Output) -> &[u8] {
    assert!(
        output.status.success(),
        "exit {:?}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    &output.stdout
}

/// Writes `contents` to the file `name` in `directory`; returns its path as the text a
/// command line takes.
pub fn write_file(directory: &Path, name: &str, contents: impl AsRef<[u8]>) -> String {
    let path = directory.join(name);
    std::fs::write(&path, contents).unwrap();
    path.to_str().unwrap().to_string()
}
