//! The scheduler over TLS: a client that trusts the server's certificate is served, one
//! speaking plain HTTP/2 is not.

use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::admin_service_client::AdminServiceClient;
use carve_scheduler::scheduler::SchedulerSettings;
use carve_scheduler::server::{SchedulerConfig, TlsIdentity, run};
use tonic::Request;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

const ADMIN: &str = "carve_tls_admin";

#[tokio::test]
async fn clients_that_trust_the_certificate_are_served_over_tls() {
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let certificate_pem = certified.cert.pem();
    let directory = tempfile::tempdir().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (shutdown, shutdown_signal) = tokio::sync::oneshot::channel::<()>();
    let config = SchedulerConfig {
        database_url: format!("sqlite://{}", directory.path().join("carve.db").display()),
        settings: SchedulerSettings::default(),
        admin_token: Some(ADMIN.into()),
        metrics_address: None,
        tls: Some(TlsIdentity {
            certificate_chain_pem: certificate_pem.clone().into_bytes(),
            private_key_pem: certified.signing_key.serialize_pem().into_bytes(),
        }),
    };
    let server = tokio::spawn(run(config, listener, async {
        let _ = shutdown_signal.await;
    }));

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

    let _ = shutdown.send(());
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
