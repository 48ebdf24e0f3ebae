//! The real scheduler in-process (SQLite in a temp directory) and the real worker
//! in-process (`run_worker` with simulated GPUs), whose attempt processes are the real
//! `carve-worker` binary training tiny jobs on synthetic data: a job to success with
//! its measured peak, a batch that does not fit its slice, two slices side by side on
//! one GPU (and cancelling them), an attempt process killed from outside (interrupted,
//! resumed) or failing by itself (failed). With the worker binary as its own process:
//! killing it takes its attempt down, and a restarted one kills recorded leftovers; an
//! attempt process alone stops when its stdout closes or its parent dies.

use std::path::{Path, PathBuf};
use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::cluster_service_client::ClusterServiceClient;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::{SchedulerConfig, TlsIdentity};
use carve_worker::checkpoint_files::promoted_path;
use carve_worker::child_protocol::WORKER_GONE_EXIT_CODE;
use carve_worker::gpus::SimulatedGpu;
use carve_worker::leftover_processes::{
    AttemptProcessRecord, process_start_time, record_directory, write_record,
};
use carve_worker::{StartedAttemptProcess, WorkerConfig, run_worker};
use std::os::unix::process::CommandExt;
use tokio::sync::{mpsc, oneshot};
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

mod support;
use support::{
    alice_with_tokens, authorized, poll_until, process_command_lines, tiny_job_spec,
    worker_process_command,
};

const ADMIN: &str = "carve_worker_test_admin_secret";

/// The run config of [`job_spec`]'s jobs, as an attempt process takes it.
const CONFIG_JSON: &str = r#"{"batch_size":64,"micro_batch_size":64,"precision":1,"recompute_segment_layers":null,"workspace_limit_bytes":67108864,"prefetch_batches":1}"#;

/// How long any one wait in these tests may take before the test fails.
const WAIT: Duration = Duration::from_secs(60);

/// How often most of these waits look again.
const EVERY_20_MS: Duration = Duration::from_millis(20);

