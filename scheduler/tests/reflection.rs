//! gRPC server reflection as tools see it: both `grpc.reflection.v1` and the older
//! `grpc.reflection.v1alpha` (the only one grpcio-reflection and older grpcurl speak)
//! answer ListServices, and list carve's services, the health service and both
//! reflection services.

use std::time::Duration;

#[path = "support/worker.rs"]
mod test_worker;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{channel, start};

/// The service names one reflection version lists; `$version` is the module of
/// `tonic_reflection::pb` (the two versions' generated types are alike but distinct).
macro_rules! listed_services {
    ($channel:expr, $version:ident) => {{
        use tonic_reflection::pb::$version::{
            ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
            server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
        };
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut responses = ServerReflectionClient::new($channel.clone())
            .server_reflection_info(tokio_stream::iter([request]))
            .await
            .expect(concat!(stringify!($version), " reflection answers"))
            .into_inner();
        let response = responses.message().await.unwrap().expect("one response");
        match response.message_response {
            Some(MessageResponse::ListServicesResponse(list)) => list
                .service
                .into_iter()
                .map(|service| service.name)
                .collect::<Vec<String>>(),
            other => panic!("not a service list: {other:?}"),
        }
    }};
}

#[tokio::test]
async fn v1_and_v1alpha_reflection_list_every_service() {
    let cluster = start(Duration::from_secs(30)).await;
    let channel = channel(&cluster).await;
    let lists = [
        ("v1", listed_services!(channel, v1)),
        ("v1alpha", listed_services!(channel, v1alpha)),
    ];
    for (version, services) in lists {
        for expected in [
            "carve.v1.JobService",
            "carve.v1.AdminService",
            "carve.v1.ClusterService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ] {
            assert!(
                services.iter().any(|service| service == expected),
                "{version} reflection does not list {expected}: {services:?}"
            );
        }
    }
}
