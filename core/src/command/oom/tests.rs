//! Real messages from each framework as fixtures, and how a run's end is classified.

use super::messages::{size_after, size_before};
use super::*;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

const PYTORCH_2: &str = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.02 GiB memory in use. Of the allocated memory 76.50 GiB is allocated by PyTorch, and 1.02 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)";

const PYTORCH_1: &str = "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB already allocated; 3.44 MiB free; 14.60 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.";

const PYTORCH_1_WITHOUT_RESERVED: &str = "RuntimeError: CUDA out of memory. Tried to allocate 512.00 KiB (GPU 0; 7.79 GiB total capacity; 6.50 GiB already allocated; 0 bytes free)";

const PYTORCH_ASYNC: &str = "RuntimeError: CUDA error: out of memory";

const TENSORFLOW_TENSOR: &str = "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor with shape[32,64,512,512] and type float on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc";

const TENSORFLOW_BFC: &str = "2024-03-01 12:00:00.000000: W tensorflow/tsl/framework/bfc_allocator.cc:485] Allocator (GPU_0_bfc) ran out of memory trying to allocate 2.00GiB (rounded to 2147483648)requested by op Conv2D";

const JAX: &str = "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes.";

const CUBLAS: &str =
    "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`";

const CUDNN: &str = "tensorflow.python.framework.errors_impl.UnknownError: Failed to get convolution algorithm. This is probably because cuDNN failed to initialize: CUDNN_STATUS_ALLOC_FAILED";

const TENSORFLOW_STATUS: &str = "E tensorflow/stream_executor/cuda/cuda_blas.cc:232] failed to create cublas handle: STATUS_ALLOC_FAILED";

const CUDA_DRIVER: &str = "standin: cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2)";

fn found(line: &str) -> FrameworkOom {
    find_framework_oom([line]).unwrap_or_else(|| panic!("no OOM found in {line:?}"))
}

/// `GiB`-with-two-decimals numbers as a framework would have rounded them.
fn hundredths_of_gib(hundredths: u64) -> u64 {
    (hundredths as f64 / 100.0 * GIB as f64).round() as u64
}

#[test]
fn pytorch_2_gives_the_request_and_what_its_allocator_held() {
    let oom = found(PYTORCH_2);
    assert_eq!(oom.source, OomSource::PyTorch);
    assert_eq!(oom.requested_bytes, Some(2 * GIB));
    assert_eq!(
        oom.in_use_bytes,
        Some(hundredths_of_gib(7650) + hundredths_of_gib(102))
    );
    assert_eq!(oom.line.chars().count(), EVIDENCE_LINE_CHARACTERS);
    assert!(
        oom.line
            .starts_with("torch.OutOfMemoryError: CUDA out of memory.")
    );
}

#[test]
fn pytorch_1_gives_the_request_and_the_reserved_total() {
    let oom = found(PYTORCH_1);
    assert_eq!(oom.source, OomSource::PyTorch);
    assert_eq!(oom.requested_bytes, Some(20 * MIB));
    assert_eq!(oom.in_use_bytes, Some(hundredths_of_gib(1460)));
    let oom = found(PYTORCH_1_WITHOUT_RESERVED);
    assert_eq!(oom.requested_bytes, Some(512 << 10));
    assert_eq!(oom.in_use_bytes, Some(hundredths_of_gib(650)));
}

#[test]
fn the_cuda_malloc_async_wording_is_pytorch_without_numbers() {
    let oom = found(PYTORCH_ASYNC);
    assert_eq!(oom.source, OomSource::PyTorch);
    assert_eq!((oom.requested_bytes, oom.in_use_bytes), (None, None));
}

#[test]
fn tensorflow_gives_the_tensor_size_from_its_shape_and_type() {
    let oom = found(TENSORFLOW_TENSOR);
    assert_eq!(oom.source, OomSource::TensorFlow);
    assert_eq!(oom.requested_bytes, Some(32 * 64 * 512 * 512 * 4));
    for (type_name, size) in [
        ("half", 2),
        ("bfloat16", 2),
        ("double", 8),
        ("int32", 4),
        ("int64", 8),
    ] {
        let line = TENSORFLOW_TENSOR.replace("type float", &format!("type {type_name}"));
        assert_eq!(
            found(&line).requested_bytes,
            Some(32 * 64 * 512 * 512 * size)
        );
    }
    let unknown_type = TENSORFLOW_TENSOR.replace("type float", "type variant");
    assert_eq!(found(&unknown_type).requested_bytes, None);
    let scalar = TENSORFLOW_TENSOR.replace("shape[32,64,512,512]", "shape[]");
    assert_eq!(found(&scalar).requested_bytes, Some(4));
    let absurd = TENSORFLOW_TENSOR.replace("[32,64,512,512]", "[4294967296,4294967296,16]");
    assert_eq!(found(&absurd).requested_bytes, None);
}

