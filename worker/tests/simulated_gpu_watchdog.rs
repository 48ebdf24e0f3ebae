//! The watchdog over simulated GPUs, against a hostile tenant who bypasses the guard:
//! one program rewrites the limit in its own guard account and takes four times its
//! slice (`tests/hostile/gpu_cap_lift.py`), another starts a child without `LD_PRELOAD`
//! (`tests/hostile/gpu_unguarded_child.py`). Their device memory is the worker's ledger
//! (`simulated_gpu_ledger.rs`), which the fake driver asks for every byte and the
//! watchdog reads by process, as it reads NVML on a real GPU: both attempts are stopped
//! and end FAILED with the watchdog's reason. The same two jobs on a worker with the
//! simulated GPUs' watchdog off (`watch_simulated_gpus = false`) hold their memory to
//! the end and succeed: each check fails without the protection.
//!
//! Contained where this machine can contain attempts (root and runc, as CI), so the
//! watchdog reads the containers' cgroups and the ledger's socket is bound at the
//! container's device path; elsewhere uncontained (process trees, the socket named in
//! the environment). Needs python3.

#[path = "support/mod.rs"]
#[allow(dead_code, reason = "the chaos test's helpers are not all used here")]
mod support;

#[path = "support/cluster.rs"]
#[allow(dead_code, reason = "not every helper is used here")]
mod cluster;

#[path = "support/guard_world.rs"]
mod guard_world;

use std::path::{Path, PathBuf};

use carve_proto::v1;
use carve_worker::gpus::SimulatedGpu;
use carve_worker::sandbox::SandboxPolicy;
use cluster::Cluster;
use guard_world::guard_world;
use serde_json::json;
use support::can_contain;

const ADMIN: &str = "carve_admin_simulated_watchdog_test_0001";

/// How long each attack holds its memory: long past the watchdog's three readings (a
/// second apart), short enough for the unwatched run to end soon.
const HOLD_SECONDS: &str = "12";

fn programs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/hostile")
        .canonicalize()
        .unwrap()
}

fn has_python() -> bool {
    std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success())
}

/// A command job running `program` with the fake driver on its library path.
fn job(name: &str, program: &str, libraries: &Path) -> String {
    json!({
        "name": name,
        "command": {
            "argv": ["python3", program, HOLD_SECONDS],
            "env": { "LD_LIBRARY_PATH": libraries.display().to_string() },
            "working_directory": programs().display().to_string(),
            "global_batch": 1,
        },
        "resources": { "vram": "256MiB" },
    })
    .to_string()
}

struct Ended {
    job: v1::Job,
    lines: Vec<String>,
}

/// Runs both attacks side by side on one worker with one simulated 2 GiB GPU, its
/// watchdog on or off, and returns how each job ended and what it printed.
async fn run_the_attacks(watched: bool) -> [Ended; 2] {
    let directory = tempfile::tempdir().unwrap();
    let (guard, libraries) = guard_world(directory.path());
    let url = format!("sqlite://{}", directory.path().join("carve.db").display());
    let contained = can_contain();
    let cluster = Cluster::start(
        directory.path(),
        url,
        PathBuf::from(env!("CARGO_BIN_EXE_carve-worker")),
        ADMIN,
        |config| {
            config.simulated_gpus = vec![SimulatedGpu {
                total_bytes: 2 << 30,
            }];
            config.watch_simulated_gpus = watched;
            config.sandbox.policy = if contained {
                SandboxPolicy::Required
            } else {
                SandboxPolicy::Off
            };
            config.sandbox.job_paths = vec![programs()];
            // The fake driver and the guard where the test's build left them.
            config.sandbox.read_only_host_paths =
                vec![guard.parent().unwrap().to_path_buf(), libraries.clone()];
            config.guard_library = Some(guard.clone());
        },
    )
    .await;
    let lift = cluster
        .submit(job("lift", "gpu_cap_lift.py", &libraries))
        .await;
    let child = cluster
        .submit(job("child", "gpu_unguarded_child.py", &libraries))
        .await;
    let mut ended = Vec::new();
    for submitted in [lift, child] {
        let job = loop {
            let job = cluster.get(&submitted.id).await;
            if [v1::JobState::Succeeded, v1::JobState::Failed]
                .iter()
                .any(|state| job.state == *state as i32)
            {
                break job;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        };
        let lines = cluster
            .attempt_lines(&job.id, 1)
            .await
            .into_iter()
            .map(|line| line.message)
            .collect();
        ended.push(Ended { job, lines });
    }
    ended.try_into().map_err(|_| "two jobs").unwrap()
}

fn failure(ended: &Ended) -> &str {
    ended
        .job
        .attempts
        .first()
        .map_or("", |attempt| attempt.failure_message.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_stops_a_guard_bypass_on_a_simulated_gpu_and_nothing_else_does() {
    if !has_python() {
        eprintln!("skipped: needs python3 (CI has it)");
        assert!(std::env::var_os("CI").is_none(), "CI runs this test");
        return;
    }
    let [lift, child] = run_the_attacks(true).await;
    for (ended, reason) in [
        (&lift, "more than its slice of 256 MiB"),
        (&child, "used the gpu without the guard"),
    ] {
        assert_eq!(
            ended.job.state,
            v1::JobState::Failed as i32,
            "{:#?}\n{:#?}",
            ended.job,
            ended.lines
        );
        assert!(
            failure(ended).contains("stopped by the worker") && failure(ended).contains(reason),
            "{}: {:?}",
            ended.job.name,
            failure(ended)
        );
        assert!(
            !ended.lines.iter().any(|line| line.contains("SUCCEEDED")),
            "{:?}",
            ended.lines
        );
    }
    // The lift held its memory before it was stopped: the attack itself worked, and the
    // watchdog is what ended it.
    assert!(
        lift.lines
            .iter()
            .any(|line| line.starts_with("holding 1024 MiB on a slice of 256 MiB")),
        "{:?}",
        lift.lines
    );

    // The same attacks with the simulated GPUs' watchdog off: both hold their memory to
    // the end, so every check above would fail without it.
    let [lift, child] = run_the_attacks(false).await;
    for (ended, attack) in [
        (&lift, "ATTACK lift_the_account_limit SUCCEEDED"),
        (&child, "ATTACK unguarded_child SUCCEEDED"),
    ] {
        assert_eq!(
            ended.job.state,
            v1::JobState::Succeeded as i32,
            "{:#?}\n{:#?}",
            ended.job,
            ended.lines
        );
        assert!(
            ended.lines.iter().any(|line| line == attack),
            "{:?}",
            ended.lines
        );
    }
}
