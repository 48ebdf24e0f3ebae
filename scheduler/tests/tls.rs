//! The scheduler over TLS: a client that trusts the server's certificate is served, one
//! speaking plain HTTP/2 is not; with a client CA (mutual TLS), only clients showing a
//! certificate that CA signed are.

use std::time::Duration;

use carve_proto::client::{
    AuthenticatedChannel, BearerToken, ClientIdentity, connect, create_tenant_with_tokens,
};
use carve_proto::v1;
use carve_proto::v1::admin_service_client::AdminServiceClient;
use carve_proto::v1::worker_service_client::WorkerServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::{SchedulerConfig, TlsIdentity, run};
use carve_testing::{PemPair, TestAuthority};
use tonic::Request;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

const ADMIN: &str = "carve_tls_admin";

/// The scheduler in this process on SQLite, serving `tls` on a port of its own.
struct TlsScheduler {
    port: u16,
    shutdown: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), carve_scheduler::error::SchedulerError>>,
    _directory: tempfile::TempDir,
}

impl TlsScheduler {
    async fn start(tls: TlsIdentity) -> TlsScheduler {
        let directory = tempfile::tempdir().unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (shutdown, shutdown_signal) = tokio::sync::oneshot::channel::<()>();
        let config = SchedulerConfig {
            database_url: format!("sqlite://{}", directory.path().join("carve.db").display()),
            settings: SchedulerSettings::default(),
            admin_token: Some(ADMIN.into()),
            metrics_address: None,
            tls: Some(tls),
        };
        let server = tokio::spawn(run(config, listener, async {
            let _ = shutdown_signal.await;
        }));
        TlsScheduler {
            port,
            shutdown,
            server,
            _directory: directory,
        }
    }

    async fn stop(self) {
        let _ = self.shutdown.send(());
        tokio::time::timeout(Duration::from_secs(10), self.server)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}

#[tokio::test]
async fn clients_that_trust_the_certificate_are_served_over_tls() {
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let certificate_pem = certified.cert.pem();
    let server = TlsScheduler::start(TlsIdentity {
        certificate_chain_pem: certificate_pem.clone().into_bytes(),
        private_key_pem: certified.signing_key.serialize_pem().into_bytes(),
        client_ca_certificate_pem: None,
    })
    .await;
    let port = server.port;

    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&certificate_pem))
        .domain_name("localhost");
    let mut channel = None;
    for _ in 0..100 {
        let endpoint = Channel::from_shared(format!("https://127.0.0.1:{port}"))
            .unwrap()
            .tls_config(tls.clone())
            .unwrap();
        if let Ok(connected) = endpoint.connect().await {
            channel = Some(connected);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut admin = AdminServiceClient::new(channel.expect("a TLS connection"));
    let request = carve_proto::client::authorized_request(v1::ListTenantsRequest {}, ADMIN)
        .expect("a valid token");
    let tenants = admin
        .list_tenants(request)
        .await
        .unwrap()
        .into_inner()
        .tenants;
    assert_eq!(tenants[0].name, "default");

    // Plain HTTP/2 against the TLS port gets no gRPC answer.
    let plain = Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await;
    let plain_answered = match plain {
        Ok(channel) => AdminServiceClient::new(channel)
            .list_tenants(Request::new(v1::ListTenantsRequest {}))
            .await
            .is_ok(),
        Err(_) => false,
    };
    assert!(!plain_answered);

    server.stop().await;
}

fn identity(pair: &PemPair) -> ClientIdentity {
    ClientIdentity {
        certificate_chain_pem: pair.certificate_pem.clone().into_bytes(),
        private_key_pem: pair.private_key_pem.clone().into_bytes(),
    }
}

/// Registers a worker with one simulated GPU over `channel`, as carve-worker does.
async fn register(channel: AuthenticatedChannel) -> Result<String, tonic::Status> {
    let gpu = v1::Gpu {
        uuid: "gpu-mtls".into(),
        model_name: "simulated".into(),
        total_bytes: 16 << 30,
        context_bytes: 1 << 30,
        free_bytes: 15 << 30,
        simulated: true,
        compute_capability: "9.0".into(),
        ..v1::Gpu::default()
    };
    let registered = WorkerServiceClient::new(channel)
        .register(v1::RegisterWorkerRequest {
            hostname: "gpu-node-1".into(),
            gpus: vec![gpu],
            version: "test".into(),
            previous_worker_id: String::new(),
            ..Default::default()
        })
        .await?;
    Ok(registered.into_inner().worker_id)
}

#[tokio::test]
async fn with_a_client_ca_only_workers_showing_its_certificates_are_served() {
    let authority = TestAuthority::new("carve test CA").unwrap();
    let server_certificate = authority.issue_server(&["localhost"]).unwrap();
    let worker_certificate = authority.issue_client("gpu-node-1").unwrap();
    let stranger_certificate = TestAuthority::new("someone else's CA")
        .unwrap()
        .issue_client("gpu-node-2")
        .unwrap();
    let server = TlsScheduler::start(TlsIdentity {
        certificate_chain_pem: server_certificate.certificate_pem.into_bytes(),
        private_key_pem: server_certificate.private_key_pem.into_bytes(),
        client_ca_certificate_pem: Some(authority.certificate_pem().into_bytes()),
    })
    .await;
    let endpoint = format!("https://localhost:{}", server.port);
    let trusted = authority.certificate_pem().into_bytes();
    let open = |identity: Option<ClientIdentity>, token: String| {
        let endpoint = endpoint.clone();
        let trusted = trusted.clone();
        async move {
            connect(
                &endpoint,
                Some(&trusted),
                identity.as_ref(),
                BearerToken::new(&token).unwrap(),
                Duration::from_secs(5),
            )
            .await
        }
    };

    // With a certificate from the CA: served (the listener is bound, so no retries).
    let admin = open(Some(identity(&worker_certificate)), ADMIN.into())
        .await
        .unwrap();
    let tokens = create_tenant_with_tokens(
        admin,
        "mtls",
        v1::Quota::default(),
        &[v1::Role::Worker],
        "mutual tls test",
    )
    .await
    .unwrap();
    let worker_token = tokens[0].clone();
    let worker = open(Some(identity(&worker_certificate)), worker_token.clone())
        .await
        .unwrap();
    let worker_id = register(worker).await.unwrap();
    assert!(!worker_id.is_empty());

    // Without a certificate, or with one another CA signed: refused in the handshake,
    // whatever the token.
    for shown in [None, Some(identity(&stranger_certificate))] {
        let refusal = match open(shown.clone(), worker_token.clone()).await {
            Err(error) => error.to_string(),
            Ok(channel) => register(channel).await.unwrap_err().to_string(),
        };
        assert!(
            refusal.to_lowercase().contains("certificate")
                || refusal.to_lowercase().contains("alert"),
            "{shown:?}: {refusal}"
        );
    }

    server.stop().await;
}