/// The BFC allocator's "ran out of memory trying to allocate" is a warning: either the
/// caller recovers ("The caller indicates that this is not a failure") or the op's own
/// fatal "OOM when allocating tensor" follows it, which is the message that counts. It
/// used to be read as an OOM by itself, which turned a recovered warning followed by an
/// unrelated error into a false OOM (issue 28).
#[test]
fn tensorflow_bfc_allocator_warnings_are_not_an_oom_by_themselves() {
    assert_eq!(find_framework_oom([TENSORFLOW_BFC]), None);
    let recovered = "2024-03-01 12:00:00.000000: W tensorflow/tsl/framework/bfc_allocator.cc:296] Allocator (GPU_0_bfc) ran out of memory trying to allocate 2.26GiB with freed_by_count=0. The caller indicates that this is not a failure, but this may mean that there could be performance gains if more memory were available.";
    assert_eq!(find_framework_oom([recovered]), None);
    let then_the_op = [TENSORFLOW_BFC, TENSORFLOW_TENSOR];
    let oom = find_framework_oom(then_the_op).unwrap();
    assert_eq!(oom.requested_bytes, Some(32 * 64 * 512 * 512 * 4));
}

#[test]
fn a_recovered_warning_then_an_unrelated_error_is_that_error() {
    let recovered = "2024-03-01 12:00:00.000000: W tensorflow/tsl/framework/bfc_allocator.cc:296] Allocator (GPU_0_bfc) ran out of memory trying to allocate 2.26GiB with freed_by_count=0. The caller indicates that this is not a failure, but this may mean that there could be performance gains if more memory were available.";
    let stderr = lines(&[
        recovered,
        "Traceback (most recent call last):",
        "  File \"train.py\", line 40, in <module>",
        "    model.fit(x, y)",
        "ValueError: Shapes (None, 10) and (None, 1) are incompatible",
    ]);
    let CommandRunEnd::Failed { message } = classify_command_exit(&exit(Some(1), None, &stderr))
    else {
        panic!("expected a failure");
    };
    assert!(message.ends_with("are incompatible"), "{message}");
    // Without the traceback's head (a tail that lost it) the error line still decides.
    assert_eq!(
        find_framework_oom([recovered, "ValueError: bad shape"]),
        None
    );
}

#[test]
fn jax_gives_the_request_in_bytes() {
    let oom = found(JAX);
    assert_eq!(oom.source, OomSource::Jax);
    assert_eq!(oom.requested_bytes, Some(1_073_741_824));
    let older = "RESOURCE_EXHAUSTED: Out of memory allocating 34359738368 bytes.";
    assert_eq!(found(older).requested_bytes, Some(34_359_738_368));
    // A JAX line quoting the driver's status is JAX's.
    let quoting = "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB: CUDA_ERROR_OUT_OF_MEMORY";
    let oom = found(quoting);
    assert_eq!(oom.source, OomSource::Jax);
    assert_eq!(oom.requested_bytes, Some(8 * GIB));
}

#[test]
fn library_and_driver_statuses_name_their_source() {
    assert_eq!(found(CUBLAS).source, OomSource::Cublas);
    assert_eq!(found(CUDNN).source, OomSource::Cudnn);
    assert_eq!(found(TENSORFLOW_STATUS).source, OomSource::TensorFlow);
    assert_eq!(found(CUDA_DRIVER).source, OomSource::Cuda);
    assert_eq!(
        found("cudaErrorMemoryAllocation: out of memory").source,
        OomSource::Cuda
    );
    assert_eq!(OomSource::Cublas.name(), "cublas");
}

