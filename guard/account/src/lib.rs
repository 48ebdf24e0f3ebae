//! The contract between the worker and the guard (`libcarve_guard.so`), and the memory
//! account one attempt's processes share.
//!
//! The worker creates the account in the attempt's directory and starts the program with
//! the variables below; the guard, preloaded into every process of the attempt (data
//! loader workers and `torchrun` children included), charges each device allocation to
//! the account before it reaches the driver. The account is one memory-mapped file (see
//! [`account`]) so that all processes of an attempt see one total, and the worker can read
//! it live without asking any of them.
//!
//! Refusals are appended to the OOM record ([`OomRecordLine`], one JSON object a line),
//! which the worker reads when the attempt ends.

mod account;
mod oom_record;

pub use account::{
    Account, AccountUsage, OverLimit, ProcessUsage, Reserved, SLOT_COUNT, SlotIndex,
};
pub use oom_record::{OomRecordLine, append_oom_record};

use std::path::PathBuf;

/// The slice size in bytes (decimal). Without it the guard refuses CUDA: fail closed.
pub const ENV_LIMIT_BYTES: &str = "CARVE_GUARD_LIMIT_BYTES";
/// The path of the attempt's account file.
pub const ENV_ACCOUNT: &str = "CARVE_GUARD_ACCOUNT";
/// The path of the attempt's OOM record (JSON lines, appended).
pub const ENV_OOM_RECORD: &str = "CARVE_GUARD_OOM_RECORD";

/// The crate's one error type.
#[derive(Debug, thiserror::Error)]
pub enum AccountError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a Carve memory account ({reason})")]
    NotAnAccount { path: PathBuf, reason: String },
    #[error(
        "{path} holds a limit of {account_limit_bytes} bytes, but {expected_limit_bytes} \
         were asked for"
    )]
    LimitMismatch {
        path: PathBuf,
        account_limit_bytes: u64,
        expected_limit_bytes: u64,
    },
    #[error("all {SLOT_COUNT} process slots of the account are held by live processes")]
    NoFreeSlot,
    #[error("OOM record line {line_number}: {reason}")]
    BadRecordLine { line_number: usize, reason: String },
}
