//! What the client tests share: a `carve dev` child process (its endpoint and tokens),
//! `carve` runs against it with what they printed and their exit code, and the words
//! tests read back from `submit` and `jobs -o json`.

// Each test file uses some of these; the local commands' tests none.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long `carve dev` may take to print its endpoint and tokens.
pub const STARTUP_LIMIT: Duration = Duration::from_secs(60);

pub fn carve_binary() -> &'static str {
    env!("CARGO_BIN_EXE_carve")
}

pub fn repository_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A `carve dev` child process, killed when dropped.
pub struct DevCluster {
    pub child: Child,
    pub endpoint: String,
    pub user_token: String,
    pub admin_token: String,
    pub stderr: Arc<Mutex<String>>,
    /// No user config file may leak into the commands: this is their XDG_CONFIG_HOME.
    pub config_home: tempfile::TempDir,
    pub _data: tempfile::TempDir,
}

impl DevCluster {
    pub fn start() -> DevCluster {
        let data = tempfile::tempdir().unwrap();
        let data_dir = data.path().to_path_buf();
        Self::start_at(&data_dir, data)
    }

    /// A `carve dev` on `data_dir`, which the caller keeps (to start another on it).
    pub fn start_on(data_dir: &Path) -> DevCluster {
        Self::start_at(data_dir, tempfile::tempdir().unwrap())
    }

    /// A `carve dev` on `data_dir`; `data` is removed when the cluster drops.
    fn start_at(data_dir: &Path, data: tempfile::TempDir) -> DevCluster {
        let mut child = Command::new(carve_binary())
            .args(["dev", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut stderr_pipe = child.stderr.take().unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        let stderr_sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut buffer = [0u8; 4096];
            while let Ok(read) = stderr_pipe.read(&mut buffer) {
                if read == 0 {
                    break;
                }
                stderr_sink
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buffer[..read]));
            }
        });
        // Lines go to the test until it has what it needs; the thread keeps draining the
        // pipe after that, so the child never blocks on a full pipe.
        let (lines, received) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = lines.send(line);
            }
        });
        let (mut endpoint, mut user_token, mut admin_token) = (None, None, None);
        let mut seen = String::new();
        while endpoint.is_none() || user_token.is_none() || admin_token.is_none() {
            let line = match received.recv_timeout(STARTUP_LIMIT) {
                Ok(line) => line,
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "carve dev did not print its endpoint and tokens\nstdout:\n{seen}\nstderr:\n{}",
                        stderr.lock().unwrap()
                    );
                }
            };
            seen.push_str(&line);
            seen.push('\n');
            let value = |prefix: &str| {
                line.trim()
                    .strip_prefix(prefix)
                    .and_then(|rest| rest.split_whitespace().next())
                    .map(str::to_string)
            };
            endpoint = endpoint.or_else(|| value("endpoint:"));
            user_token = user_token.or_else(|| value("token:"));
            admin_token = admin_token.or_else(|| value("admin:"));
        }
        DevCluster {
            child,
            endpoint: endpoint.unwrap(),
            user_token: user_token.unwrap(),
            admin_token: admin_token.unwrap(),
            stderr,
            config_home: tempfile::tempdir().unwrap(),
            _data: data,
        }
    }

    /// Runs `carve ARGS` against this cluster with `token`.
    pub fn carve_with_token(&self, token: &str, arguments: &[&str]) -> Outcome {
        run_carve(
            arguments,
            &[
                ("CARVE_ENDPOINT", &self.endpoint),
                ("CARVE_TOKEN", token),
                (
                    "XDG_CONFIG_HOME",
                    &self.config_home.path().display().to_string(),
                ),
            ],
        )
    }

    /// `carve admin tokens list --tenant TENANT -o json` with `admin`'s token, parsed.
    pub fn tenant_tokens_json(&self, admin: &str, tenant: &str) -> serde_json::Value {
        self.carve_with_token(
            admin,
            &["admin", "tokens", "list", "--tenant", tenant, "-o", "json"],
        )
        .expect_code(0)
        .json()
    }

    /// Starts `carve ARGS` as the `dev` tenant's user, without waiting for it.
    pub fn spawn_carve(&self, arguments: &[&str]) -> Child {
        self.spawn_carve_with_stdin(arguments, Stdio::null())
    }

    /// Starts `carve ARGS` as the `dev` tenant's user with `stdin`, without waiting.
    pub fn spawn_carve_with_stdin(&self, arguments: &[&str], stdin: Stdio) -> Child {
        Command::new(carve_binary())
            .args(arguments)
            .current_dir(repository_root())
            .env_remove("CARVE_CLI_CONFIG")
            .env_remove("CARVE_CA_CERT")
            .env("CARVE_ENDPOINT", &self.endpoint)
            .env("CARVE_TOKEN", &self.user_token)
            .env("XDG_CONFIG_HOME", self.config_home.path())
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Runs `carve ARGS` as the `dev` tenant's user.
    pub fn carve(&self, arguments: &[&str]) -> Outcome {
        self.carve_with_token(&self.user_token, arguments)
    }
}

