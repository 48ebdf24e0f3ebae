//! How a command job's run ended: an OOM only when the program exited non-zero with the
//! guard's record of a refused allocation (which wins over any text) or when the error
//! it ended with is a framework's fatal out-of-memory message of the GPU
//! (`terminal_error` finds that error, `messages` reads the frameworks' words; both are
//! tested on the real output in `core/tests/oom_corpus/`); a program that caught its own
//! OOM and went on (exit 0) is not one; every other exit is a failure with the last lines
//! of stderr. A framework's numbers above the slice are its view of the whole GPU and are
//! not used ([`framework_report`]).

use std::fmt;

use crate::FieldError;
use crate::allocator::OutOfMemory;
use crate::bytes::HumanBytes;

/// Who said an attempt was out of memory: Carve's engine (a model job's slice
/// allocator) or, for a command job, the guard or a framework's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OomSource {
    /// Carve's own engine: the slice allocator refused (a model job).
    Allocator,
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
    pub const ALL: [OomSource; 8] = [
        OomSource::Allocator,
        OomSource::Guard,
        OomSource::PyTorch,
        OomSource::TensorFlow,
        OomSource::Jax,
        OomSource::Cublas,
        OomSource::Cudnn,
        OomSource::Cuda,
    ];

    /// The stable lowercase name the protocol and the store carry.
    pub fn name(self) -> &'static str {
        match self {
            OomSource::Allocator => "allocator",
            OomSource::Guard => "guard",
            OomSource::PyTorch => "pytorch",
            OomSource::TensorFlow => "tensorflow",
            OomSource::Jax => "jax",
            OomSource::Cublas => "cublas",
            OomSource::Cudnn => "cudnn",
            OomSource::Cuda => "cuda",
        }
    }

    /// The source named `name`, or an error listing the names there are.
    pub fn from_name(name: &str) -> Result<OomSource, FieldError> {
        OomSource::ALL
            .into_iter()
            .find(|source| source.name() == name)
            .ok_or_else(|| {
                let names = OomSource::ALL.map(OomSource::name);
                FieldError::not_one_of(name, "an out-of-memory detector", &names)
            })
    }
}

impl fmt::Display for OomSource {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

impl TryFrom<&str> for OomSource {
    type Error = FieldError;

    fn try_from(name: &str) -> Result<OomSource, FieldError> {
        OomSource::from_name(name)
    }
}

/// A framework's out-of-memory message found on stderr, with what numbers it gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameworkOom {
    pub source: OomSource,
    /// The bytes it tried to allocate, when the message says ("Tried to allocate 2.00
    /// GiB", `OOM when allocating tensor with shape[32,64,512,512]` and a type: the
    /// shape's product times the type's size).
    pub requested_bytes: Option<u64>,
    /// Bytes the framework held, when the message says (PyTorch's "already allocated" /
    /// "allocated by PyTorch" plus "reserved by PyTorch but unallocated").
    pub in_use_bytes: Option<u64>,
    /// The line that matched, trimmed to at most 300 characters.
    pub line: String,
}

