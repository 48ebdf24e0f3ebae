//! The one mapping from errors to `tonic::Status` for the whole project.
//!
//! Every service crate (the scheduler's handlers, its store, auth) converts its own error
//! enum into [`ApiError`], and only `impl From<ApiError> for tonic::Status` decides the gRPC
//! code and the message, so a client sees the same code for the same kind of failure from
//! every service. Messages are lowercase and, for bad input, name the field and the
//! reason: `spec.model.layers[3].conv2d.kernel: 5 is larger than the 4x4 input`.

use carve_core::allocator::OutOfMemory;
use carve_core::{CoreError, FieldError};
use tonic::metadata::MetadataValue;

/// The response metadata (trailer) key under which an `INVALID_ARGUMENT` status carries
/// the offending field's path, so a client can point at the field without parsing the
/// message.
pub const FIELD_METADATA_KEY: &str = "carve-field";

/// The response metadata (trailer) key under which a replica that does not lead names
/// the leader's endpoint on its `UNAVAILABLE` ([`ApiError::NotLeader`]), so the worker
/// and `carve` go there at once instead of trying every replica in turn.
pub const LEADER_METADATA_KEY: &str = "carve-leader";

/// Everything an API call can fail with, by the gRPC code it maps to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// A request field (or a path inside the job spec) is malformed or inconsistent.
    /// `field` is empty when the whole request is at fault (JSON that does not parse).
    #[error("{}", field_and_reason(field, reason))]
    InvalidArgument { field: String, reason: String },
    /// No token, or one that is unknown, expired or revoked.
    #[error("{0}")]
    Unauthenticated(String),
    /// The token is valid but its role or tenant may not do this.
    #[error("{0}")]
    PermissionDenied(String),
    /// No such thing, or one the caller may not see (another tenant's job reads as
    /// missing, so ids do not leak across tenants).
    #[error("{what} {id} not found")]
    NotFound { what: &'static str, id: String },
    /// Creating something whose name is taken.
    #[error("{what} {id} already exists")]
    AlreadyExists { what: &'static str, id: String },
    /// Out of memory, out of quota, or nothing the job allows fits anywhere.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The request is well formed but the thing is in the wrong state for it (cancelling
    /// a finished job, draining a lost worker).
    #[error("{0}")]
    FailedPrecondition(String),
    /// A dependency (the store, a worker) is down for now; retrying may help.
    #[error("{0}")]
    Unavailable(String),
    /// This scheduler replica does not lead (a standby, or a leader that stepped down),
    /// and the call needs the leader: the leader's endpoint when this replica knows it.
    /// `UNAVAILABLE`, with the endpoint in the [`LEADER_METADATA_KEY`] trailer.
    #[error("{reason}")]
    NotLeader {
        leader_endpoint: Option<String>,
        reason: String,
    },
    /// The call was cut short by a newer one that took its place (a worker's session
    /// replaced by a newer session of the same worker); the newer one carries on.
    #[error("{0}")]
    Aborted(String),
    /// The server dropped part of what the call was owed (a watcher that fell too far
    /// behind the events); calling again starts from what is current.
    #[error("{0}")]
    DataLoss(String),
    /// A bug or an invariant broken on the server side.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// An [`ApiError::InvalidArgument`] about `field`.
    pub fn invalid_argument(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ApiError::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// An [`ApiError::NotFound`] for the `what` (a kind of thing: "job", "worker") named `id`.
    pub fn not_found(what: &'static str, id: impl Into<String>) -> Self {
        ApiError::NotFound {
            what,
            id: id.into(),
        }
    }

    /// An [`ApiError::AlreadyExists`] for the `what` named `id`.
    pub fn already_exists(what: &'static str, id: impl Into<String>) -> Self {
        ApiError::AlreadyExists {
            what,
            id: id.into(),
        }
    }

    /// The same error about a field one level down, for errors raised on a nested value:
    /// `prefix_field("spec")` turns `training.batch_size` into `spec.training.batch_size`
    /// (and an empty field into `spec`). Other variants are returned unchanged.
    pub fn prefix_field(self, prefix: &str) -> Self {
        match self {
            ApiError::InvalidArgument { field, reason } => ApiError::InvalidArgument {
                field: join_field(prefix, &field),
                reason,
            },
            other => other,
        }
    }

    /// The gRPC code this error maps to.
    pub fn code(&self) -> tonic::Code {
        match self {
            ApiError::InvalidArgument { .. } => tonic::Code::InvalidArgument,
            ApiError::Unauthenticated(_) => tonic::Code::Unauthenticated,
            ApiError::PermissionDenied(_) => tonic::Code::PermissionDenied,
            ApiError::NotFound { .. } => tonic::Code::NotFound,
            ApiError::AlreadyExists { .. } => tonic::Code::AlreadyExists,
            ApiError::ResourceExhausted(_) => tonic::Code::ResourceExhausted,
            ApiError::FailedPrecondition(_) => tonic::Code::FailedPrecondition,
            ApiError::Unavailable(_) | ApiError::NotLeader { .. } => tonic::Code::Unavailable,
            ApiError::Aborted(_) => tonic::Code::Aborted,
            ApiError::DataLoss(_) => tonic::Code::DataLoss,
            ApiError::Internal(_) => tonic::Code::Internal,
        }
    }
}

/// `field` and `prefix` joined into one path. An index (`[3]`) attaches without a dot.
pub(crate) fn join_field(prefix: &str, field: &str) -> String {
    match (prefix.is_empty(), field.is_empty()) {
        (_, true) => prefix.to_string(),
        (true, false) => field.to_string(),
        (false, false) if field.starts_with('[') => format!("{prefix}{field}"),
        (false, false) => format!("{prefix}.{field}"),
    }
}

fn field_and_reason(field: &str, reason: &str) -> String {
    if field.is_empty() {
        reason.to_string()
    } else {
        format!("{field}: {reason}")
    }
}

impl From<ApiError> for tonic::Status {
    fn from(error: ApiError) -> Self {
        let mut status = tonic::Status::new(error.code(), error.to_string());
        if let ApiError::InvalidArgument { field, .. } = &error {
            // A path that is not a valid header value (non-ASCII) is still in the message,
            // so leaving the trailer out loses nothing a person needs.
            if let Ok(value) = MetadataValue::try_from(field.as_str())
                && !field.is_empty()
            {
                status.metadata_mut().insert(FIELD_METADATA_KEY, value);
            }
        }
        if let ApiError::NotLeader {
            leader_endpoint: Some(endpoint),
            ..
        } = &error
            && let Ok(value) = MetadataValue::try_from(endpoint.as_str())
        {
            status.metadata_mut().insert(LEADER_METADATA_KEY, value);
        }
        status
    }
}

/// The field an `INVALID_ARGUMENT` status is about, when the server attached it.
pub fn status_field(status: &tonic::Status) -> Option<&str> {
    status.metadata().get(FIELD_METADATA_KEY)?.to_str().ok()
}

/// The leader a replica that does not lead named in its refusal ([`ApiError::NotLeader`]).
pub fn leader_named_by(status: &tonic::Status) -> Option<&str> {
    if status.code() != tonic::Code::Unavailable {
        return None;
    }
    status
        .metadata()
        .get(LEADER_METADATA_KEY)?
        .to_str()
        .ok()
        .filter(|endpoint| !endpoint.is_empty())
}

impl From<FieldError> for ApiError {
    fn from(error: FieldError) -> Self {
        ApiError::InvalidArgument {
            field: error.field,
            reason: error.reason,
        }
    }
}

impl From<CoreError> for ApiError {
    fn from(error: CoreError) -> Self {
        match error {
            CoreError::InvalidSpec(field_error) => field_error.into(),
            // Core's messages already carry the numbers (available, smallest required,
            // the strategies tried), which is what a person needs to resize the job.
            does_not_fit @ CoreError::DoesNotFit { .. } => {
                ApiError::ResourceExhausted(does_not_fit.to_string())
            }
            // Too costly to search: like not fitting, more memory (or a smaller model) is
            // what the caller can change.
            gave_up @ CoreError::ShrinkBudgetExhausted { .. } => {
                ApiError::ResourceExhausted(gave_up.to_string())
            }
            CoreError::OutOfMemory(out_of_memory) => {
                ApiError::ResourceExhausted(out_of_memory.to_string())
            }
        }
    }
}

impl From<OutOfMemory> for ApiError {
    fn from(error: OutOfMemory) -> Self {
        ApiError::ResourceExhausted(error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use carve_core::allocator::OutOfMemory;
    use carve_core::{CoreError, FieldError};
    use tonic::Code;

    use super::{ApiError, leader_named_by, status_field};

    #[test]
    fn every_variant_maps_to_its_code() {
        let cases = [
            (
                ApiError::invalid_argument("name", "must not be empty"),
                Code::InvalidArgument,
            ),
            (
                ApiError::Unauthenticated("no bearer token".into()),
                Code::Unauthenticated,
            ),
            (
                ApiError::PermissionDenied("admins only".into()),
                Code::PermissionDenied,
            ),
            (ApiError::not_found("job", "j-1"), Code::NotFound),
            (
                ApiError::already_exists("tenant", "acme"),
                Code::AlreadyExists,
            ),
            (
                ApiError::ResourceExhausted("quota".into()),
                Code::ResourceExhausted,
            ),
            (
                ApiError::FailedPrecondition("job already ended".into()),
                Code::FailedPrecondition,
            ),
            (
                ApiError::Unavailable("store is down".into()),
                Code::Unavailable,
            ),
            (
                ApiError::NotLeader {
                    leader_endpoint: None,
                    reason: "a standby; no leader is known yet".into(),
                },
                Code::Unavailable,
            ),
            (
                ApiError::Aborted("a newer session replaced this one".into()),
                Code::Aborted,
            ),
            (
                ApiError::DataLoss("the watcher fell 3 events behind".into()),
                Code::DataLoss,
            ),
            (ApiError::Internal("bug".into()), Code::Internal),
        ];
        for (error, code) in cases {
            let message = error.to_string();
            let status = tonic::Status::from(error);
            assert_eq!(status.code(), code, "{message}");
            assert_eq!(status.message(), message);
        }
    }

    #[test]
    fn a_replica_that_does_not_lead_names_the_leader_in_the_trailer() {
        let status = tonic::Status::from(ApiError::NotLeader {
            leader_endpoint: Some("http://10.0.0.7:7470".into()),
            reason: "this scheduler replica is a standby; the leader is at http://10.0.0.7:7470"
                .into(),
        });
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(leader_named_by(&status), Some("http://10.0.0.7:7470"));

        let unknown = tonic::Status::from(ApiError::NotLeader {
            leader_endpoint: None,
            reason: "no leader is known yet".into(),
        });
        assert_eq!(leader_named_by(&unknown), None);
        // Only an UNAVAILABLE names a leader, whatever metadata another answer carries.
        let mut other = tonic::Status::not_found("job j-1 not found");
        other
            .metadata_mut()
            .insert(super::LEADER_METADATA_KEY, "http://x:1".parse().unwrap());
        assert_eq!(leader_named_by(&other), None);
    }

    #[test]
    fn invalid_argument_names_the_field_in_the_message_and_the_trailer() {
        let status = tonic::Status::from(ApiError::invalid_argument(
            "spec.model.layers[3].conv2d.kernel",
            "5 is larger than the 4x4 input",
        ));
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(
            status.message(),
            "spec.model.layers[3].conv2d.kernel: 5 is larger than the 4x4 input"
        );
        assert_eq!(
            status_field(&status),
            Some("spec.model.layers[3].conv2d.kernel")
        );
    }

    #[test]
    fn invalid_argument_without_a_field_is_just_the_reason() {
        let status = tonic::Status::from(ApiError::invalid_argument(
            "",
            "expected value at line 1 column 1",
        ));
        assert_eq!(status.message(), "expected value at line 1 column 1");
        assert_eq!(status_field(&status), None);
    }

    #[test]
    fn messages_are_lowercase() {
        assert_eq!(
            ApiError::not_found("job", "j-1").to_string(),
            "job j-1 not found"
        );
        assert_eq!(
            ApiError::already_exists("tenant", "acme").to_string(),
            "tenant acme already exists"
        );
        assert_eq!(
            ApiError::Internal("lost a row".into()).to_string(),
            "internal error: lost a row"
        );
    }

    #[test]
    fn prefix_field_joins_paths_and_indices() {
        let prefixed = ApiError::invalid_argument("training.batch_size", "must be at least 1")
            .prefix_field("spec");
        assert_eq!(
            prefixed,
            ApiError::invalid_argument("spec.training.batch_size", "must be at least 1")
        );
        let indexed = ApiError::invalid_argument("[2]", "bad").prefix_field("states");
        assert_eq!(indexed, ApiError::invalid_argument("states[2]", "bad"));
        let whole = ApiError::invalid_argument("", "not json").prefix_field("spec");
        assert_eq!(whole, ApiError::invalid_argument("spec", "not json"));
        let untouched = ApiError::not_found("job", "j-1").prefix_field("spec");
        assert_eq!(untouched, ApiError::not_found("job", "j-1"));
    }

    #[test]
    fn field_errors_become_invalid_argument() {
        let error = ApiError::from(FieldError::new("training.steps", "must be at least 1"));
        assert_eq!(
            error,
            ApiError::invalid_argument("training.steps", "must be at least 1")
        );
        let error = ApiError::from(CoreError::InvalidSpec(FieldError::new(
            "name",
            "must not be empty",
        )));
        assert_eq!(
            tonic::Status::from(error).message(),
            "name: must not be empty"
        );
    }

    #[test]
    fn does_not_fit_is_resource_exhausted_with_the_numbers() {
        let error = ApiError::from(CoreError::DoesNotFit {
            available_bytes: 4 << 30,
            smallest_required_bytes: 6 << 30,
            smallest_config: "batch 64, fp16".into(),
            strategies: "mixed_precision, accumulate".into(),
        });
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(
            status.message().starts_with("no configuration fits"),
            "{}",
            status.message()
        );
        for part in ["4", "6", "batch 64, fp16", "mixed_precision, accumulate"] {
            assert!(
                status.message().contains(part),
                "{part} missing in {}",
                status.message()
            );
        }
    }

    #[test]
    fn a_shrink_search_that_gave_up_is_resource_exhausted_with_its_numbers() {
        let error = ApiError::from(CoreError::ShrinkBudgetExhausted {
            candidate_replays: 93,
            plan_steps_replayed: 25_000_123,
            budget_plan_steps: 25_000_000,
            available_bytes: 1 << 20,
            smallest_required_bytes: 6 << 30,
            smallest_config: "batch 32, fp16".into(),
        });
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(
            status
                .message()
                .starts_with("the shrink planner gave up after 93 candidate replays"),
            "{}",
            status.message()
        );
        assert!(status.message().contains("batch 32, fp16"));
    }

    #[test]
    fn out_of_memory_is_resource_exhausted() {
        let out_of_memory = OutOfMemory {
            requested: 1 << 20,
            in_use: 3 << 20,
            limit: 4 << 20,
            largest_free: 1 << 19,
            peak: 3 << 20,
        };
        for error in [
            ApiError::from(CoreError::OutOfMemory(out_of_memory)),
            ApiError::from(out_of_memory),
        ] {
            let status = tonic::Status::from(error);
            assert_eq!(status.code(), Code::ResourceExhausted);
            assert!(
                status.message().starts_with("out of memory"),
                "{}",
                status.message()
            );
        }
    }
}
