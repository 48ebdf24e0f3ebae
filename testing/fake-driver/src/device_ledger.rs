//! The simulated device's memory, kept outside the program: when the worker runs the fake
//! driver's program on a simulated GPU, the device's memory is a ledger the worker owns
//! (`carve_worker::simulated_gpu_ledger`), reached over a unix socket, and not this
//! library's own count. The ledger plays the kernel driver's part: it knows each process
//! by the credentials the kernel gives it (`SO_PEERCRED`), grants memory up to the
//! device's capacity across every process of every attempt, and forgets a process's
//! holding when the process is gone, and the worker's watchdog reads per-process usage
//! from it as it reads NVML on a real GPU. So what the program holds of the simulated
//! device is what the ledger granted it, whatever the program writes in its guard
//! account or whichever process skips the guard.
//!
//! Where the socket is: [`CONTAINER_DEVICE_PATH`] when it exists (the worker binds the
//! GPU's socket there in a container, as it binds `/dev/nvidiaN`; a program cannot point
//! the driver elsewhere by changing its environment), else [`ENV_DEVICE_SOCKET`] (an
//! uncontained attempt), else none: the fake keeps its own count, as before, for the
//! guard's and this crate's tests.
//!
//! The protocol, one text line each way per request:
//! - `hold BYTES` -> `ok`, or `out-of-memory` when the device cannot hold that much for
//!   this process beside everyone else's: this connection's process now holds BYTES (the
//!   whole of what the driver holds for it; a decrease is always granted);
//! - `info` -> `CAPACITY USED`: the device's capacity and what every process holds.
//!
//! Each process connects on its own: a forked child (another pid) opens its own
//! connection at its first request, so it is charged as itself.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

/// Where a container finds its simulated GPU's socket.
pub const CONTAINER_DEVICE_PATH: &str = "/dev/carve-simulated-gpu";

/// The environment variable naming the socket outside a container.
pub const ENV_DEVICE_SOCKET: &str = "CARVE_FAKE_CUDA_DEVICE_SOCKET";

/// The socket this process's driver must use, if any (see the module's doc).
pub(crate) fn configured_socket() -> Option<PathBuf> {
    let in_container = Path::new(CONTAINER_DEVICE_PATH);
    if in_container.exists() {
        return Some(in_container.to_path_buf());
    }
    std::env::var_os(ENV_DEVICE_SOCKET)
        .filter(|value| !value.is_empty())
        .map(PathBuf::from)
}

/// This process's connection to the ledger.
#[derive(Debug)]
pub(crate) struct DeviceLedger {
    socket: PathBuf,
    /// The connection and the pid that opened it.
    connection: Option<(u32, BufReader<UnixStream>)>,
    /// What the ledger was last told this process holds.
    held_bytes: u64,
}

impl DeviceLedger {
    pub fn new(socket: PathBuf) -> DeviceLedger {
        DeviceLedger {
            socket,
            connection: None,
            held_bytes: 0,
        }
    }

    /// One request and its answer line, over this process's own connection.
    fn ask(&mut self, request: &str) -> Result<String, String> {
        let process_id = std::process::id();
        if self
            .connection
            .as_ref()
            .is_none_or(|(owner, _)| *owner != process_id)
        {
            // A forked child holds nothing on the device yet.
            self.held_bytes = 0;
            let stream = UnixStream::connect(&self.socket).map_err(|error| {
                format!(
                    "cannot reach the simulated gpu at {}: {error}",
                    self.socket.display()
                )
            })?;
            self.connection = Some((process_id, BufReader::new(stream)));
        }
        let (_, connection) = self.connection.as_mut().expect("connected above");
        let mut answer = String::new();
        let exchanged = connection
            .get_mut()
            .write_all(format!("{request}\n").as_bytes())
            .and_then(|()| connection.read_line(&mut answer));
        match exchanged {
            Ok(0) | Err(_) => {
                self.connection = None;
                Err(format!(
                    "the simulated gpu at {} closed the connection",
                    self.socket.display()
                ))
            }
            Ok(_) => Ok(answer.trim_end().to_string()),
        }
    }

    /// The device's capacity and what all its processes hold.
    pub fn info(&mut self) -> Result<(u64, u64), String> {
        let answer = self.ask("info")?;
        let mut numbers = answer.split(' ').map(str::parse::<u64>);
        match (numbers.next(), numbers.next()) {
            (Some(Ok(capacity)), Some(Ok(used))) => Ok((capacity, used)),
            _ => Err(format!("the simulated gpu answered {answer:?} to info")),
        }
    }

    /// Asks the device to let this process hold `bytes` in all; whether it may.
    pub fn hold(&mut self, bytes: u64) -> bool {
        match self.ask(&format!("hold {bytes}")) {
            Ok(answer) if answer == "ok" => {
                self.held_bytes = bytes;
                true
            }
            Ok(_) => false,
            Err(problem) => {
                eprintln!("carve-fake-driver: {problem}");
                false
            }
        }
    }

    /// Tells the device what this process holds now, after a call that may have freed
    /// memory (or failed after [`DeviceLedger::hold`] granted more than it took).
    pub fn settle(&mut self, bytes: u64) {
        if bytes != self.held_bytes {
            // A decrease is always granted; an increase was granted before it was made.
            self.hold(bytes);
        }
    }
}