/// Finds the out-of-memory message the program ended with in `stderr_lines` (its tail),
/// or `None` when it ended with another error.
///
/// Only the error the program ended with counts (`terminal_error`): the exception text of
/// its last Python traceback (with the tracebacks chained to it), or without one, from
/// the last error or out-of-memory line to the end. A memory warning a framework
/// recovers from (TensorFlow's and XLA's BFC "ran out of memory trying to allocate",
/// "failed to allocate ... from device") is never one, and a warning followed by an
/// unrelated error is that error. The messages (`messages`): PyTorch "CUDA out of
/// memory. Tried to allocate ..." (1.x and 2.x, `torch.OutOfMemoryError`,
/// `torch.cuda.OutOfMemoryError`), its cudaMallocAsync backend's "would exceed allowed
/// memory. (out of memory)" and "CUDA error: out of memory"; TensorFlow "OOM when
/// allocating tensor" on a GPU, an eager op's "failed to allocate memory" and
/// `STATUS_ALLOC_FAILED`; JAX/XLA "RESOURCE_EXHAUSTED: Out of memory ...", "Out of memory
/// while trying to allocate" (also inside a TensorFlow error: Keras 3 compiles with XLA),
/// "Failed to allocate request for ..." and its buffer report; `CUDNN_STATUS_ALLOC_FAILED`;
/// `CUBLAS_STATUS_ALLOC_FAILED`; the driver's `CUDA_ERROR_OUT_OF_MEMORY` and the
/// runtime's `cudaErrorMemoryAllocation`. An error that only says "cuDNN failed to
/// initialize" (or "Blas GEMM launch failed") is an OOM when the log above it says the
/// library's handle could not allocate.
pub fn find_framework_oom<'a>(
    stderr_lines: impl IntoIterator<Item = &'a str>,
) -> Option<FrameworkOom> {
    let lines: Vec<&str> = stderr_lines.into_iter().collect();
    let error_lines = terminal_error::terminal_error_lines(&lines);
    let in_error = error_lines
        .iter()
        .find_map(|&index| messages::oom_in_line(lines[index], &lines[index + 1..]));
    if let Some(mut oom) = in_error {
        // XLA's message inside a TensorFlow error (Keras 3 compiles its steps with XLA)
        // is TensorFlow's OOM.
        let tensorflow_error = error_lines.iter().any(|&index| {
            lines[index].contains("tensorflow.") || lines[index].contains("ResourceExhaustedError")
        });
        if oom.source == OomSource::Jax && tensorflow_error {
            oom.source = OomSource::TensorFlow;
        }
        return Some(oom);
    }
    let first_error_line = *error_lines.first()?;
    if !error_lines
        .iter()
        .any(|&index| messages::refers_to_log_above(lines[index]))
    {
        return None;
    }
    let logged = lines[..first_error_line]
        .iter()
        .rev()
        .find(|line| messages::library_allocation_source(line).is_some())?;
    Some(FrameworkOom {
        source: messages::library_allocation_source(logged)?,
        requested_bytes: None,
        in_use_bytes: None,
        line: logged
            .trim()
            .chars()
            .take(EVIDENCE_LINE_CHARACTERS)
            .collect(),
    })
}

/// The longest line kept as evidence.
const EVIDENCE_LINE_CHARACTERS: usize = 300;

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
    /// Killed by a signal from outside that the worker did not send (an operator, a node
    /// agent, the kernel): not the program's doing, so it is retried from its
    /// checkpoint as an engine attempt is.
    Interrupted {
        /// "killed by signal 15 (SIGTERM), which the worker did not send", then the last
        /// lines of stderr.
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
    /// The slice's size and the run's peak (the guard's account, or where it counted
    /// nothing the program's own report: `memory_model::learning::run_peak_bytes`), for
    /// an OOM report built from a framework message whose numbers are missing or above
    /// the slice.
    pub slice_bytes: u64,
    pub peak_bytes: u64,
    /// The container's host memory limit, when its memory reached it (the kernel's OOM
    /// killer then killed a process in it); `None` when it did not, or runs uncontained.
    pub host_memory_limit_reached: Option<u64>,
}

/// Classifies a run's end. Exit 0 is success whatever stderr says. Non-zero (or a
/// signal) with a guard refusal is an OOM from the guard's numbers; else with a framework
/// message an OOM from its numbers (missing ones filled from the slice and the peak);
/// else, killed by SIGKILL when its container had reached its host memory limit, a
/// failure of its own (the kernel's OOM killer; retrying would repeat it); else, ended by
/// a signal it did not raise on itself (not a fault: SEGV, BUS, ILL, FPE, ABRT, SYS,
/// TRAP), an interruption; else a failure with at most the last 20 lines of stderr.
pub fn classify_command_exit(exit: &CommandExit<'_>) -> CommandRunEnd {
    if exit.exit_code == Some(0) {
        return CommandRunEnd::Succeeded;
    }
    if let Some(refusal) = exit.guard_refusal {
        return CommandRunEnd::OutOfMemory {
            source: OomSource::Guard,
            report: refusal,
            evidence: format!(
                "the guard refused an allocation of {} with {} of the {} slice in use",
                HumanBytes(refusal.requested),
                HumanBytes(refusal.in_use),
                HumanBytes(refusal.limit)
            ),
        };
    }
    if let Some(oom) = find_framework_oom(exit.stderr_tail.iter().map(String::as_str)) {
        let (report, evidence) = framework_report(&oom, exit.slice_bytes, exit.peak_bytes);
        return CommandRunEnd::OutOfMemory {
            source: oom.source,
            report,
            evidence,
        };
    }
    if let (Some(limit), Some(SIGKILL)) = (exit.host_memory_limit_reached, exit.signal) {
        return CommandRunEnd::Failed {
            message: failure_message(
                exit,
                &format!(
                    " by the kernel: its container reached its host memory limit of {} \
                     (the worker's --attempt-memory)",
                    HumanBytes(limit)
                ),
            ),
        };
    }
    if exit.exit_code.is_none() && exit.signal.is_some_and(|signal| !is_fault_signal(signal)) {
        return CommandRunEnd::Interrupted {
            message: failure_message(exit, ", which the worker did not send"),
        };
    }
    CommandRunEnd::Failed {
        message: failure_message(exit, ""),
    }
}

