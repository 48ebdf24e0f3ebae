//! A scheduler run in the test's own process on a SQLite file, for the tests of how carve
//! survives a scheduler going away (`tests/watch_failover.rs`, and the unit tests of
//! `src/client/failover_tests.rs`, which include this file by path).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::{SchedulerConfig, run};

/// The admin token of [`start`]'s schedulers.
pub const ADMIN: &str = "carve_test_admin_secret";

/// A small job named `name`, as the JSON a submit sends.
pub fn job_json(name: &str) -> String {
    format!(
        r#"{{
  "name": "{name}",
  "model": {{
    "input_shape": [8, 8, 1],
    "loss": "softmax_cross_entropy",
    "layers": [ {{ "flatten": {{}} }}, {{ "dense": {{ "units": 4 }} }} ]
  }},
  "training": {{ "batch_size": 8, "steps": 10, "optimizer": {{ "adam": {{ "learning_rate": 0.001 }} }} }},
  "data": {{ "format": "synthetic", "samples": 64 }}
}}"#
    )
}

/// A scheduler on `directory`'s `carve.db`, listening on `address` (port 0 for any):
/// its endpoint, what stops it, and its task (which ends once it has stopped).
pub async fn start(
    directory: &Path,
    address: SocketAddr,
) -> (
    String,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let listener = tokio::net::TcpListener::bind(address).await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let config = SchedulerConfig {
        database_url: format!("sqlite://{}", directory.join("carve.db").display()),
        settings: SchedulerSettings {
            heartbeat_interval: Duration::from_millis(100),
            scheduling_interval: Duration::from_millis(50),
            ..SchedulerSettings::default()
        },
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
        .unwrap();
    });
    (endpoint, stop, server)
}
