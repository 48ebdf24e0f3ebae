//! `carve dev [--demo]`: a whole local cluster in one process. The real scheduler
//! (SQLite in a data directory) and the real worker (simulated GPUs) run in-process; the
//! worker's attempt processes are this binary (`carve attempt ...`). A tenant `dev` with
//! a user token and a worker token is created through the admin API, exactly as an
//! operator would. With `--demo` the examples are submitted (step counts cut so they
//! train in seconds on a CPU), watched to the end through the JobService, and summed up
//! in a table; the exit code says whether every one of them succeeded.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use carve_core::validate::parse_job_spec_toml;
use carve_proto::client::{AuthenticatedChannel, create_tenant_with_tokens, shutdown_signal};
use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::SchedulerConfig;
use carve_worker::gpus::{SimulatedGpu, parse_simulated_gpus};
use carve_worker::image::ImageSettings;
use carve_worker::nvml::discover_nvml_gpus;
use carve_worker::sandbox::{SandboxPolicy, uncontained_reason};
use carve_worker::{WorkerConfig, run_worker};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::client::connection::connect_channel;
use crate::client::failure::FailureKind;
use crate::client::output::{
    bytes_text, config_text, is_terminal, job_state_name, outcome_name, precision_name,
    print_wide_table,
};
use crate::client::overrides::toml_to_json;
use crate::spec_input::make_command_directory_absolute;

mod demo_image;

/// The tenant `carve dev` creates and hands out a user token for.
pub const DEV_TENANT: &str = "dev";

/// How long the demo waits for all its jobs before it gives up.
const DEMO_DEADLINE: Duration = Duration::from_secs(600);

/// How long stopping the worker or the scheduler may take before it is abandoned.
const STOP_DEADLINE: Duration = Duration::from_secs(30);

#[derive(Debug, clap::Args)]
pub struct DevArguments {
    /// Submit the examples, watch them to the end, print a summary and stop; the exit
    /// code is 0 when every one succeeded.
    #[arg(long)]
    demo: bool,
    /// Where the scheduler listens (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Where the database and checkpoints go; a fresh temporary directory, removed at
    /// the end, when not given.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The GPUs the worker simulates: `2x16GiB` or `16GiB,8GiB`.
    #[arg(long, default_value = "2x16GiB")]
    sim_gpus: String,
    /// Offer this machine's GPUs (found through NVML) instead of simulated ones; the
    /// attempts then train on them with the cuda backend.
    #[arg(long, conflicts_with = "sim_gpus")]
    real_gpus: bool,
}

/// One example the demo submits: its file, and the step count it is cut to.
#[derive(Debug)]
struct DemoExample {
    file: &'static str,
    toml: &'static str,
    steps: u64,
}

/// The examples that train in seconds on a CPU. `tf-conv2d-128px-batch32` asks for a
/// 128 MiB slice its batch does not fit: the scheduler shrinks it at submit. The
/// 1024px, deep-CNN and ResNet examples take minutes a step on a CPU and are left out;
/// `mnist-idx` needs the real MNIST files.
const DEMO_EXAMPLES: &[DemoExample] = &[
    DemoExample {
        file: "examples/mnist-cnn.toml",
        toml: include_str!("../../examples/mnist-cnn.toml"),
        steps: 30,
    },
    DemoExample {
        file: "examples/tf-conv2d-128px-batch32.toml",
        toml: include_str!("../../examples/tf-conv2d-128px-batch32.toml"),
        steps: 5,
    },
];

/// The command job the demo submits: a user's program (the CI stand-in, simulating its
/// device memory against its slice) that runs out of memory at run time and is retried
/// with gradient accumulation. The script is written into the data directory, where the
/// job runs it, so the demo works from any folder.
const DEMO_COMMAND_FILE: &str = "examples/command/standin-demo.toml";
const DEMO_COMMAND_TOML: &str = include_str!("../../examples/command/standin-demo.toml");
const DEMO_COMMAND_SCRIPT_NAME: &str = "standin_train.py";
const DEMO_COMMAND_SCRIPT: &str = include_str!("../../examples/command/standin_train.py");

pub fn run(arguments: DevArguments) -> Result<ExitCode> {
    // Check what was typed, and that there are GPUs, before starting anything.
    let gpus = if arguments.real_gpus {
        let found = discover_nvml_gpus().map_err(|error| anyhow!("--real-gpus: {error}"))?;
        if found.is_empty() {
            bail!("--real-gpus: NVML found no GPU on this machine");
        }
        Vec::new()
    } else {
        parse_simulated_gpus(&arguments.sim_gpus)?
    };
    let program = std::env::current_exe().context("cannot find the carve binary")?;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(run_cluster(arguments, gpus, program))
}

