//! What the tests of the local `carve` commands (estimate, run, sim) share: running the
//! real binary (with a stdin, if need be), checking that it succeeded, and writing its input
//! files (IDX data among them).

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

/// An IDX file: a big-endian magic number and dimensions (the header), then the bytes.
#[allow(dead_code, reason = "not every test file reads IDX data")]
fn idx_file(magic: u32, dimensions: &[u32], payload: &[u8]) -> Vec<u8> {
    std::iter::once(magic)
        .chain(dimensions.iter().copied())
        .flat_map(u32::to_be_bytes)
        .chain(payload.iter().copied())
        .collect()
}

/// A 4x4 job on IDX files named by relative paths (`digits/…`, see [`write_idx_digits`]).
#[allow(dead_code, reason = "not every test file reads IDX data")]
pub const RELATIVE_IDX_JOB: &str = "name = \"relative-idx\"\n[model]\ninput_shape = [4, 4, 1]\nloss = \"softmax_cross_entropy\"\nlayers = [{ flatten = {} }, { dense = { units = 2 } }]\n[training]\nbatch_size = 4\nsteps = 2\noptimizer = { sgd = { learning_rate = 0.1 } }\n[data]\nformat = \"idx\"\ntrain = { images = \"digits/images\", labels = \"digits/labels\" }\n";

/// Writes the eight 4x4 images and labels of [`RELATIVE_IDX_JOB`] to `directory/digits/`.
#[allow(dead_code, reason = "not every test file reads IDX data")]
pub fn write_idx_digits(directory: &Path) {
    let digits = directory.join("digits");
    std::fs::create_dir(&digits).unwrap();
    let pixels: Vec<u8> = (0..8 * 16).map(|index| (index * 7 % 256) as u8).collect();
    std::fs::write(digits.join("images"), idx_file(0x0803, &[8, 4, 4], &pixels)).unwrap();
    std::fs::write(
        digits.join("labels"),
        idx_file(0x0801, &[8], &[0, 1, 0, 1, 0, 1, 0, 1]),
    )
    .unwrap();
}