#[test]
fn ordinary_lines_are_not_out_of_memory() {
    let lines = [
        "Epoch 1/10",
        "CARVE_PROGRESS step=3 total_steps=10 loss=0.5",
        "checking for out of memory conditions: none",
        "RESOURCE_EXHAUSTED: quota exceeded for requests",
        "Traceback (most recent call last):",
        "",
    ];
    assert_eq!(find_framework_oom(lines), None);
}

#[test]
fn the_first_message_wins() {
    let lines = ["Traceback (most recent call last):", PYTORCH_1, JAX];
    assert_eq!(
        find_framework_oom(lines).unwrap().source,
        OomSource::PyTorch
    );
}

#[test]
fn sizes_are_read_in_every_written_form() {
    assert_eq!(size_after("x 2.00 GiB", "x "), Some(2 * GIB));
    assert_eq!(size_after("x 2.00GiB.", "x "), Some(2 * GIB));
    assert_eq!(size_after("x 20.00 MiB (GPU", "x "), Some(20 * MIB));
    assert_eq!(size_after("x 1073741824 bytes.", "x "), Some(GIB));
    assert_eq!(size_after("x 4096", "x "), Some(4096));
    assert_eq!(size_after("x 1.5 GB", "x "), Some(1_500_000_000));
    assert_eq!(size_after("x lots", "x "), None);
    assert_eq!(size_after("x 3 parsecs", "x "), None);
    assert_eq!(size_after("nothing here", "x "), None);
    assert_eq!(size_after("x 99999999999999 TiB", "x "), Some(u64::MAX));
    assert_eq!(
        size_before("has 14.56 GiB already allocated", " already"),
        Some(hundredths_of_gib(1456))
    );
    assert_eq!(size_before("has 0 bytes free", " free"), Some(0));
    assert_eq!(
        size_before("(1.5GiB reserved", " reserved"),
        Some(1_610_612_736)
    );
    assert_eq!(size_before("GiB reserved", " reserved"), None);
}

fn lines(text: &[&str]) -> Vec<String> {
    text.iter().map(|line| line.to_string()).collect()
}

fn exit<'a>(exit_code: Option<i32>, signal: Option<i32>, stderr: &'a [String]) -> CommandExit<'a> {
    CommandExit {
        exit_code,
        signal,
        guard_refusal: None,
        stderr_tail: stderr,
        slice_bytes: 8 * GIB,
        peak_bytes: 7 * GIB,
        host_memory_limit_reached: None,
    }
}

#[test]
fn exit_0_is_success_even_after_an_oom_the_program_caught() {
    let stderr = lines(&[PYTORCH_2, "caught it, going on with a smaller batch"]);
    assert_eq!(
        classify_command_exit(&exit(Some(0), None, &stderr)),
        CommandRunEnd::Succeeded
    );
}

#[test]
fn the_guards_refusal_comes_first() {
    let stderr = lines(&[PYTORCH_2]);
    let refusal = OutOfMemory {
        requested: 64 * MIB,
        in_use: 8 * GIB - 10 * MIB,
        limit: 8 * GIB,
        largest_free: 10 * MIB,
        peak: 8 * GIB - 10 * MIB,
    };
    let end = classify_command_exit(&CommandExit {
        guard_refusal: Some(refusal),
        ..exit(Some(1), None, &stderr)
    });
    match end {
        CommandRunEnd::OutOfMemory {
            source,
            report,
            evidence,
        } => {
            assert_eq!(source, OomSource::Guard);
            assert_eq!(report, refusal);
            assert!(evidence.contains("64 MiB"), "{evidence}");
            assert!(evidence.contains("8 GiB slice"), "{evidence}");
        }
        other => panic!("expected an OOM, got {other:?}"),
    }
    // A signal with a refusal is an OOM too.
    let end = classify_command_exit(&CommandExit {
        guard_refusal: Some(refusal),
        ..exit(None, Some(6), &stderr)
    });
    assert!(matches!(
        end,
        CommandRunEnd::OutOfMemory {
            source: OomSource::Guard,
            ..
        }
    ));
}