/// A task running until its stop sender fires.
struct Stoppable {
    name: &'static str,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<()>>,
}

impl Stoppable {
    /// Spawns `serve`, given the future that resolves once `stop` is called.
    fn spawn<Served, Failure>(
        name: &'static str,
        serve: impl FnOnce(Pin<Box<dyn Future<Output = ()> + Send>>) -> Served,
    ) -> Stoppable
    where
        Served: Future<Output = Result<(), Failure>> + Send + 'static,
        Failure: std::error::Error + Send + Sync + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let served = serve(Box::pin(async {
            let _ = stopped.await;
        }));
        let task = tokio::spawn(async move { served.await.map_err(anyhow::Error::from) });
        Stoppable { name, stop, task }
    }

    async fn stop(self) -> Result<()> {
        let _ = self.stop.send(());
        match tokio::time::timeout(STOP_DEADLINE, self.task).await {
            Ok(Ok(result)) => result.with_context(|| format!("the {}", self.name)),
            Ok(Err(error)) => Err(anyhow!("the {} panicked: {error}", self.name)),
            Err(_) => bail!(
                "the {} did not stop within {}s",
                self.name,
                STOP_DEADLINE.as_secs()
            ),
        }
    }
}

async fn run_cluster(
    arguments: DevArguments,
    gpus: Vec<SimulatedGpu>,
    program: PathBuf,
) -> Result<ExitCode> {
    // The temporary directory lives (and is removed) with this function.
    let (_temporary, data_dir) = match &arguments.data_dir {
        Some(directory) => (None, directory.clone()),
        None => {
            let temporary = tempfile::Builder::new()
                .prefix("carve-dev-")
                .tempdir()
                .context("cannot create a temporary data directory")?;
            let path = temporary.path().to_path_buf();
            (Some(temporary), path)
        }
    };
    std::fs::create_dir_all(&data_dir)
        .with_context(|| format!("cannot create {}", data_dir.display()))?;
    let data_dir = data_dir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", data_dir.display()))?;
    // Held until this function returns (or the process ends, however it ends).
    let _lock = lock_data_dir(&data_dir)?;
    let listener = tokio::net::TcpListener::bind(arguments.listen)
        .await
        .with_context(|| format!("cannot listen on {}", arguments.listen))?;
    let address = listener.local_addr().context("the listening address")?;
    let endpoint = format!("http://{address}");

    let admin_token = carve_scheduler::auth::generate_secret();
    let scheduler = start_scheduler(&data_dir, listener, admin_token.clone());
    let result = async {
        // The listener is bound already, so connecting succeeds at once.
        let admin = connect_channel(&endpoint, None, None, &admin_token).await?;
        let (user_token, worker_token) = create_tenant_and_tokens(admin).await?;
        let channel = connect_channel(&endpoint, None, None, &user_token).await?;
        let real_gpus = arguments.real_gpus;
        let (worker, demo_image) =
            start_worker(&endpoint, worker_token, gpus, real_gpus, program, &data_dir);
        println!(
            "carve dev: a scheduler and a worker ({}) are running",
            if real_gpus {
                "this machine's GPUs"
            } else {
                arguments.sim_gpus.as_str()
            }
        );
        println!("  endpoint:  {endpoint}");
        println!("  token:     {user_token}   (tenant `{DEV_TENANT}`)");
        println!("  admin:     {admin_token}");
        println!("  data dir:  {}", data_dir.display());
        println!("  export CARVE_ENDPOINT={endpoint} CARVE_TOKEN={user_token}");
        let code = if arguments.demo {
            tokio::select! {
                code = run_demo(&channel, &data_dir, demo_image) => code?,
                () = shutdown_signal() => {
                    println!("interrupted; stopping");
                    ExitCode::from(FailureKind::Interrupted)
                }
            }
        } else {
            println!("Ctrl-C stops it.");
            shutdown_signal().await;
            println!("stopping");
            ExitCode::SUCCESS
        };
        drop(channel);
        worker.stop().await?;
        Ok::<_, anyhow::Error>(code)
    }
    .await;
    let stopped = scheduler.stop().await;
    let code = result?;
    stopped?;
    println!("stopped");
    Ok(code)
}

