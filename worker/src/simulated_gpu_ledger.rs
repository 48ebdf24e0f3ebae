//! A simulated GPU's memory, kept by the worker outside every program: the part the
//! kernel driver plays for a real GPU. The fake CUDA driver (`testing/fake-driver`,
//! `device_ledger.rs`) asks this ledger, over a unix socket, for every byte it hands a
//! program, and the watchdog reads each process's holding from it as it reads NVML's
//! per-process usage on a real GPU. So the watchdog runs over simulated GPUs too, on
//! numbers the program cannot write: not its guard account (which it can rewrite) and
//! not the fake driver's count in its own memory.
//!
//! What makes the numbers the program's own and no one else's:
//! - a connection's process is the one the kernel names (`SO_PEERCRED`, translated into
//!   the worker's pid namespace, so a container's pid 1 is its host pid): a process is
//!   charged as itself, never as a neighbour, and cannot pick the pid it is listed under;
//! - a holding ends with its process (the driver frees a process's memory when it
//!   exits): at the connection's end, or when the process is gone or its pid was reused
//!   (start time), so a connection handed to another process before its owner exits
//!   holds nothing and may ask for nothing more;
//! - the device's capacity holds across every process of every attempt on the GPU, so a
//!   program past its slice takes memory its neighbours would be refused.
//!
//! The protocol (the fake driver's side documents it too): one text line each way,
//! `hold BYTES` -> `ok` | `out-of-memory` (this process now holds BYTES in all; a
//! decrease is always granted), `info` -> `CAPACITY USED`. A line longer than
//! [`LONGEST_REQUEST`] or anything else ends the connection.
//!
//! What it cannot show: a program is free to skip the fake driver and use host memory
//! as if it were a device, which costs nothing but host memory (the container's cgroup
//! limits that); on a real GPU there is no such way round the kernel driver. And a
//! process that passes its connection to another while it lives has the other's
//! requests charged to itself: still a member of the attempt, counted against its
//! slice, but seen as the guarded process it is.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
// `tokio::net` comes with `tokio-stream`'s "net" feature, which the worker depends on.
use tokio::net::{UnixListener, UnixStream};

use crate::error::WorkerError;
use crate::leftover_processes::process_start_time;
use crate::nvml::ProcessUsage;

/// Where a container finds its simulated GPU's socket, as it finds `/dev/nvidiaN`
/// (the fake driver's `CONTAINER_DEVICE_PATH`).
pub const SIMULATED_GPU_DEVICE_PATH: &str = "/dev/carve-simulated-gpu";

/// The variable naming the socket to the fake driver (its `ENV_DEVICE_SOCKET`).
pub const ENV_SIMULATED_GPU_SOCKET: &str = "CARVE_FAKE_CUDA_DEVICE_SOCKET";

/// The longest request line: `hold` and a 20-digit number, with room to spare.
pub const LONGEST_REQUEST: u64 = 64;

/// One simulated GPU's ledger, serving its socket while it lives.
#[derive(Debug)]
pub struct SimulatedGpuLedger {
    socket: PathBuf,
    state: Arc<Mutex<LedgerState>>,
    server: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct LedgerState {
    capacity_bytes: u64,
    next_connection: u64,
    holdings: HashMap<u64, Holding>,
}

/// What one connection's process holds.
#[derive(Debug, Clone, Copy)]
struct Holding {
    process_id: u32,
    /// Its start time when it connected: another start time under the pid is another
    /// process.
    start_time: u64,
    bytes: u64,
}

impl Holding {
    fn process_lives(&self) -> bool {
        process_start_time(self.process_id) == Some(self.start_time)
    }
}

impl LedgerState {
    /// Forgets the holdings of processes that are gone.
    fn forget_the_gone(&mut self) {
        self.holdings.retain(|_, holding| holding.process_lives());
    }

