//! Issue 32's end-to-end test: two tenants, one with a night of recorded usage (written
//! through the store with the night's timestamps), submit at the same moment to a
//! cluster whose one GPU holds one of their jobs at a time; the one without history is
//! placed first. Then the real `carve usage` binary reports both exactly, compared with
//! the attempts' own slices, ends and measured peaks and their jobs' submits. The
//! scheduler and a real worker run in this process; the worker's attempts are real
//! processes (`carve attempt`, as in `carve dev`) on a simulated GPU.

use std::process::{Command, Stdio};
use std::time::Duration;

use carve_proto::client::BearerToken;
use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::store::{Store, UsageRecord};
use carve_worker::gpus::SimulatedGpu;
use carve_worker::sandbox::SandboxPolicy;
use carve_worker::{WorkerConfig, run_worker};
use serde_json::Value;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

#[path = "support/in_process.rs"]
mod in_process;
#[allow(dead_code)]
mod support;
use in_process::{ADMIN, job_json};
use support::dev_cluster::{Outcome, carve_binary, repository_root, wait_for};

const HOUR_MS: i64 = 3_600_000;
const GIB: i64 = 1 << 30;
const CONTEXT_BYTES: u64 = 64 << 20;
/// The longest any wait of the test may take.
const WAIT: Duration = Duration::from_secs(60);

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

fn milliseconds(timestamp: &prost_types::Timestamp) -> i64 {
    timestamp.seconds * 1000 + i64::from(timestamp.nanos / 1_000_000)
}

/// `ms` as the UTC time `carve usage --since` reads, to the millisecond.
fn utc_text(ms: i64) -> String {
    let days = ms.div_euclid(86_400_000);
    let of_day = ms.rem_euclid(86_400_000);
    // Howard Hinnant's civil_from_days.
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        of_day / HOUR_MS,
        of_day % HOUR_MS / 60_000,
        of_day % 60_000 / 1000,
        of_day % 1000
    )
}