/// The file in a data directory that a running `carve dev` holds locked, with its
/// process id in it.
const DATA_DIR_LOCK_FILE: &str = "carve-dev.lock";

/// Takes the lock on `data_dir` that says a `carve dev` uses it: a second one on the same
/// directory would start a scheduler the first one's SQLite lock refuses, and fail far
/// from the reason. The lock is the kernel's (`flock`), so it goes when the process
/// does, even killed; the process id in the file is only for the message.
fn lock_data_dir(data_dir: &Path) -> Result<std::fs::File> {
    use std::io::{Read as _, Seek as _, Write as _};
    let path = data_dir.join(DATA_DIR_LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let mut holder = String::new();
            // Written right after the lock was taken: empty only in that instant.
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let holder = if holder.is_empty() {
                String::new()
            } else {
                format!(" (pid {holder})")
            };
            bail!(
                "the data directory {} is in use by another carve dev{holder}; stop that one, \
                 or give this one another --data-dir",
                data_dir.display()
            );
        }
        Err(error) => {
            return Err(error).with_context(|| format!("cannot lock {}", path.display()));
        }
    }
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{}", std::process::id()))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(file)
}

fn start_scheduler(
    data_dir: &Path,
    listener: tokio::net::TcpListener,
    admin_token: String,
) -> Stoppable {
    let config = SchedulerConfig {
        database_url: format!("sqlite://{}", data_dir.join("carve.db").display()),
        settings: SchedulerSettings {
            heartbeat_interval: Duration::from_secs(1),
            scheduling_interval: Duration::from_millis(200),
            ..SchedulerSettings::default()
        },
        admin_token: Some(admin_token),
        metrics_address: None,
        tls: None,
    };
    Stoppable::spawn("scheduler", move |stopped| {
        carve_scheduler::server::run(config, listener, stopped)
    })
}

/// The worker, and whether the demo's image job can run on it (else why not).
fn start_worker(
    endpoint: &str,
    worker_token: String,
    gpus: Vec<SimulatedGpu>,
    real_gpus: bool,
    program: PathBuf,
    data_dir: &Path,
) -> (Stoppable, Result<(), String>) {
    let mut config = WorkerConfig::new(endpoint, worker_token, gpus, program);
    // Simulated GPUs alone unless asked: a dev cluster on a GPU machine behaves the same
    // as anywhere else.
    config.discover_real_gpus = real_gpus;
    config.hostname = "dev-node".into();
    config.checkpoint_directory = data_dir.join("checkpoints");
    // Contained when this machine has a runtime (and loudly not, when it has none).
    // A dev cluster has one tenant, the person who started it: its jobs may name any
    // path of the host as their code or data (read-only, as the tenant's own uid, so
    // only what others may read), never the worker's own directory.
    config.sandbox.policy = SandboxPolicy::IfAvailable;
    config.sandbox.job_paths = vec![PathBuf::from("/")];
    let demo_image = match uncontained_reason(&config.sandbox) {
        Some(reason) => {
            println!(
                "WARNING: attempts are NOT contained: each runs with your rights (its files, \
                 processes and network), because {reason}. Install runc (apt-get install \
                 runc) and run carve dev as root to contain them."
            );
            Err("images run only in contained attempts".to_string())
        }
        // Job images (`command.image`) from registries, and the demo's own image.
        None => {
            let layout = demo_image::write_demo_image(data_dir);
            let mut images = ImageSettings::under(&config.checkpoint_directory);
            images.layout_directories = layout.iter().cloned().collect();
            config.sandbox.images = Some(images);
            layout.map(|_| ())
        }
    };
    config.reconnect_backoff_initial = Duration::from_millis(50);
    config.reconnect_backoff_max = Duration::from_secs(1);
    (
        Stoppable::spawn("worker", move |stopped| run_worker(config, stopped)),
        demo_image,
    )
}

/// Creates the `dev` tenant (unless a reused data dir has it) and returns a new user
/// token and a new worker token for it.
async fn create_tenant_and_tokens(admin: AuthenticatedChannel) -> Result<(String, String)> {
    let secrets = create_tenant_with_tokens(
        admin,
        DEV_TENANT,
        v1::Quota::default(),
        &[v1::Role::User, v1::Role::Worker],
        "carve dev",
    )
    .await
    .map_err(|status| {
        anyhow!(
            "cannot create the tenant `{DEV_TENANT}` and its tokens: {}",
            status.message()
        )
    })?;
    let [user, worker] = <[String; 2]>::try_from(secrets)
        .map_err(|_| anyhow!("the scheduler did not answer with two tokens"))?;
    Ok((user, worker))
}

