//! `carve-failover-bench`: how long after a leader's kill -9 the cluster places again.
//! Three real `carve-scheduler` replicas on a private PostgreSQL server and one real
//! `carve-worker` (simulated GPUs; `--scheduler` lists the three) run as child
//! processes. Each round waits until the worker holds its session with the leader (a
//! job placed), kills the leader with SIGKILL, submits a job to a standby at once, and
//! times the kill to the job's first attempt row (its placement by the new leader, read
//! from the database every 5 ms) and to the new leadership row. The killed replica is
//! started again on its own port before the next round. It prints min/median/max of
//! both, per lease. See BENCHMARKS.md ("Failover") for how to run it and what it
//! measured.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use carve_proto::client::BearerToken;
use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use carve_testing::PgServer;
use clap::Parser;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, Parser)]
#[command(about = "Leader kill -9 to first placement, with real replicas and a real worker")]
struct Arguments {
    /// Leader kills per lease.
    #[arg(long, default_value_t = 10)]
    kills: usize,
    /// The leases to measure, in milliseconds (the scheduler's default is 10000).
    #[arg(long, value_delimiter = ',', default_value = "10000,2000")]
    leases_ms: Vec<u64>,
    /// The carve-scheduler binary [default: next to this one].
    #[arg(long)]
    scheduler_binary: Option<PathBuf>,
    /// The carve-worker binary [default: next to this one].
    #[arg(long)]
    worker_binary: Option<PathBuf>,
}

const ADMIN: &str = "carve_failover_bench_admin";
const REPLICAS: usize = 3;
/// How often the database is read for the placement and the leadership row.
const POLL: Duration = Duration::from_millis(5);
/// A failover that takes longer than this is reported as a failure of the run.
const GIVE_UP: Duration = Duration::from_secs(60);

/// A model job small enough to train in a moment on the CPU.
const JOB: &str = r#"{
  "name": "failover-probe",
  "model": { "input_shape": [4], "loss": "softmax_cross_entropy", "layers": [ { "dense": { "units": 2 } } ] },
  "training": { "batch_size": 8, "steps": 2, "optimizer": { "sgd": { "learning_rate": 0.1 } } },
  "data": { "format": "synthetic", "samples": 16 }
}"#;

type JobClient = JobServiceClient<InterceptedService<Channel, BearerToken>>;

fn sibling_binary(explicit: Option<&Path>, name: &str) -> Result<PathBuf> {
    if let Some(path) = explicit {
        return Ok(path.to_path_buf());
    }
    let me = std::env::current_exe().context("find this executable")?;
    let candidate = me.with_file_name(name);
    if !candidate.is_file() {
        bail!(
            "no {name} next to {}: build it first (cargo build --release -p carve-scheduler \
             -p carve-worker -p carve-bench)",
            me.display()
        );
    }
    Ok(candidate)
}

/// One replica: its process and where it listens.
struct Replica {
    child: Child,
    port: u16,
}

