//! carve-proto: Carve's v1 gRPC API.
//!
//! - [`v1`]: the types and the tonic clients and servers generated from
//!   `proto/carve/v1/*.proto` (package `carve.v1`): `JobService`, `ClusterService`,
//!   `AdminService` and `WorkerService`.
//! - [`FILE_DESCRIPTOR_SET`]: the encoded descriptors of those files (and the well-known
//!   types they import), for the gRPC reflection service.
//! - [`status`]: [`ApiError`], the one mapping from errors to `tonic::Status` for the whole
//!   project. Service crates convert their own errors into it and nothing else builds a
//!   `Status` by hand, so codes and messages stay consistent.
//! - [`convert`]: conversions between the generated types and carve-core's. Generated
//!   types stop at the service handlers: core types carry no wire derives, and every
//!   translation (with its field-named errors) lives here.
//! - [`client`]: what the programs around the API share: [`client::BearerToken`] (the
//!   `authorization` metadata, also as an interceptor), [`client::connect`] (the
//!   authenticated channel to a scheduler) and [`client::shutdown_signal`].
//! - `logging` (feature `logging`, for the scheduler and worker binaries): `--log-format`
//!   and the tracing subscriber they install.

pub mod client;
pub mod convert;
#[cfg(feature = "logging")]
pub mod logging;
pub mod status;

pub use status::ApiError;

/// The generated `carve.v1` package.
///
/// Timestamps and durations are `prost_types::Timestamp` and `prost_types::Duration`.
/// Enum fields are `i32` on the wire, as prost generates them; read them with the
/// conversions in [`crate::convert`], which reject unknown values naming the field.
pub mod v1 {
    // Generated code: its style is prost's and tonic's, not ours.
    #![allow(
        missing_docs,
        missing_debug_implementations,
        clippy::all,
        clippy::pedantic,
        rustdoc::all
    )]
    tonic::include_proto!("carve.v1");
}

/// The encoded `google.protobuf.FileDescriptorSet` of the v1 API, with the well-known
/// types it imports: hand it to `tonic_reflection`'s
/// `Builder::register_encoded_file_descriptor_set`.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/carve_descriptor.bin"));

/// A job event as bytes, for the scheduler to store with the log line it made (a resumed
/// watch replays it from there on any replica).
pub fn encode_job_event(event: &v1::JobEvent) -> Vec<u8> {
    prost::Message::encode_to_vec(event)
}

/// [`encode_job_event`]'s bytes back; `None` when they are not a job event.
pub fn decode_job_event(bytes: &[u8]) -> Option<v1::JobEvent> {
    prost::Message::decode(bytes).ok()
}

#[cfg(test)]
mod tests {
    use prost::Message;
    use prost_types::FileDescriptorSet;

    use super::{FILE_DESCRIPTOR_SET, v1};

    fn descriptor_set() -> FileDescriptorSet {
        FileDescriptorSet::decode(FILE_DESCRIPTOR_SET).expect("the descriptor set decodes")
    }

    #[test]
    fn descriptor_set_has_every_service_and_method() {
        let set = descriptor_set();
        let services: Vec<(String, Vec<String>)> = set
            .file
            .iter()
            .filter(|file| file.package() == "carve.v1")
            .flat_map(|file| &file.service)
            .map(|service| {
                (
                    format!("carve.v1.{}", service.name()),
                    service
                        .method
                        .iter()
                        .map(|method| method.name().to_string())
                        .collect(),
                )
            })
            .collect();
        let expected: [(&str, &[&str]); 4] = [
            (
                "carve.v1.JobService",
                &[
                    "SubmitJob",
                    "GetJob",
                    "ListJobs",
                    "CancelJob",
                    "WatchJob",
                    "EstimateJob",
                    "GetJobLogs",
                    "ResetMemoryModels",
                ],
            ),
            (
                "carve.v1.ClusterService",
                &[
                    "ListWorkers",
                    "GetWorker",
                    "DrainWorker",
                    "UndrainWorker",
                    "ListSlices",
                    "RemoveWorker",
                    "GetUsage",
                ],
            ),
            (
                "carve.v1.AdminService",
                &[
                    "CreateTenant",
                    "ListTenants",
                    "SetQuota",
                    "DeleteTenant",
                    "CreateToken",
                    "ListTokens",
                    "RevokeToken",
                ],
            ),
            ("carve.v1.WorkerService", &["Register", "Session"]),
        ];
        for (service, methods) in expected {
            let found = services
                .iter()
                .find(|(name, _)| name == service)
                .unwrap_or_else(|| panic!("{service} missing from {services:?}"));
            assert_eq!(found.1, methods, "{service}");
        }
    }

    #[test]
    fn descriptor_set_includes_the_imported_well_known_types() {
        // Reflection clients resolve imports from the same set, so they must be in it.
        let set = descriptor_set();
        let names: Vec<&str> = set.file.iter().map(|file| file.name()).collect();
        for name in [
            "google/protobuf/timestamp.proto",
            "google/protobuf/duration.proto",
            "carve/v1/common.proto",
            "carve/v1/jobs.proto",
            "carve/v1/cluster.proto",
            "carve/v1/admin.proto",
            "carve/v1/worker.proto",
        ] {
            assert!(names.contains(&name), "{name} missing from {names:?}");
        }
    }

    #[test]
    fn streaming_methods_stream() {
        let set = descriptor_set();
        let method = |service: &str, method: &str| {
            set.file
                .iter()
                .flat_map(|file| &file.service)
                .filter(|candidate| candidate.name() == service)
                .flat_map(|candidate| &candidate.method)
                .find(|candidate| candidate.name() == method)
                .cloned()
                .unwrap_or_else(|| panic!("{service}.{method} missing"))
        };
        let watch = method("JobService", "WatchJob");
        assert!(!watch.client_streaming() && watch.server_streaming());
        let session = method("WorkerService", "Session");
        assert!(session.client_streaming() && session.server_streaming());
    }

    #[test]
    fn oneof_messages_survive_the_wire() {
        let event = v1::JobEvent {
            job_id: "j-1".into(),
            sequence: 7,
            log_sequence: 3,
            time: Some(prost_types::Timestamp {
                seconds: 1_700_000_000,
                nanos: 5,
            }),
            event: Some(v1::job_event::Event::Oom(v1::job_event::OutOfMemory {
                attempt_number: 2,
                config: None,
                report: Some(v1::OutOfMemoryReport {
                    requested_bytes: 1,
                    in_use_bytes: 2,
                    limit_bytes: 3,
                    largest_free_bytes: 4,
                    peak_bytes: 5,
                }),
            })),
        };
        let decoded = v1::JobEvent::decode(event.encode_to_vec().as_slice()).unwrap();
        assert_eq!(decoded, event);
        assert_eq!(
            super::decode_job_event(&super::encode_job_event(&event)),
            Some(event)
        );
        assert_eq!(super::decode_job_event(b"\xff\xff"), None);

        let message = v1::WorkerMessage {
            sequence: 1,
            body: Some(v1::worker_message::Body::Hello(v1::worker_message::Hello {
                worker_id: "w-1".into(),
                running_attempts: vec![v1::AttemptRef {
                    job_id: "j-1".into(),
                    attempt_number: 2,
                    lease_epoch: 9,
                    gang_rank: None,
                }],
            })),
        };
        assert_eq!(
            v1::WorkerMessage::decode(message.encode_to_vec().as_slice()).unwrap(),
            message
        );
    }
}