async fn connect(endpoint: &str) -> Channel {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match Channel::from_shared(endpoint.to_string())
            .unwrap()
            .connect()
            .await
        {
            Ok(channel) => return channel,
            Err(error) => {
                assert!(tokio::time::Instant::now() < deadline, "{error}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

fn jobs(
    channel: &Channel,
    token: &str,
) -> JobServiceClient<InterceptedService<Channel, BearerToken>> {
    JobServiceClient::new(InterceptedService::new(
        channel.clone(),
        BearerToken::new(token).unwrap(),
    ))
}

/// A tenant and its tokens (user, worker), the user's described as `user`.
async fn tenant(channel: &Channel, name: &str, user: &str) -> (String, String) {
    let admin = InterceptedService::new(channel.clone(), BearerToken::new(ADMIN).unwrap());
    let secrets = carve_proto::client::create_tenant_with_tokens(
        admin,
        name,
        v1::Quota::default(),
        &[v1::Role::User, v1::Role::Worker],
        user,
    )
    .await
    .unwrap();
    (secrets[0].clone(), secrets[1].clone())
}

async fn wait_until_succeeded(channel: &Channel, token: &str, job_id: &str) -> v1::Job {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let job = jobs(channel, token)
            .get_job(v1::GetJobRequest {
                job_id: job_id.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .job
            .unwrap();
        if job.state == v1::JobState::Succeeded as i32 {
            return job;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "job {job_id} did not succeed: {job:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs the real `carve` with `arguments` against `endpoint` as `token`, killed if it
/// has not ended within a minute.
async fn carve(endpoint: &str, token: &str, arguments: &[&str]) -> Outcome {
    let mut child = Command::new(carve_binary())
        .args(arguments)
        .current_dir(repository_root())
        .env_remove("CARVE_CLI_CONFIG")
        .env_remove("CARVE_CA_CERT")
        .env("CARVE_ENDPOINT", endpoint)
        .env("CARVE_TOKEN", token)
        .env("XDG_CONFIG_HOME", "/nonexistent")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let what = format!("carve {}", arguments.join(" "));
    tokio::task::spawn_blocking(move || wait_for(&mut child, &what))
        .await
        .unwrap()
}

/// What one tenant's figures must be: summed from its attempts' own records.
#[derive(Debug, Default)]
struct Expected {
    jobs: u64,
    attempts: u64,
    gpu_milliseconds: u64,
    vram_requested: u128,
    vram_used: u128,
    vram_requested_measured: u128,
    measured_attempts: u64,
    queue_times: Vec<u64>,
}

impl Expected {
    fn add(&mut self, slice: i64, held_ms: i64, peak: Option<i64>) {
        self.attempts += 1;
        self.gpu_milliseconds += held_ms as u64;
        let requested = slice as u128 * held_ms as u128;
        self.vram_requested += requested;
        if let Some(peak) = peak {
            self.measured_attempts += 1;
            self.vram_used += peak as u128 * held_ms as u128;
            self.vram_requested_measured += requested;
        }
    }

    fn check(&self, figures: &Value) {
        let number = |name: &str| {
            figures[name]
                .as_u64()
                .unwrap_or_else(|| panic!("{name} in {figures}"))
        };
        let text = |name: &str| {
            figures[name]
                .as_str()
                .unwrap_or_else(|| panic!("{name} in {figures}"))
                .to_string()
        };
        assert_eq!(number("jobs"), self.jobs, "{figures}");
        assert_eq!(number("attempts"), self.attempts, "{figures}");
        assert_eq!(
            number("gpu_milliseconds"),
            self.gpu_milliseconds,
            "{figures}"
        );
        assert_eq!(
            text("vram_requested_byte_milliseconds"),
            self.vram_requested.to_string()
        );
        assert_eq!(
            text("vram_used_byte_milliseconds"),
            self.vram_used.to_string()
        );
        assert_eq!(
            text("vram_requested_measured_byte_milliseconds"),
            self.vram_requested_measured.to_string()
        );
        assert_eq!(
            number("measured_attempts"),
            self.measured_attempts,
            "{figures}"
        );
        assert_eq!(number("oom_retries"), 0, "{figures}");
        assert_eq!(number("preemptions"), 0, "{figures}");
        assert_eq!(number("queued_attempts"), self.queue_times.len() as u64);
        // One wait each: every percentile is that wait.
        for percentile in ["p50", "p90", "p99"] {
            assert_eq!(
                number(&format!("queue_time_{percentile}_ms")),
                self.queue_times[0],
                "{percentile} in {figures}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_without_history_is_placed_first_and_carve_usage_reports_both_exactly() {
    let directory = tempfile::tempdir().unwrap();
    let (endpoint, _stop_scheduler, _server) =
        in_process::start(directory.path(), "127.0.0.1:0".parse().unwrap()).await;
    let channel = connect(&endpoint).await;
    // The night tenant's name sorts first: instantaneous fair share would place it first.
    let (night_user, worker_token) = tenant(&channel, "aa-night", "night-owl").await;
    let (fresh_user, _) = tenant(&channel, "zz-fresh", "early-bird").await;

    // Last night: eight hours of a 40 GiB slice (31 GiB measured), ended an hour ago.
    let started_ms = now_ms();
    let store = Store::open(&format!(
        "sqlite://{}",
        directory.path().join("carve.db").display()
    ))
    .await
    .unwrap();
    let night = UsageRecord {
        job_id: "job-last-night".to_string(),
        attempt_number: 1,
        tenant: "aa-night".to_string(),
        gpu_type: "simulated".to_string(),
        slice_bytes: 40 * GIB,
        placed_at_ms: started_ms - 9 * HOUR_MS,
        ended_at_ms: Some(started_ms - HOUR_MS),
        measured_peak_bytes: Some(31 * GIB),
    };
    store
        .record_usage(std::slice::from_ref(&night))
        .await
        .unwrap();

    // Both submit before any GPU exists, so both wait for the same pass.
    let mut submitted = Vec::new();
    for (token, name) in [(&night_user, "night-job"), (&fresh_user, "fresh-job")] {
        let job = jobs(&channel, token)
            .submit_job(v1::SubmitJobRequest {
                spec_json: job_json(name),
                idempotency_key: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .job
            .unwrap();
        submitted.push(job);
    }
    let required = submitted[0].estimate.as_ref().unwrap().required_bytes;
    assert_eq!(
        required,
        submitted[1].estimate.as_ref().unwrap().required_bytes
    );

    // One simulated GPU with room for one of the two slices at a time.
    let gpus = vec![SimulatedGpu {
        total_bytes: CONTEXT_BYTES + required * 3 / 2,
    }];
    let program = std::path::PathBuf::from(carve_binary());
    let mut config = WorkerConfig::new(endpoint.clone(), worker_token, gpus, program);
    config.hostname = "usage-node".into();
    config.discover_real_gpus = false;
    config.context_bytes = CONTEXT_BYTES;
    config.checkpoint_directory = directory.path().join("checkpoints");
    config.sandbox.policy = SandboxPolicy::Off;
    let (_stop_worker, worker_stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(run_worker(config, async {
        let _ = worker_stopped.await;
    }));

    let night_job = wait_until_succeeded(&channel, &night_user, &submitted[0].id).await;
    let fresh_job = wait_until_succeeded(&channel, &fresh_user, &submitted[1].id).await;
    let until_ms = now_ms() + 1;

    // The placements as stored with each attempt's usage.
    let rows = store.usage_between(0, i64::MAX, None).await.unwrap();
    let row_of = |job: &v1::Job| -> UsageRecord {
        let found: Vec<&UsageRecord> = rows.iter().filter(|row| row.job_id == job.id).collect();
        assert_eq!(found.len(), 1, "one attempt of {}: {rows:?}", job.name);
        found[0].clone()
    };
    let (night_row, fresh_row) = (row_of(&night_job), row_of(&fresh_job));
    assert!(
        fresh_row.ended_at_ms.unwrap() <= night_row.placed_at_ms,
        "the tenant without history is placed (and runs) first: {fresh_row:?} then {night_row:?}"
    );

    // Each tenant's figures, from the attempts' own records: slice, end and measured
    // peak as the attempt shows them; held from its placement (the attempt's own start
    // is when it began training, a little later) to its end.
    let mut expected_night = Expected {
        jobs: 2,
        ..Expected::default()
    };
    expected_night.add(night.slice_bytes, 8 * HOUR_MS, night.measured_peak_bytes);
    let mut expected_fresh = Expected {
        jobs: 1,
        ..Expected::default()
    };
    for (job, row, expected) in [
        (&night_job, &night_row, &mut expected_night),
        (&fresh_job, &fresh_row, &mut expected_fresh),
    ] {
        assert_eq!(job.attempts.len(), 1, "{job:#?}");
        let attempt = &job.attempts[0];
        assert_eq!(row.slice_bytes as u64, attempt.slice_bytes);
        let finished = milliseconds(attempt.finished_at.as_ref().unwrap());
        assert_eq!(row.ended_at_ms, Some(finished));
        assert!(row.placed_at_ms <= milliseconds(attempt.started_at.as_ref().unwrap()));
        let peak = attempt.measured_peak_bytes.map(|peak| peak as i64);
        assert_eq!(row.measured_peak_bytes, peak);
        expected.add(
            attempt.slice_bytes as i64,
            finished - row.placed_at_ms,
            peak,
        );
        let submitted_at = milliseconds(job.created_at.as_ref().unwrap());
        expected
            .queue_times
            .push((row.placed_at_ms - submitted_at) as u64);
    }

    let since = utc_text(started_ms - 10 * HOUR_MS);
    let until = utc_text(until_ms);
    let period = ["--since", since.as_str(), "--until", until.as_str()];
    let report = carve(
        &endpoint,
        ADMIN,
        &[&["usage", "-o", "json"], &period[..]].concat(),
    )
    .await
    .expect_code(0)
    .json();
    let tenants = report["tenants"].as_array().unwrap();
    assert_eq!(tenants.len(), 2, "{report:#}");
    assert_eq!(tenants[0]["tenant"], "aa-night");
    assert_eq!(tenants[0]["gpu_type"], "simulated");
    expected_night.check(&tenants[0]);
    assert_eq!(tenants[1]["tenant"], "zz-fresh");
    expected_fresh.check(&tenants[1]);
    // Per user: the night's row has no job (unknown submitter), the jobs have theirs.
    let users: Vec<(String, String, u64)> = report["users"]
        .as_array()
        .unwrap()
        .iter()
        .map(|figures| {
            (
                figures["tenant"].as_str().unwrap().to_string(),
                figures["user"].as_str().unwrap().to_string(),
                figures["attempts"].as_u64().unwrap(),
            )
        })
        .collect();
    let mut users_sorted = users.clone();
    users_sorted.sort();
    assert_eq!(
        users_sorted,
        [
            ("aa-night".to_string(), String::new(), 1),
            ("aa-night".to_string(), "night-owl".to_string(), 1),
            ("zz-fresh".to_string(), "early-bird".to_string(), 1),
        ],
        "{report:#}"
    );

    // The night tenant's own token: its tenant alone, as CSV, with the same integers.
    let csv = carve(
        &endpoint,
        &night_user,
        &[&["usage", "-o", "csv"], &period[..]].concat(),
    )
    .await
    .expect_code(0);
    let lines: Vec<&str> = csv.stdout.lines().collect();
    assert!(
        lines[0].starts_with(
            "scope,tenant,user_token_id,user,gpu_type,jobs,attempts,gpu_milliseconds,"
        )
    );
    let tenant_rows: Vec<Vec<&str>> = lines[1..]
        .iter()
        .map(|line| line.split(',').collect())
        .filter(|cells: &Vec<&str>| cells[0] == "tenant")
        .collect();
    assert_eq!(tenant_rows.len(), 1, "{}", csv.context());
    assert_eq!(tenant_rows[0][1], "aa-night");
    assert_eq!(
        tenant_rows[0][7],
        expected_night.gpu_milliseconds.to_string()
    );
    assert_eq!(tenant_rows[0][8], expected_night.vram_requested.to_string());
    assert!(!csv.stdout.contains("zz-fresh"), "{}", csv.context());
    // And it may not ask for the other tenant's.
    let refused = carve(
        &endpoint,
        &night_user,
        &[&["usage", "--tenant", "zz-fresh"], &period[..]].concat(),
    )
    .await;
    assert_ne!(refused.code, Some(0), "{}", refused.context());
    refused.assert_stderr_contains("tenant");
    assert!(
        !refused.stdout.contains("zz-fresh"),
        "{}",
        refused.context()
    );

    // The table, for people.
    let table = carve(&endpoint, ADMIN, &[&["usage"], &period[..]].concat())
        .await
        .expect_code(0);
    table.assert_stdout_contains("night-owl");
    table.assert_stdout_contains("(unknown)");
}
