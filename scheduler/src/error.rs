//! The scheduler's one error type and its way into a `tonic::Status`. The kinds of failure
//! a caller can see are `carve_proto::ApiError`'s (which alone chooses gRPC codes), held
//! here as [`SchedulerError::Api`]; only what is the scheduler's own (a write that lost a
//! race, the database) has a variant of its own. Messages are lowercase.

use carve_proto::ApiError;

/// Everything the scheduler (its store, auth, services) can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    /// A write lost to a newer one: a fenced update quoting a stale lease epoch, an
    /// attempt finished twice.
    #[error("{0}")]
    Conflict(String),
    /// The database failed; the message is sqlx's, starting lowercase.
    #[error("database error: {0}")]
    Database(String),
    /// A failure that is already one of the API's kinds: bad input naming its field, no
    /// such thing, no token, no permission, out of quota, wrong state, down, or a bug.
    #[error(transparent)]
    Api(#[from] ApiError),
}

impl SchedulerError {
    /// An [`ApiError::NotFound`] for the `what` named `id`.
    pub fn not_found(what: &'static str, id: impl Into<String>) -> Self {
        SchedulerError::Api(ApiError::not_found(what, id))
    }

    /// An [`ApiError::AlreadyExists`] for the `what` named `id`.
    pub fn already_exists(what: &'static str, id: impl Into<String>) -> Self {
        SchedulerError::Api(ApiError::already_exists(what, id))
    }

    /// An [`ApiError::InvalidArgument`] about `field`.
    pub fn invalid_argument(field: impl Into<String>, reason: impl Into<String>) -> Self {
        SchedulerError::Api(ApiError::invalid_argument(field, reason))
    }
}

impl From<sqlx::Error> for SchedulerError {
    fn from(error: sqlx::Error) -> Self {
        match error {
            // A value this build cannot read (a state it does not know, a broken JSON
            // report): retrying will not help, and no default may stand in for it.
            sqlx::Error::ColumnDecode { index, source } => SchedulerError::Api(ApiError::Internal(
                format!("corrupt row: column {index}: {source}"),
            )),
            other => SchedulerError::Database(lowercase_first(&other.to_string())),
        }
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
            // A stale write is a request that no longer applies to the state of the thing,
            // which is what FAILED_PRECONDITION says (ABORTED is kept for a call that a
            // newer one took over, like a replaced worker session).
            SchedulerError::Conflict(message) => ApiError::FailedPrecondition(message),
            // Connection loss, pool timeouts and locked databases are what a database
            // error usually is: retrying may help.
            database @ SchedulerError::Database(_) => ApiError::Unavailable(database.to_string()),
            SchedulerError::Api(api_error) => api_error,
        }
    }
}

/// So a handler returning `Result<_, Status>` can use `?` on the scheduler's results; the
/// code is still chosen by `ApiError` alone.
impl From<SchedulerError> for tonic::Status {
    fn from(error: SchedulerError) -> Self {
        ApiError::from(error).into()
    }
}

#[cfg(test)]
mod tests {
    use carve_proto::ApiError;
    use carve_proto::status::status_field;
    use tonic::Code;

    use super::SchedulerError;

    #[test]
    fn messages_are_lowercase_and_name_the_thing() {
        for (error, message) in [
            (SchedulerError::not_found("job", "j-1"), "job j-1 not found"),
            (
                SchedulerError::already_exists("tenant", "acme"),
                "tenant acme already exists",
            ),
            (
                SchedulerError::invalid_argument("page_token", "not a page token"),
                "page_token: not a page token",
            ),
            (
                SchedulerError::invalid_argument("", "bad request"),
                "bad request",
            ),
        ] {
            assert_eq!(error.to_string(), message);
        }
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
    fn the_scheduler_own_variants_map_to_an_api_error() {
        assert_eq!(
            ApiError::from(SchedulerError::Conflict(
                "attempt j/2 was reassigned".into()
            )),
            ApiError::FailedPrecondition("attempt j/2 was reassigned".into())
        );
        assert_eq!(
            ApiError::from(SchedulerError::Database("pool timed out".into())),
            ApiError::Unavailable("database error: pool timed out".into())
        );
    }

    #[test]
    fn an_api_error_passes_through_unchanged() {
        let api_errors = [
            ApiError::not_found("job", "j-1"),
            ApiError::already_exists("tenant", "acme"),
            ApiError::invalid_argument("states[0]", "bad"),
            ApiError::Unauthenticated("no token".into()),
            ApiError::PermissionDenied("admins only".into()),
            ApiError::ResourceExhausted("quota".into()),
            ApiError::FailedPrecondition("ended".into()),
            ApiError::Unavailable("down".into()),
            ApiError::Internal("bug".into()),
        ];
        for api_error in api_errors {
            let error = SchedulerError::from(api_error.clone());
            assert_eq!(error.to_string(), api_error.to_string());
            assert_eq!(ApiError::from(error), api_error);
        }
    }

    #[test]
    fn a_status_is_the_one_its_api_error_makes() {
        let cases = [
            (
                SchedulerError::invalid_argument("page_token", "not a page token"),
                Code::InvalidArgument,
                "page_token: not a page token",
            ),
            (
                SchedulerError::not_found("job", "j-1"),
                Code::NotFound,
                "job j-1 not found",
            ),
            (
                SchedulerError::Conflict("attempt j/2 was reassigned".into()),
                Code::FailedPrecondition,
                "attempt j/2 was reassigned",
            ),
            (
                SchedulerError::Database("pool timed out".into()),
                Code::Unavailable,
                "database error: pool timed out",
            ),
        ];
        for (error, code, message) in cases {
            let expected = tonic::Status::from(ApiError::from(error.clone()));
            let status = tonic::Status::from(error);
            assert_eq!(status.code(), code, "{message}");
            assert_eq!(status.message(), message);
            assert_eq!(status_field(&status), status_field(&expected));
        }
        let status = tonic::Status::from(SchedulerError::invalid_argument("page_token", "bad"));
        assert_eq!(status_field(&status), Some("page_token"));
    }
}
