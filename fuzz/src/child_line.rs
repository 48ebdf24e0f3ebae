//! The child protocol target: what an attempt process writes on stdout and the worker
//! reads, one JSON object a line, and the run config the child reads from its command
//! line. Two directions:
//!
//! - reading: every line of the input, as the worker reads it (`ChildLine`), must read
//!   back equal after being written again; the last line read is the attempt's final
//!   line for `final_reports` under the exit codes that matter (0, 3, 1); every line as
//!   the child's `--config-json` goes through the same run-config check the child makes;
//! - writing: a line built from the input's bytes, whatever numbers they make (NaN and
//!   infinities included, which a diverging run reports), written as the child writes it,
//!   must read back as the same line (non-finite numbers as NaN, or no accuracy): a line
//!   the worker cannot read turns a finished attempt into a failed one.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::OnceLock;

use carve_core::validate::{ValidatedJob, load_job_spec_toml};
use carve_proto::ApiError;
use carve_proto::v1;
use carve_worker::attempt_process::{Observed, final_reports};
use carve_worker::child_protocol::{CheckpointLine, ChildLine, ConfigArgument};

use crate::floats_close;
use crate::spec::text_of;

/// The protocol's keys and values, for the CI mutator.
pub const CHILD_LINE_DICTIONARY: &[&[u8]] = &[
    b"\"type\"",
    b"\"started\"",
    b"\"progress\"",
    b"\"checkpoint\"",
    b"\"finished\"",
    b"\"oom\"",
    b"reserved_bytes",
    b"pid",
    b"step",
    b"total_steps",
    b"loss",
    b"samples_per_second",
    b"memory_in_use_bytes",
    b"memory_peak_bytes",
    b"location",
    b"final_loss",
    b"test_accuracy",
    b"peak_bytes",
    b"requested_bytes",
    b"in_use_bytes",
    b"limit_bytes",
    b"largest_free_bytes",
    b"batch_size",
    b"micro_batch_size",
    b"precision",
    b"recompute_segment_layers",
    b"workspace_limit_bytes",
    b"prefetch_batches",
    b"null",
    b"18446744073709551615",
    b"1e400",
    b"-1",
    b"\n",
];

pub fn fuzz_child_line(data: &[u8]) {
    if let Some(text) = text_of(data) {
        read_lines(text);
    }
    write_line(data);
}

fn read_lines(text: &str) {
    let mut final_line = None;
    for line in text.lines() {
        if let Ok(read) = serde_json::from_str::<ChildLine>(line) {
            let written = serde_json::to_string(&read)
                .unwrap_or_else(|error| panic!("a line read cannot be written: {error}"));
            let again: ChildLine = serde_json::from_str(&written).unwrap_or_else(|error| {
                panic!("a line read does not read back once written: {error}\n{written}")
            });
            assert!(
                same_line(&again, &read),
                "a line changed once written and read again: {read:?} became {again:?}"
            );
            final_line = Some(read);
        }
        if let Ok(argument) = serde_json::from_str::<ConfigArgument>(line) {
            check_config_argument(&argument);
        }
    }
    let attempt = v1::AttemptRef {
        job_id: "job-fuzz".into(),
        attempt_number: 1,
        lease_epoch: 1,
        gang_rank: None,
    };
    for exit_code in [0, 3, 1] {
        // A wait status holds the exit code in its second byte.
        let exit_status = ExitStatus::from_raw(exit_code << 8);
        let reports = final_reports(
            &attempt,
            Ok(exit_status),
            final_line.clone(),
            None,
            Observed::default(),
            &[],
        );
        assert!(
            !reports.is_empty(),
            "no report for an attempt that exited {exit_code}"
        );
    }
}

/// The child checks its config against its job with the scheduler's conversion.
fn check_config_argument(argument: &ConfigArgument) {
    let wire = v1::RunConfig::from(argument);
    assert_eq!(
        &ConfigArgument::from(&wire),
        argument,
        "the run config changed through its wire form"
    );
    match carve_proto::convert::run_config_for_job(&wire, example_job(), "config") {
        Ok(_) | Err(ApiError::InvalidArgument { .. }) => {}
        Err(other) => panic!("a bad --config-json is not an invalid argument: {other:?}"),
    }
}

