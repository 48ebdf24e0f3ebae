//! What one line of a program's stderr says: a framework's out-of-memory message (and
//! the numbers it gives), an error that is not one, or a pointer to a library's log line
//! above. Which line counts is `terminal_error`'s business; this file only reads lines.
//!
//! Messages that look like an OOM but are not one are refused here, before any pattern:
//! TensorFlow's and XLA's BFC warnings ("ran out of memory trying to allocate ...": the
//! caller recovers, or the op's own "OOM when allocating tensor" error follows), a device
//! allocation TensorFlow or XLA retries smaller ("failed to allocate ... from device",
//! "failed to alloc ... on device"), and a tensor that did not fit in host memory
//! ("... on /job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu"): the slice is
//! GPU memory.

use super::{EVIDENCE_LINE_CHARACTERS, FrameworkOom, OomSource};

/// The out-of-memory message `line` is, if it is one; `following` are the lines after
/// it (PyTorch's cudaMallocAsync backend gives its numbers on lines of their own).
pub(super) fn oom_in_line(line: &str, following: &[&str]) -> Option<FrameworkOom> {
    if is_recovered_warning(line) || is_host_memory_tensor(line) {
        return None;
    }
    let (source, requested_bytes, in_use_bytes) = if line.contains("CUDA out of memory") {
        (
            OomSource::PyTorch,
            size_after(line, "Tried to allocate "),
            pytorch_in_use(line),
        )
    } else if line.contains("would exceed allowed memory") && line.contains("(out of memory)") {
        let (requested, in_use) = pytorch_async_numbers(following);
        (OomSource::PyTorch, requested, in_use)
    } else if line.contains("CUDA error: out of memory") {
        (OomSource::PyTorch, None, None)
    } else if line.contains("OOM when allocating tensor") {
        (OomSource::TensorFlow, tensorflow_tensor_bytes(line), None)
    } else if is_resource_exhausted(line) && line.to_ascii_lowercase().contains("out of memory") {
        let requested = size_after(line, "trying to allocate ")
            .or_else(|| size_after(line, "allocating "))
            .or_else(|| size_after(line, "allocate "));
        (OomSource::Jax, requested, None)
    } else if line.contains("Out of memory while trying to allocate ") {
        // XLA's wording without its status on the line: Keras 3 compiling a TensorFlow
        // step ("Graph execution error:" ... "Out of memory while trying to allocate").
        (
            OomSource::Jax,
            size_after(line, "Out of memory while trying to allocate "),
            None,
        )
    } else if (is_resource_exhausted(line) || line.contains("ResourceExhaustedError"))
        && line.contains("failed to allocate memory")
    {
        // TensorFlow's eager ops: "ResourceExhaustedError: failed to allocate memory
        // [Op:AddV2]".
        (OomSource::TensorFlow, None, None)
    } else if is_resource_exhausted(line) && line.contains("Failed to allocate request for ") {
        (
            OomSource::Jax,
            size_after(line, "Failed to allocate request for "),
            None,
        )
    } else if line.contains("BufferAssignment OOM Debugging")
        || line.trim_start().starts_with("XLA Label:")
    {
        // XLA's OOM exception text goes on for a hundred lines of its peak buffers
        // ("XLA Label: fusion"): a tail may have kept only those.
        (OomSource::Jax, None, None)
    } else if let Some(source) = library_allocation_source(line) {
        (source, None, None)
    } else if line.contains("CUDA_ERROR_OUT_OF_MEMORY")
        || line.contains("cudaErrorMemoryAllocation")
        || (is_glog_fatal(line) && line.trim_end().ends_with(": out of memory"))
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

/// A cuDNN or cuBLAS handle that could not allocate its workspace: the log line
/// TensorFlow writes above an error that only says "cuDNN failed to initialize".
pub(super) fn library_allocation_source(line: &str) -> Option<OomSource> {
    if line.contains("CUDNN_STATUS_ALLOC_FAILED") {
        Some(OomSource::Cudnn)
    } else if line.contains("CUBLAS_STATUS_ALLOC_FAILED") {
        Some(OomSource::Cublas)
    } else if line.contains("STATUS_ALLOC_FAILED") {
        Some(OomSource::TensorFlow)
    } else {
        None
    }
}

/// An error that names no cause but sends the reader to a log line above it
/// (TensorFlow's "Failed to get convolution algorithm. This is probably because cuDNN
/// failed to initialize, so try looking to see if a warning log message was printed
/// above.", "Blas GEMM launch failed", "without BLAS support").
pub(super) fn refers_to_log_above(line: &str) -> bool {
    line.contains("cuDNN failed to initialize")
        || line.contains("Blas GEMM launch failed")
        || line.contains("without BLAS support")
}

fn is_resource_exhausted(line: &str) -> bool {
    line.contains("RESOURCE_EXHAUSTED") || line.contains("Resource exhausted")
}

/// Memory warnings the framework recovers from, or that come before the fatal message
/// of their own op (which is what decides).
fn is_recovered_warning(line: &str) -> bool {
    line.contains("The caller indicates that this is not a failure")
        || line.contains("ran out of memory trying to allocate")
        || (line.contains("failed to allocate") && line.contains("from device"))
        || (line.contains("failed to alloc ")
            && (line.contains(" on device") || line.contains(" on host")))
        || line.contains("Could not allocate pinned host memory")
}

/// TensorFlow's OOM of a tensor in host memory: not the slice's.
fn is_host_memory_tensor(line: &str) -> bool {
    line.contains("OOM when allocating tensor")
        && (line.contains("/device:CPU:") || line.contains("by allocator cpu"))
}

/// Whether `line` is an error a program ended with that is not an out-of-memory message:
/// a Python exception's first line ("ValueError: ...", "MemoryError",
/// "UnknownError (see above for traceback): ..."), C++'s "terminate called after
/// throwing", a glog fatal or failed check, a Rust panic.
pub(super) fn is_error_line(line: &str) -> bool {
    is_python_exception_line(line)
        || line.starts_with("terminate called after throwing")
        || line.contains("] Check failed:")
        || is_glog_fatal(line)
        || (line.starts_with("thread '") && line.contains("' panicked at"))
}

fn is_python_exception_line(line: &str) -> bool {
    let name = line
        .split(':')
        .next()
        .unwrap_or_default()
        .trim_end()
        .trim_end_matches(" (see above for traceback)");
    let dotted_identifier = !name.is_empty()
        && name.starts_with(|character: char| character.is_ascii_alphabetic() || character == '_')
        && name
            .chars()
            .all(|character| character.is_ascii_alphanumeric() || "._".contains(character));
    let last = name.rsplit('.').next().unwrap_or_default();
    dotted_identifier
        && (last.ends_with("Error")
            || last.ends_with("Exception")
            || last == "KeyboardInterrupt"
            || last == "SystemExit")
}

/// glog's fatal line: "F1128 00:00:00.000000 1234 file.cc:12] ..." or TensorFlow's
/// "2024-03-01 12:00:00.000000: F tensorflow/...".
fn is_glog_fatal(line: &str) -> bool {
    let bytes = line.as_bytes();
    let glog = bytes.len() > 5
        && bytes[0] == b'F'
        && bytes[1..5].iter().all(u8::is_ascii_digit)
        && bytes[5] == b' ';
    let tensorflow =
        line.starts_with(|character: char| character.is_ascii_digit()) && line.contains(": F ");
    glog || tensorflow
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

/// The cudaMallocAsync backend's numbers, each on a line of its own under "Allocation on
/// device 0 would exceed allowed memory. (out of memory)": "Requested               :
/// 2.00 GiB" and "Currently allocated     : 1.50 GiB".
fn pytorch_async_numbers(following: &[&str]) -> (Option<u64>, Option<u64>) {
    let mut requested = None;
    let mut in_use = None;
    for line in following.iter().take(8) {
        let line = line.trim_start();
        if line.starts_with("Requested") {
            requested = size_after(line, ": ");
        } else if line.starts_with("Currently allocated") {
            in_use = size_after(line, ": ");
        }
    }
    (requested, in_use)
}

/// TensorFlow's `OOM when allocating tensor with shape[32,64,512,512] and type float`:
/// the elements times the type's size.
pub(super) fn tensorflow_tensor_bytes(line: &str) -> Option<u64> {
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
pub(super) fn size_after(line: &str, marker: &str) -> Option<u64> {
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
pub(super) fn size_before(line: &str, marker: &str) -> Option<u64> {
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