/// The spec JSON of an example with its steps cut.
fn demo_spec_json(example: &DemoExample) -> Result<String> {
    let mut spec =
        parse_job_spec_toml(example.toml).map_err(|error| anyhow!("{}: {error}", example.file))?;
    spec.training.steps = Some(example.steps);
    spec.training.epochs = None;
    carve_proto::convert::job_spec_to_json(&spec)
        .map_err(|error| anyhow!("{}: {error}", example.file))
}

/// The spec JSON of the demo's command job, its program written to `data_dir/programs`
/// and run there; `None` (said on stdout) when this machine has no `python3` to run it.
fn demo_command_spec_json(data_dir: &Path) -> Result<Option<String>> {
    let has_python = std::process::Command::new("python3")
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if !has_python {
        println!("skipping {DEMO_COMMAND_FILE}: no python3 on this machine to run its program");
        return Ok(None);
    }
    let programs = data_dir.join("programs");
    std::fs::create_dir_all(&programs)
        .with_context(|| format!("cannot create {}", programs.display()))?;
    let script = programs.join(DEMO_COMMAND_SCRIPT_NAME);
    std::fs::write(&script, DEMO_COMMAND_SCRIPT)
        .with_context(|| format!("cannot write {}", script.display()))?;
    let mut document: toml::Table = toml::from_str(DEMO_COMMAND_TOML)
        .map_err(|error| anyhow!("{DEMO_COMMAND_FILE}: {error}"))?;
    make_command_directory_absolute(&mut document, &programs)
        .map_err(|error| anyhow!("{DEMO_COMMAND_FILE}: {error}"))?;
    let json = toml_to_json(&toml::Value::Table(document), "")
        .map_err(|error| anyhow!("{DEMO_COMMAND_FILE}: {error}"))?;
    Ok(Some(json.to_string()))
}

