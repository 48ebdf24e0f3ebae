//! Members of a gang (issue 31) launched through the worker's own code, with no
//! scheduler: `carve_worker::gang_member` reads each member's assignment (one-node gang,
//! master port 0: the worker picks it), and `run_gang_member_attempt` runs it as a command
//! attempt on its own simulated GPU, slice and directories, contained when this machine
//! can contain (runc and root; elsewhere the containment checks say why they are skipped
//! and CI fails). The program is `examples/command/gang_data_parallel.py`, the stand-in
//! data-parallel trainer: two members train together and report the same losses as one
//! process with the same global batch; a member whose peer never starts fails with the
//! rendezvous reason; and a hostile member cannot read another member's checkpoint or
//! attempt directory when contained, which it can when not (the same attack, uncontained,
//! is the check that the assertion fails with the protection off).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use carve_core::command::validate::{ValidatedCommandJob, ValidatedSpec, parse_spec_json};
use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use carve_worker::command_attempt::{CommandAttemptLaunch, run_gang_member_attempt};
use carve_worker::gang_member::{
    GangMemberLaunch, GangPorts, member_checkpoint_directory, member_launch,
};
use carve_worker::sandbox::{Sandbox, SandboxPolicy, SandboxSettings};
use serde_json::json;
use tokio::sync::mpsc;

const MIB: u64 = 1 << 20;
/// A hang guard, never a timing assertion: no member here should take a tenth of it.
const WAIT: Duration = Duration::from_secs(120);
const TENANT: &str = "tenant-gang";
const JOB_ID: &str = "job-gang";

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/command")
        .canonicalize()
        .unwrap()
}

/// A command job running `argv` in `examples/command/`, global batch 32 in micro-batches
/// of `micro_batch`, 5 steps.
fn job(argv: &[&str], micro_batch: u64) -> ValidatedCommandJob {
    let spec = json!({
        "name": "gang-test",
        "command": {
            "argv": argv,
            "working_directory": examples().display().to_string(),
            "global_batch": 32,
            "micro_batch": micro_batch,
            "steps": 5,
        },
        "resources": { "vram": "256MiB" },
    });
    match parse_spec_json(&spec.to_string()).expect("a valid command job") {
        ValidatedSpec::Command(job) => job,
        ValidatedSpec::Model(_) => panic!("not a command job"),
    }
}

/// The stand-in, every gang value from its placeholders.
fn trainer(micro_batch: u64) -> ValidatedCommandJob {
    job(
        &[
            "python3",
            "gang_data_parallel.py",
            "--rank",
            "{rank}",
            "--world-size",
            "{world_size}",
            "--master-addr",
            "{master_addr}",
            "--master-port",
            "{master_port}",
            "--micro-batch",
            "{micro_batch}",
            "--accumulation-steps",
            "{accumulation_steps}",
            "--global-batch",
            "{global_batch}",
            "--checkpoint-dir",
            "{checkpoint_dir}",
            "--steps",
            "{max_steps}",
            "--device-memory",
            "simulated",
        ],
        micro_batch,
    )
}

/// The assignment's gang for member `rank` of a gang of `world_size` on this one node.
fn one_node_gang(
    gang_id: &str,
    rank: u32,
    world_size: u32,
    timeout_seconds: i64,
) -> v1::GangMember {
    v1::GangMember {
        gang_id: gang_id.into(),
        rank,
        world_size,
        local_rank: rank,
        local_world_size: world_size,
        node_rank: 0,
        master_addr: String::new(),
        master_port: 0,
        rendezvous_timeout: Some(prost_types::Duration {
            seconds: timeout_seconds,
            nanos: 0,
        }),
    }
}

/// Where the worker's directories are, and whether its attempts are contained.
struct Node {
    directory: tempfile::TempDir,
    sandbox: Option<Arc<Sandbox>>,
}

impl Node {
    fn uncontained() -> Node {
        Node {
            directory: node_directory(),
            sandbox: None,
        }
    }

