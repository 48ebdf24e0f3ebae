//! How a command job's run ended: an OOM only when the program exited non-zero with the
//! guard's record of a refused allocation or a framework's fatal out-of-memory message
//! on stderr; a program that caught its own OOM and went on (exit 0) is not one; every
//! other exit is a failure with the last lines of stderr.

use crate::allocator::OutOfMemory;

/// Who said the run was out of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OomSource {
    /// The guard refused an allocation (its OOM record).
    Guard,
    PyTorch,
    TensorFlow,
    Jax,
    Cublas,
    Cudnn,
    /// `CUDA_ERROR_OUT_OF_MEMORY` / "out of memory" from the driver or runtime itself.
    Cuda,
}

impl OomSource {
    pub fn name(self) -> &'static str {
        match self {
            OomSource::Guard => "guard",
            OomSource::PyTorch => "pytorch",
            OomSource::TensorFlow => "tensorflow",
            OomSource::Jax => "jax",
            OomSource::Cublas => "cublas",
            OomSource::Cudnn => "cudnn",
            OomSource::Cuda => "cuda",
        }
    }
}

/// A framework's out-of-memory message found on stderr, with what numbers it gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameworkOom {
    pub source: OomSource,
    /// The bytes it tried to allocate, when the message says ("Tried to allocate 2.00
    /// GiB", "OOM when allocating tensor with shape[32,64,512,512]" and a type: the
    /// shape's product times the type's size).
    pub requested_bytes: Option<u64>,
    /// Bytes the framework held, when the message says (PyTorch's "already allocated" /
    /// "allocated by PyTorch" plus "reserved by PyTorch but unallocated").
    pub in_use_bytes: Option<u64>,
    /// The line that matched, trimmed to at most 300 characters.
    pub line: String,
}

/// Finds the first fatal out-of-memory message in `stderr_lines`: PyTorch "CUDA out of
/// memory. Tried to allocate ..." (and the cudaMallocAsync wording "CUDA error: out of
/// memory"), TensorFlow "OOM when allocating tensor" / "ran out of memory trying to
/// allocate" / `STATUS_ALLOC_FAILED`, `CUDNN_STATUS_ALLOC_FAILED`, JAX
/// "RESOURCE_EXHAUSTED: Out of memory", `CUBLAS_STATUS_ALLOC_FAILED`,
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub fn find_framework_oom<'a>(
    stderr_lines: impl IntoIterator<Item = &'a str>,
) -> Option<FrameworkOom> {
    let _ = stderr_lines;
    todo!()
}

/// How a run of a command job ended, as the scheduler is told.
#[derive(Debug, Clone, PartialEq)]
pub enum CommandRunEnd {
    Succeeded,
    OutOfMemory {
        source: OomSource,
        report: OutOfMemory,
        /// For people: the guard's numbers or the framework's line.
        evidence: String,
    },
    Failed {
        /// "exited with status 2" / "killed by signal 9" / "could not start: ...", then
        /// the last lines of stderr.
        message: String,
    },
}

/// What the worker knows when a run's process has exited.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandExit<'a> {
    /// The exit code, `None` when a signal ended it.
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// The guard's first OOM record of this run, as numbers (`requested`, `in_use` is
    /// the account's total then, `limit` the slice, `peak` the account's peak).
    pub guard_refusal: Option<OutOfMemory>,
    /// The last lines of stderr (the worker keeps a bounded tail).
    pub stderr_tail: &'a [String],
    /// The slice's size and the account's peak, for an OOM report built from a
    /// framework message that lacks numbers.
    pub slice_bytes: u64,
    pub peak_bytes: u64,
}

/// Classifies a run's end. Exit 0 is success whatever stderr says. Non-zero (or a
/// signal) with a guard refusal is an OOM from the guard's numbers; else with a framework
/// message an OOM from its numbers (missing ones filled from the slice and the peak);
/// else a failure with at most the last 20 lines of stderr.
pub fn classify_command_exit(exit: &CommandExit<'_>) -> CommandRunEnd {
    let _ = exit;
    todo!()
}