impl Drop for DevCluster {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("carve dev stderr:\n{}", self.stderr.lock().unwrap());
        }
    }
}

/// What one `carve` process did.
pub struct Outcome {
    pub arguments: String,
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Outcome {
    pub fn context(&self) -> String {
        format!(
            "carve {}\nexit code: {:?}\nstdout:\n{}\nstderr:\n{}",
            self.arguments, self.code, self.stdout, self.stderr
        )
    }

    /// Asserts that stdout holds `text`, showing the whole outcome where it does not.
    pub fn assert_stdout_contains(&self, text: &str) {
        assert!(self.stdout.contains(text), "{}", self.context());
    }

    /// Asserts that stderr holds `text`, showing the whole outcome where it does not.
    pub fn assert_stderr_contains(&self, text: &str) {
        assert!(self.stderr.contains(text), "{}", self.context());
    }

    /// Asserts the exit code and returns the outcome for further checks.
    pub fn expect_code(self, code: i32) -> Outcome {
        assert_eq!(self.code, Some(code), "{}", self.context());
        self
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|error| panic!("not json: {error}\n{}", self.context()))
    }
}

pub fn run_carve(arguments: &[&str], environment: &[(&str, &str)]) -> Outcome {
    let mut command = Command::new(carve_binary());
    command
        .args(arguments)
        .current_dir(repository_root())
        .env_remove("CARVE_ENDPOINT")
        .env_remove("CARVE_TOKEN")
        .env_remove("CARVE_CLI_CONFIG")
        .env_remove("CARVE_CA_CERT")
        .stdin(Stdio::null());
    for (name, value) in environment {
        command.env(name, value);
    }
    let Output {
        status,
        stdout,
        stderr,
    } = command.output().unwrap();
    Outcome {
        arguments: arguments.join(" "),
        code: status.code(),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    }
}

/// Waits for a spawned `carve` to exit on its own; one still running after
/// [`STARTUP_LIMIT`] is killed and the test fails (a hang, not a slow machine).
pub fn wait_for(child: &mut Child, what: &str) -> Outcome {
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > STARTUP_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not exit within {}s", STARTUP_LIMIT.as_secs());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut stdout = String::new();
    let mut stderr = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    Outcome {
        arguments: what.to_string(),
        code: child.wait().unwrap().code(),
        stdout,
        stderr,
    }
}

/// The job id in `submit`'s first line: "submitted job ID (NAME)".
pub fn submitted_job_id(outcome: &Outcome) -> String {
    outcome
        .stdout
        .lines()
        .find_map(|line| line.strip_prefix("submitted job "))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no job id\n{}", outcome.context()))
        .to_string()
}

pub fn listed_ids(list: &serde_json::Value) -> Vec<String> {
    list["jobs"]
        .as_array()
        .unwrap_or_else(|| panic!("no jobs array: {list}"))
        .iter()
        .map(|job| job["id"].as_str().unwrap().to_string())
        .collect()
}
