//! A real worker against a scheduler that requires client certificates (mutual TLS):
//! with `client_identity` (what `--tls-cert`/`--tls-key` load) it registers; without one
//! the handshake is refused and it never does.

use std::time::{Duration, Instant};

use carve_proto::client::{
    AuthenticatedChannel, BearerToken, ClientIdentity, connect, create_tenant_with_tokens,
};
use carve_proto::v1;
use carve_proto::v1::cluster_service_client::ClusterServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::{SchedulerConfig, TlsIdentity};
use carve_testing::{PemPair, TestAuthority};
use carve_worker::gpus::SimulatedGpu;
use carve_worker::{WorkerConfig, run_worker};

const ADMIN: &str = "carve_mutual_tls_admin";

fn identity(pair: &PemPair) -> ClientIdentity {
    ClientIdentity {
        certificate_chain_pem: pair.certificate_pem.clone().into_bytes(),
        private_key_pem: pair.private_key_pem.clone().into_bytes(),
    }
}

/// A worker named `hostname` with one simulated GPU, showing `client_identity`.
fn start_worker(
    endpoint: &str,
    trusted: &str,
    token: &str,
    hostname: &str,
    client_identity: Option<ClientIdentity>,
    directory: &std::path::Path,
) -> tokio::task::JoinHandle<Result<(), carve_worker::error::WorkerError>> {
    let gpus = vec![SimulatedGpu {
        total_bytes: 4 << 30,
    }];
    let program = std::path::PathBuf::from(env!("CARGO_BIN_EXE_carve-worker"));
    let mut config = WorkerConfig::new(endpoint, token, gpus, program);
    config.discover_real_gpus = false;
    config.hostname = hostname.into();
    config.scheduler_ca_certificate_pem = Some(trusted.as_bytes().to_vec());
    config.client_identity = client_identity;
    config.checkpoint_directory = directory.join(hostname);
    config.reconnect_backoff_initial = Duration::from_millis(50);
    config.reconnect_backoff_max = Duration::from_millis(200);
    tokio::spawn(run_worker(config, std::future::pending()))
}

async fn hostnames(admin: &AuthenticatedChannel) -> Vec<String> {
    ClusterServiceClient::new(admin.clone())
        .list_workers(v1::ListWorkersRequest { states: vec![] })
        .await
        .unwrap()
        .into_inner()
        .workers
        .into_iter()
        .map(|worker| worker.hostname)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_worker_with_a_client_certificate_registers() {
    let authority = TestAuthority::new("carve test CA").unwrap();
    let server_certificate = authority.issue_server(&["localhost"]).unwrap();
    let node_certificate = authority.issue_client("gpu-node-1").unwrap();
    let trusted = authority.certificate_pem();
    let directory = tempfile::tempdir().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!(
        "https://localhost:{}",
        listener.local_addr().unwrap().port()
    );
    let config = SchedulerConfig {
        database_url: format!("sqlite://{}", directory.path().join("carve.db").display()),
        settings: SchedulerSettings::default(),
        admin_token: Some(ADMIN.into()),
        metrics_address: None,
        tls: Some(TlsIdentity {
            certificate_chain_pem: server_certificate.certificate_pem.into_bytes(),
            private_key_pem: server_certificate.private_key_pem.into_bytes(),
            client_ca_certificate_pem: Some(trusted.clone().into_bytes()),
        }),
    };
    let (_stop_scheduler, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(carve_scheduler::server::run(config, listener, async {
        let _ = stopped.await;
    }));
    let admin = connect(
        &endpoint,
        Some(trusted.as_bytes()),
        Some(&identity(&node_certificate)),
        BearerToken::new(ADMIN).unwrap(),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let tokens = create_tenant_with_tokens(
        admin.clone(),
        "gpus",
        v1::Quota::default(),
        &[v1::Role::Worker],
        "mutual tls",
    )
    .await
    .unwrap();

    let without = start_worker(
        &endpoint,
        &trusted,
        &tokens[0],
        "no-certificate",
        None,
        directory.path(),
    );
    let with = start_worker(
        &endpoint,
        &trusted,
        &tokens[0],
        "gpu-node-1",
        Some(identity(&node_certificate)),
        directory.path(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !hostnames(&admin).await.contains(&"gpu-node-1".to_string()) {
        assert!(
            Instant::now() < deadline,
            "the worker with a certificate never registered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The other has been trying as long, reconnecting every 200 ms at most.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(hostnames(&admin).await, vec!["gpu-node-1".to_string()]);
    without.abort();
    with.abort();
}
