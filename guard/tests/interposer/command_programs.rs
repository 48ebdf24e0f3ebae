//! The programs command jobs run (`examples/command/`), checked without a worker: the
//! Python stand-in under the real guard and the fake driver (what CI's end-to-end command
//! job runs), the stand-in's simulated mode (what `carve dev --demo` runs), and the GPU
//! examples at least compiling.
//!
//! The stand-in's shape is `examples/command/standin.toml`'s: fixed 200 MiB, 12 MiB per
//! sample, 4 MiB more per sample from step 3, global batch 64.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::harness::{MIB, Output, World, run};

/// The workspace root (this crate lives one directory below it).
fn repository_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("carve-guard lives one directory below the workspace root")
        .to_path_buf()
}

fn standin_script() -> PathBuf {
    repository_root().join("examples/command/standin_train.py")
}

/// Whether `python3` runs here; the cases below say so and pass when it does not, as
/// on a machine without Python nothing of a command job can run anyway.
fn python_available() -> bool {
    let found = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success());
    if !found {
        println!("  (python3 not found: the command program checks are skipped)");
    }
    found
}

const GLOBAL_BATCH: u64 = 64;
const STEPS: u64 = 6;

/// The stand-in at `micro_batch` (accumulation global / micro) on the fake driver, its
/// checkpoint in `checkpoint_dir`.
fn standin(world: &World, checkpoint_dir: &Path, micro_batch: u64) -> Command {
    let mut command = world.program("python3");
    command.arg(standin_script()).args([
        "--micro-batch",
        &micro_batch.to_string(),
        "--accumulation-steps",
        &(GLOBAL_BATCH / micro_batch).to_string(),
        "--global-batch",
        &GLOBAL_BATCH.to_string(),
        "--precision",
        "fp32",
        "--checkpoint-dir",
        checkpoint_dir.to_str().expect("UTF-8 path"),
        "--steps",
        &STEPS.to_string(),
        "--fixed-mib",
        "200",
        "--per-sample-mib",
        "12",
        "--late-extra-per-sample-mib",
        "4",
        "--late-from-step",
        "3",
    ]);
    command
}

/// What the stand-in's checkpoint says, flattened by Python (this crate has no JSON
/// parser): the step, then per optimizer step `step:samples:micro_batch`.
#[derive(Debug, PartialEq)]
struct Checkpoint {
    step: u64,
    /// (step, samples, micro_batch) of every optimizer step, in order.
    optimizer_steps: Vec<(u64, u64, u64)>,
}

const SUMMARIZE_CHECKPOINT: &str = "import json, sys\n\
state = json.load(open(sys.argv[1]))\n\
print(state['step'], ' '.join('%d:%d:%d' % (s['step'], s['samples'], s['micro_batch']) \
for s in state['optimizer_steps']))\n";

fn read_checkpoint(checkpoint_dir: &Path) -> Checkpoint {
    let output = Command::new("python3")
        .args(["-c", SUMMARIZE_CHECKPOINT])
        .arg(checkpoint_dir.join("standin.json"))
        .output()
        .expect("run python3");
    assert!(output.status.success(), "{output:?}");
    let text = String::from_utf8(output.stdout).expect("UTF-8");
    let mut words = text.split_whitespace();
    let step = words.next().expect("step").parse().expect("step number");
    let optimizer_steps = words
        .map(|word| {
            let numbers: Vec<u64> = word
                .split(':')
                .map(|number| number.parse().expect("number"))
                .collect();
            (numbers[0], numbers[1], numbers[2])
        })
        .collect();
    Checkpoint {
        step,
        optimizer_steps,
    }
}

/// Every optimizer step from 1 to `STEPS` is there once, in order, and saw the global
/// batch; the micro-batch each ran at, in step order.
fn assert_every_step_saw_the_global_batch(checkpoint: &Checkpoint) -> Vec<u64> {
    assert_eq!(checkpoint.step, STEPS, "{checkpoint:?}");
    let steps: Vec<u64> = checkpoint.optimizer_steps.iter().map(|s| s.0).collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>(), "{checkpoint:?}");
    assert!(
        checkpoint
            .optimizer_steps
            .iter()
            .all(|(_, samples, _)| *samples == GLOBAL_BATCH),
        "{checkpoint:?}"
    );
    checkpoint.optimizer_steps.iter().map(|s| s.2).collect()
}