    /// A node that contains its attempts, or `None` (with the reason printed) where
    /// this machine cannot; in CI that is a failure.
    fn contained() -> Option<Node> {
        let directory = node_directory();
        let settings = SandboxSettings {
            policy: SandboxPolicy::Required,
            job_paths: vec![examples()],
            ..SandboxSettings::default()
        };
        match Sandbox::open(&settings, &directory.path().join("worker"), "gang-node") {
            Ok(sandbox) => Some(Node {
                directory,
                sandbox: sandbox.map(Arc::new),
            }),
            Err(error) if std::env::var_os("CI").is_none() => {
                eprintln!("skipped the contained part: no sandbox on this machine ({error})");
                None
            }
            Err(error) => panic!("CI must be able to contain attempts: {error}"),
        }
    }

    fn checkpoints(&self) -> PathBuf {
        self.directory.path().join("checkpoints")
    }

    /// The job's directory, as the worker names it (`job_directory`).
    fn job_directory(&self) -> PathBuf {
        self.checkpoints().join(JOB_ID)
    }

    /// Member `gang.rank`'s launch as the worker builds it in `command_launch.rs`: its
    /// own GPU, slice, checkpoint directory (rank 0 the job's, the others beside it) and
    /// attempt directory (`{job}.attempt-{N}.rank-{r}.run`).
    fn member(&self, job: &ValidatedCommandJob, gang: &GangMemberLaunch) -> CommandAttemptLaunch {
        let rank = gang.place.rank;
        CommandAttemptLaunch {
            attempt: v1::AttemptRef {
                job_id: JOB_ID.into(),
                attempt_number: 1,
                lease_epoch: 1,
                gang_rank: Some(rank),
            },
            config: job.initial_config(),
            job: job.clone(),
            slice_bytes: 256 * MIB,
            gpu_uuid: format!("GPU-sim-{rank}"),
            guard_library: None,
            checkpoint_dir: member_checkpoint_directory(&self.job_directory(), rank),
            attempt_directory: self
                .checkpoints()
                .join(format!("{JOB_ID}.attempt-1.rank-{rank}.run")),
            profile: false,
            resume_from: None,
            sandbox: self.sandbox.clone(),
            tenant: TENANT.into(),
            image: Default::default(),
            devices: Default::default(),
            simulated_gpu_socket: None,
            // Unique on the host (tests run at once, and cgroups are named after it).
            container_name: format!(
                "carve-{JOB_ID}-1-rank{rank}-{}",
                self.directory
                    .path()
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .replace(|character: char| !character.is_ascii_alphanumeric(), "")
            ),
            supervision: None,
        }
    }
}

/// A worker directory the containers' root users can pass through (a container's root
/// is "others" to the host's directories; mktemp makes 0700 ones).
fn node_directory() -> tempfile::TempDir {
    let directory = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        directory.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    directory
}

/// Runs one member to its end; every report it sent, in order.
async fn run_member(launch: CommandAttemptLaunch, gang: GangMemberLaunch) -> Vec<Body> {
    let (reports, mut incoming) = mpsc::unbounded_channel();
    // Held to the end: a dropped control channel means the worker is going away.
    let (_control, control_receiver) = mpsc::unbounded_channel();
    tokio::time::timeout(
        WAIT,
        run_gang_member_attempt(launch, gang, reports, control_receiver, (), || {}),
    )
    .await
    .expect("the member ended (hang guard)");
    let mut all = Vec::new();
    while let Ok(body) = incoming.try_recv() {
        all.push(body);
    }
    all
}

fn finish(reports: &[Body]) -> &v1::worker_message::AttemptFinished {
    match reports.last() {
        Some(Body::AttemptFinished(finished)) => finished,
        other => panic!("the last report is not a finish: {other:?}\nall: {reports:#?}"),
    }
}

fn outcome(reports: &[Body]) -> v1::AttemptOutcome {
    v1::AttemptOutcome::try_from(finish(reports).outcome).unwrap()
}

/// The losses the member reported, step by step.
fn losses(reports: &[Body]) -> Vec<(u64, f64)> {
    reports
        .iter()
        .filter_map(|body| match body {
            Body::Progress(progress) => progress
                .progress
                .as_ref()
                .map(|progress| (progress.step, progress.loss)),
            _ => None,
        })
        .collect()
}

