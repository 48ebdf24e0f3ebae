//! The scheduler's one error type, and its mapping into `carve_proto::ApiError` (which
//! alone chooses gRPC status codes). Messages are lowercase.

use carve_proto::ApiError;

/// Everything the scheduler (its store, auth, services) can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    /// No such thing (`what` is a kind of thing: "job", "tenant", "attempt").
    #[error("{what} {id} not found")]
    NotFound { what: &'static str, id: String },
    /// Creating something whose id or name is taken.
    #[error("{what} {id} already exists")]
    AlreadyExists { what: &'static str, id: String },
    /// A write lost to a newer one: a fenced update quoting a stale lease epoch, an
    /// attempt finished twice.
    #[error("{0}")]
    Conflict(String),
    /// The database failed; the message is sqlx's, starting lowercase.
    #[error("database error: {0}")]
    Database(String),
    /// A value is malformed; `field` names it (empty when the whole request is at fault).
    #[error("{}", field_and_reason(field, reason))]
    InvalidArgument { field: String, reason: String },
    /// No token, or one that is unknown, expired or revoked.
    #[error("{0}")]
    Unauthenticated(String),
    /// The token is valid but may not do this.
    #[error("{0}")]
    PermissionDenied(String),
    /// Out of quota, or nothing fits.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The thing is in the wrong state for the request.
    #[error("{0}")]
    FailedPrecondition(String),
    /// Something the scheduler needs is down for now; retrying may help.
    #[error("{0}")]
    Unavailable(String),
    /// A bug or a broken invariant.
    #[error("internal error: {0}")]
    Internal(String),
}

impl SchedulerError {
    /// A [`SchedulerError::NotFound`] for the `what` named `id`.
    pub fn not_found(what: &'static str, id: impl Into<String>) -> Self {
        SchedulerError::NotFound {
            what,
            id: id.into(),
        }
    }

    /// A [`SchedulerError::AlreadyExists`] for the `what` named `id`.
    pub fn already_exists(what: &'static str, id: impl Into<String>) -> Self {
        SchedulerError::AlreadyExists {
            what,
            id: id.into(),
        }
    }

    /// A [`SchedulerError::InvalidArgument`] about `field`.
    pub fn invalid_argument(field: impl Into<String>, reason: impl Into<String>) -> Self {
        SchedulerError::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

fn field_and_reason(field: &str, reason: &str) -> String {
    if field.is_empty() {
        reason.to_string()
    } else {
        format!("{field}: {reason}")
    }
}

impl From<sqlx::Error> for SchedulerError {
    fn from(error: sqlx::Error) -> Self {
        SchedulerError::Database(lowercase_first(&error.to_string()))
    }
}

impl From<sqlx::migrate::MigrateError> for SchedulerError {
    fn from(error: sqlx::migrate::MigrateError) -> Self {
        SchedulerError::Database(format!(
            "migrating the schema: {}",
            lowercase_first(&error.to_string())
        ))
    }
}

fn lowercase_first(message: &str) -> String {
    let mut chars = message.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

impl From<SchedulerError> for ApiError {
    fn from(error: SchedulerError) -> Self {
        match error {
            SchedulerError::NotFound { what, id } => ApiError::NotFound { what, id },
            SchedulerError::AlreadyExists { what, id } => ApiError::AlreadyExists { what, id },
            // gRPC's ABORTED is not in ApiError; a stale write is a request that no longer
            // applies to the state of the thing, which is what FAILED_PRECONDITION says.
            SchedulerError::Conflict(message) => ApiError::FailedPrecondition(message),
            // Connection loss, pool timeouts and locked databases are what a database
            // error usually is: retrying may help.
            database @ SchedulerError::Database(_) => ApiError::Unavailable(database.to_string()),
            SchedulerError::InvalidArgument { field, reason } => {
                ApiError::InvalidArgument { field, reason }
            }
            SchedulerError::Unauthenticated(message) => ApiError::Unauthenticated(message),
            SchedulerError::PermissionDenied(message) => ApiError::PermissionDenied(message),
            SchedulerError::ResourceExhausted(message) => ApiError::ResourceExhausted(message),
            SchedulerError::FailedPrecondition(message) => ApiError::FailedPrecondition(message),
            SchedulerError::Unavailable(message) => ApiError::Unavailable(message),
            SchedulerError::Internal(message) => ApiError::Internal(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use carve_proto::ApiError;

    use super::SchedulerError;

    #[test]
    fn messages_are_lowercase_and_name_the_thing() {
        assert_eq!(
            SchedulerError::not_found("job", "j-1").to_string(),
            "job j-1 not found"
        );
        assert_eq!(
            SchedulerError::already_exists("tenant", "acme").to_string(),
            "tenant acme already exists"
        );
        assert_eq!(
            SchedulerError::invalid_argument("page_token", "not a page token").to_string(),
            "page_token: not a page token"
        );
        assert_eq!(
            SchedulerError::invalid_argument("", "bad request").to_string(),
            "bad request"
        );
        let database = SchedulerError::from(sqlx::Error::PoolTimedOut);
        assert!(
            database
                .to_string()
                .starts_with("database error: pool timed out"),
            "{database}"
        );
        let database = SchedulerError::from(sqlx::Error::Protocol("Bad frame".into()));
        assert_eq!(
            database.to_string(),
            "database error: encountered unexpected or invalid data: Bad frame"
        );
    }

    #[test]
    fn every_variant_maps_to_an_api_error() {
        let cases = [
            (
                SchedulerError::not_found("job", "j-1"),
                ApiError::not_found("job", "j-1"),
            ),
            (
                SchedulerError::already_exists("tenant", "acme"),
                ApiError::already_exists("tenant", "acme"),
            ),
            (
                SchedulerError::Conflict("attempt j/2 was reassigned".into()),
                ApiError::FailedPrecondition("attempt j/2 was reassigned".into()),
            ),
            (
                SchedulerError::Database("pool timed out".into()),
                ApiError::Unavailable("database error: pool timed out".into()),
            ),
            (
                SchedulerError::invalid_argument("states[0]", "bad"),
                ApiError::invalid_argument("states[0]", "bad"),
            ),
            (
                SchedulerError::Unauthenticated("no token".into()),
                ApiError::Unauthenticated("no token".into()),
            ),
            (
                SchedulerError::PermissionDenied("admins only".into()),
                ApiError::PermissionDenied("admins only".into()),
            ),
            (
                SchedulerError::ResourceExhausted("quota".into()),
                ApiError::ResourceExhausted("quota".into()),
            ),
            (
                SchedulerError::FailedPrecondition("ended".into()),
                ApiError::FailedPrecondition("ended".into()),
            ),
            (
                SchedulerError::Unavailable("down".into()),
                ApiError::Unavailable("down".into()),
            ),
            (
                SchedulerError::Internal("bug".into()),
                ApiError::Internal("bug".into()),
            ),
        ];
        for (error, expected) in cases {
            assert_eq!(ApiError::from(error), expected);
        }
    }
}