#[test]
fn a_framework_message_is_an_oom_with_its_numbers() {
    let stderr = lines(&[
        "Traceback (most recent call last):",
        "  File \"train.py\"",
        PYTORCH_1,
    ]);
    // A 16 GiB slice: the message's 14.60 GiB fits in it, so it is a measurement.
    match classify_command_exit(&CommandExit {
        slice_bytes: 16 * GIB,
        ..exit(Some(1), None, &stderr)
    }) {
        CommandRunEnd::OutOfMemory {
            source,
            report,
            evidence,
        } => {
            assert_eq!(source, OomSource::PyTorch);
            assert_eq!(report.requested, 20 * MIB);
            assert_eq!(report.in_use, hundredths_of_gib(1460));
            assert_eq!(report.limit, 16 * GIB);
            assert_eq!(report.peak, hundredths_of_gib(1460));
            assert_eq!(report.largest_free, 16 * GIB - hundredths_of_gib(1460));
            assert!(evidence.starts_with("RuntimeError: CUDA out of memory"));
        }
        other => panic!("expected an OOM, got {other:?}"),
    }
}

#[test]
fn numbers_a_framework_leaves_out_come_from_the_slice_and_the_peak() {
    let stderr = lines(&[CUBLAS]);
    match classify_command_exit(&exit(Some(1), None, &stderr)) {
        CommandRunEnd::OutOfMemory { source, report, .. } => {
            assert_eq!(source, OomSource::Cublas);
            assert_eq!(report.in_use, 7 * GIB);
            assert_eq!(report.requested, GIB);
            assert_eq!(report.limit, 8 * GIB);
            assert_eq!(report.largest_free, GIB);
            assert_eq!(report.peak, 7 * GIB);
        }
        other => panic!("expected an OOM, got {other:?}"),
    }
}

#[test]
fn any_other_exit_is_a_failure_with_the_last_lines_of_stderr() {
    let stderr: Vec<String> = (1..=30).map(|index| format!("line {index}")).collect();
    let CommandRunEnd::Failed { message } = classify_command_exit(&exit(Some(2), None, &stderr))
    else {
        panic!("expected a failure");
    };
    assert!(message.starts_with("exited with status 2; the last lines of stderr:\nline 11\n"));
    assert!(message.ends_with("line 30"));
    assert!(!message.contains("line 10\n"));
    // Killed by the kernel's OOM killer in a container at its host memory limit: the
    // program's own failure (a retry would only be killed again).
    let CommandRunEnd::Failed { message } = classify_command_exit(&CommandExit {
        host_memory_limit_reached: Some(GIB),
        ..exit(None, Some(9), &[])
    }) else {
        panic!("expected a failure");
    };
    assert!(
        message.starts_with(
            "killed by signal 9 (SIGKILL) by the kernel: its container reached its host \
             memory limit of 1 GiB"
        ),
        "{message}"
    );
    // Killed from outside: an interruption, retried from the checkpoint.
    let CommandRunEnd::Interrupted { message } = classify_command_exit(&exit(None, Some(9), &[]))
    else {
        panic!("expected an interruption");
    };
    assert_eq!(
        message,
        "killed by signal 9 (SIGKILL), which the worker did not send; stderr was empty"
    );
    // A fault of its own is the program's failure.
    let CommandRunEnd::Failed { message } = classify_command_exit(&exit(None, Some(11), &[]))
    else {
        panic!("expected a failure");
    };
    assert!(message.starts_with("killed by signal 11"), "{message}");
    let CommandRunEnd::Interrupted { message } = classify_command_exit(&exit(None, Some(64), &[]))
    else {
        panic!("expected an interruption");
    };
    assert_eq!(
        message,
        "killed by signal 64, which the worker did not send; stderr was empty"
    );
    let CommandRunEnd::Failed { message } = classify_command_exit(&exit(None, None, &[])) else {
        panic!("expected a failure");
    };
    assert!(message.starts_with("ended without an exit status"));
}

#[test]
fn a_failure_message_stays_under_4_kib() {
    let stderr: Vec<String> = (0..100).map(|_| "é".repeat(5000)).collect();
    let CommandRunEnd::Failed { message } = classify_command_exit(&exit(Some(1), None, &stderr))
    else {
        panic!("expected a failure");
    };
    assert!(message.len() < 4096, "{} bytes", message.len());
    assert_eq!(message.lines().count(), 21);
    assert!(message.lines().nth(1).unwrap().ends_with("..."));
}