/// The `step=` of each CARVE_PROGRESS line.
fn progress_steps(output: &Output) -> Vec<u64> {
    output
        .lines
        .iter()
        .filter(|line| line.starts_with("CARVE_PROGRESS "))
        .map(|line| {
            let value = line
                .split_whitespace()
                .find_map(|pair| pair.strip_prefix("step="))
                .unwrap_or_else(|| panic!("no step in {line}"));
            value.parse().expect("step number")
        })
        .collect()
}

fn account_peak_bytes(world: &World) -> u64 {
    carve_guard_account::Account::open(&world.account_path())
        .expect("open the account")
        .usage()
        .peak_bytes
}

/// A world whose fake GPU is larger than every slice here, so refusals are the guard's.
fn roomy_world(limit_bytes: u64) -> World {
    let mut world = World::new(limit_bytes);
    world.fake_total_bytes = 4 << 30;
    world
}

pub fn standin_under_the_limit_trains_every_step_at_the_global_batch() {
    if !python_available() {
        return;
    }
    let world = roomy_world(1280 * MIB);
    let checkpoint_dir = world.dir.path().join("checkpoint");
    let output = run(world.with_guard(standin(&world, &checkpoint_dir, 64)));
    assert!(output.success, "{output:#?}");
    assert_eq!(progress_steps(&output), (1..=STEPS).collect::<Vec<_>>());
    let micro_batches = assert_every_step_saw_the_global_batch(&read_checkpoint(&checkpoint_dir));
    assert_eq!(micro_batches, [64; STEPS as usize]);
    // Through the guard, byte for byte: 200 MiB + 64 x (12 + 4) MiB from step 3.
    assert_eq!(account_peak_bytes(&world), 1224 * MIB);
    assert!(world.oom_record().is_empty(), "{:?}", world.oom_record());
}

pub fn standin_out_of_memory_then_resumed_with_accumulation() {
    if !python_available() {
        return;
    }
    // The slice a profile sizes with no margin: micro 64 needed exactly 968 MiB in its
    // first two steps, which fit it to the byte.
    let slice_bytes = 968 * MIB;
    let first = roomy_world(slice_bytes);
    let checkpoint_dir = first.dir.path().join("checkpoint");
    let output = run(first.with_guard(standin(&first, &checkpoint_dir, 64)));
    assert_eq!(output.exit_code, Some(1), "{output:#?}");
    assert_eq!(progress_steps(&output), [1, 2]);
    assert!(
        output.stderr.lines().any(|line| line.starts_with(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 MiB. \
             GPU 0 has a total capacity of 968.00 MiB of which 0 bytes is free."
        )),
        "{}",
        output.stderr
    );
    let record = first.oom_record();
    assert_eq!(record.len(), 1, "{record:?}");
    assert_eq!(
        (
            record[0].requested_bytes,
            record[0].in_use_bytes,
            record[0].limit_bytes
        ),
        (256 * MIB, 968 * MIB, slice_bytes),
        "{record:?}"
    );
    assert_eq!(read_checkpoint(&checkpoint_dir).step, 2);

    // The retry: a fresh account of the same size, micro 32 x 2, the same checkpoint.
    let retry = roomy_world(slice_bytes);
    let output = run(retry.with_guard(standin(&retry, &checkpoint_dir, 32)));
    assert!(output.success, "{output:#?}");
    assert!(
        output
            .lines
            .iter()
            .any(|line| line == "standin: resumed from step 2"),
        "{output:#?}"
    );
    assert_eq!(progress_steps(&output), [3, 4, 5, 6]);
    let micro_batches = assert_every_step_saw_the_global_batch(&read_checkpoint(&checkpoint_dir));
    assert_eq!(micro_batches, [64, 64, 32, 32, 32, 32]);
    assert_eq!(account_peak_bytes(&retry), (200 + 32 * 16) * MIB);
    assert!(retry.oom_record().is_empty());
}

