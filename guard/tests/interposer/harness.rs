//! Running the probe under the guard: the fake driver's library directory, the guard's
//! environment, a timeout, and reading the probe's JSON lines.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use carve_guard_account::{ENV_ACCOUNT, ENV_LIMIT_BYTES, ENV_OOM_RECORD};

pub const MIB: u64 = 1 << 20;
const CHILD_TIMEOUT: Duration = Duration::from_secs(60);

/// The directory of this test binary: `target/<profile>/deps/`, where cargo writes both
/// shared libraries.
fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().expect("deps directory").to_path_buf()
}

pub fn guard_library() -> PathBuf {
    deps_dir().join("libcarve_guard.so")
}

/// Checks once that `deps/libcarve_guard.so` is this crate's build: cdylib names carry no
/// hash, so another checkout building into the same target directory replaces it.
fn assert_guard_is_this_build() {
    static CHECKED: std::sync::Once = std::sync::Once::new();
    CHECKED.call_once(|| {
        let library = guard_library();
        assert!(library.exists(), "{} is missing", library.display());
        assert!(
            exported_symbols(&library)
                .iter()
                .any(|symbol| symbol == "carve_guard_hook_entry"),
            "{} is not this checkout's guard (another build replaced it?)",
            library.display()
        );
    });
}

/// One case's world: a temporary directory holding the fake driver's symlinks, the
/// account and the OOM record.
pub struct World {
    pub dir: tempfile::TempDir,
    pub limit_bytes: u64,
    pub fake_total_bytes: u64,
}

impl World {
    pub fn new(limit_bytes: u64) -> World {
        let dir = tempfile::tempdir().expect("temporary directory");
        let fake = deps_dir().join("libcarve_fake_driver.so");
        assert!(
            fake.exists(),
            "{} is missing: cargo did not build the fake driver",
            fake.display()
        );
        assert_guard_is_this_build();
        let libraries = dir.path().join("lib");
        std::fs::create_dir(&libraries).expect("lib directory");
        for name in [
            "libcuda.so.1",
            "libcuda.so",
            "libnvidia-ml.so.1",
            "libnvidia-ml.so",
        ] {
            std::os::unix::fs::symlink(&fake, libraries.join(name)).expect("symlink");
        }
        World {
            dir,
            limit_bytes,
            fake_total_bytes: 1 << 30,
        }
    }

    pub fn account_path(&self) -> PathBuf {
        self.dir.path().join("account")
    }

    pub fn oom_record_path(&self) -> PathBuf {
        self.dir.path().join("oom.jsonl")
    }

    /// The probe with the guard's full environment.
    pub fn probe(&self, operations: &[&str]) -> Command {
        self.with_guard(self.bare_probe(operations))
    }

    /// `command` with the guard preloaded and its variables set for this world.
    pub fn with_guard(&self, mut command: Command) -> Command {
        command
            .env("LD_PRELOAD", guard_library())
            .env(ENV_LIMIT_BYTES, self.limit_bytes.to_string())
            .env(ENV_ACCOUNT, self.account_path())
            .env(ENV_OOM_RECORD, self.oom_record_path());
        command
    }

    /// The probe against the fake driver, without the guard or its variables.
    pub fn bare_probe(&self, operations: &[&str]) -> Command {
        let mut command = self.program(std::env::current_exe().expect("test binary"));
        command.arg("probe").args(operations);
        command
    }

    /// `program` against the fake driver (first on `LD_LIBRARY_PATH`), without the guard
    /// or its variables, its output piped.
    pub fn program(&self, program: impl AsRef<OsStr>) -> Command {
        let mut command = Command::new(program);
        command
            .env_remove("LD_PRELOAD")
            .env_remove(ENV_LIMIT_BYTES)
            .env_remove(ENV_ACCOUNT)
            .env_remove(ENV_OOM_RECORD)
            .env("LD_LIBRARY_PATH", self.dir.path().join("lib"))
            .env(
                "CARVE_FAKE_CUDA_TOTAL_BYTES",
                self.fake_total_bytes.to_string(),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    }

    pub fn oom_record(&self) -> Vec<carve_guard_account::OomRecordLine> {
        let text = std::fs::read_to_string(self.oom_record_path()).unwrap_or_default();
        carve_guard_account::OomRecordLine::parse_record(&text).expect("OOM record parses")
    }
}

/// What a finished probe printed.
#[derive(Debug)]
pub struct Output {
    pub success: bool,
    /// `None` when a signal ended it.
    pub exit_code: Option<i32>,
    pub lines: Vec<String>,
    pub stderr: String,
}

impl Output {
    /// The lines of operation `op`, in order.
    pub fn op(&self, op: &str) -> Vec<&str> {
        let tag = format!("\"op\":\"{op}\"");
        self.lines
            .iter()
            .filter(|line| line.contains(&tag))
            .map(String::as_str)
            .collect()
    }