#[test]
fn every_detector_reads_back_from_its_name_and_an_unknown_one_is_refused() {
    for source in OomSource::ALL {
        assert_eq!(OomSource::from_name(source.name()), Ok(source));
        assert_eq!(source.to_string(), source.name());
    }
    let refused = OomSource::from_name("telepathy").unwrap_err();
    assert!(
        refused
            .reason
            .contains("\"telepathy\" is not an out-of-memory detector (allocator, guard"),
        "{refused:?}"
    );
}

/// Issue 28: PyTorch's numbers in a 2 GiB slice said 77.52 GiB held ("total capacity of
/// 79.19 GiB"), the framework's view of the whole GPU: they must not become the peak.
#[test]
fn numbers_above_the_slice_are_the_whole_gpus_not_this_attempts() {
    let pytorch = PYTORCH_2.replace("79.10 GiB", "79.19 GiB");
    let stderr = lines(&[&pytorch]);
    let in_a_2_gib_slice = |peak_bytes| CommandExit {
        slice_bytes: 2 * GIB,
        peak_bytes,
        ..exit(Some(1), None, &stderr)
    };
    let CommandRunEnd::OutOfMemory {
        report, evidence, ..
    } = classify_command_exit(&in_a_2_gib_slice(GIB + 512 * MIB))
    else {
        panic!("expected an OOM");
    };
    // In use and the peak are the account's; the 2 GiB request fits the slice and stays.
    assert_eq!(report.in_use, GIB + 512 * MIB);
    assert_eq!(report.peak, GIB + 512 * MIB);
    assert_eq!(report.requested, 2 * GIB);
    assert_eq!(report.limit, 2 * GIB);
    assert!(
        evidence.ends_with(
            "[numbers above the 2 GiB slice not used: in use 77.52 GiB; the framework's \
             view of the whole GPU, not this attempt's]"
        ),
        "{evidence}"
    );
    // A simulated GPU measured nothing: the run needed the whole slice, no more known.
    let CommandRunEnd::OutOfMemory { report, .. } = classify_command_exit(&in_a_2_gib_slice(0))
    else {
        panic!("expected an OOM");
    };
    assert_eq!(
        (report.in_use, report.peak, report.requested),
        (0, 0, 2 * GIB)
    );
    // TensorFlow's shape[256,32,1024,1024] float is 32 GiB: not this attempt's request.
    let tensorflow = TENSORFLOW_TENSOR.replace("[32,64,512,512]", "[256,32,1024,1024]");
    let stderr = lines(&[&tensorflow]);
    let CommandRunEnd::OutOfMemory {
        report, evidence, ..
    } = classify_command_exit(&CommandExit {
        slice_bytes: 2 * GIB,
        peak_bytes: 0,
        ..exit(Some(1), None, &stderr)
    })
    else {
        panic!("expected an OOM");
    };
    assert_eq!((report.in_use, report.requested), (0, 2 * GIB));
    assert!(evidence.contains("requested 32 GiB"), "{evidence}");
    // A peak the worker reports above the slice is never taken as in use.
    let CommandRunEnd::OutOfMemory { report, .. } =
        classify_command_exit(&in_a_2_gib_slice(3 * GIB))
    else {
        panic!("expected an OOM");
    };
    assert_eq!((report.in_use, report.requested), (2 * GIB, 2 * GIB));
    // Nor as the peak: where the guard counted nothing, the peak is the program's own
    // report, and a program may report anything.
    assert_eq!(report.peak, 2 * GIB);
}