    fn used_bytes(&self) -> u64 {
        self.holdings.values().map(|holding| holding.bytes).sum()
    }
}

fn lock(state: &Mutex<LedgerState>) -> MutexGuard<'_, LedgerState> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl SimulatedGpuLedger {
    /// Serves a GPU of `capacity_bytes` at `socket` (replacing a file a previous run
    /// left there), from a task on the current tokio runtime. The socket is open to every
    /// uid: containers reach it as their tenants' uids, as they open `/dev/nvidiaN`.
    pub fn bind(socket: &Path, capacity_bytes: u64) -> Result<SimulatedGpuLedger, WorkerError> {
        use std::os::unix::fs::PermissionsExt;
        let failed = |error| {
            WorkerError::io(
                format!("cannot serve a simulated gpu at {}", socket.display()),
                error,
            )
        };
        if let Some(parent) = socket.parent() {
            std::fs::create_dir_all(parent).map_err(failed)?;
        }
        if let Err(error) = std::fs::remove_file(socket)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            return Err(failed(error));
        }
        let listener = UnixListener::bind(socket).map_err(failed)?;
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o666)).map_err(failed)?;
        let state = Arc::new(Mutex::new(LedgerState {
            capacity_bytes,
            next_connection: 0,
            holdings: HashMap::new(),
        }));
        let server = tokio::spawn(serve(listener, state.clone()));
        Ok(SimulatedGpuLedger {
            socket: socket.to_path_buf(),
            state,
            server,
        })
    }

    /// The socket the GPU's programs reach it at.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// What each live process holds, as NVML's per-process usage (host pids); processes
    /// that hold nothing are left out, as NVML lists only processes with a context.
    pub fn usage(&self) -> Vec<ProcessUsage> {
        let mut state = lock(&self.state);
        state.forget_the_gone();
        let mut by_process: HashMap<u32, u64> = HashMap::new();
        for holding in state.holdings.values().filter(|holding| holding.bytes > 0) {
            *by_process.entry(holding.process_id).or_default() += holding.bytes;
        }
        let mut usage: Vec<ProcessUsage> = by_process
            .into_iter()
            .map(|(process_id, used_bytes)| ProcessUsage {
                process_id,
                used_bytes,
            })
            .collect();
        usage.sort_by_key(|usage| usage.process_id);
        usage
    }
}

impl Drop for SimulatedGpuLedger {
    fn drop(&mut self) {
        self.server.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

async fn serve(listener: UnixListener, state: Arc<Mutex<LedgerState>>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(serve_connection(stream, state.clone()));
            }
            Err(error) => {
                tracing::warn!(%error, "a simulated gpu's ledger cannot accept a connection");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// One process's connection: registered under the kernel's pid for it, its holding
/// dropped when it ends.
async fn serve_connection(stream: UnixStream, state: Arc<Mutex<LedgerState>>) {
    let Some(process_id) = stream
        .peer_cred()
        .ok()
        .and_then(|credentials| credentials.pid())
        .and_then(|pid| u32::try_from(pid).ok())
    else {
        return;
    };
    let Some(start_time) = process_start_time(process_id) else {
        return;
    };
    let connection = {
        let mut state = lock(&state);
        state.next_connection += 1;
        let connection = state.next_connection;
        state.holdings.insert(
            connection,
            Holding {
                process_id,
                start_time,
                bytes: 0,
            },
        );
        connection
    };
    let (reader, mut writer) = stream.into_split();
    let mut reader = BufReader::new(reader);
    loop {
        let mut line = String::new();
        match (&mut reader)
            .take(LONGEST_REQUEST)
            .read_line(&mut line)
            .await
        {
            Ok(read) if read > 0 && line.ends_with('\n') => {}
            _ => break,
        }
        let Some(answer) = answer(&mut lock(&state), connection, line.trim_end()) else {
            break;
        };
        if writer.write_all(answer.as_bytes()).await.is_err() {
            break;
        }
    }
    lock(&state).holdings.remove(&connection);
}

/// The answer line to one request, or `None` to end the connection (an unknown
/// request, or its process is gone).
fn answer(state: &mut LedgerState, connection: u64, request: &str) -> Option<String> {
    state.forget_the_gone();
    let holding = *state.holdings.get(&connection)?;
    if request == "info" {
        return Some(format!("{} {}\n", state.capacity_bytes, state.used_bytes()));
    }
    let bytes: u64 = request.strip_prefix("hold ")?.parse().ok()?;
    let others = state.used_bytes() - holding.bytes;
    let granted = bytes <= holding.bytes
        || others
            .checked_add(bytes)
            .is_some_and(|total| total <= state.capacity_bytes);
    if !granted {
        return Some("out-of-memory\n".to_string());
    }
    state.holdings.get_mut(&connection)?.bytes = bytes;
    Some("ok\n".to_string())
}

#[cfg(test)]
mod tests;
