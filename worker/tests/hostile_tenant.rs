//! The hostile-tenant suite: tenant mallory's program (`tests/hostile/attacker.py`)
//! tries every attack of issue 26 on a worker that also runs tenant alice's job
//! (`tests/hostile/victim.py`), through the real scheduler, the real worker and real
//! containers. With the sandbox every attack is blocked, alice's job finishes with its own
//! result, and nothing mallory started outlives its attempt. The same run with the
//! sandbox switched off (`--insecure-no-sandbox`) shows every check failing: each attack
//! succeeds there, so none of the assertions could pass without the protection.
//!
//! Needs python3, runc and root, as CI has; elsewhere it says why it did not run (and
//! fails in CI).

#[path = "support/mod.rs"]
#[allow(dead_code, reason = "the chaos test's helpers are not all used here")]
mod support;

#[path = "support/cluster.rs"]
#[allow(dead_code, reason = "not every helper is used here")]
mod cluster;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use carve_proto::v1;
use carve_worker::gpus::SimulatedGpu;
use carve_worker::sandbox::{AttemptLimits, SandboxPolicy};
use cluster::{Cluster, WAIT};
use serde_json::json;
use support::{can_contain, poll_until};

const ADMIN: &str = "carve_admin_hostile_tenant_test_token_0001";

/// Every attack the attacker makes, by the name it prints.
const ATTACKS: [&str; 15] = [
    "read_worker_token_file",
    "token_in_other_processes",
    "read_victim_checkpoint",
    "overwrite_victim_checkpoint",
    "list_worker_directory",
    "write_worker_directory",
    "see_victim_process",
    "read_victim_environment",
    "signal_victim",
    "reach_scheduler",
    "write_system_directory",
    "survive_the_attempt",
    "fork_bomb",
    "host_memory",
    "fill_tmp",
];

/// Attacks whose success only the host can see (the attacker reports them blocked).
const JUDGED_ON_THE_HOST: [&str; 1] = ["survive_the_attempt"];

/// Attacks that succeed without the sandbox in this test's set-up. The token in other
/// processes does not: the in-process worker of a test holds its token in memory only.
fn succeeds_uncontained(attack: &str) -> bool {
    !JUDGED_ON_THE_HOST.contains(&attack) && attack != "token_in_other_processes"
}

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

/// A command job of `program` in `tests/hostile` with `arguments` after it.
fn job(name: &str, program: &str, arguments: &[String], env: BTreeMap<&str, &str>) -> String {
    let mut argv = vec!["python3".to_string(), program.to_string()];
    argv.extend(arguments.iter().cloned());
    json!({
        "name": name,
        "command": {
            "argv": argv,
            "env": env,
            "working_directory": programs().display().to_string(),
            "global_batch": 1,
        },
        "resources": { "vram": "128MiB" },
    })
    .to_string()
}

/// The attacker's verdicts, by attack: `true` when it says it succeeded.
fn verdicts(lines: &[v1::JobLogLine]) -> BTreeMap<String, (bool, String)> {
    lines
        .iter()
        .filter_map(|line| {
            let rest = line.message.strip_prefix("ATTACK ")?;
            let (name, verdict) = rest.split_once(' ')?;
            (name != "DONE").then(|| {
                (
                    name.to_string(),
                    (verdict.starts_with("SUCCEEDED"), verdict.to_string()),
                )
            })
        })
        .collect()
}

/// Host processes whose command line holds `marker`.
fn processes_with(marker: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let command_line = std::fs::read(entry.path().join("cmdline")).ok()?;
            String::from_utf8_lossy(&command_line)
                .contains(marker)
                .then_some(pid)
        })
        .collect()
}

struct Outcome {
    verdicts: BTreeMap<String, (bool, String)>,
    victim: v1::Job,
    survivors: Vec<u32>,
}