/// Where the error a program ended with starts: only its lines can make an OOM.
#[test]
fn only_the_error_the_program_ended_with_counts() {
    // An OOM traceback logged and handled, then another error's: that error.
    let handled = [
        "Traceback (most recent call last):",
        "  File \"loop.py\", line 30, in step",
        PYTORCH_1,
        "INFO step 120 loss 2.1",
        "Traceback (most recent call last):",
        "  File \"main.py\", line 14, in <module>",
        "KeyError: 'lr'",
    ];
    assert_eq!(find_framework_oom(handled), None);
    // Chained to it ("During handling ..."): the OOM is the chain's cause.
    let chained = [
        "Traceback (most recent call last):",
        "  File \"loop.py\", line 30, in step",
        PYTORCH_1,
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        "  File \"main.py\", line 14, in <module>",
        "RuntimeError: giving up",
    ];
    assert_eq!(
        find_framework_oom(chained).map(|oom| oom.source),
        Some(OomSource::PyTorch)
    );
    // A frame's code is the program's, not what it said.
    let in_a_frame = [
        "Traceback (most recent call last):",
        "  File \"train.py\", line 9, in <module>",
        "    raise SystemExit('CUDA out of memory is handled elsewhere')",
        "ValueError: bad config",
    ];
    assert_eq!(find_framework_oom(in_a_frame), None);
    // IPython's header names the exception first.
    let ipython = [
        "ValueError                                Traceback (most recent call last)",
        "Cell In[3], line 2",
        "ValueError: bad config",
    ];
    assert_eq!(find_framework_oom(ipython), None);
    // An exception ignored at shutdown did not end the program.
    let ignored = [
        "Traceback (most recent call last):",
        "  File \"train.py\", line 9, in <module>",
        JAX,
        "Exception ignored in: <function Pool.__del__ at 0x7f>",
        "Traceback (most recent call last):",
        "  File \"pool.py\", line 3, in __del__",
        "AttributeError: 'NoneType' object has no attribute 'close'",
    ];
    assert_eq!(
        find_framework_oom(ignored).map(|oom| oom.source),
        Some(OomSource::Jax)
    );
    // Without a traceback, the last error line decides; ordinary lines after it do not.
    assert_eq!(find_framework_oom(["MemoryError", "Epoch 2/10"]), None);
    assert_eq!(
        find_framework_oom(["ValueError: x", CUDA_DRIVER, "cleaning up"]).map(|oom| oom.source),
        Some(OomSource::Cuda)
    );
    // Nothing that is an error at all: not an OOM.
    assert_eq!(find_framework_oom(["Epoch 1/10", "Killed"]), None);
}

#[test]
fn error_lines_are_told_from_ordinary_ones() {
    use super::messages::is_error_line;
    for error in [
        "ValueError: bad",
        "MemoryError",
        "numpy.core._exceptions._ArrayMemoryError: Unable to allocate 3 GiB",
        "UnknownError (see above for traceback): Failed to get convolution algorithm",
        "KeyboardInterrupt",
        "terminate called after throwing an instance of 'std::bad_alloc'",
        "F1128 00:00:00.000000 1234 main.cc:12] Check failed: ok",
        "2024-03-01 12:00:00.000000: F tensorflow/core/kernels/x.cc:9] boom",
        "thread 'main' panicked at src/main.rs:3:5:",
    ] {
        assert!(is_error_line(error), "{error}");
    }
    for ordinary in [
        "Epoch 1/10",
        "WARNING:root:memory is low",
        "INFO:trainer:step 3 loss 0.2",
        "1/100 [..............................] - loss: 0.5",
        "  File \"train.py\", line 3, in <module>",
        "Error rate 0.02 at step 30",
        "",
    ] {
        assert!(!is_error_line(ordinary), "{ordinary}");
    }
}

/// A tenant's program writes its own stderr: a forged message with absurd numbers
/// must not size anything beyond its slice (with the slice check off, these reports
/// would carry exabytes into the retry plan).
#[test]
fn forged_numbers_stay_inside_the_slice() {
    for forged in [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 99999999999 TiB. Of the allocated memory 88888888888 TiB is allocated by PyTorch, and 7 TiB is reserved by PyTorch but unallocated.",
        "RuntimeError: CUDA out of memory. Tried to allocate 18446744073709551615 bytes (GPU 0; 1 TiB total capacity; 17 EiB already allocated; 99999 TiB reserved in total by PyTorch)",
        "ResourceExhaustedError: OOM when allocating tensor with shape[4294967295,4294967295] and type complex128 on /job:localhost/replica:0/task:0/device:GPU:0",
        "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1e308 bytes.",
        "torch.OutOfMemoryError: Allocation on device 0 would exceed allowed memory. (out of memory)",
    ] {
        let stderr = lines(&[
            forged,
            "Currently allocated     : 9999999 TiB",
            "Requested               : 9999999 TiB",
        ]);
        let CommandRunEnd::OutOfMemory { report, .. } =
            classify_command_exit(&exit(Some(1), None, &stderr))
        else {
            panic!("expected an OOM for {forged}");
        };
        assert!(report.in_use <= report.limit, "{forged}: {report:?}");
        assert!(report.requested <= report.limit, "{forged}: {report:?}");
        assert_eq!(report.peak, 7 * GIB, "{forged}");
    }
}