/// A job small enough to train in well under a second; `steps` sets how long it runs.
fn job_spec(name: &str, steps: u64, vram: Option<&str>) -> String {
    let resources = match vram {
        Some(vram) => format!(r#", "resources": {{ "vram": "{vram}" }}"#),
        None => String::new(),
    };
    tiny_job_spec(name, steps, 50, &resources)
}

struct Cluster {
    channel: Channel,
    address: String,
    /// The certificate the scheduler serves, when it serves TLS.
    certificate_pem: Option<String>,
    user: String,
    worker_token: String,
    checkpoints: PathBuf,
    directory: tempfile::TempDir,
    shutdown: oneshot::Sender<()>,
    server: tokio::task::JoinHandle<()>,
}

/// Starts the real scheduler on `listener` with its database in `directory`.
async fn start_scheduler(
    directory: &Path,
    listener: tokio::net::TcpListener,
    lease: Duration,
) -> (Channel, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    start_scheduler_with_tls(directory, listener, lease, None).await
}

/// A self-signed certificate for 127.0.0.1 (an IP SAN, so clients can dial the address)
/// and its key, both PEM.
fn self_signed_certificate() -> (String, String) {
    let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    (certified.cert.pem(), certified.signing_key.serialize_pem())
}

/// [`start_scheduler`], serving TLS with `tls` (certificate, key) when given.
async fn start_scheduler_with_tls(
    directory: &Path,
    listener: tokio::net::TcpListener,
    lease: Duration,
    tls: Option<(String, String)>,
) -> (Channel, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let address = format!("{scheme}://{}", listener.local_addr().unwrap());
    let client_tls = tls.as_ref().map(|(certificate, _)| {
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(certificate))
    });
    let (shutdown, shutdown_signal) = oneshot::channel::<()>();
    let config = SchedulerConfig {
        database_url: format!("sqlite://{}", directory.join("carve.db").display()),
        settings: SchedulerSettings {
            lease_duration: lease,
            heartbeat_interval: Duration::from_millis(200),
            scheduling_interval: Duration::from_millis(50),
            infrastructure_retry_backoff: Duration::from_millis(100),
            ..SchedulerSettings::default()
        },
        admin_token: Some(ADMIN.into()),
        metrics_address: None,
        tls: tls.map(|(certificate, key)| TlsIdentity {
            certificate_chain_pem: certificate.into_bytes(),
            private_key_pem: key.into_bytes(),
            client_ca_certificate_pem: None,
        }),
    };
    let server = tokio::spawn(async move {
        carve_scheduler::server::run(config, listener, async {
            let _ = shutdown_signal.await;
        })
        .await
        .unwrap();
    });
    let mut channel = None;
    for _ in 0..200 {
        let mut endpoint = Channel::from_shared(address.clone()).unwrap();
        if let Some(client_tls) = &client_tls {
            endpoint = endpoint.tls_config(client_tls.clone()).unwrap();
        }
        if let Ok(connected) = endpoint.connect().await {
            channel = Some(connected);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let channel = channel.expect("the scheduler comes up");
    (channel, shutdown, server)
}

async fn start_cluster() -> Cluster {
    start_cluster_with_lease(Duration::from_secs(30)).await
}

async fn start_cluster_with_lease(lease: Duration) -> Cluster {
    start_cluster_with(lease, false).await
}

async fn start_cluster_with(lease: Duration, serve_tls: bool) -> Cluster {
    let directory = tempfile::tempdir().unwrap();
    let checkpoints = directory.path().join("checkpoints");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tls = serve_tls.then(self_signed_certificate);
    let certificate_pem = tls.as_ref().map(|(certificate, _)| certificate.clone());
    let scheme = if serve_tls { "https" } else { "http" };
    let address = format!("{scheme}://{}", listener.local_addr().unwrap());
    let (channel, shutdown, server) =
        start_scheduler_with_tls(directory.path(), listener, lease, tls).await;
    let (user, worker_token) = alice_with_tokens(&channel, ADMIN).await;
    Cluster {
        channel,
        address,
        certificate_pem,
        user,
        worker_token,
        checkpoints,
        directory,
        shutdown,
        server,
    }
}

struct RunningWorker {
    started_processes: mpsc::UnboundedReceiver<StartedAttemptProcess>,
    _shutdown: oneshot::Sender<()>,
}

/// The real worker in-process with one simulated 1 GiB GPU; its attempts run `program`
/// (the real binary, or a wrapper around it).
fn start_worker(cluster: &Cluster, program: &Path) -> RunningWorker {
    start_named_worker(cluster, "test-node", program)
}

fn start_named_worker(cluster: &Cluster, hostname: &str, program: &Path) -> RunningWorker {
    let gpus = vec![SimulatedGpu {
        total_bytes: 1 << 30,
    }];
    let (observer, started_processes) = mpsc::unbounded_channel();
    let mut config = WorkerConfig::new(
        cluster.address.clone(),
        cluster.worker_token.clone(),
        gpus,
        program.to_path_buf(),
    );
    config.hostname = hostname.into();
    // Only the simulated GPUs, even on a machine with real ones.
    config.discover_real_gpus = false;
    config.context_bytes = 64 << 20;
    config.checkpoint_directory = cluster.checkpoints.clone();
    if program != worker_binary() {
        // A wrapper standing in for a GPU's behaviour keeps its state in the test's
        // directory, which no container may write: it runs uncontained.
        config.sandbox.policy = carve_worker::sandbox::SandboxPolicy::Off;
    }
    config.process_observer = Some(observer);
    config.reconnect_backoff_initial = Duration::from_millis(50);
    config.reconnect_backoff_max = Duration::from_millis(200);
    config.scheduler_ca_certificate_pem = cluster
        .certificate_pem
        .as_ref()
        .map(|pem| pem.clone().into_bytes());
    let (shutdown, shutdown_signal) = oneshot::channel::<()>();
    tokio::spawn(async move {
        run_worker(config, async {
            let _ = shutdown_signal.await;
        })
        .await
        .unwrap();
    });
    RunningWorker {
        started_processes,
        _shutdown: shutdown,
    }
}

fn worker_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_carve-worker"))
}

/// A cluster and its worker running the real binary.
async fn cluster_with_worker() -> (Cluster, RunningWorker) {
    let cluster = start_cluster().await;
    let worker = start_worker(&cluster, &worker_binary());
    (cluster, worker)
}

/// A cluster and its worker running the program `write_program` puts in the cluster's
/// directory.
async fn cluster_with_worker_running(
    write_program: fn(&Path) -> PathBuf,
) -> (Cluster, RunningWorker) {
    let cluster = start_cluster().await;
    let program = write_program(cluster.directory.path());
    let worker = start_worker(&cluster, &program);
    (cluster, worker)
}

/// Submits [`job_spec`]'s job without a vram request.
async fn submit_tiny(cluster: &Cluster, name: &str, steps: u64) -> v1::Job {
    submit(cluster, &job_spec(name, steps, None)).await
}

/// Submits [`job_spec`]'s job and waits until its attempt process has started on
/// `worker` and the scheduler shows it running.
async fn submit_and_start(
    cluster: &Cluster,
    worker: &mut RunningWorker,
    name: &str,
    steps: u64,
) -> (v1::Job, StartedAttemptProcess) {
    let job = submit_tiny(cluster, name, steps).await;
    let process = next_process(worker).await;
    wait_for_state(cluster, &job.id, v1::JobState::Running).await;
    (job, process)
}

/// Where attempt `attempt_number` of `job` writes its checkpoint.
fn attempt_checkpoint(cluster: &Cluster, job: &v1::Job, attempt_number: u32) -> PathBuf {
    cluster
        .checkpoints
        .join(&job.id)
        .join(format!("{}.attempt-{attempt_number}.ckpt", job.id))
}

async fn submit(cluster: &Cluster, spec: &str) -> v1::Job {
    let request = v1::SubmitJobRequest {
        spec_json: spec.into(),
        idempotency_key: String::new(),
    };
    let response = JobServiceClient::new(cluster.channel.clone())
        .submit_job(authorized(request, &cluster.user))
        .await;
    response.unwrap().into_inner().job.unwrap()
}

async fn get(cluster: &Cluster, job_id: &str) -> v1::Job {
    let request = v1::GetJobRequest {
        job_id: job_id.into(),
    };
    let response = JobServiceClient::new(cluster.channel.clone())
        .get_job(authorized(request, &cluster.user))
        .await;
    response.unwrap().into_inner().job.unwrap()
}

/// The slices the scheduler shows now.
async fn list_slices(cluster: &Cluster) -> Vec<v1::Slice> {
    ClusterServiceClient::new(cluster.channel.clone())
        .list_slices(authorized(v1::ListSlicesRequest::default(), &cluster.user))
        .await
        .unwrap()
        .into_inner()
        .slices
}

/// Polls until `done` holds for the job; fails the test after [`WAIT`].
async fn wait_for_job(
    cluster: &Cluster,
    job_id: &str,
    what: &str,
    done: impl Fn(&v1::Job) -> bool,
) -> v1::Job {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let job = get(cluster, job_id).await;
        if done(&job) {
            return job;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "job {job_id} never became {what}: {job:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_for_state(cluster: &Cluster, job_id: &str, state: v1::JobState) -> v1::Job {
    wait_for_job(cluster, job_id, state.as_str_name(), |job| {
        job.state == state as i32
    })
    .await
}

async fn next_process(worker: &mut RunningWorker) -> StartedAttemptProcess {
    tokio::time::timeout(WAIT, worker.started_processes.recv())
        .await
        .expect("an attempt process starts")
        .expect("the worker runs")
}

fn outcome(attempt: &v1::Attempt) -> v1::AttemptOutcome {
    v1::AttemptOutcome::try_from(attempt.outcome).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_job_trains_to_success_with_its_measured_peak_equal_to_the_estimate() {
    let (cluster, mut worker) = cluster_with_worker().await;
    let job = submit_tiny(&cluster, "small", 20).await;
    let process = next_process(&mut worker).await;
    assert_eq!(process.job_id, job.id);
    assert!(process.process_id > 0);
    let finished = wait_for_state(&cluster, &job.id, v1::JobState::Succeeded).await;
    assert_eq!(finished.attempts.len(), 1, "{finished:#?}");
    let attempt = &finished.attempts[0];
    assert_eq!(outcome(attempt), v1::AttemptOutcome::Succeeded);
    assert_eq!(attempt.gpu_uuid, "sim-test-node-0");
    let estimate = finished.estimate.as_ref().unwrap();
    assert_eq!(attempt.measured_peak_bytes, Some(estimate.peak_bytes));
    assert!(attempt.slice_bytes >= estimate.peak_bytes);
    // The final checkpoint is the attempt's own file, in its job's directory; its
    // directory (with its spec file) and its process record are gone.
    assert!(attempt_checkpoint(&cluster, &job, 1).is_file());
    let leftovers: Vec<_> = std::fs::read_dir(&cluster.checkpoints)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".run"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let records = record_directory(&cluster.checkpoints, "test-node");
    poll_until(WAIT, EVERY_20_MS, "the process record is removed", || {
        std::fs::read_dir(&records)
            .unwrap()
            .next()
            .is_none()
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_trusting_the_scheduler_s_certificate_runs_jobs_over_tls() {
    let cluster = start_cluster_with(Duration::from_secs(30), true).await;
    assert!(cluster.address.starts_with("https://"));
    let _worker = start_worker(&cluster, &worker_binary());
    let job = submit_tiny(&cluster, "over-tls", 5).await;
    let finished = wait_for_state(&cluster, &job.id, v1::JobState::Succeeded).await;
    assert_eq!(finished.attempts.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vram_request_too_small_for_the_batch_runs_the_shrunk_config_inside_it() {
    // The scheduler shrinks a job whose explicit vram is too small at submit, before any
    // attempt, so this OOM never reaches a worker: what runs is the shrunk config, and
    // it must really fit the slice it was given.
    let (cluster, _worker) = cluster_with_worker().await;
    let roomy = submit_tiny(&cluster, "roomy", 10).await;
    let needed = roomy.estimate.as_ref().unwrap().required_bytes;
    wait_for_state(&cluster, &roomy.id, v1::JobState::Succeeded).await;
    let vram = needed * 3 / 4;
    let job = submit(&cluster, &job_spec("tight", 10, Some(&vram.to_string()))).await;
    let config = job.current_config.as_ref().unwrap();
    assert!(
        config.micro_batch_size < config.batch_size
            || config.precision != v1::Precision::Fp32 as i32,
        "the scheduler shrank the config: {config:?}"
    );
    let finished = wait_for_state(&cluster, &job.id, v1::JobState::Succeeded).await;
    let attempt = &finished.attempts[0];
    assert_eq!(attempt.config.as_ref(), Some(config));
    assert!(attempt.slice_bytes <= vram.max(job.estimate.as_ref().unwrap().required_bytes));
    assert!(attempt.measured_peak_bytes.unwrap() <= attempt.slice_bytes);
}

/// Writes `text` to `path` as an executable script; returns the path.
fn write_script(path: &Path, text: &str) -> PathBuf {
    std::fs::write(path, text).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.to_path_buf()
}

/// A wrapper around the worker binary that hands its first attempt process a quarter of
/// its slice: what a real GPU does when the estimate is too low. Later attempts get
/// their slice unchanged.
fn wrapper_shrinking_the_first_slice(directory: &Path) -> PathBuf {
    let marker = directory.join("first-attempt-done");
    write_script(
        &directory.join("first-attempt-gets-a-quarter-slice.sh"),
        &format!(
            r#"#!/bin/bash
shrink=0
if mkdir "{marker}" 2>/dev/null; then shrink=1; fi
arguments=()
previous=""
for argument in "$@"; do
  if [ "$previous" = "--slice-bytes" ] && [ "$shrink" = 1 ]; then argument=$((argument / 4)); fi
  arguments+=("$argument")
  previous="$argument"
done
exec "{program}" "${{arguments[@]}}"
"#,
            marker = marker.display(),
            program = worker_binary().display()
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_that_runs_out_of_memory_is_retried_with_the_planners_config_and_succeeds() {
    let (cluster, _worker) = cluster_with_worker_running(wrapper_shrinking_the_first_slice).await;
    let job = submit_tiny(&cluster, "squeezed", 10).await;
    let settled = wait_for_job(&cluster, &job.id, "settled after an oom", |job| {
        job.attempts
            .first()
            .is_some_and(|attempt| outcome(attempt) == v1::AttemptOutcome::OutOfMemory)
            && (job.state == v1::JobState::Succeeded as i32
                || job.state == v1::JobState::Failed as i32)
    })
    .await;
    let first = &settled.attempts[0];
    let oom = first.oom.as_ref().expect("the oom numbers");
    assert_eq!(oom.limit_bytes, first.slice_bytes / 4, "{settled:#?}");
    assert!(oom.requested_bytes > 0);
    assert!(
        oom.in_use_bytes + oom.requested_bytes > oom.limit_bytes
            || oom.largest_free_bytes < oom.requested_bytes
    );
    // The planner shrinks to what the attempt really had (the report's limit), and the
    // retry trains to the end from the checkpoint.
    assert_eq!(
        settled.state,
        v1::JobState::Succeeded as i32,
        "{}",
        settled.message
    );
    assert_eq!(settled.attempts.len(), 2, "{settled:#?}");
    assert_eq!(outcome(&settled.attempts[1]), v1::AttemptOutcome::Succeeded);
    assert_ne!(settled.attempts[1].config, first.config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_jobs_share_one_gpu_in_two_slices_and_cancel_stops_both() {
    let (cluster, mut worker) = cluster_with_worker().await;
    let first = submit_tiny(&cluster, "first", 1_000_000).await;
    let second = submit_tiny(&cluster, "second", 1_000_000).await;
    next_process(&mut worker).await;
    next_process(&mut worker).await;
    for job in [&first, &second] {
        wait_for_state(&cluster, &job.id, v1::JobState::Running).await;
    }
    let slices = list_slices(&cluster).await;
    assert_eq!(slices.len(), 2, "{slices:#?}");
    assert!(
        slices
            .iter()
            .all(|slice| slice.gpu_uuid == "sim-test-node-0")
    );
    let mut jobs: Vec<&str> = slices.iter().map(|slice| slice.job_id.as_str()).collect();
    jobs.sort();
    let mut wanted = vec![first.id.as_str(), second.id.as_str()];
    wanted.sort();
    assert_eq!(jobs, wanted);

    for job in [&first, &second] {
        JobServiceClient::new(cluster.channel.clone())
            .cancel_job(authorized(
                v1::CancelJobRequest {
                    job_id: job.id.clone(),
                    reason: "enough".into(),
                },
                &cluster.user,
            ))
            .await
            .unwrap();
    }
    for job in [&first, &second] {
        let cancelled = wait_for_job(&cluster, &job.id, "cancelled with its attempt", |job| {
            job.attempts
                .first()
                .is_some_and(|attempt| outcome(attempt) == v1::AttemptOutcome::Cancelled)
        })
        .await;
        assert_eq!(cancelled.state, v1::JobState::Cancelled as i32);
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let slices = list_slices(&cluster).await;
        if slices.is_empty() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{slices:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `file` exists, then a moment for the report that names it to reach the
/// scheduler.
async fn wait_for_checkpoint(file: &Path) {
    let written = format!("{} is written", file.display());
    poll_until(WAIT, Duration::from_millis(10), &written, || {
        file.is_file().then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_process_killed_from_outside_is_interrupted_and_resumes_from_its_checkpoint() {
    let (cluster, mut worker) = cluster_with_worker().await;
    let (job, process) = submit_and_start(&cluster, &mut worker, "interrupted", 400).await;
    let checkpoint = attempt_checkpoint(&cluster, &job, 1);
    wait_for_checkpoint(&checkpoint).await;
    send_signal("-KILL", process.process_id);
    // An infrastructure failure, not the program's: the job goes back to the queue and
    // its next attempt resumes from the first one's checkpoint.
    let second = next_process(&mut worker).await;
    assert_eq!(second.attempt_number, 2);
    let finished = wait_for_state(&cluster, &job.id, v1::JobState::Succeeded).await;
    assert_eq!(finished.attempts.len(), 2, "{finished:#?}");
    let first = &finished.attempts[0];
    assert_eq!(outcome(first), v1::AttemptOutcome::Interrupted);
    assert!(
        first
            .failure_message
            .contains("killed by signal 9 (SIGKILL), which the worker did not send"),
        "{}",
        first.failure_message
    );
    let resumed = &finished.attempts[1];
    assert_eq!(outcome(resumed), v1::AttemptOutcome::Succeeded);
    let resumed_from = resumed
        .resumed_from
        .as_ref()
        .expect("resumed from a checkpoint");
    // The recorded file is the checkpoint promoted under its step's name, which no
    // stale attempt rewrites.
    assert_eq!(
        resumed_from.location,
        promoted_path(&checkpoint, resumed_from.step)
            .display()
            .to_string()
    );
    // The second attempt wrote its own file; the first one's is as it left it.
    assert!(attempt_checkpoint(&cluster, &job, 2).is_file());
}

/// A program that fails by itself: exit code 1 with a reason on stderr.
fn failing_program(directory: &Path) -> PathBuf {
    write_script(
        &directory.join("fails.sh"),
        "#!/bin/bash\necho 'the data set is unreadable' >&2\nexit 1\n",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_process_that_fails_by_itself_fails_the_job_without_a_retry() {
    let (cluster, _worker) = cluster_with_worker_running(failing_program).await;
    let job = submit_tiny(&cluster, "broken", 10).await;
    let failed = wait_for_state(&cluster, &job.id, v1::JobState::Failed).await;
    assert_eq!(failed.attempts.len(), 1, "{failed:#?}");
    let attempt = &failed.attempts[0];
    assert_eq!(outcome(attempt), v1::AttemptOutcome::Failed);
    assert!(
        attempt.failure_message.contains("exit status: 1")
            && attempt
                .failure_message
                .contains("the data set is unreadable"),
        "{}",
        attempt.failure_message
    );
}

/// The pids of the attempt processes whose command line names `directory` (their
/// checkpoint directory), that are still running (not zombies).
fn attempt_processes_in(directory: &Path) -> Vec<u32> {
    let needle = directory.display().to_string();
    process_command_lines()
        .into_iter()
        .filter(|(_, arguments)| {
            arguments.iter().any(|argument| argument == "attempt")
                && arguments.iter().any(|argument| argument.contains(&needle))
        })
        .map(|(process_id, _)| process_id)
        .filter(|process_id| process_start_time(*process_id).is_some())
        .collect()
}

/// The real `carve-worker` binary as its own process, with one simulated GPU.
fn start_worker_process(cluster: &Cluster, hostname: &str) -> std::process::Child {
    worker_process_command(
        &cluster.address,
        &cluster.worker_token,
        &cluster.checkpoints,
        hostname,
    )
    .env("RUST_LOG", "warn")
    .stdin(std::process::Stdio::null())
    .stdout(std::process::Stdio::null())
    .spawn()
    .unwrap()
}

/// Waits until none of `processes` runs any more; fails the test after `limit`.
async fn wait_until_gone(processes: &[u32], limit: Duration, what: &str) {
    let what = format!("{what}: {processes:?}");
    poll_until(limit, EVERY_20_MS, &what, || {
        processes
            .iter()
            .all(|process_id| process_start_time(*process_id).is_none())
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_worker_process_takes_its_attempt_process_down_with_it() {
    let cluster = start_cluster().await;
    let mut worker = start_worker_process(&cluster, "doomed-node");
    let job = submit_tiny(&cluster, "orphan", 1_000_000).await;
    wait_for_state(&cluster, &job.id, v1::JobState::Running).await;
    let attempts = poll_until(WAIT, EVERY_20_MS, "the attempt process runs", || {
        Some(attempt_processes_in(&cluster.checkpoints)).filter(|attempts| !attempts.is_empty())
    })
    .await;
    assert_eq!(attempts.len(), 1);
    let checkpoint = attempt_checkpoint(&cluster, &job, 1);
    wait_for_checkpoint(&checkpoint).await;
    worker.kill().unwrap();
    worker.wait().unwrap();
    wait_until_gone(
        &attempts,
        Duration::from_secs(3),
        "the attempt process dies with its worker",
    )
    .await;
    // Nothing rewrites the checkpoint any more.
    let written = std::fs::metadata(&checkpoint).unwrap().modified().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        std::fs::metadata(&checkpoint).unwrap().modified().unwrap(),
        written
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_kills_the_attempt_processes_its_previous_life_left() {
    let cluster = start_cluster().await;
    // A leftover: a process in its own group, recorded by a worker that is gone (this
    // process's pid with another start time is not this process).
    let mut leftover = std::process::Command::new("sleep")
        .arg("600")
        .process_group(0)
        .spawn()
        .unwrap();
    let record = AttemptProcessRecord {
        job_id: "job-left-over".into(),
        attempt_number: 1,
        process_id: leftover.id(),
        process_group: leftover.id(),
        start_time_ticks: process_start_time(leftover.id()).unwrap(),
        worker_process_id: std::process::id(),
        worker_start_time_ticks: 0,
    };
    let file = write_record(
        &record_directory(&cluster.checkpoints, "restarted-node"),
        &record,
    )
    .unwrap();
    let mut worker = start_worker_process(&cluster, "restarted-node");
    let status = poll_until(WAIT, EVERY_20_MS, "the leftover is killed", || {
        leftover.try_wait().unwrap()
    })
    .await;
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9));
    assert!(!file.exists());
    worker.kill().unwrap();
    worker.wait().unwrap();
}

/// Writes `spec` to `spec.json` in `directory`; returns its path.
fn write_spec_file(directory: &Path, spec: &str) -> PathBuf {
    let spec_file = directory.join("spec.json");
    std::fs::write(&spec_file, spec).unwrap();
    spec_file
}

/// The attempt process on its own, as the worker starts it: `spec_file` trained with
/// [`CONFIG_JSON`] in a slice of `slice_bytes`, checkpointing to `checkpoint`.
fn attempt_command(spec_file: &Path, slice_bytes: u64, checkpoint: &Path) -> std::process::Command {
    let mut command = std::process::Command::new(worker_binary());
    command
        .arg("attempt")
        .arg("--spec-file")
        .arg(spec_file)
        .arg("--config-json")
        .arg(CONFIG_JSON)
        .arg("--slice-bytes")
        .arg(slice_bytes.to_string())
        .arg("--checkpoint")
        .arg(checkpoint);
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_process_whose_stdout_closes_stops() {
    let directory = tempfile::tempdir().unwrap();
    // No checkpoints and rare progress lines: only the watch over stdout notices.
    let spec_file = write_spec_file(
        directory.path(),
        &job_spec("unread", 1_000_000, None).replace(
            r#""checkpoint_every_steps": 50"#,
            r#""checkpoint_every_steps": 0"#,
        ),
    );
    let mut child = attempt_command(&spec_file, 1 << 30, &directory.path().join("unread.ckpt"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut started = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut started).unwrap();
    assert!(started.contains(r#""type":"started""#), "{started}");
    drop(stdout);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(std::time::Instant::now() < deadline, "the attempt stops");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(WORKER_GONE_EXIT_CODE), "{stderr}");
    assert!(stderr.contains("the worker is gone"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_process_whose_parent_dies_stops() {
    // Started by a shell that exits a second later, without the parent-death signal the
    // worker arms: the process's own watch notices its new parent.
    let directory = tempfile::tempdir().unwrap();
    let spec_file = write_spec_file(directory.path(), &job_spec("reparented", 1_000_000, None));
    let stderr_file = directory.path().join("stderr");
    let output = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{program}' attempt --spec-file '{spec}' --config-json '{CONFIG_JSON}' \
             --slice-bytes 1073741824 --checkpoint '{checkpoint}' >/dev/null 2>'{stderr}' & \
             echo $!; sleep 1",
            program = worker_binary().display(),
            spec = spec_file.display(),
            checkpoint = directory.path().join("reparented.ckpt").display(),
            stderr = stderr_file.display(),
        ))
        .output()
        .unwrap();
    let process_id: u32 = String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .unwrap();
    wait_until_gone(
        &[process_id],
        Duration::from_secs(5),
        "the reparented attempt stops",
    )
    .await;
    let stderr = std::fs::read_to_string(&stderr_file).unwrap();
    assert!(stderr.contains("the parent process changed"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attempt_process_alone_reports_an_oom_and_exits_with_3() {
    // The child side on its own: a slice far too small for the batch.
    let directory = tempfile::tempdir().unwrap();
    let spec_file = write_spec_file(directory.path(), &job_spec("alone", 5, None));
    let attempt = attempt_command(&spec_file, 4096, &directory.path().join("alone.ckpt"));
    let output = tokio::process::Command::from(attempt)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(3),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(last["type"], "oom", "{stdout}");
    assert_eq!(last["limit_bytes"], 4096);
    assert!(last["requested_bytes"].as_u64().unwrap() > 0);
}

fn send_signal(signal: &str, process_id: u32) {
    let status = std::process::Command::new("kill")
        .arg(signal)
        .arg(process_id.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal} {process_id}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_that_finishes_while_the_scheduler_is_down_is_recorded_after_the_reconnect() {
    let (mut cluster, mut worker) = cluster_with_worker().await;
    let (job, process) = submit_and_start(&cluster, &mut worker, "across-a-restart", 1000).await;
    // Hold the attempt still (it trains for seconds) so that it cannot finish before the
    // scheduler is gone.
    send_signal("-STOP", process.process_id);
    // The scheduler's parts are moved out of the cluster here and put back at the restart.
    drop(cluster.channel);
    let _ = cluster.shutdown.send(());
    tokio::time::timeout(WAIT, cluster.server)
        .await
        .expect("the scheduler stops")
        .unwrap();
    // The attempt finishes with nobody to tell: its reports wait in the worker.
    send_signal("-CONT", process.process_id);
    let process_directory = PathBuf::from(format!("/proc/{}", process.process_id));
    poll_until(WAIT, EVERY_20_MS, "the attempt process ends", || {
        (!process_directory.exists()).then_some(())
    })
    .await;
    // The scheduler comes back on the same address with the same database.
    let listener = tokio::net::TcpListener::bind(cluster.address.trim_start_matches("http://"))
        .await
        .unwrap();
    (cluster.channel, cluster.shutdown, cluster.server) =
        start_scheduler(cluster.directory.path(), listener, Duration::from_secs(30)).await;
    let finished = wait_for_state(&cluster, &job.id, v1::JobState::Succeeded).await;
    assert_eq!(finished.attempts.len(), 1, "{finished:#?}");
    let attempt = &finished.attempts[0];
    assert_eq!(outcome(attempt), v1::AttemptOutcome::Succeeded);
    assert_eq!(
        attempt.measured_peak_bytes,
        Some(finished.estimate.as_ref().unwrap().peak_bytes)
    );
    // The worker kept its id across the reconnect, and no second process was started.
    assert!(worker.started_processes.try_recv().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_worker_s_attempt_resumes_from_its_checkpoint_on_another_worker() {
    let cluster = start_cluster_with_lease(Duration::from_millis(800)).await;
    let mut first_worker = start_named_worker(&cluster, "first-node", &worker_binary());
    let (job, _) = submit_and_start(&cluster, &mut first_worker, "moving", 400).await;
    // A checkpoint every 50 steps: wait for the first one on disk, then a moment for
    // its report to reach the scheduler.
    let checkpoint = attempt_checkpoint(&cluster, &job, 1);
    wait_for_checkpoint(&checkpoint).await;
    // The first worker dies with its attempt; its lease runs out.
    drop(first_worker);
    let mut second_worker = start_named_worker(&cluster, "second-node", &worker_binary());
    next_process(&mut second_worker).await;
    let finished = wait_for_state(&cluster, &job.id, v1::JobState::Succeeded).await;
    assert_eq!(finished.attempts.len(), 2, "{finished:#?}");
    assert_eq!(outcome(&finished.attempts[0]), v1::AttemptOutcome::Lost);
    let second = &finished.attempts[1];
    assert_eq!(outcome(second), v1::AttemptOutcome::Succeeded);
    assert_eq!(second.gpu_uuid, "sim-second-node-0");
    let resumed_from = second
        .resumed_from
        .as_ref()
        .expect("resumed from a checkpoint");
    // The recorded file is the checkpoint promoted under its step's name, which no
    // stale attempt rewrites.
    assert_eq!(
        resumed_from.location,
        promoted_path(&checkpoint, resumed_from.step)
            .display()
            .to_string()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_worker_finishes_what_runs_and_starts_nothing_new() {
    let (cluster, mut worker) = cluster_with_worker().await;
    let (running, _) = submit_and_start(&cluster, &mut worker, "running", 300).await;
    let mut clusters = ClusterServiceClient::new(cluster.channel.clone());
    let workers = clusters
        .list_workers(authorized(v1::ListWorkersRequest::default(), &cluster.user))
        .await
        .unwrap()
        .into_inner()
        .workers;
    assert_eq!(workers.len(), 1);
    clusters
        .drain_worker(authorized(
            v1::DrainWorkerRequest {
                worker_id: workers[0].id.clone(),
                reason: "maintenance".into(),
            },
            ADMIN,
        ))
        .await
        .unwrap();
    let waiting = submit_tiny(&cluster, "waiting", 10).await;
    let finished = wait_for_state(&cluster, &running.id, v1::JobState::Succeeded).await;
    assert_eq!(
        outcome(&finished.attempts[0]),
        v1::AttemptOutcome::Succeeded
    );
    // A few scheduling passes later the new job still waits and no process started.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let still_waiting = get(&cluster, &waiting.id).await;
    assert_eq!(still_waiting.state, v1::JobState::Queued as i32);
    assert!(still_waiting.attempts.is_empty());
    assert!(worker.started_processes.try_recv().is_err());
}
