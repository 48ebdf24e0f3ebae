//! carve-worker: runs on every GPU node. It offers its GPUs to the scheduler (real ones
//! through NVML, simulated ones with `--sim-gpus`), holds a session with it, and
//! runs each attempt in its own child process inside a memory-limited slice.
//!
//! - `worker`: `run_worker(config, shutdown)`, the session loop, admission, reconnects;
//! - `attempt_process`: the worker's side of one attempt process (start, watch, stop);
//! - `command_attempt`: the worker's side of a command job's attempt (the user's own
//!   program under the guard, its output, its profile runs, its end classified);
//! - `command_output`: a command's output: bounded lines, `CARVE_PROGRESS` lines;
//! - `command_checkpoint`: a command's reported checkpoints (`CARVE_CHECKPOINT`), copied
//!   where the program cannot write before they are reported, and resumed from;
//! - `attempt_child`: the attempt process itself (`carve-worker attempt ...`);
//! - `leader_lease`: the worker's own count of its lease, and stopping its attempts when
//!   no leader heard it for half of it; `attempt_lease`: an engine attempt process's
//!   lease, renewed by its worker, so it stops even when its worker is frozen;
//! - `checkpoint_files`: engine checkpoints promoted to names nothing rewrites, and the
//!   superseded ones deleted once the scheduler recorded a newer one;
//! - `child_protocol`: the JSON lines between the two;
//! - `leftover_processes`: records of running attempt processes, and killing those a
//!   crashed worker left behind when it starts again;
//! - `gpus`: the GPUs offered (real and simulated), `--sim-gpus` parsing, the slice book;
//! - `guard_environment`: the guard for one attempt: its account, its environment, reading
//!   the account and the OOM record;
//! - `image`: job images: pulled, verified, unpacked into a cache attempts share;
//! - `nvml`: real GPUs through NVML: discovery and each GPU's compute processes;
//! - `sandbox`: every attempt in its own OCI container (bundle, runtime, tenants' ids);
//! - `simulated_gpu_ledger`: a simulated GPU's memory outside its programs (the kernel
//!   driver's part, for the fake driver), which the watchdog reads as it reads NVML;
//! - `watchdog`: stops an attempt whose process tree holds more than its slice and
//!   context, or (under the guard) uses the GPU without the guard;
//! - `attempt_limits`: stops an attempt that runs past its max_duration or whose
//!   directories hold more than the checkpoint limit.
//!
//! Architecture invariants: the worker never admits a slice its GPU cannot hold; an
//! attempt process that ends without its final line is a failed or an interrupted
//! attempt, never an OOM; and no attempt process outlives its worker.

pub mod attempt_child;
pub mod attempt_lease;
pub mod attempt_limits;
pub mod attempt_process;
pub mod checkpoint_files;
pub mod child_protocol;
pub mod command_attempt;
pub mod command_checkpoint;
pub mod command_output;
pub mod command_supervisor;
pub mod error;
pub mod gang_member;
pub mod gpus;
pub mod guard_environment;
pub mod image;
pub mod leader_lease;
pub mod leftover_processes;
pub mod nvml;
pub mod program_output;
pub mod sandbox;
pub mod simulated_gpu_ledger;
pub mod token_file;
pub mod watchdog;
pub mod worker;

pub use error::WorkerError;
pub use worker::{StartedAttemptProcess, WorkerConfig, run_worker};