/// Submits the demo examples, follows them to their end and prints the summary.
async fn run_demo(
    channel: &AuthenticatedChannel,
    data_dir: &Path,
    demo_image: Result<(), String>,
) -> Result<ExitCode> {
    let started = Instant::now();
    let mut client = JobServiceClient::new(channel.clone());
    let mut jobs = Vec::new();
    let mut submissions = Vec::new();
    for example in DEMO_EXAMPLES {
        submissions.push((
            example.file,
            format!("{} steps", example.steps),
            demo_spec_json(example)?,
        ));
    }
    if let Some(spec_json) = demo_command_spec_json(data_dir)? {
        submissions.push((DEMO_COMMAND_FILE, "a user's program".to_string(), spec_json));
    }
    match demo_image {
        Ok(()) => submissions.push((
            demo_image::DEMO_IMAGE,
            "a program in its own image".to_string(),
            demo_image::demo_image_spec_json(),
        )),
        Err(reason) => println!("skipping the job in {}: {reason}", demo_image::DEMO_IMAGE),
    }
    for (file, what, spec_json) in submissions {
        let request = v1::SubmitJobRequest {
            spec_json,
            idempotency_key: String::new(),
        };
        let job = client
            .submit_job(request)
            .await
            .map_err(|status| anyhow!("cannot submit {file}: {}", status.message()))?
            .into_inner()
            .job
            .context("the scheduler answered a submit without the job")?;
        println!(
            "submitted {file} as {} ({what}): {}, estimate {}",
            job.id,
            config_text(job.current_config.as_ref()),
            bytes_text(
                job.estimate
                    .as_ref()
                    .map(|estimate| estimate.required_bytes)
            ),
        );
        jobs.push(job);
    }
    // Poll every job until all have ended, telling each state change as it happens.
    let deadline = started + DEMO_DEADLINE;
    let mut states: Vec<(i32, usize)> = jobs.iter().map(|job| (job.state, 0)).collect();
    loop {
        for (index, job) in jobs.iter_mut().enumerate() {
            if is_terminal(job) {
                continue;
            }
            let request = v1::GetJobRequest {
                job_id: job.id.clone(),
            };
            *job = client
                .get_job(request)
                .await
                .map_err(|status| anyhow!("cannot get job {}: {}", job.id, status.message()))?
                .into_inner()
                .job
                .context("the scheduler answered without the job")?;
            let now = (job.state, job.attempts.len());
            if now != states[index] {
                states[index] = now;
                let attempt = job
                    .attempts
                    .last()
                    .map(|attempt| {
                        format!(
                            " (attempt {}: {})",
                            attempt.number,
                            outcome_name(attempt.outcome)
                        )
                    })
                    .unwrap_or_default();
                println!(
                    "[{:>5.1}s] {}: {}{attempt}",
                    started.elapsed().as_secs_f64(),
                    job.name,
                    job_state_name(job.state)
                );
            }
        }
        if jobs.iter().all(is_terminal) {
            break;
        }
        if Instant::now() >= deadline {
            println!(
                "the demo jobs did not all end within {}s",
                DEMO_DEADLINE.as_secs()
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    print_summary(&jobs);
    println!("demo finished in {:.1}s", started.elapsed().as_secs_f64());
    let all_succeeded = jobs
        .iter()
        .all(|job| job.state == v1::JobState::Succeeded as i32);
    Ok(if all_succeeded {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(FailureKind::Other)
    })
}

/// What to say about a job beyond its state: its failure, or the shrink it went through.
fn job_note(job: &v1::Job) -> String {
    if !job.message.is_empty() {
        return job.message.clone();
    }
    if let Some(attempt) = job.attempts.last()
        && !attempt.failure_message.is_empty()
    {
        return attempt.failure_message.clone();
    }
    let ooms = job
        .attempts
        .iter()
        .filter(|attempt| attempt.outcome == v1::AttemptOutcome::OutOfMemory as i32)
        .count();
    let spec = carve_proto::convert::job_spec_from_json(&job.spec_json).ok();
    let ran = job
        .attempts
        .last()
        .and_then(|attempt| attempt.config.as_ref());
    let shrunk = match (spec, ran) {
        (Some(spec), Some(ran)) => {
            ran.micro_batch_size != spec.training.batch_size
                || precision_name(ran.precision) != spec.training.precision.name()
        }
        _ => false,
    };
    let seen_by: Vec<&str> = job
        .attempts
        .iter()
        .map(|attempt| attempt.oom_detected_by.as_str())
        .filter(|detector| !detector.is_empty() && *detector != "allocator")
        .collect();
    match (ooms, shrunk) {
        (0, true) => "shrunk at submit to fit its slice".into(),
        (0, false) => "ran as written".into(),
        (count, _) if !seen_by.is_empty() => format!(
            "shrunk after {count} out-of-memory attempt(s), seen by {}",
            seen_by.join(", ")
        ),
        (count, _) => format!("shrunk after {count} out-of-memory attempt(s)"),
    }
}

fn print_summary(jobs: &[v1::Job]) {
    let header = [
        "JOB", "STATE", "ATTEMPTS", "CONFIG", "SLICE", "ESTIMATE", "PEAK", "NOTE",
    ];
    let rows: Vec<[String; 8]> = jobs
        .iter()
        .map(|job| {
            let attempt = job.attempts.last();
            [
                job.name.clone(),
                job_state_name(job.state),
                job.attempts.len().to_string(),
                config_text(
                    attempt
                        .and_then(|attempt| attempt.config.as_ref())
                        .or(job.current_config.as_ref()),
                ),
                bytes_text(attempt.map(|attempt| attempt.slice_bytes)),
                bytes_text(attempt.map(|attempt| attempt.estimate_bytes)),
                bytes_text(attempt.and_then(|attempt| attempt.measured_peak_bytes)),
                job_note(job),
            ]
        })
        .collect();
    // Whole cells, not cut to 100 columns: the demo's point is these numbers and notes.
    println!();
    print_wide_table(header, &rows);
    println!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_directory_in_use_is_refused_naming_the_process_until_it_is_let_go() {
        let directory = tempfile::tempdir().unwrap();
        let held = lock_data_dir(directory.path()).unwrap();
        let refused = lock_data_dir(directory.path()).unwrap_err().to_string();
        assert_eq!(
            refused,
            format!(
                "the data directory {} is in use by another carve dev (pid {}); stop that \
                 one, or give this one another --data-dir",
                directory.path().display(),
                std::process::id()
            )
        );
        drop(held);
        // Let go (as when that process ends): the next one takes it, and says so in it.
        let _taken = lock_data_dir(directory.path()).unwrap();
        let written = std::fs::read_to_string(directory.path().join(DATA_DIR_LOCK_FILE)).unwrap();
        assert_eq!(written, format!("{}\n", std::process::id()));
    }
}
