//! What the worker's end-to-end and chaos tests share: the tiny job they train, a
//! request with its bearer token, the `carve-worker` command line of a worker process,
//! and the command lines of the processes running now (how both find attempt processes).

use std::path::Path;
use std::process::Command;

use tonic::Request;

/// `message` with `token` as its bearer token.
pub fn authorized<T>(message: T, token: &str) -> Request<T> {
    carve_proto::client::authorized_request(message, token).expect("a valid token")
}

/// A job small enough to train in well under a second, as JSON: `steps` sets how long it
/// runs; `resources` is appended after the data section as it is (empty, or
/// `, "resources": {...}`).
pub fn tiny_job_spec(
    name: &str,
    steps: u64,
    checkpoint_every_steps: u64,
    resources: &str,
) -> String {
    format!(
        r#"{{
  "name": "{name}",
  "model": {{
    "input_shape": [8, 8, 1],
    "loss": "softmax_cross_entropy",
    "layers": [
      {{ "conv2d": {{ "filters": 8, "kernel": 3, "padding": "same" }} }},
      {{ "relu": {{}} }},
      {{ "flatten": {{}} }},
      {{ "dense": {{ "units": 4 }} }}
    ]
  }},
  "training": {{ "batch_size": 64, "steps": {steps}, "checkpoint_every_steps": {checkpoint_every_steps}, "optimizer": {{ "adam": {{ "learning_rate": 0.001 }} }} }},
  "data": {{ "format": "synthetic", "samples": 256 }}{resources}
}}"#
    )
}

/// The real `carve-worker` binary as a worker with one simulated 1 GiB GPU, connecting
/// to `address`; the caller adds its log level and standard streams. The worker takes its
/// token from a file only (`--token-file`, mode 0600), written beside `checkpoints` as
/// `worker-token-{hostname}`.
pub fn worker_process_command(
    address: &str,
    token: &str,
    checkpoints: &Path,
    hostname: &str,
) -> Command {
    let token_file = checkpoints.with_file_name(format!("worker-token-{hostname}"));
    write_token_file(&token_file, token);
    let mut command = Command::new(env!("CARGO_BIN_EXE_carve-worker"));
    command
        .arg("--scheduler")
        .arg(address)
        .arg("--token-file")
        .arg(&token_file)
        .arg("--sim-gpus")
        .arg("1GiB")
        .arg("--context-bytes")
        .arg("64MiB")
        .arg("--checkpoint-dir")
        .arg(checkpoints)
        .arg("--hostname")
        .arg(hostname);
    // Contained where this machine can (CI installs runc and runs as root); elsewhere
    // the worker is told to run without, as it refuses to start otherwise.
    if !can_contain() {
        command.arg("--insecure-no-sandbox");
    }
    command
}

/// Whether attempts can run in containers here: a runtime and root. CI must be able to.
pub fn can_contain() -> bool {
    let can =
        carve_worker::sandbox::find_runtime(None).is_ok() && rustix::process::geteuid().is_root();
    assert!(
        can || std::env::var_os("CI").is_none(),
        "CI must be able to contain attempts (runc installed, root)"
    );
    can
}

/// `token` in a file at `path` that its owner alone may read, as carve-worker demands
/// (written again, mode and all, when a restarted worker reuses it).
fn write_token_file(path: &Path, token: &str) {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .expect("the worker's token file is written");
    std::io::Write::write_all(&mut file, format!("{token}\n").as_bytes())
        .expect("the worker's token file is written");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .expect("the worker's token file is made 0600");
}

/// The command line of every process running now, by pid (nothing where `/proc` cannot
/// be read; a process that ends meanwhile is left out).
pub fn process_command_lines() -> Vec<(u32, Vec<String>)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|process_id| {
            let cmdline = std::fs::read(format!("/proc/{process_id}/cmdline")).ok()?;
            let arguments = cmdline
                .split(|byte| *byte == 0)
                .map(|argument| String::from_utf8_lossy(argument).into_owned())
                .collect();
            Some((process_id, arguments))
        })
        .collect()
}

/// A tenant `alice` made with the `admin` token on the scheduler behind `channel`, and
/// the secrets of a user token and a worker token of hers.
#[allow(dead_code, reason = "the chaos test makes its own tenant")]
pub async fn alice_with_tokens(
    channel: &tonic::transport::Channel,
    admin: &str,
) -> (String, String) {
    let [user, worker] = carve_testing::cluster::tenant_with_tokens(
        channel,
        admin,
        "alice",
        carve_proto::v1::Quota::default(),
        &[carve_proto::v1::Role::User, carve_proto::v1::Role::Worker],
    )
    .await
    .try_into()
    .expect("two tokens");
    (user, worker)
}

/// Calls `check` every `interval` until it gives a value; fails the test with `what`
/// once `limit` has passed without one.
pub async fn poll_until<T>(
    limit: std::time::Duration,
    interval: std::time::Duration,
    what: &str,
    mut check: impl FnMut() -> Option<T>,
) -> T {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(interval).await;
    }
}

/// Sends signal `name` (`STOP`, `CONT`, `KILL`) to a process, through kill(1): a test's
/// stand-in for a frozen or killed scheduler or worker.
#[allow(dead_code, reason = "only the freeze tests signal processes")]
pub fn signal(process_id: u32, name: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{name}"))
        .arg(process_id.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} {process_id}");
}

/// Submits `spec_json` as `user` and returns the new job's id.
#[allow(dead_code, reason = "only the freeze tests submit this way")]
pub async fn submit_job_id(
    channel: &tonic::transport::Channel,
    user: &str,
    spec_json: String,
) -> String {
    carve_proto::v1::job_service_client::JobServiceClient::new(channel.clone())
        .submit_job(authorized(
            carve_proto::v1::SubmitJobRequest {
                spec_json,
                idempotency_key: String::new(),
            },
            user,
        ))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap()
        .id
}