fn example_job() -> &'static ValidatedJob {
    static JOB: OnceLock<ValidatedJob> = OnceLock::new();
    JOB.get_or_init(|| {
        load_job_spec_toml(include_str!("../../examples/mnist-cnn.toml"))
            .expect("the example job is valid")
    })
}

/// Reads the input as the fields of one line: a kind byte, then 8 bytes per number
/// (missing bytes are zeros), so every bit pattern of a float is reachable.
fn write_line(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let mut words = rest.chunks(8).map(|chunk| {
        let mut bytes = [0u8; 8];
        bytes[..chunk.len()].copy_from_slice(chunk);
        u64::from_le_bytes(bytes)
    });
    let mut word = || words.next().unwrap_or(0);
    let line = match kind % 5 {
        0 => ChildLine::Started {
            reserved_bytes: word(),
            pid: word() as u32,
            resumed_from: (word() & 1 == 0).then(|| CheckpointLine {
                step: word(),
                location: String::from_utf8_lossy(rest).into_owned(),
            }),
        },
        1 => ChildLine::Progress {
            step: word(),
            total_steps: word(),
            loss: f64::from_bits(word()),
            samples_per_second: f64::from_bits(word()),
            memory_in_use_bytes: word(),
            memory_peak_bytes: word(),
        },
        2 => ChildLine::Checkpoint {
            step: word(),
            location: String::from_utf8_lossy(rest).into_owned(),
        },
        3 => {
            let final_loss = f64::from_bits(word());
            let accuracy = f64::from_bits(word());
            ChildLine::Finished {
                final_loss,
                test_accuracy: (accuracy.to_bits() & 1 == 0).then_some(accuracy),
                peak_bytes: word(),
                steps: word(),
                samples_per_second: f64::from_bits(word()),
            }
        }
        _ => ChildLine::Oom {
            requested_bytes: word(),
            in_use_bytes: word(),
            limit_bytes: word(),
            largest_free_bytes: word(),
            peak_bytes: word(),
            checkpoint: Some(CheckpointLine {
                step: word(),
                location: "/checkpoints/job.ckpt".into(),
            }),
        },
    };
    // As the child writes it (attempt_child's `emit`).
    let written = serde_json::to_string(&line)
        .unwrap_or_else(|error| panic!("the child cannot write {line:?}: {error}"));
    assert!(
        !written.contains('\n'),
        "a line holds a line break: {written}"
    );
    let read: ChildLine = serde_json::from_str(&written).unwrap_or_else(|error| {
        panic!("the worker cannot read a line the child wrote: {error}\nline: {written}\nfrom: {line:?}")
    });
    assert!(
        same_line(&read, &line),
        "the line changed between the child and the worker: {line:?} became {read:?} ({written})"
    );
}

/// Whether two lines say the same, as the protocol promises to carry a line: every
/// non-finite float as NaN, a non-finite accuracy as none, and finite floats to within
/// two units in the last place ([`floats_close`]).
fn same_line(left: &ChildLine, right: &ChildLine) -> bool {
    let (left_floats, left_rest) = parts(left);
    let (right_floats, right_rest) = parts(right);
    left_rest == right_rest
        && left_floats.len() == right_floats.len()
        && left_floats
            .iter()
            .zip(&right_floats)
            .all(|(left, right)| floats_close(*left, *right))
}

/// The line's floats, and everything else as text.
fn parts(line: &ChildLine) -> (Vec<f64>, String) {
    match line {
        ChildLine::Progress {
            step,
            total_steps,
            loss,
            samples_per_second,
            memory_in_use_bytes,
            memory_peak_bytes,
        } => (
            vec![*loss, *samples_per_second],
            format!("progress {step} {total_steps} {memory_in_use_bytes} {memory_peak_bytes}"),
        ),
        ChildLine::Finished {
            final_loss,
            test_accuracy,
            peak_bytes,
            steps,
            samples_per_second,
        } => {
            let accuracy = test_accuracy.filter(|accuracy| accuracy.is_finite());
            let mut floats = vec![*final_loss, *samples_per_second];
            floats.extend(accuracy);
            (
                floats,
                format!("finished {} {peak_bytes} {steps}", accuracy.is_some()),
            )
        }
        other => (Vec::new(), format!("{other:?}")),
    }
}