/// Runs alice's victim and mallory's attacker side by side on one worker, contained or
/// not, and returns what the attacker got, how the victim ended and what outlived the
/// attacker.
async fn run_the_attack(contained: bool) -> Outcome {
    let directory = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", directory.path().join("carve.db").display());
    let cluster = Cluster::start(
        directory.path(),
        url,
        PathBuf::from(env!("CARGO_BIN_EXE_carve-worker")),
        ADMIN,
        |config| {
            config.simulated_gpus = vec![SimulatedGpu {
                total_bytes: 1 << 30,
            }];
            config.sandbox.policy = if contained {
                SandboxPolicy::Required
            } else {
                SandboxPolicy::Off
            };
            config.sandbox.job_paths = vec![programs()];
            config.sandbox.limits = AttemptLimits {
                memory_bytes: 256 << 20,
                pids: 64,
                cpus: None,
                tmp_bytes: 64 << 20,
                shm_bytes: 64 << 20,
            };
        },
    )
    .await;
    // The worker's token as an operator keeps it: a file only the worker may read.
    let token_file = directory.path().join("worker-token");
    std::fs::write(&token_file, &cluster.worker_token).unwrap();
    std::fs::set_permissions(
        &token_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let [mallory] = carve_testing::cluster::tenant_with_tokens(
        &cluster.channel,
        ADMIN,
        "mallory",
        v1::Quota::default(),
        &[v1::Role::User],
    )
    .await
    .try_into()
    .expect("one token");

    let victim = cluster
        .submit(job(
            "victim",
            "victim.py",
            &["{checkpoint_dir}".to_string()],
            BTreeMap::from([("VICTIM_SECRET", "alice-s-secret")]),
        ))
        .await;
    let victim_checkpoints = cluster.checkpoints.join(&victim.id);
    poll_until(
        WAIT,
        Duration::from_millis(50),
        "the victim is ready",
        || victim_checkpoints.join("ready").exists().then_some(()),
    )
    .await;
    let port = cluster.address.rsplit(':').next().unwrap().to_string();
    let attacker = cluster
        .submit_as(
            &mallory,
            job(
                "attacker",
                "attacker.py",
                &[
                    victim_checkpoints.display().to_string(),
                    cluster.checkpoints.display().to_string(),
                    token_file.display().to_string(),
                    port,
                    "{checkpoint_dir}".to_string(),
                ],
                BTreeMap::new(),
            ),
        )
        .await;
    let attacker = cluster
        .wait_for_state_as(&mallory, &attacker.id, v1::JobState::Succeeded)
        .await;
    let lines = cluster.attempt_lines_as(&mallory, &attacker.id, 1).await;
    assert!(
        lines.iter().any(|line| line.message == "ATTACKS DONE"),
        "the attacker ran to its end: {lines:#?}"
    );
    // The attacker has ended: what it left running would show now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let survivors = processes_with("hostile-survivor");
    for survivor in &survivors {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(*survivor as i32).unwrap(),
            rustix::process::Signal::KILL,
        );
    }
    std::fs::write(victim_checkpoints.join("release"), "go").unwrap();
    let victim_job = loop {
        let job = cluster.get(&victim.id).await;
        if [v1::JobState::Succeeded, v1::JobState::Failed]
            .iter()
            .any(|state| job.state == *state as i32)
        {
            break job;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = std::fs::remove_file(cluster.checkpoints.join("planted-by-mallory"));
    Outcome {
        verdicts: verdicts(&lines),
        victim: victim_job,
        survivors,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_tenant_is_contained_and_every_check_fails_without_the_sandbox() {
    if !has_python() || !can_contain() {
        eprintln!("skipped: needs python3, an OCI runtime and root (CI has them)");
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the hostile-tenant suite"
        );
        return;
    }

    let contained = run_the_attack(true).await;
    eprintln!("contained: {:#?}", contained.verdicts);
    for attack in ATTACKS {
        let (succeeded, verdict) = contained
            .verdicts
            .get(attack)
            .unwrap_or_else(|| panic!("{attack} was tried: {:#?}", contained.verdicts));
        assert!(!succeeded, "{attack} got through the sandbox: {verdict}");
    }
    assert!(
        contained.survivors.is_empty(),
        "a process outlived its contained attempt: {:?}",
        contained.survivors
    );
    assert_eq!(
        contained.victim.state,
        v1::JobState::Succeeded as i32,
        "the victim kept its own result: {:#?}",
        contained.victim
    );

    // The same attacks with the protection off: each check above would fail.
    let uncontained = run_the_attack(false).await;
    eprintln!("uncontained: {:#?}", uncontained.verdicts);
    for attack in ATTACKS.iter().filter(|attack| succeeds_uncontained(attack)) {
        let (succeeded, verdict) = &uncontained.verdicts[*attack];
        assert!(
            succeeded,
            "{attack} should succeed without the sandbox, or the check proves nothing: \
             {verdict}"
        );
    }
    assert!(
        !uncontained.survivors.is_empty(),
        "without the sandbox a setsid process outlives its attempt"
    );
    assert_eq!(
        uncontained.victim.state,
        v1::JobState::Failed as i32,
        "without the sandbox the victim's weights were changed: {:#?}",
        uncontained.victim
    );
}