impl Replica {
    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a replica on `port` (0: any) and waits until it says where it listens.
fn start_replica(
    binary: &Path,
    database_url: &str,
    token_file: &Path,
    lease: Duration,
    port: u16,
) -> Result<Replica> {
    let mut child = Command::new(binary)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--database", database_url])
        .arg("--admin-token-file")
        .arg(token_file)
        .args(["--leader-lease-ms", &lease.as_millis().to_string()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("start {}", binary.display()))?;
    let mut lines = BufReader::new(child.stderr.take().context("its stderr")?).lines();
    let address = loop {
        let Some(line) = lines.next() else {
            bail!("the scheduler exited before it listened");
        };
        let line = line?;
        if let Some(address) = line.strip_prefix("carve-scheduler listening on ") {
            break address.trim().to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let port = address
        .rsplit(':')
        .next()
        .and_then(|port| port.parse().ok())
        .with_context(|| format!("the port of {address}"))?;
    Ok(Replica { child, port })
}

async fn client(endpoint: &str, token: &str) -> Option<JobClient> {
    let channel = Endpoint::from_shared(endpoint.to_string())
        .ok()?
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .ok()?;
    Some(JobServiceClient::with_interceptor(
        channel,
        BearerToken::new(token).ok()?,
    ))
}

/// Submits the probe job to the first replica (of `endpoints`) that takes it.
async fn submit(endpoints: &[String], token: &str, key: &str) -> Result<String> {
    let started = Instant::now();
    loop {
        for endpoint in endpoints {
            let Some(mut client) = client(endpoint, token).await else {
                continue;
            };
            match client
                .submit_job(v1::SubmitJobRequest {
                    spec_json: JOB.into(),
                    idempotency_key: key.into(),
                })
                .await
            {
                Ok(answer) => return Ok(answer.into_inner().job.context("a job")?.id),
                Err(status) if status.code() == tonic::Code::Unavailable => {}
                Err(status) if status.code() == tonic::Code::Unknown => {}
                Err(status) => bail!("submit refused: {status:?}"),
            }
        }
        if started.elapsed() > GIVE_UP {
            bail!("no replica took a submit");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The current leader's (epoch, endpoint).
async fn current_leader(database: &sqlx::PgPool) -> Option<(i64, String)> {
    sqlx::query_as(
        "SELECT epoch, endpoint FROM leadership \
         WHERE expires_at_ms >= (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT",
    )
    .fetch_optional(database)
    .await
    .ok()
    .flatten()
}

async fn placed(database: &sqlx::PgPool, job_id: &str) -> bool {
    sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM attempts WHERE job_id = $1")
        .bind(job_id)
        .fetch_one(database)
        .await
        .is_ok_and(|count| count > 0)
}

/// Waits for `job_id`'s first attempt; how long it took from `since`.
async fn wait_for_placement(
    database: &sqlx::PgPool,
    job_id: &str,
    since: Instant,
) -> Result<Duration> {
    loop {
        if placed(database, job_id).await {
            return Ok(since.elapsed());
        }
        if since.elapsed() > GIVE_UP {
            bail!("job {job_id} was not placed within {GIVE_UP:?}");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// min, median, max.
fn summary(mut samples: Vec<Duration>) -> (Duration, Duration, Duration) {
    samples.sort();
    (
        samples[0],
        samples[samples.len() / 2],
        samples[samples.len() - 1],
    )
}

fn seconds(duration: Duration) -> String {
    format!("{:.2} s", duration.as_secs_f64())
}

struct LeaseResult {
    lease: Duration,
    placements: Vec<Duration>,
    takeovers: Vec<Duration>,
}

async fn measure_lease(
    arguments: &Arguments,
    postgres: &PgServer,
    lease: Duration,
) -> Result<LeaseResult> {
    let scheduler_binary =
        sibling_binary(arguments.scheduler_binary.as_deref(), "carve-scheduler")?;
    let worker_binary = sibling_binary(arguments.worker_binary.as_deref(), "carve-worker")?;
    let database_url = postgres.create_database("carve_failover").await?;
    let database = sqlx::PgPool::connect(&database_url).await?;
    let directory = tempfile::tempdir()?;
    let admin_token_file = directory.path().join("admin.token");
    std::fs::write(&admin_token_file, ADMIN)?;
    let mut replicas = Vec::new();
    for _ in 0..REPLICAS {
        replicas.push(start_replica(
            &scheduler_binary,
            &database_url,
            &admin_token_file,
            lease,
            0,
        )?);
    }
    let endpoints: Vec<String> = replicas.iter().map(Replica::endpoint).collect();
    let started = Instant::now();
    let leader = loop {
        if let Some(leader) = current_leader(&database).await {
            break leader;
        }
        if started.elapsed() > GIVE_UP {
            bail!("no replica took the lead");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let channel = Endpoint::from_shared(leader.1.clone())?.connect().await?;
    let [user, worker_token]: [String; 2] = carve_testing::cluster::tenant_with_tokens(
        &channel,
        ADMIN,
        "bench",
        v1::Quota::default(),
        &[v1::Role::User, v1::Role::Worker],
    )
    .await
    .try_into()
    .map_err(|_| anyhow::anyhow!("two tokens"))?;
    let worker_token_file = directory.path().join("worker.token");
    std::fs::write(&worker_token_file, &worker_token)?;
    std::fs::set_permissions(&worker_token_file, std::fs::Permissions::from_mode(0o600))?;
    let mut worker = Command::new(&worker_binary)
        .args(["--scheduler", &endpoints.join(",")])
        .arg("--token-file")
        .arg(&worker_token_file)
        .args(["--sim-gpus", "2x16GiB", "--context-bytes", "64MiB"])
        .arg("--checkpoint-dir")
        .arg(directory.path().join("checkpoints"))
        .args(["--hostname", "failover-bench", "--insecure-no-sandbox"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("start {}", worker_binary.display()))?;

    let mut placements = Vec::new();
    let mut takeovers = Vec::new();
    let outcome: Result<()> = async {
        for round in 0..arguments.kills {
            // The worker holds its session with the leader: a job is placed.
            let warm_up = submit(&endpoints, &user, &format!("warm-{round}")).await?;
            wait_for_placement(&database, &warm_up, Instant::now()).await?;
            let (epoch, leader_endpoint) = current_leader(&database)
                .await
                .context("a leader before the kill")?;
            let index = replicas
                .iter()
                .position(|replica| replica.endpoint() == leader_endpoint)
                .with_context(|| format!("the leader {leader_endpoint} is not a replica here"))?;
            let port = replicas[index].port;
            replicas[index].child.kill()?;
            let killed_at = Instant::now();
            replicas[index].child.wait()?;
            let standbys: Vec<String> = endpoints
                .iter()
                .filter(|endpoint| **endpoint != leader_endpoint)
                .cloned()
                .collect();
            let job = submit(&standbys, &user, &format!("probe-{round}")).await?;
            let takeover = async {
                loop {
                    if let Some((new_epoch, _)) = current_leader(&database).await
                        && new_epoch > epoch
                    {
                        return killed_at.elapsed();
                    }
                    tokio::time::sleep(POLL).await;
                }
            };
            let (placement, takeover) =
                tokio::join!(wait_for_placement(&database, &job, killed_at), takeover);
            let placement = placement?;
            println!(
                "lease {}: kill {}: new leader after {}, first placement after {}",
                seconds(lease),
                round + 1,
                seconds(takeover),
                seconds(placement)
            );
            placements.push(placement);
            takeovers.push(takeover);
            // The killed replica comes back on its own port (the worker's list names it).
            replicas[index] = start_replica(
                &scheduler_binary,
                &database_url,
                &admin_token_file,
                lease,
                port,
            )?;
        }
        Ok(())
    }
    .await;
    let _ = worker.kill();
    let _ = worker.wait();
    drop(replicas);
    outcome?;
    Ok(LeaseResult {
        lease,
        placements,
        takeovers,
    })
}

fn main() -> Result<()> {
    let arguments = Arguments::parse();
    if arguments.kills == 0 {
        bail!("--kills: must be at least 1");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let postgres = PgServer::start()?;
    let mut results = Vec::new();
    for lease_ms in &arguments.leases_ms {
        let lease = Duration::from_millis(*lease_ms);
        results.push(runtime.block_on(measure_lease(&arguments, &postgres, lease))?);
    }
    println!();
    println!(
        "| lease | kills | kill -> new leader (min / median / max) | kill -> first placement (min / median / max) | target (lease + 1 s) |"
    );
    println!("|---|---|---|---|---|");
    for result in &results {
        let (leader_min, leader_median, leader_max) = summary(result.takeovers.clone());
        let (min, median, max) = summary(result.placements.clone());
        println!(
            "| {} | {} | {} / {} / {} | {} / {} / {} | {} |",
            seconds(result.lease),
            result.placements.len(),
            seconds(leader_min),
            seconds(leader_median),
            seconds(leader_max),
            seconds(min),
            seconds(median),
            seconds(max),
            if max <= result.lease + Duration::from_secs(1) {
                "met"
            } else {
                "missed"
            }
        );
    }
    Ok(())
}
