//! A worker whose token the scheduler refuses stops with a clear error instead of
//! reconnecting forever: an unknown token (UNAUTHENTICATED) and a user's token
//! (PERMISSION_DENIED: not a worker's), against a real scheduler on SQLite.

use std::time::Duration;

use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::SchedulerConfig;
use carve_worker::error::WorkerError;
use carve_worker::gpus::SimulatedGpu;
use carve_worker::{WorkerConfig, run_worker};
use tonic::transport::Channel;

// Only the tenant helper is used here.
#[allow(dead_code)]
mod support;
use support::alice_with_tokens;

const ADMIN: &str = "carve_token_refused_admin_secret";

/// Runs a worker with `token` against the scheduler at `address` until it stops, or
/// fails the test when it is still trying after 20 s.
async fn run_until_stopped(address: &str, token: &str) -> Result<(), WorkerError> {
    let gpus = vec![SimulatedGpu {
        total_bytes: 1 << 30,
    }];
    let program = std::path::PathBuf::from(env!("CARGO_BIN_EXE_carve-worker"));
    let mut config = WorkerConfig::new(address.to_string(), token.to_string(), gpus, program);
    config.discover_real_gpus = false;
    config.reconnect_backoff_initial = Duration::from_millis(50);
    config.reconnect_backoff_max = Duration::from_millis(200);
    let directory = tempfile::tempdir().unwrap();
    config.checkpoint_directory = directory.path().to_path_buf();
    tokio::time::timeout(
        Duration::from_secs(20),
        run_worker(config, std::future::pending()),
    )
    .await
    .expect("the worker stopped instead of retrying forever")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_a_refused_token_stops_and_says_why() {
    let directory = tempfile::tempdir().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let config = SchedulerConfig {
        database_url: format!("sqlite://{}", directory.path().join("carve.db").display()),
        settings: SchedulerSettings::default(),
        admin_token: Some(ADMIN.into()),
        metrics_address: None,
        tls: None,
    };
    let (_stop_scheduler, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(carve_scheduler::server::run(config, listener, async {
        let _ = stopped.await;
    }));
    let channel = {
        let mut connected = None;
        for _ in 0..250 {
            if let Ok(channel) = Channel::from_shared(address.clone())
                .unwrap()
                .connect()
                .await
            {
                connected = Some(channel);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        connected.expect("the scheduler came up")
    };
    let (user_token, _worker_token) = alice_with_tokens(&channel, ADMIN).await;

    for token in ["carve_no_such_token", user_token.as_str()] {
        let error = run_until_stopped(&address, token).await.unwrap_err();
        assert!(matches!(error, WorkerError::TokenRefused(_)), "{error}");
        let message = error.to_string();
        assert!(
            message.starts_with("the scheduler refused this worker's token: ")
                && message.contains("carve admin tokens create --role worker"),
            "{message}"
        );
    }
}