pub fn standin_simulated_memory_runs_out_against_the_slice() {
    if !python_available() {
        return;
    }
    // No guard, no driver: what `carve dev --demo` runs (CARVE_SLICE_BYTES from the
    // worker, `--device-memory simulated` from standin-demo.toml).
    let dir = tempfile::tempdir().expect("temporary directory");
    let checkpoint_dir = dir.path().join("checkpoint");
    let simulated = |micro_batch: u64| {
        let world = roomy_world(0);
        let mut command = standin(&world, &checkpoint_dir, micro_batch);
        command
            .args(["--device-memory", "simulated"])
            .env("CARVE_SLICE_BYTES", (1u64 << 30).to_string());
        run(command)
    };
    let output = simulated(64);
    assert_eq!(output.exit_code, Some(1), "{output:#?}");
    assert!(
        output.stderr.contains(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 MiB. \
             GPU 0 has a total capacity of 1.00 GiB of which 56.00 MiB is free."
        ),
        "{}",
        output.stderr
    );
    assert_eq!(progress_steps(&output), [1, 2]);
    let output = simulated(16);
    assert!(output.success, "{output:#?}");
    assert_eq!(progress_steps(&output), [3, 4, 5, 6]);
    let micro_batches = assert_every_step_saw_the_global_batch(&read_checkpoint(&checkpoint_dir));
    assert_eq!(micro_batches, [64, 64, 16, 16, 16, 16]);
}

pub fn standin_other_endings_for_the_classifier() {
    if !python_available() {
        return;
    }
    // A program that catches its refusals and goes on: the guard records each one, the
    // PyTorch line is on stderr, and it still exits 0 with every step done.
    let world = roomy_world(1000 * MIB);
    let checkpoint_dir = world.dir.path().join("checkpoint");
    let mut command = world.with_guard(standin(&world, &checkpoint_dir, 64));
    command.arg("--catch-out-of-memory");
    let output = run(command);
    assert!(output.success, "{output:#?}");
    assert!(
        output
            .stderr
            .contains("torch.OutOfMemoryError: CUDA out of memory.")
    );
    assert_eq!(
        world.oom_record().len(),
        4,
        "one refusal in each of steps 3 to 6"
    );
    assert_eq!(read_checkpoint(&checkpoint_dir).step, STEPS);

    // An ordinary crash: exit 1, a traceback, no OOM anywhere.
    let world = roomy_world(1280 * MIB);
    let checkpoint_dir = world.dir.path().join("checkpoint");
    let mut command = world.with_guard(standin(&world, &checkpoint_dir, 64));
    command.args(["--fail-at-step", "2"]);
    let output = run(command);
    assert_eq!(output.exit_code, Some(1), "{output:#?}");
    assert!(
        output
            .stderr
            .contains("RuntimeError: a bug in the training script at step 2"),
        "{}",
        output.stderr
    );
    assert!(
        !output.stderr.contains("out of memory"),
        "{}",
        output.stderr
    );
    assert!(world.oom_record().is_empty());
    assert_eq!(read_checkpoint(&checkpoint_dir).step, 1);
}

/// The programs the command examples' job files run.
const EXPECTED_PROGRAMS: &[&str] = &["standin_train.py", "pytorch/train.py", "keras/train.py"];

/// Compiles (without running) every Python program under `examples/command/`: the GPU
/// examples need PyTorch or TensorFlow and run only on GPU machines, but a syntax error
/// should not wait for one. The bytecode goes to a temporary directory.
pub fn command_example_programs_compile() {
    if !python_available() {
        return;
    }
    let examples = repository_root().join("examples/command");
    let mut programs = Vec::new();
    let mut directories = vec![examples];
    while let Some(directory) = directories.pop() {
        for entry in std::fs::read_dir(&directory).expect("read examples/command") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                directories.push(path);
            } else if path.extension().is_some_and(|extension| extension == "py") {
                programs.push(path);
            }
        }
    }
    programs.sort();
    for expected in EXPECTED_PROGRAMS {
        assert!(
            programs.iter().any(|path| path.ends_with(expected)),
            "examples/command/{expected} is missing: {programs:?}"
        );
    }
    let bytecode = tempfile::tempdir().expect("temporary directory");
    for (index, program) in programs.iter().enumerate() {
        let output = Command::new("python3")
            .args([
                "-c",
                "import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True)",
            ])
            .arg(program)
            .arg(bytecode.path().join(format!("{index}.pyc")))
            .output()
            .expect("run python3");
        assert!(
            output.status.success(),
            "{} does not compile: {}",
            program.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
