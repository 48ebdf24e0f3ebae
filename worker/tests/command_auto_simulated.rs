//! `vram = "auto"` end to end on a simulated GPU, as `carve dev` runs it: the real
//! scheduler and worker in-process, the guard preloaded as `carve dev` finds it, and a
//! program that makes no CUDA call (so the guard counts nothing). A program that reports
//! its own memory (`memory_peak_bytes` in its CARVE_PROGRESS lines: the stand-in's
//! simulated accounting) is profiled, sized by what it reported, runs and succeeds; one
//! that reports nothing is "unmeasured" and runs in its profile's slice, never in a
//! 0-byte one. What GetJob (`carve get`) shows of the model and why, both times.

use std::path::{Path, PathBuf};

use carve_core::command::validate::{ValidatedSpec, load_spec_toml};
use carve_proto::v1;
use carve_worker::gpus::SimulatedGpu;

#[path = "support/cluster.rs"]
#[allow(dead_code, reason = "not every helper is used here")]
mod cluster;
#[path = "support/guard_world.rs"]
mod guard_world;
#[allow(dead_code, reason = "the chaos test's helpers are not all used here")]
mod support;

use cluster::Cluster;
use guard_world::guard_world;

const ADMIN: &str = "carve_auto_simulated_admin_secret";
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/command")
        .canonicalize()
        .expect("examples/command")
}

/// `examples/command/standin.toml`, run in its folder as `carve submit` does, with its
/// memory simulated (no CUDA call: what a program on `carve dev` looks like to the
/// guard) and no late memory (nothing runs out).
fn simulated_standin_job() -> String {
    let text = std::fs::read_to_string(examples().join("standin.toml")).unwrap();
    let ValidatedSpec::Command(job) = load_spec_toml(&text).expect("the example is valid") else {
        panic!("standin.toml is a command job");
    };
    let mut spec = job.spec;
    spec.command.working_directory = Some(examples().display().to_string());
    let late = spec
        .command
        .argv
        .iter()
        .position(|argument| argument == "--late-extra-per-sample-mib")
        .expect("the stand-in's late memory");
    spec.command.argv[late + 1] = "0".into();
    spec.command
        .argv
        .extend(["--device-memory".to_string(), "simulated".to_string()]);
    serde_json::to_string(&spec).unwrap()
}

/// The scheduler and a worker with one simulated 4 GiB GPU, the guard preloaded into
/// command jobs as `carve dev` does when it finds it.
async fn cluster(directory: &Path) -> Cluster {
    let (guard, _libraries) = guard_world(directory);
    let url = format!("sqlite://{}", directory.join("carve.db").display());
    Cluster::start(
        directory,
        url,
        PathBuf::from(env!("CARGO_BIN_EXE_carve-worker")),
        ADMIN,
        |config| {
            config.simulated_gpus = vec![SimulatedGpu {
                total_bytes: 4 * GIB,
            }];
            config.sandbox.job_paths = vec![examples()];
            config.sandbox.read_only_host_paths =
                guard.parent().map(Path::to_path_buf).into_iter().collect();
            config.guard_library = Some(guard);
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_reporting_its_memory_is_profiled_sized_by_it_and_succeeds() {
    let directory = tempfile::tempdir().unwrap();
    let cluster = cluster(directory.path()).await;
    let job = cluster.submit(simulated_standin_job()).await;
    let job = cluster
        .wait_for_state(&job.id, v1::JobState::Succeeded)
        .await;
    assert_eq!(job.attempts.len(), 2, "{job:#?}");

    // The profile measured what the program reported: 200 MiB + 12 MiB per sample.
    let profile = &job.attempts[0];
    assert!(profile.profile, "{profile:#?}");
    let points: Vec<(u64, u64)> = profile
        .profile_points
        .iter()
        .map(|point| (point.micro_batch, point.peak_bytes / MIB))
        .collect();
    assert_eq!(points, vec![(64, 968), (32, 584)], "{profile:#?}");

    // Sized by it (never 0 bytes, never below the floor), run, succeeded.
    let training = &job.attempts[1];
    assert!(!training.profile);
    assert!(
        training.slice_bytes >= 968 * MIB && training.slice_bytes < 2 * GIB,
        "{training:#?}"
    );
    assert_eq!(training.steps_done, Some(6), "{training:#?}");

    // What `carve get` shows: the model, measured, and what it rests on.
    let model = job.memory_model.expect("the fitted model");
    assert!(model.measured, "{model:#?}");
    assert_eq!(model.fixed_bytes, 200 * MIB);
    assert_eq!(model.per_sample_bytes, 12 * MIB);
    assert!(
        model
            .basis
            .starts_with(&format!("fitted from {} attempt 1's profile", job.id)),
        "{}",
        model.basis
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_reporting_no_memory_is_unmeasured_and_runs_in_its_profiles_slice() {
    let directory = tempfile::tempdir().unwrap();
    let cluster = cluster(directory.path()).await;
    // A numpy-style trainer: progress, no memory figures, no CUDA.
    let spec = serde_json::json!({
        "name": "numpy-trainer",
        "command": {
            "argv": ["sh", "-c",
                     "i=1; while [ $i -le $0 ]; do echo \"CARVE_PROGRESS step=$i total_steps=$0\"; i=$((i+1)); done",
                     "{max_steps}"],
            "global_batch": 8,
            "steps": 3,
            "profile": { "steps": 1 },
        },
        "resources": { "vram": "auto" },
    });
    let job = cluster.submit(spec.to_string()).await;
    let job = cluster
        .wait_for_state(&job.id, v1::JobState::Succeeded)
        .await;
    assert_eq!(job.attempts.len(), 2, "{job:#?}");
    let (profile, training) = (&job.attempts[0], &job.attempts[1]);
    assert!(profile.profile);
    assert_eq!(
        training.slice_bytes, profile.slice_bytes,
        "an unmeasured profile falls back to its own slice: {job:#?}"
    );
    assert!(training.slice_bytes > GIB, "{training:#?}");
    let model = job.memory_model.expect("the fallback, shown");
    assert!(!model.measured, "{model:#?}");
    assert!(model.basis.starts_with("unmeasured: "), "{}", model.basis);
    assert!(model.basis.contains("memory_peak_bytes"), "{}", model.basis);
}
