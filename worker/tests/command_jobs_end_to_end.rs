//! A command job end to end (issue 16): the real scheduler in-process, the real worker
//! in-process with a simulated GPU, the real guard (`libcarve_guard.so`) preloaded into
//! the program in front of the fake CUDA driver, and the CI stand-in
//! (`examples/command/standin.toml`) as the user's program. Its memory is unknown, so it is
//! profiled, admitted in the slice the profile sized, runs out of memory at run time
//! (memory the two-step profile did not see), and is retried exactly once with gradient
//! accumulation that keeps the global batch; the stand-in's checkpoint shows that every
//! optimizer step saw the global batch.

use std::path::{Path, PathBuf};
use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::SchedulerConfig;
use carve_worker::gpus::SimulatedGpu;
use carve_worker::{WorkerConfig, run_worker};
use tokio::sync::oneshot;
use tonic::transport::Channel;

// The other end-to-end tests' helpers are not all used here.
#[allow(dead_code)]
mod support;
use support::{alice_with_tokens, authorized, guard_world};

const ADMIN: &str = "carve_command_jobs_admin_secret";

/// How long the job may take (a profile of two runs, then two training attempts of a
/// few steps each, in Python).
const WAIT: Duration = Duration::from_secs(120);

fn repository_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the worker crate is in the repository")
        .to_path_buf()
}

