//! A command job's program under its supervisor (`carve-worker supervise`, the real
//! binary), driven through the worker's attempt module with a lease that nobody renews:
//! the worker's side never stops the program (no control message comes, as from a
//! frozen worker), so only the supervisor can, at the deadline (SIGTERM) and a grace
//! later (SIGKILL). Each test fails without the supervisor (`supervision: None`): the
//! program runs on until the hang guard.
//!
//! The hostile program (hostile/lease_escape.py) needs python3, runc and root (CI has
//! them); elsewhere that test says why it did not run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use carve_core::command::validate::{ValidatedSpec, parse_spec_json};
use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use carve_worker::command_attempt::{CommandAttemptLaunch, run_command_attempt};
use carve_worker::command_supervisor::Supervision;
use carve_worker::sandbox::{Sandbox, SandboxPolicy, SandboxSettings};
use serde_json::json;
use tokio::sync::{mpsc, watch};

/// How long any run may take before the test fails (a hang guard, not a timing).
const HANG_GUARD: Duration = Duration::from_secs(60);

fn launch(
    directory: &Path,
    argv: &[&str],
    sandbox: Option<Arc<Sandbox>>,
    supervision: Supervision,
) -> CommandAttemptLaunch {
    let spec = json!({
        "name": "lease-test",
        "command": { "argv": argv, "global_batch": 8, "micro_batch": 8, "steps": 1000 },
        "resources": { "vram": "1GiB" },
    });
    let ValidatedSpec::Command(job) = parse_spec_json(&spec.to_string()).unwrap() else {
        panic!("not a command job");
    };
    let name = format!(
        "carve-lease-{}",
        directory.file_name().unwrap().to_string_lossy()
    );
    CommandAttemptLaunch {
        attempt: v1::AttemptRef {
            job_id: "job-1".into(),
            attempt_number: 1,
            ..Default::default()
        },
        config: job.initial_config(),
        job,
        slice_bytes: 64 << 20,
        gpu_uuid: "GPU-sim-test".into(),
        guard_library: None,
        checkpoint_dir: directory.join("job-1"),
        attempt_directory: directory.join("job-1.attempt-1.run"),
        profile: false,
        resume_from: None,
        sandbox,
        tenant: "alice".into(),
        image: Default::default(),
        devices: Default::default(),
        simulated_gpu_socket: None,
        container_name: name.to_lowercase(),
        supervision: Some(supervision),
    }
}

/// A lease running out `left` from now that nobody renews, with `grace` to SIGKILL.
fn unrenewed_lease(
    left: Duration,
    grace: Duration,
) -> (watch::Sender<Option<Instant>>, Supervision) {
    let (sender, deadlines) = watch::channel(Some(Instant::now() + left));
    let supervision = Supervision {
        program: PathBuf::from(env!("CARGO_BIN_EXE_carve-worker")),
        deadlines,
        grace,
    };
    (sender, supervision)
}

/// Runs the attempt; every report it sent, in order. The control channel is held open
/// and never used: the worker's side never stops the program.
async fn run(launch: CommandAttemptLaunch) -> Vec<Body> {
    let (reports, mut incoming) = mpsc::unbounded_channel();
    let (_control, control_receiver) = mpsc::unbounded_channel();
    tokio::time::timeout(
        HANG_GUARD,
        run_command_attempt(launch, reports, control_receiver, (), || {}),
    )
    .await
    .expect("the program was stopped (hang guard: nothing stopped it)");
    let mut all = Vec::new();
    while let Ok(body) = incoming.try_recv() {
        all.push(body);
    }
    all
}

fn finished(reports: &[Body]) -> &v1::worker_message::AttemptFinished {
    match reports.last() {
        Some(Body::AttemptFinished(finished)) => finished,
        other => panic!("no final report: {other:?}"),
    }
}

