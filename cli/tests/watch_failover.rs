//! `carve watch` across a scheduler restart: the real `carve` binary watches a job while
//! the scheduler (in-process, on a SQLite file) stops and starts again on the same
//! address; meanwhile the job is cancelled. The watch reconnects and resumes after the
//! last event it showed: the job's state is shown once (no duplicate), its cancellation
//! once (no gap), and it exits with the cancelled job's code.

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use carve_proto::client::BearerToken;
use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

// Only the binary's path is used here.
#[path = "support/in_process.rs"]
mod in_process;
#[allow(dead_code)]
mod support;
use in_process::{ADMIN, job_json};

/// A scheduler on `directory`'s database at `address`: what stops it, and its task.
async fn start(
    directory: &std::path::Path,
    address: SocketAddr,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (_, stop, server) = in_process::start(directory, address).await;
    (stop, server)
}

async fn channel(address: SocketAddr) -> Channel {
    for _ in 0..200 {
        if let Ok(channel) = Channel::from_shared(format!("http://{address}"))
            .unwrap()
            .connect()
            .await
        {
            return channel;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the scheduler did not come up at {address}");
}

fn jobs(
    channel: &Channel,
    token: &str,
) -> JobServiceClient<InterceptedService<Channel, BearerToken>> {
    JobServiceClient::with_interceptor(channel.clone(), BearerToken::new(token).unwrap())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_watch_resumes_across_a_restart_showing_each_event_once() {
    let directory = tempfile::tempdir().unwrap();
    let address = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (stop, server) = start(directory.path(), address).await;
    let first = channel(address).await;
    let [user] = carve_testing::cluster::tenant_with_tokens(
        &first,
        ADMIN,
        "alice",
        v1::Quota::default(),
        &[v1::Role::User],
    )
    .await
    .try_into()
    .unwrap();
    // No worker: the job waits in the queue.
    let job = jobs(&first, &user)
        .submit_job(v1::SubmitJobRequest {
            spec_json: job_json("small"),
            idempotency_key: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();

    let mut watch = Command::new(support::dev_cluster::carve_binary())
        .args(["watch", &job.id, "--endpoint", &format!("http://{address}")])
        .env("CARVE_TOKEN", &user)
        .env_remove("CARVE_ENDPOINT")
        .env_remove("CARVE_CLI_CONFIG")
        .env("XDG_CONFIG_HOME", directory.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Let it show the job's state, then stop the scheduler under it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    drop(first);
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the scheduler stops with a watch open")
        .unwrap();

    // The second life, on the same file and address: the job is cancelled there, likely
    // before the watch has found it again.
    let (stop, server) = start(directory.path(), address).await;
    let second = channel(address).await;
    jobs(&second, &user)
        .cancel_job(v1::CancelJobRequest {
            job_id: job.id.clone(),
            reason: "not needed".into(),
        })
        .await
        .unwrap();

    let status = tokio::task::spawn_blocking(move || {
        let status = watch.wait().unwrap();
        let mut stdout = String::new();
        let mut stderr = String::new();
        watch
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut stdout)
            .unwrap();
        watch
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        (status, stdout, stderr)
    });
    let (status, stdout, stderr) = tokio::time::timeout(Duration::from_secs(60), status)
        .await
        .expect("the watch ends with the job")
        .unwrap();
    let context = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(
        status.code(),
        Some(11),
        "the cancelled job's code; {context}"
    );
    assert_eq!(
        stdout
            .matches(&format!("job {} (small): queued", job.id))
            .count(),
        1,
        "the state is shown once, not again after the restart; {context}"
    );
    assert_eq!(
        stdout.matches("-> cancelled").count(),
        1,
        "the cancellation is shown once; {context}"
    );
    assert!(stdout.contains("reconnecting"), "{context}");
    stop.send(()).unwrap();
    server.await.unwrap();
}