    /// Field `key` of the `index`th line of `op`.
    pub fn number(&self, op: &str, index: usize, key: &str) -> u64 {
        let lines = self.op(op);
        let line = lines
            .get(index)
            .unwrap_or_else(|| panic!("no {op} line {index} in {self:#?}"));
        number(line, key).unwrap_or_else(|| panic!("no {key} in {line}"))
    }

    /// `result` of every line of `op`.
    pub fn results(&self, op: &str) -> Vec<u64> {
        self.op(op)
            .iter()
            .map(|line| number(line, "result").expect("result"))
            .collect()
    }
}

/// A numeric field of a flat JSON line.
pub fn number(line: &str, key: &str) -> Option<u64> {
    let start = line.find(&format!("\"{key}\":"))? + key.len() + 3;
    let digits: String = line[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// Waits for `child` (at most CHILD_TIMEOUT, then kills it) and collects its output.
pub fn finish(mut child: Child) -> Output {
    let stdout = child.stdout.take();
    let stderr = child.stderr.take().expect("piped stderr");
    let (lines_sender, lines_receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let lines: Vec<String> = stdout
            .map(|stdout| {
                BufReader::new(stdout)
                    .lines()
                    .map_while(Result::ok)
                    .collect()
            })
            .unwrap_or_default();
        let _ = lines_sender.send(lines);
    });
    let (stderr_sender, stderr_receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = BufReader::new(stderr).read_to_string(&mut text);
        let _ = stderr_sender.send(text);
    });
    let deadline = Instant::now() + CHILD_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for probe") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let lines = lines_receiver
        .recv_timeout(Duration::from_secs(5))
        .unwrap_or_default();
    let stderr = stderr_receiver
        .recv_timeout(Duration::from_secs(5))
        .unwrap_or_default();
    assert!(
        status.is_some(),
        "probe timed out; stdout {lines:?}; stderr {stderr}"
    );
    Output {
        success: status.is_some_and(|status| status.success()),
        exit_code: status.and_then(|status| status.code()),
        lines,
        stderr,
    }
}

/// Runs a probe to the end.
pub fn run(mut command: Command) -> Output {
    finish(command.spawn().expect("start probe"))
}

/// A probe started and left running; its stdout lines arrive on `lines`.
pub struct Running {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
}

pub fn start(mut command: Command) -> Running {
    let mut child = command.spawn().expect("start probe");
    let stdout = child.stdout.take().expect("piped stdout");
    let (sender, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    Running { child, lines }
}

impl Running {
    /// The next line containing `needle` (panics after the timeout).
    pub fn wait_for(&self, needle: &str) -> String {
        let deadline = Instant::now() + CHILD_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no line with {needle}"));
            if line.contains(needle) {
                return line;
            }
        }
    }
}

/// Global, defined symbols of an ELF64 shared object's dynamic symbol table.
pub fn exported_symbols(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).expect("read shared object");
    let u16_at = |at: usize| u16::from_le_bytes(bytes[at..at + 2].try_into().expect("2 bytes"));
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let u64_at =
        |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes")) as usize;
    assert_eq!(&bytes[..4], b"\x7fELF", "not ELF");
    let section_headers = u64_at(0x28);
    let header_size = usize::from(u16_at(0x3a));
    let section_count = usize::from(u16_at(0x3c));
    let section = |index: usize| section_headers + index * header_size;
    let mut names = Vec::new();
    for index in 0..section_count {
        let header = section(index);
        if u32_at(header + 4) != 11 {
            continue; // not SHT_DYNSYM
        }
        let (offset, size, entry_size) = (
            u64_at(header + 0x18),
            u64_at(header + 0x20),
            u64_at(header + 0x38),
        );
        let strings = u64_at(section(u32_at(header + 0x28) as usize) + 0x18);
        for symbol in (offset..offset + size).step_by(entry_size) {
            let binding = bytes[symbol + 4] >> 4;
            let defined = u16_at(symbol + 6) != 0;
            if !defined || (binding != 1 && binding != 2) {
                continue;
            }
            let name_start = strings + u32_at(symbol) as usize;
            let name_end = bytes[name_start..]
                .iter()
                .position(|byte| *byte == 0)
                .expect("NUL")
                + name_start;
            names.push(String::from_utf8_lossy(&bytes[name_start..name_end]).into_owned());
        }
    }
    names
}