/// The OOM report a framework's message gives in a slice of `slice_bytes` whose account
/// peaked at `peak_bytes`, and its evidence line.
///
/// A number above the slice is the framework's view of the whole GPU (PyTorch's "76.50
/// GiB is allocated by PyTorch" where the driver was not the guard, a TensorFlow tensor
/// shape printed for another run), not a measurement of this attempt: it is dropped, so
/// it never becomes the peak or the need the retry is planned from. Numbers missing or
/// dropped come from the account: in use is its peak; the request is what was left of
/// the slice (the run needed at least the whole slice). The evidence says which numbers
/// were dropped. The peak itself is kept within the slice: where the guard counted
/// nothing it is the program's own report, which may be anything.
pub fn framework_report(
    oom: &FrameworkOom,
    slice_bytes: u64,
    peak_bytes: u64,
) -> (OutOfMemory, String) {
    let within_slice = |bytes: &u64| *bytes <= slice_bytes;
    let dropped: Vec<String> = [
        ("in use", oom.in_use_bytes),
        ("requested", oom.requested_bytes),
    ]
    .into_iter()
    .filter_map(|(name, bytes)| {
        bytes
            .filter(|bytes| !within_slice(bytes))
            .map(|bytes| format!("{name} {}", HumanBytes(bytes)))
    })
    .collect();
    let in_use = oom
        .in_use_bytes
        .filter(within_slice)
        .unwrap_or(peak_bytes)
        .min(slice_bytes);
    let requested = oom
        .requested_bytes
        .filter(within_slice)
        .unwrap_or_else(|| slice_bytes.saturating_sub(in_use));
    let report = OutOfMemory {
        requested,
        in_use,
        limit: slice_bytes,
        largest_free: slice_bytes.saturating_sub(in_use),
        // The peak may be the program's own report (a simulated GPU, where the guard
        // counts nothing): above the slice, it is not this attempt's either.
        peak: peak_bytes.min(slice_bytes).max(in_use),
    };
    let evidence = if dropped.is_empty() {
        oom.line.clone()
    } else {
        format!(
            "{} [numbers above the {} slice not used: {}; the framework's view of the whole \
             GPU, not this attempt's]",
            oom.line,
            HumanBytes(slice_bytes),
            dropped.join(", ")
        )
    };
    (report, evidence)
}

const SIGKILL: i32 = 9;

/// Signals the kernel raises on a process for its own fault (SIGSEGV, SIGBUS, SIGILL,
/// SIGFPE, SIGABRT, SIGSYS, SIGTRAP): retrying would repeat them.
fn is_fault_signal(signal: i32) -> bool {
    [11, 7, 4, 8, 6, 31, 5].contains(&signal)
}

/// Lines of stderr a failure message keeps.
const FAILURE_STDERR_LINES: usize = 20;
/// Bytes of one stderr line a failure message keeps: 20 of them and the first line stay
/// under 4 KiB, small enough for a job's row and a terminal.
const FAILURE_LINE_BYTES: usize = 176;

/// "exited with status 2" / "killed by signal 9 (SIGKILL)" and `note`, then the last
/// lines of stderr, each cut to [`FAILURE_LINE_BYTES`].
fn failure_message(exit: &CommandExit<'_>, note: &str) -> String {
    let how = match (exit.exit_code, exit.signal) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => match signal_name(signal) {
            Some(name) => format!("killed by signal {signal} ({name})"),
            None => format!("killed by signal {signal}"),
        },
        (None, None) => "ended without an exit status".to_string(),
    };
    let how = format!("{how}{note}");
    let skip = exit.stderr_tail.len().saturating_sub(FAILURE_STDERR_LINES);
    let lines: Vec<String> = exit.stderr_tail[skip..]
        .iter()
        .map(|line| cut_to_bytes(line.trim_end(), FAILURE_LINE_BYTES))
        .collect();
    if lines.iter().all(String::is_empty) {
        format!("{how}; stderr was empty")
    } else {
        format!("{how}; the last lines of stderr:\n{}", lines.join("\n"))
    }
}

/// `text` cut to at most `limit` bytes at a character boundary, marked with "..." when cut.
fn cut_to_bytes(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_string();
    }
    let mut end = limit - 3;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

/// The names of the signals a training program is usually ended by.
fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        _ => return None,
    })
}

mod messages;
mod terminal_error;

#[cfg(test)]
mod tests;
