//! `carve jobs` over jobs with large specs: the scheduler bounds each ListJobs page in
//! bytes (so that it fits the 4 MiB the client decodes), which makes pages shorter than
//! asked; `carve jobs` follows the page tokens and shows every job once, newest first.
//! The real `carve` binary against a scheduler in the test's own process (SQLite).

use std::collections::HashSet;
use std::process::Command;

use carve_proto::client::BearerToken;
use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use tonic::transport::Channel;

#[allow(dead_code, reason = "only the scheduler of in_process is used here")]
#[path = "support/in_process.rs"]
mod in_process;
use in_process::ADMIN;

/// A command job (no worker runs it: it waits, queued) whose spec is about 100 KB.
fn large_command_job(name: &str) -> String {
    serde_json::json!({
        "name": name,
        "description": "d".repeat(100 << 10),
        "command": {
            "argv": ["python3", "train.py", "--steps", "{max_steps}"],
            "working_directory": "/tmp",
            "global_batch": 64,
            "steps": 6,
        },
        "resources": { "vram": "2GiB" },
    })
    .to_string()
}

/// `carve ARGUMENTS` against `endpoint` as `token`: its exit code and stdout.
async fn carve(endpoint: &str, token: &str, arguments: &[&str]) -> (Option<i32>, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_carve"));
    command
        .args(arguments)
        .args(["--endpoint", endpoint])
        .env("CARVE_TOKEN", token)
        .env_remove("CARVE_ENDPOINT")
        .env_remove("CARVE_CLI_CONFIG")
        .env("XDG_CONFIG_HOME", "/nonexistent");
    let output = tokio::task::spawn_blocking(move || command.output().unwrap())
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "carve {arguments:?}: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    (
        output.status.code(),
        String::from_utf8(output.stdout).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn carve_jobs_shows_every_large_job_across_pages_cut_by_bytes() {
    let directory = tempfile::tempdir().unwrap();
    let (endpoint, _stop, _server) =
        in_process::start(directory.path(), "127.0.0.1:0".parse().unwrap()).await;
    let channel = loop {
        if let Ok(channel) = Channel::from_shared(endpoint.clone())
            .unwrap()
            .connect()
            .await
        {
            break channel;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let [user] = carve_testing::cluster::tenant_with_tokens(
        &channel,
        ADMIN,
        "alice",
        v1::Quota::default(),
        &[v1::Role::User],
    )
    .await
    .try_into()
    .unwrap();
    let mut client = JobServiceClient::with_interceptor(channel, BearerToken::new(&user).unwrap());
    // 100 jobs of 100 KB: one page of them would be 10 MB.
    let mut submitted = Vec::new();
    for index in 0..100 {
        let job = client
            .submit_job(v1::SubmitJobRequest {
                spec_json: large_command_job(&format!("large-{index}")),
                idempotency_key: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .job
            .unwrap();
        submitted.push(job.id);
    }
    let newest_first: Vec<String> = submitted.iter().rev().cloned().collect();

    // Every job (--limit 0), as JSON: all of them, newest first, each once.
    let (_, stdout) = carve(&endpoint, &user, &["jobs", "--limit", "0", "-o", "json"]).await;
    let list: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let listed: Vec<String> = list["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|job| job["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(listed, newest_first);

    // The default limit (200) and a limit that ends inside a short page, as a table.
    let (_, table) = carve(&endpoint, &user, &["jobs"]).await;
    let shown: HashSet<&String> = submitted
        .iter()
        .filter(|id| table.contains(id.as_str()))
        .collect();
    assert_eq!(shown.len(), 100, "{table}");
    let (_, stdout) = carve(&endpoint, &user, &["jobs", "--limit", "45", "-o", "json"]).await;
    let list: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let listed: Vec<&str> = list["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|job| job["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, newest_first[..45]);
}
