//! `carve-list-jobs-bench`: ListJobs over jobs with large specs. A real scheduler runs
//! in-process on a SQLite file and 127.0.0.1:0; `--jobs` command jobs whose specs are
//! `--spec-bytes` long (a long description) are submitted, and then, `--runs` times
//! each, the first page of `--page-size` jobs is read, and every job is read by following
//! the page tokens, through a gRPC client that decodes at most `--max-decode-bytes` (4 MiB,
//! tonic's default and the CLI's). It prints the medians: time, the response's bytes and
//! its jobs. A page that the client cannot decode is reported as such, with what it said.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use carve_proto::client::BearerToken;
use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::{SchedulerConfig, run};
use clap::Parser;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

#[derive(Debug, Parser)]
#[command(about = "ListJobs time and bytes over jobs with large specs")]
struct Arguments {
    /// Jobs to submit.
    #[arg(long, default_value_t = 100)]
    jobs: usize,
    /// The length of each job's spec, in bytes (about: a description fills it).
    #[arg(long, default_value_t = 100 * 1024)]
    spec_bytes: usize,
    /// The page size asked for.
    #[arg(long, default_value_t = 100)]
    page_size: u32,
    /// Reads of each kind; the medians are printed.
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// The most bytes the client decodes in one response (tonic's default: 4 MiB).
    #[arg(long, default_value_t = 4 << 20)]
    max_decode_bytes: usize,
}

const ADMIN: &str = "carve_list_jobs_bench_admin";

type Client = JobServiceClient<InterceptedService<Channel, BearerToken>>;

/// A command job with a declared size (it waits, queued: no worker runs here) whose spec
/// is about `spec_bytes` long.
fn large_command_job(name: &str, spec_bytes: usize) -> String {
    serde_json::json!({
        "name": name,
        "description": "d".repeat(spec_bytes.saturating_sub(300)),
        "command": {
            "argv": ["python3", "train.py", "--steps", "{max_steps}"],
            "working_directory": "/tmp",
            "global_batch": 64,
            "steps": 6,
        },
        "resources": { "vram": "2GiB" },
        "oom": { "strategies": ["accumulate"] },
    })
    .to_string()
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// One ListJobs call: its time and its answer (or what the client said).
async fn list_page(
    client: &mut Client,
    page_size: u32,
    page_token: String,
) -> (Duration, Result<v1::ListJobsResponse, tonic::Status>) {
    let started = Instant::now();
    let answer = client
        .list_jobs(v1::ListJobsRequest {
            page_size,
            page_token,
            ..Default::default()
        })
        .await
        .map(tonic::Response::into_inner);
    (started.elapsed(), answer)
}

#[tokio::main]
async fn main() -> Result<()> {
    let arguments = Arguments::parse();
    if arguments.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let directory = tempfile::tempdir().context("a scratch directory")?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = format!("http://{}", listener.local_addr()?);
    let config = SchedulerConfig {
        database_url: format!("sqlite://{}", directory.path().join("carve.db").display()),
        settings: SchedulerSettings::default(),
        admin_token: Some(ADMIN.into()),
        metrics_address: None,
        tls: None,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        run(config, listener, async {
            let _ = stopped.await;
        })
        .await
    });
    let channel = loop {
        if let Ok(channel) = Channel::from_shared(address.clone())?.connect().await {
            break channel;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let [user] = carve_testing::cluster::tenant_with_tokens(
        &channel,
        ADMIN,
        "bench",
        v1::Quota::default(),
        &[v1::Role::User],
    )
    .await
    .try_into()
    .expect("one token");
    let mut client = JobServiceClient::with_interceptor(channel, BearerToken::new(&user)?)
        .max_decoding_message_size(arguments.max_decode_bytes);

    let started = Instant::now();
    for index in 0..arguments.jobs {
        let spec = large_command_job(&format!("large-{index}"), arguments.spec_bytes);
        client
            .submit_job(v1::SubmitJobRequest {
                spec_json: spec,
                idempotency_key: String::new(),
            })
            .await
            .with_context(|| format!("submit job {index}"))?;
    }
    println!(
        "{} jobs of {} B specs submitted in {:.1?}; page size {}, client decode limit {} B",
        arguments.jobs,
        large_command_job("large-0", arguments.spec_bytes).len(),
        started.elapsed(),
        arguments.page_size,
        arguments.max_decode_bytes,
    );

    // The first page, as `carve jobs` reads it first.
    let mut times = Vec::new();
    let mut shape = None;
    for _ in 0..arguments.runs {
        let (time, answer) = list_page(&mut client, arguments.page_size, String::new()).await;
        times.push(time);
        match answer {
            Ok(page) => {
                shape = Some((prost::Message::encoded_len(&page), page.jobs.len()));
            }
            Err(status) => {
                println!(
                    "first page: the client cannot receive it ({:?}): {}",
                    status.code(),
                    status.message()
                );
                shape = None;
                break;
            }
        }
    }
    if let Some((bytes, jobs)) = shape {
        println!(
            "first page:  median {:>9.2?} over {} runs, {bytes} B, {jobs} jobs",
            median(times),
            arguments.runs
        );
    }

    // Every job, following the tokens.
    let mut times = Vec::new();
    let mut totals = None;
    'runs: for _ in 0..arguments.runs {
        let started = Instant::now();
        let (mut pages, mut bytes, mut jobs, mut largest) = (0, 0, 0, 0);
        let mut token = String::new();
        loop {
            let (_, answer) = list_page(&mut client, arguments.page_size, token).await;
            let page = match answer {
                Ok(page) => page,
                Err(status) => {
                    println!(
                        "every job: page {} cannot be received ({:?}): {}",
                        pages + 1,
                        status.code(),
                        status.message()
                    );
                    totals = None;
                    break 'runs;
                }
            };
            let page_bytes = prost::Message::encoded_len(&page);
            pages += 1;
            bytes += page_bytes;
            largest = largest.max(page_bytes);
            jobs += page.jobs.len();
            token = page.next_page_token;
            if token.is_empty() {
                break;
            }
        }
        times.push(started.elapsed());
        totals = Some((pages, bytes, largest, jobs));
    }
    if let Some((pages, bytes, largest, jobs)) = totals {
        println!(
            "every job:   median {:>9.2?} over {} runs, {pages} pages, {bytes} B \
             (largest page {largest} B), {jobs} jobs",
            median(times),
            arguments.runs
        );
    }

    let _ = stop.send(());
    server.await??;
    Ok(())
}