/// The stand-in's job file as `carve submit` sends it: run in its own folder, with the
/// fake driver as the `libcuda.so.1` its ctypes finds.
fn standin_spec_json(libraries: &Path) -> String {
    let folder = repository_root().join("examples/command");
    let text = std::fs::read_to_string(folder.join("standin.toml")).unwrap();
    let mut document: toml::Table = toml::from_str(&text).unwrap();
    let command = document["command"].as_table_mut().unwrap();
    command.insert(
        "working_directory".into(),
        folder.display().to_string().into(),
    );
    let mut environment = toml::Table::new();
    environment.insert(
        "LD_LIBRARY_PATH".into(),
        libraries.display().to_string().into(),
    );
    command.insert("env".into(), toml::Value::Table(environment));
    serde_json::to_string(&document).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_is_profiled_runs_out_at_run_time_and_succeeds_after_one_retry() {
    let directory = tempfile::tempdir().unwrap();
    let (guard, libraries) = guard_world(directory.path());
    let checkpoints = directory.path().join("checkpoints");

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let (_stop_scheduler, scheduler_stopped) = oneshot::channel::<()>();
    let config = SchedulerConfig {
        database_url: format!("sqlite://{}", directory.path().join("carve.db").display()),
        settings: SchedulerSettings {
            lease_duration: Duration::from_secs(30),
            heartbeat_interval: Duration::from_millis(200),
            scheduling_interval: Duration::from_millis(50),
            checkpoint_directory: checkpoints.display().to_string(),
            infrastructure_retry_backoff: Duration::from_millis(100),
        },
        admin_token: Some(ADMIN.into()),
        metrics_address: None,
        tls: None,
    };
    tokio::spawn(carve_scheduler::server::run(config, listener, async {
        let _ = scheduler_stopped.await;
    }));
    let channel = connect(&address).await;
    let (user, worker_token) = alice_with_tokens(&channel, ADMIN).await;
    let gpus = vec![SimulatedGpu {
        total_bytes: 4 << 30,
    }];
    let mut worker = WorkerConfig::new(
        address,
        worker_token,
        gpus,
        PathBuf::from(env!("CARGO_BIN_EXE_carve-worker")),
    );
    worker.hostname = "command-node".into();
    worker.discover_real_gpus = false;
    worker.context_bytes = 64 << 20;
    worker.checkpoint_directory = checkpoints.clone();
    worker.guard_library = Some(guard);
    let (_stop_worker, worker_stopped) = oneshot::channel::<()>();
    tokio::spawn(run_worker(worker, async {
        let _ = worker_stopped.await;
    }));

    let mut jobs = JobServiceClient::new(channel.clone());
    let submitted = jobs
        .submit_job(authorized(
            v1::SubmitJobRequest {
                spec_json: standin_spec_json(&libraries),
                idempotency_key: String::new(),
            },
            &user,
        ))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    let job = wait_until_ended(&mut jobs, &user, &submitted.id).await;
    assert_eq!(job.state, v1::JobState::Succeeded as i32, "{job:#?}");

    // profile -> admitted -> out of memory at micro-batch 64 -> one retry -> success.
    let outcomes: Vec<i32> = job.attempts.iter().map(|attempt| attempt.outcome).collect();
    assert_eq!(
        outcomes,
        [
            v1::AttemptOutcome::Succeeded as i32,
            v1::AttemptOutcome::OutOfMemory as i32,
            v1::AttemptOutcome::Succeeded as i32,
        ],
        "{job:#?}"
    );
    let [profile, ran_out, retry] = &job.attempts[..] else {
        unreachable!()
    };
    assert!(profile.profile);
    let measured: Vec<u64> = profile
        .profile_points
        .iter()
        .map(|point| point.micro_batch)
        .collect();
    assert_eq!(measured, [64, 32]);
    // 200 MiB fixed + 12 MiB per sample, as the guard counted the stand-in's allocations.
    assert_eq!(profile.profile_points[0].peak_bytes, (200 + 64 * 12) << 20);
    let model = job.memory_model.as_ref().unwrap();
    assert!(model.per_sample_bytes >= 12 << 20, "{model:?}");

    let sized = ran_out.config.as_ref().unwrap();
    assert_eq!((sized.batch_size, sized.micro_batch_size), (64, 64));
    assert_eq!(ran_out.slice_bytes, (200 + 64 * 12) << 20);
    assert_eq!(ran_out.oom_detected_by, "guard");
    assert!(
        ran_out.command_argv.contains(&"64".to_string()),
        "{ran_out:?}"
    );

    let retried = retry.config.as_ref().unwrap();
    assert_eq!(retried.batch_size, 64, "the global batch is kept");
    assert!(retried.micro_batch_size < 64, "{retried:?}");
    assert!(
        retry
            .chosen_because
            .starts_with("after attempt 2 ran out of memory: micro-batch 64 ->"),
        "{retry:?}"
    );
    assert!(retry.slice_bytes <= ran_out.slice_bytes);

    // The stand-in resumed from its checkpoint, and every optimizer step saw 64 samples.
    let checkpoint: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(checkpoints.join(&job.id).join("standin.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(checkpoint["step"], 6);
    let steps = checkpoint["optimizer_steps"].as_array().unwrap();
    assert_eq!(steps.len(), 6);
    for (index, step) in steps.iter().enumerate() {
        assert_eq!(step["step"], index as u64 + 1);
        assert_eq!(step["samples"], 64, "{step}");
    }
    let micro_batches: Vec<u64> = steps
        .iter()
        .map(|step| step["micro_batch"].as_u64().unwrap())
        .collect();
    assert_eq!(
        &micro_batches[..2],
        [64, 64],
        "the first attempt did two steps"
    );
    assert!(
        micro_batches[2..]
            .iter()
            .all(|micro| *micro == retried.micro_batch_size),
        "{micro_batches:?}"
    );

    // The program's own output is in the job's logs, under its attempt.
    let lines = jobs
        .get_job_logs(authorized(
            v1::GetJobLogsRequest {
                job_id: job.id.clone(),
                attempt_number: 3,
                ..Default::default()
            },
            &user,
        ))
        .await
        .unwrap()
        .into_inner()
        .lines;
    assert!(
        lines
            .iter()
            .any(|line| line.message.contains("resumed from step 2")),
        "{lines:#?}"
    );
}

async fn wait_until_ended(
    jobs: &mut JobServiceClient<Channel>,
    user: &str,
    job_id: &str,
) -> v1::Job {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let job = jobs
            .get_job(authorized(
                v1::GetJobRequest {
                    job_id: job_id.into(),
                },
                user,
            ))
            .await
            .unwrap()
            .into_inner()
            .job
            .unwrap();
        let ended = [
            v1::JobState::Succeeded,
            v1::JobState::Failed,
            v1::JobState::Cancelled,
        ]
        .iter()
        .any(|state| job.state == *state as i32);
        if ended {
            return job;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "job {job_id} did not end within {WAIT:?}: {job:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn connect(address: &str) -> Channel {
    for _ in 0..250 {
        if let Ok(channel) = Channel::from_shared(address.to_string())
            .unwrap()
            .connect()
            .await
        {
            return channel;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the scheduler did not come up at {address}")
}
