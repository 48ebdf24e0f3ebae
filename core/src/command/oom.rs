//! How a command job's run ended: an OOM only when the program exited non-zero with the
//! guard's record of a refused allocation or a framework's fatal out-of-memory message
//! on stderr; a program that caught its own OOM and went on (exit 0) is not one; every
//! other exit is a failure with the last lines of stderr.

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
    stderr_lines.into_iter().find_map(framework_oom_in_line)
}

/// The longest line kept as evidence.
const EVIDENCE_LINE_CHARACTERS: usize = 300;

/// One line's out-of-memory message, the most specific pattern first (a JAX line may
/// quote the driver's `CUDA_ERROR_OUT_OF_MEMORY`, a TensorFlow one cuDNN's status).
fn framework_oom_in_line(line: &str) -> Option<FrameworkOom> {
    let (source, requested_bytes, in_use_bytes) = if line.contains("CUDA out of memory") {
        (
            OomSource::PyTorch,
            size_after(line, "Tried to allocate "),
            pytorch_in_use(line),
        )
    } else if line.contains("CUDA error: out of memory") {
        (OomSource::PyTorch, None, None)
    } else if line.contains("OOM when allocating tensor") {
        (OomSource::TensorFlow, tensorflow_tensor_bytes(line), None)
    } else if line.contains("ran out of memory trying to allocate") {
        (
            OomSource::TensorFlow,
            size_after(line, "ran out of memory trying to allocate "),
            None,
        )
    } else if line.contains("RESOURCE_EXHAUSTED")
        && line.to_ascii_lowercase().contains("out of memory")
    {
        let requested = size_after(line, "trying to allocate ")
            .or_else(|| size_after(line, "allocating "))
            .or_else(|| size_after(line, "allocate "));
        (OomSource::Jax, requested, None)
    } else if line.contains("CUDNN_STATUS_ALLOC_FAILED") {
        (OomSource::Cudnn, None, None)
    } else if line.contains("CUBLAS_STATUS_ALLOC_FAILED") {
        (OomSource::Cublas, None, None)
    } else if line.contains("STATUS_ALLOC_FAILED") {
        (OomSource::TensorFlow, None, None)
    } else if line.contains("CUDA_ERROR_OUT_OF_MEMORY")
        || line.contains("cudaErrorMemoryAllocation")
    {
        (OomSource::Cuda, None, None)
    } else {
        return None;
    };
    Some(FrameworkOom {
        source,
        requested_bytes,
        in_use_bytes,
        line: line.trim().chars().take(EVIDENCE_LINE_CHARACTERS).collect(),
    })
}

/// What PyTorch says its caching allocator held: 2.x gives "X is allocated by PyTorch,
/// and Y is reserved by PyTorch but unallocated" (held = X + Y); 1.x gives "X reserved in
/// total by PyTorch" (all it held) and "Z already allocated" (the part in tensors).
fn pytorch_in_use(line: &str) -> Option<u64> {
    if let Some(allocated) = size_before(line, " is allocated by PyTorch") {
        let unallocated = size_before(line, " is reserved by PyTorch but unallocated").unwrap_or(0);
        return Some(allocated.saturating_add(unallocated));
    }
    size_before(line, " reserved in total by PyTorch")
        .or_else(|| size_before(line, " already allocated"))
}

/// TensorFlow's "OOM when allocating tensor with shape[32,64,512,512] and type float":
/// the elements times the type's size.
fn tensorflow_tensor_bytes(line: &str) -> Option<u64> {
    let after_shape = &line[line.find("shape[")? + "shape[".len()..];
    let dimensions = &after_shape[..after_shape.find(']')?];
    let elements = dimensions
        .split(',')
        .map(str::trim)
        .filter(|dimension| !dimension.is_empty())
        .try_fold(1u64, |product, dimension| {
            product.checked_mul(dimension.parse::<u64>().ok()?)
        })?;
    let after_type = &after_shape[after_shape.find(" type ")? + " type ".len()..];
    let type_name = after_type
        .split(|character: char| !(character.is_ascii_alphanumeric() || character == '_'))
        .next()?;
    elements.checked_mul(tensorflow_type_bytes(type_name)?)
}

/// The size of one element of a TensorFlow dtype, by the name its messages print.
fn tensorflow_type_bytes(type_name: &str) -> Option<u64> {
    Some(match type_name {
        "bool" | "int8" | "uint8" | "qint8" | "quint8" => 1,
        "half" | "float16" | "bfloat16" | "int16" | "uint16" | "qint16" | "quint16" => 2,
        "float" | "float32" | "int32" | "uint32" | "qint32" => 4,
        "double" | "float64" | "int64" | "uint64" | "complex64" => 8,
        "complex128" => 16,
        _ => return None,
    })
}

/// The size written right after `marker`: "2.00 GiB", "20.00 MiB", "2.00GiB",
/// "1073741824 bytes", "512B", a bare number of bytes.
fn size_after(line: &str, marker: &str) -> Option<u64> {
    let rest = line[line.find(marker)? + marker.len()..].trim_start();
    let number_end = rest
        .find(|character: char| !(character.is_ascii_digit() || character == '.'))
        .unwrap_or(rest.len());
    let unit: String = rest[number_end..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_alphabetic)
        .collect();
    size_in_bytes(&rest[..number_end], &unit)
}

/// The size written right before `marker`: "76.50 GiB is allocated", "14.56GiB already".
fn size_before(line: &str, marker: &str) -> Option<u64> {
    let before = line[..line.find(marker)?].trim_end();
    let unit_start = before
        .rfind(|character: char| !character.is_ascii_alphabetic())
        .map_or(0, |index| index + 1);
    let (number_text, unit) = before.split_at(unit_start);
    let number_text = number_text.trim_end();
    let number_start = number_text
        .rfind(|character: char| !(character.is_ascii_digit() || character == '.'))
        .map_or(0, |index| index + 1);
    size_in_bytes(&number_text[number_start..], unit)
}

/// `number` of `unit` as bytes, rounded; frameworks print two decimals of a binary
/// unit, so the answer is within half a hundredth of that unit.
fn size_in_bytes(number: &str, unit: &str) -> Option<u64> {
    if number.is_empty() || !number.starts_with(|character: char| character.is_ascii_digit()) {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    let multiplier: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" | "byte" | "bytes" => 1.0,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024.0 * 1024.0,
        "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
        "tib" | "t" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return None,
    };
    // `as` saturates: an absurd size becomes u64::MAX, never a wrap.
    Some((value * multiplier).round() as u64)
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
    /// The slice's size and the account's peak, for an OOM report built from a
    /// framework message that lacks numbers.
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
        let in_use = oom.in_use_bytes.unwrap_or(exit.peak_bytes);
        // Without the request's size, the run needed at least the whole slice.
        let requested = oom
            .requested_bytes
            .unwrap_or_else(|| exit.slice_bytes.saturating_sub(in_use));
        return CommandRunEnd::OutOfMemory {
            source: oom.source,
            report: OutOfMemory {
                requested,
                in_use,
                limit: exit.slice_bytes,
                largest_free: exit.slice_bytes.saturating_sub(in_use),
                peak: exit.peak_bytes.max(in_use),
            },
            evidence: oom.line,
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

#[cfg(test)]
mod tests;