fn log_lines(reports: &[Body]) -> Vec<String> {
    reports
        .iter()
        .filter_map(|body| match body {
            Body::Log(line) => Some(line.message.clone()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_program_that_ignores_sigterm_is_killed_by_its_supervisor_at_the_lease_s_end() {
    let directory = tempfile::tempdir().unwrap();
    let (_renewals, supervision) =
        unrenewed_lease(Duration::from_millis(500), Duration::from_millis(500));
    let launch = launch(
        directory.path(),
        &[
            "/bin/sh",
            "-c",
            "trap '' TERM; while true; do echo alive; sleep 0.05; done",
        ],
        None,
        supervision,
    );
    let reports = run(launch).await;
    let end = finished(&reports);
    assert_eq!(
        end.outcome,
        v1::AttemptOutcome::Interrupted as i32,
        "{end:#?}"
    );
    assert!(end.message.contains("supervisor"), "{end:#?}");
    let lines = log_lines(&reports);
    assert!(
        lines
            .iter()
            .any(|line| line.starts_with("stopping: the worker did not renew")),
        "the supervisor's SIGTERM: {lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|line| line.starts_with("stopping now: the lease ran out")),
        "the supervisor's SIGKILL, for a program that ignores SIGTERM: {lines:?}"
    );
}

/// A sandbox over `directory`, or `None` (with the reason printed) where this machine
/// cannot contain anything or has no python3; in CI that is a failure.
fn sandbox(directory: &Path) -> Option<Sandbox> {
    let settings = SandboxSettings {
        policy: SandboxPolicy::Required,
        ..SandboxSettings::default()
    };
    let has_python = std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success());
    let ready = match Sandbox::open(&settings, directory, "test-node") {
        Ok(Some(sandbox)) if has_python => Ok(sandbox),
        Ok(Some(_)) => Err("no python3".to_string()),
        Ok(None) => Err("no sandbox".to_string()),
        Err(error) => Err(error.to_string()),
    };
    match ready {
        Ok(sandbox) => Some(sandbox),
        Err(reason) if std::env::var_os("CI").is_none() => {
            eprintln!("skipped: {reason} (needs python3, an OCI runtime and root)");
            None
        }
        Err(reason) => panic!("CI must be able to contain attempts: {reason}"),
    }
}

/// The host pid of the supervisor of container `name`, from its command line.
fn supervisor_of(name: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.find_map(|entry| {
        let process_id: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{process_id}/cmdline")).ok()?;
        let arguments: Vec<&[u8]> = cmdline.split(|byte| *byte == 0).collect();
        (arguments.get(1) == Some(&&b"supervise"[..])
            && arguments
                .windows(2)
                .any(|pair| pair[0] == b"--container" && pair[1] == name.as_bytes()))
        .then_some(process_id)
    })
}

#[tokio::test]
async fn a_contained_program_can_neither_kill_nor_trace_nor_renew_its_supervisor() {
    let directory = tempfile::tempdir().unwrap();
    let worker = directory.path().join("worker");
    std::fs::create_dir_all(&worker).unwrap();
    let Some(sandbox) = sandbox(&worker) else {
        return;
    };
    // Long enough for every try before the SIGTERM it ignores.
    let (_renewals, supervision) = unrenewed_lease(Duration::from_secs(4), Duration::from_secs(2));
    let jobs = directory.path().join("jobs");
    let launch = launch(
        &jobs,
        &["python3", "lease_escape.py", "{checkpoint_dir}"],
        Some(Arc::new(sandbox)),
        supervision,
    );
    std::fs::create_dir_all(&launch.attempt_directory).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hostile/lease_escape.py"),
        launch.attempt_directory.join("lease_escape.py"),
    )
    .unwrap();
    // The program is told its supervisor's host pid, as if it had guessed it.
    let container = format!("{}-1", launch.container_name);
    let pid_file = launch.checkpoint_dir.join("supervisor-pid");
    let tell = tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + HANG_GUARD;
        while tokio::time::Instant::now() < deadline {
            if let Some(process_id) = supervisor_of(&container)
                && pid_file.parent().is_some_and(Path::exists)
            {
                std::fs::write(&pid_file, process_id.to_string()).unwrap();
                return Some(process_id);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    });
    let reports = run(launch).await;
    let supervisor = tell.await.unwrap().expect("the supervisor was found");
    let lines = log_lines(&reports);
    for what in ["ptrace", "renew", "kill"] {
        let tried = format!("TRY {what} {supervisor} blocked");
        assert!(
            lines.iter().any(|line| line.starts_with(&tried)),
            "{tried}: {lines:?}"
        );
    }
    let succeeded: Vec<&String> = lines
        .iter()
        .filter(|line| line.contains("SUCCEEDED"))
        .collect();
    assert!(succeeded.is_empty(), "{succeeded:?}");
    assert!(
        lines
            .iter()
            .any(|line| line.starts_with("stopping now: the lease ran out")),
        "the supervisor outlived every try and sent SIGKILL: {lines:?}"
    );
    let end = finished(&reports);
    assert_eq!(
        end.outcome,
        v1::AttemptOutcome::Interrupted as i32,
        "{end:#?}"
    );
}
