//! What the tests of the local `carve` commands (estimate, run, sim) share: running the
//! real binary, checking that it succeeded, and writing its input files.

use std::path::Path;
use std::process::{Command, Output};

/// Runs the real `carve` binary with `arguments`.
pub fn carve(arguments: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(arguments)
        .output()
        .expect("the carve binary runs")
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