fn log_text(reports: &[Body]) -> String {
    reports
        .iter()
        .filter_map(|body| match body {
            Body::Log(line) => Some(line.message.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Trains a gang of `world_size` members at `micro_batch` on `node`; each member's
/// reports, by rank.
async fn train_gang(
    node: &Node,
    gang_id: &str,
    world_size: u32,
    micro_batch: u64,
) -> Vec<Vec<Body>> {
    let ports = GangPorts::default();
    let job = trainer(micro_batch);
    let members: Vec<_> = (0..world_size)
        .map(|rank| {
            let gang = member_launch(&one_node_gang(gang_id, rank, world_size, 60), &ports)
                .expect("a member of a one-node gang");
            tokio::spawn(run_member(node.member(&job, &gang), gang))
        })
        .collect();
    let mut reports = Vec::new();
    for member in members {
        reports.push(member.await.expect("the member's task"));
    }
    reports
}

async fn two_members_train_together_as_one_process_would(node: &Node) {
    let gang = train_gang(node, "gang-a", 2, 8).await;
    for (rank, reports) in gang.iter().enumerate() {
        assert_eq!(
            outcome(reports),
            v1::AttemptOutcome::Succeeded,
            "rank {rank}: {}\n{reports:#?}",
            finish(reports).message
        );
        // Every report names its member.
        for body in reports {
            let attempt = match body {
                Body::AttemptStarted(started) => started.attempt.as_ref(),
                Body::Progress(progress) => progress.attempt.as_ref(),
                Body::Log(line) => line.attempt.as_ref(),
                Body::AttemptFinished(finished) => finished.attempt.as_ref(),
                _ => None,
            };
            if let Some(attempt) = attempt {
                assert_eq!(attempt.gang_rank, Some(rank as u32), "{body:?}");
            }
        }
        let started = reports
            .iter()
            .find_map(|body| match body {
                Body::AttemptStarted(started) => Some(started),
                _ => None,
            })
            .expect("an AttemptStarted");
        let argv = &started.command_argv;
        // 32 = micro-batch 8 x 2 members x 2 accumulation steps.
        assert_eq!(
            argv[3..7],
            [
                rank.to_string().as_str(),
                "--world-size",
                "2",
                "--master-addr"
            ]
        );
        assert_eq!(argv[7], "127.0.0.1");
        assert_eq!(argv[13], "2", "accumulation steps: {argv:?}");
        assert_eq!(finish(reports).steps_done, Some(5));
    }
    let (rank0, rank1) = (losses(&gang[0]), losses(&gang[1]));
    assert!(!rank0.is_empty(), "{:#?}", gang[0]);
    assert_eq!(rank0.last().unwrap().0, 5);
    // The members' all-reduced losses agree, bit for bit, at every step.
    assert_eq!(
        log_lines_with_loss(&gang[0]),
        log_lines_with_loss(&gang[1]).replace("gang rank 1", "gang rank 0"),
    );
    assert_eq!(finish(&gang[0]).final_loss, finish(&gang[1]).final_loss);
    // Progress is paced (the last step always reported): the last steps' losses agree.
    assert_eq!(rank0.last(), rank1.last());
    // The same port for both members, picked by the worker: the same argv position.
    let port = |reports: &[Body]| {
        reports.iter().find_map(|body| match body {
            Body::AttemptStarted(started) => Some(started.command_argv[9].clone()),
            _ => None,
        })
    };
    assert_eq!(port(&gang[0]), port(&gang[1]));
    // Rank 0 wrote the job's checkpoint; rank 1 wrote nothing there, nor of its own.
    let checkpoint: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(node.job_directory().join("gang_standin.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(checkpoint["step"], 5);
    assert_eq!(checkpoint["optimizer_steps"][4]["world_size"], 2);
    assert!(
        !member_checkpoint_directory(&node.job_directory(), 1)
            .join("gang_standin.json")
            .exists()
    );
    // One process with the same global batch (micro-batch 8 x 4 accumulation steps)
    // reports the same losses: the gang changed how the batch was split, not the
    // training. Its own node, so it starts from no checkpoint.
    let single_node = Node {
        directory: node_directory(),
        sandbox: node.sandbox.clone(),
    };
    let single = train_gang(&single_node, "gang-single", 1, 8).await;
    assert_eq!(
        outcome(&single[0]),
        v1::AttemptOutcome::Succeeded,
        "{:#?}",
        single[0]
    );
    assert_eq!(
        log_lines_with_loss(&single[0]),
        log_lines_with_loss(&gang[0])
    );
    assert_eq!(losses(&single[0]).last(), rank0.last());
}

/// The `gang rank R: step S loss L` lines of a member's log.
fn log_lines_with_loss(reports: &[Body]) -> String {
    log_text(reports)
        .lines()
        .filter(|line| line.contains(": step "))
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_members_on_two_simulated_gpus_train_together_and_their_losses_agree() {
    two_members_train_together_as_one_process_would(&Node::uncontained()).await;
    if let Some(node) = Node::contained() {
        two_members_train_together_as_one_process_would(&node).await;
    }
}

async fn a_member_alone_fails_at_its_rendezvous_deadline(node: &Node) {
    let ports = GangPorts::default();
    let job = trainer(8);
    // Rank 1 of a gang whose rank 0 never starts, and rank 0 of one whose rank 1 never
    // starts: each waits its 2 s and fails saying what it missed.
    let alone = |gang_id: &str, rank: u32| {
        let gang = member_launch(&one_node_gang(gang_id, rank, 2, 2), &ports).unwrap();
        run_member(node.member(&job, &gang), gang)
    };
    let (rank1, rank0) = tokio::join!(alone("gang-without-0", 1), alone("gang-without-1", 0));
    for (reports, expected) in [
        (&rank1, "rank 1 could not reach rank 0 at 127.0.0.1:"),
        (&rank0, "has ranks [0] of 2, missing [1]"),
    ] {
        assert_eq!(outcome(reports), v1::AttemptOutcome::Failed, "{reports:#?}");
        let message = &finish(reports).message;
        assert!(
            message.contains("gang rendezvous timed out after 2 s") && message.contains(expected),
            "the reason names the rendezvous: {message}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_whose_peer_never_starts_fails_with_the_rendezvous_reason() {
    a_member_alone_fails_at_its_rendezvous_deadline(&Node::uncontained()).await;
    if let Some(node) = Node::contained() {
        a_member_alone_fails_at_its_rendezvous_deadline(&node).await;
    }
}

/// What a hostile rank 1 could read of rank 0's files (its checkpoint, and the
/// attempt directory where its guard account and OOM record live): the lines it printed.
async fn hostile_member_reads(node: &Node) -> Vec<String> {
    let rank0_checkpoints = member_checkpoint_directory(&node.job_directory(), 0);
    let rank0_attempt = node
        .checkpoints()
        .join(format!("{JOB_ID}.attempt-1.rank-0.run"));
    for (directory, file) in [
        (&rank0_checkpoints, "gang_standin.json"),
        (&rank0_attempt, "guard-account"),
    ] {
        std::fs::create_dir_all(directory).unwrap();
        std::fs::write(directory.join(file), "rank 0's own").unwrap();
    }
    let script = format!(
        "for file in {checkpoint} {account}; do \
           if cat \"$file\" >/dev/null 2>&1; then echo \"READ $file\"; \
           else echo \"refused $file\"; fi; \
         done",
        checkpoint = rank0_checkpoints.join("gang_standin.json").display(),
        account = rank0_attempt.join("guard-account").display(),
    );
    let job = job(&["/bin/sh", "-c", &script], 8);
    let ports = GangPorts::default();
    let gang = member_launch(&one_node_gang("gang-hostile", 1, 2, 60), &ports).unwrap();
    let reports = run_member(node.member(&job, &gang), gang).await;
    assert_eq!(
        outcome(&reports),
        v1::AttemptOutcome::Succeeded,
        "{reports:#?}"
    );
    log_text(&reports)
        .lines()
        .filter(|line| line.starts_with("READ ") || line.starts_with("refused "))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hostile_member_cannot_read_another_members_files_and_can_without_its_container() {
    // The protection off: the same member uncontained reads both (so the assertion
    // below fails without the container).
    let uncontained = hostile_member_reads(&Node::uncontained()).await;
    assert_eq!(uncontained.len(), 2, "{uncontained:?}");
    assert!(
        uncontained.iter().all(|line| line.starts_with("READ ")),
        "{uncontained:?}"
    );
    let Some(node) = Node::contained() else {
        return;
    };
    let contained = hostile_member_reads(&node).await;
    assert_eq!(contained.len(), 2, "{contained:?}");
    assert!(
        contained.iter().all(|line| line.starts_with("refused ")),
        "a contained member sees only its own directories: {contained:?}"
    );
}
