//! A real `carve-scheduler` binary as a child process, on `127.0.0.1` ports of its own,
//! with an admin token the benchmark chose. It is stopped with SIGINT (its graceful
//! shutdown), or killed when dropped still running.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::BenchError;

/// How many of the scheduler's last stderr lines an error quotes.
const STDERR_LINES_KEPT: usize = 40;

/// A running `carve-scheduler`.
#[derive(Debug)]
pub struct SchedulerProcess {
    child: Child,
    grpc_address: SocketAddr,
    metrics_address: SocketAddr,
    admin_token: String,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    started_at: Instant,
    _token_directory: tempfile::TempDir,
}

impl SchedulerProcess {
    /// The scheduler binary: `explicit` when given, else `carve-scheduler` in the
    /// directory of this executable (where `cargo build --release -p carve-scheduler -p
    /// carve-bench` puts both).
    pub fn find_binary(explicit: Option<&Path>) -> Result<PathBuf, BenchError> {
        if let Some(path) = explicit {
            return if path.is_file() {
                Ok(path.to_path_buf())
            } else {
                Err(BenchError::invalid_argument(
                    "scheduler-binary",
                    format!("{} is not a file", path.display()),
                ))
            };
        }
        let me = std::env::current_exe()
            .map_err(|error| BenchError::Io(format!("find this executable: {error}")))?;
        let mut directories: Vec<PathBuf> =
            me.parent().map(Path::to_path_buf).into_iter().collect();
        // Test binaries live one level down, in target/<profile>/deps.
        if let Some(parent) = me.parent().and_then(Path::parent) {
            directories.push(parent.to_path_buf());
        }
        directories
            .iter()
            .map(|directory| directory.join("carve-scheduler"))
            .find(|candidate| candidate.is_file())
            .ok_or_else(|| {
                BenchError::invalid_argument(
                    "scheduler-binary",
                    format!(
                        "no carve-scheduler next to {}: build it first (cargo build --release \
                         -p carve-scheduler -p carve-bench) or pass --scheduler-binary",
                        me.display()
                    ),
                )
            })
    }

    /// Starts `binary` on `database` (a SQLite path or a `postgres://` URL) and waits
    /// until it says where it listens. Its gRPC service may still be starting (opening the
    /// store, recovering): [`crate::load::Submitter::connect`] waits for that.
    pub fn start(binary: &Path, database: &str) -> Result<SchedulerProcess, BenchError> {
        let token_directory = tempfile::tempdir()
            .map_err(|error| BenchError::Io(format!("create a temp dir: {error}")))?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|elapsed| elapsed.as_nanos())
            .unwrap_or(0);
        let admin_token = format!("carve-bench-{}-{nanos}", std::process::id());
        let token_file = token_directory.path().join("admin-token");
        std::fs::write(&token_file, &admin_token)
            .map_err(|error| BenchError::Io(format!("write {}: {error}", token_file.display())))?;
        let metrics_address = free_local_address()?;
        let started_at = Instant::now();
        let mut child = Command::new(binary)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--database")
            .arg(database)
            .arg("--admin-token-file")
            .arg(&token_file)
            .arg("--metrics-listen")
            .arg(metrics_address.to_string())
            .env_remove("CARVE_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|error| {
                BenchError::Scheduler(format!("start {}: {error}", binary.display()))
            })?;
        let stderr = child
            .stderr
            .take()
            .ok_or_else(|| BenchError::Scheduler("the scheduler's stderr is not piped".into()))?;
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let (address_sender, address_receiver) = mpsc::channel();
        {
            let stderr_tail = Arc::clone(&stderr_tail);
            // Reads every line, so the scheduler never blocks on a full pipe.
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if let Some(address) = line.strip_prefix("carve-scheduler listening on ") {
                        let _ = address_sender.send(address.trim().to_string());
                    }
                    let mut tail = stderr_tail.lock().unwrap_or_else(|p| p.into_inner());
                    if tail.len() == STDERR_LINES_KEPT {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            });
        }
        let mut process = SchedulerProcess {
            child,
            grpc_address: metrics_address,
            metrics_address,
            admin_token,
            stderr_tail,
            started_at,
            _token_directory: token_directory,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match address_receiver.recv_timeout(Duration::from_millis(100)) {
                Ok(address) => {
                    process.grpc_address = address.parse().map_err(|error| {
                        BenchError::Scheduler(format!("listen address {address:?}: {error}"))
                    })?;
                    return Ok(process);
                }
                Err(_) if Instant::now() > deadline => {
                    return Err(process.failure("did not say where it listens within 60 s"));
                }
                Err(_) => {
                    if let Ok(Some(status)) = process.child.try_wait() {
                        return Err(process.failure(&format!("exited at start ({status})")));
                    }
                }
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn grpc_address(&self) -> SocketAddr {
        self.grpc_address
    }

    pub fn metrics_address(&self) -> SocketAddr {
        self.metrics_address
    }

    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// When the process was spawned.
    pub fn started_at(&self) -> Instant {
        self.started_at
    }

    /// Whether it is still running; an error quoting its stderr when it is not.
    pub fn check_running(&mut self) -> Result<(), BenchError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(self.failure(&format!("exited ({status})"))),
            Err(error) => Err(self.failure(&format!("cannot be waited for: {error}"))),
        }
    }

    /// An error saying `what` happened, with the scheduler's last stderr lines.
    pub fn failure(&self, what: &str) -> BenchError {
        let tail = self.stderr_tail.lock().unwrap_or_else(|p| p.into_inner());
        let lines: Vec<&str> = tail.iter().map(String::as_str).collect();
        BenchError::Scheduler(format!(
            "carve-scheduler (pid {}) {what}; its last stderr lines:\n{}",
            self.child.id(),
            lines.join("\n")
        ))
    }

    /// Stops it with SIGINT (a graceful shutdown) and waits; kills it after 30 s.
    pub async fn stop(mut self) -> Result<(), BenchError> {
        let pid = self.child.id().to_string();
        // `kill` rather than a signal call: this workspace denies unsafe code.
        let _ = Command::new("kill").args(["-INT", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => return Ok(()),
                Ok(None) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(self.failure("did not stop within 30 s of SIGINT; killed it"));
                }
            }
        }
    }
}

impl Drop for SchedulerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A `127.0.0.1` address with a port nothing listens on right now.
pub fn free_local_address() -> Result<SocketAddr, BenchError> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map_err(|error| BenchError::Io(format!("find a free port on 127.0.0.1: {error}")))
}
