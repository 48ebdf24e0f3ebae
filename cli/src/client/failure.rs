//! The exit codes of `carve` and the one place that chooses them.
//!
//! Scripts branch on the exit code, so every command reports a failure it can classify
//! as a [`ClientFailure`] (wrapped in `anyhow::Error` like any other error) and `main`
//! turns whatever error reaches it into a code with [`exit_code_for_error`]. gRPC
//! statuses become failures in [`status_failure`], with the advice a person needs to act
//! on them.

use std::fmt;
use std::process::ExitCode;

use tonic::Code;

/// The help text that lists the exit codes (`carve --help`).
pub const EXIT_CODES_HELP: &str = "\
Exit codes:
  0   success (for watch and submit --watch: the job succeeded)
  1   any other error
  2   usage error (bad arguments; a job prefix or name that matches several jobs)
  3   the job ran out of memory (carve run, carve estimate; a watched job that failed
      out of memory)
  4   cannot connect to the scheduler
  5   authentication or permission failure (token missing, rejected or not allowed)
  6   not found (job, worker, tenant or token)
  7   invalid argument: a rejected spec or request field (the message names it)
  8   resource exhausted: the job can never fit (quota or largest GPU)
  10  the watched job failed
  11  the watched job was cancelled
  130 interrupted (Ctrl-C during carve dev --demo)";

/// Why a command failed, as far as the exit code is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Anything without a more precise code.
    Other,
    /// A bad argument on the command line that clap could not catch: a job reference
    /// (prefix or name) that names several jobs.
    Usage,
    /// The job (or the local run) ran out of memory.
    OutOfMemory,
    /// The scheduler could not be reached.
    CannotConnect,
    /// No token, a rejected token, or a token whose role or tenant may not do this.
    Authentication,
    /// The job, worker, tenant or token does not exist (or is another tenant's).
    NotFound,
    /// A field of the request or of the spec was rejected.
    InvalidArgument,
    /// Nothing the job allows fits in its quota or on any GPU.
    ResourceExhausted,
    /// A watched job ended FAILED.
    JobFailed,
    /// A watched job ended CANCELLED.
    JobCancelled,
    /// `carve dev --demo` stopped by Ctrl-C (or SIGTERM) before its jobs ended: 130, the
    /// code a shell gives a command ended by SIGINT.
    Interrupted,
}

impl FailureKind {
    /// The process exit code of this kind of failure.
    pub fn exit_code(self) -> u8 {
        match self {
            FailureKind::Other => 1,
            FailureKind::Usage => 2,
            FailureKind::OutOfMemory => 3,
            FailureKind::CannotConnect => 4,
            FailureKind::Authentication => 5,
            FailureKind::NotFound => 6,
            FailureKind::InvalidArgument => 7,
            FailureKind::ResourceExhausted => 8,
            FailureKind::JobFailed => 10,
            FailureKind::JobCancelled => 11,
            FailureKind::Interrupted => 130,
        }
    }
}

impl From<FailureKind> for ExitCode {
    /// How a command that ends without an error (`Ok(code)`) still exits with a failure's
    /// code: `ExitCode::from(FailureKind::OutOfMemory)`, never a number written elsewhere.
    fn from(kind: FailureKind) -> Self {
        ExitCode::from(kind.exit_code())
    }
}

/// A failure with the code it exits with and the message a person reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientFailure {
    pub kind: FailureKind,
    pub message: String,
}

impl ClientFailure {
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        ClientFailure {
            kind,
            message: message.into(),
        }
    }
}

impl fmt::Display for ClientFailure {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.message)
    }
}

impl std::error::Error for ClientFailure {}

/// The kind of the first [`ClientFailure`] in an error's chain, `Other` when there is none.
fn failure_kind(error: &anyhow::Error) -> FailureKind {
    error
        .chain()
        .find_map(|cause| cause.downcast_ref::<ClientFailure>())
        .map_or(FailureKind::Other, |failure| failure.kind)
}

/// The exit code for an error that ended a command: the kind of the first
/// [`ClientFailure`] in its chain, 1 when there is none.
pub fn exit_code_for_error(error: &anyhow::Error) -> ExitCode {
    ExitCode::from(failure_kind(error))
}

/// The failures of a command that does the same to several jobs (`carve cancel J1 J2`):
/// each is reported as it happens, as `main` reports an error, and the others still run;
/// the exit code is the first failure's, 0 when none failed.
#[derive(Debug, Default)]
pub struct FailureTally {
    first: Option<FailureKind>,
}

impl FailureTally {
    pub fn record(&mut self, error: &anyhow::Error) {
        eprintln!("error: {error:#}");
        self.first.get_or_insert(failure_kind(error));
    }

    pub fn exit_code(&self) -> ExitCode {
        self.first.map_or(ExitCode::SUCCESS, ExitCode::from)
    }
}

/// The request field that names a job, which a person gives on the command line.
const JOB_REFERENCE_FIELD: &str = "job_id";

/// Turns a gRPC status from `endpoint` into a failure a person can act on. `action` says
/// what was being done ("cannot get job j-1"), for the codes whose server message alone
/// lacks context.
pub fn status_failure(status: &tonic::Status, endpoint: &str, action: &str) -> ClientFailure {
    let message = status.message();
    match status.code() {
        Code::Unauthenticated => ClientFailure::new(
            FailureKind::Authentication,
            format!("token rejected by {endpoint}: {message} (set --token or CARVE_TOKEN)"),
        ),
        Code::PermissionDenied => ClientFailure::new(
            FailureKind::Authentication,
            format!("permission denied by {endpoint}: {message}"),
        ),
        // The server's message already names the thing: "job j-1 not found".
        Code::NotFound => ClientFailure::new(FailureKind::NotFound, message),
        // A job named by a prefix or name that fits several jobs: the command line is at
        // fault, and the message lists the candidates.
        Code::InvalidArgument if status_field(status) == Some(JOB_REFERENCE_FIELD) => {
            let reason = message
                .strip_prefix(JOB_REFERENCE_FIELD)
                .and_then(|rest| rest.strip_prefix(": "))
                .unwrap_or(message);
            ClientFailure::new(FailureKind::Usage, format!("{action}: {reason}"))
        }
        // The server's message names the field and the reason.
        Code::InvalidArgument => {
            ClientFailure::new(FailureKind::InvalidArgument, format!("{action}: {message}"))
        }
        Code::ResourceExhausted => ClientFailure::new(
            FailureKind::ResourceExhausted,
            format!("{action}: {message}"),
        ),
        Code::Unavailable => cannot_reach(endpoint, &unavailable_reason(status), IS_IT_RUNNING),
        // The call's own deadline (`--timeout`) passed: tonic gave up waiting, the
        // scheduler never answered.
        Code::Cancelled if deadline_passed(status) => cannot_reach(
            endpoint,
            "it did not answer within the call's deadline",
            "is it frozen or overloaded? --timeout sets the deadline; list every replica \
             in --endpoint so another can answer",
        ),
        // A status tonic made from a broken connection, not one the scheduler sent: the
        // scheduler was not reached. Plain http to a TLS port ends this way, the server
        // hanging up on a client that does not speak TLS; so does (CANCELLED) a TLS
        // connection the scheduler closed for want of a client certificate.
        Code::Unknown | Code::Internal | Code::Cancelled
            if std::error::Error::source(status).is_some() =>
        {
            let advice = if endpoint.starts_with("http://") {
                "if the scheduler serves TLS, use https://"
            } else {
                "if the scheduler requires client certificates, set --tls-cert and \
                 --tls-key; is it running?"
            };
            cannot_reach(endpoint, &unavailable_reason(status), advice)
        }
        Code::Unimplemented => ClientFailure::new(
            FailureKind::Other,
            format!(
                "{action}: the scheduler at {endpoint} does not implement this call (it is older than this carve): {message}"
            ),
        ),
        Code::DeadlineExceeded => ClientFailure::new(
            FailureKind::CannotConnect,
            format!("{action}: the scheduler at {endpoint} did not answer in time: {message}"),
        ),
        _ => ClientFailure::new(FailureKind::Other, format!("{action}: {message}")),
    }
}

/// Whether `status` is tonic's own for a call whose deadline passed before the
/// scheduler answered (a client-side `grpc-timeout`).
pub fn deadline_passed(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if error.is::<tonic::TimeoutExpired>() {
            return true;
        }
        source = error.source();
    }
    false
}

/// Whether `status` says the connection to the scheduler broke, or that it is a standby,
/// rather than that the scheduler refused the call: UNAVAILABLE, or a status tonic made
/// from a transport error (see [`status_failure`]). Another replica may answer the call.
pub fn connection_lost(status: &tonic::Status) -> bool {
    match status.code() {
        Code::Unavailable => true,
        Code::Unknown | Code::Internal | Code::Cancelled => {
            std::error::Error::source(status).is_some()
        }
        _ => false,
    }
}

/// The field an INVALID_ARGUMENT status names in its trailer.
fn status_field(status: &tonic::Status) -> Option<&str> {
    status
        .metadata()
        .get(carve_proto::status::FIELD_METADATA_KEY)
        .and_then(|value| value.to_str().ok())
}

/// The advice for a scheduler that did not answer, when nothing more precise is known.
pub const IS_IT_RUNNING: &str = "is it running? set --endpoint or CARVE_ENDPOINT";

/// The scheduler at `endpoint` was not reached, for `reason`; `advice` says what to check.
pub fn cannot_reach(endpoint: &str, reason: &str, advice: &str) -> ClientFailure {
    ClientFailure::new(
        FailureKind::CannotConnect,
        format!("cannot reach the scheduler at {endpoint}: {reason} ({advice})"),
    )
}

/// The deepest cause of an `Unavailable` status, which for a transport failure is the
/// operating system's words ("connection refused") rather than tonic's.
fn unavailable_reason(status: &tonic::Status) -> String {
    let mut deepest = None;
    let mut source = std::error::Error::source(status);
    while let Some(cause) = source {
        deepest = Some(cause.to_string());
        source = cause.source();
    }
    deepest.map_or_else(
        || status.message().to_string(),
        |cause| lower_os_error(&cause),
    )
}

/// "Connection refused (os error 111)" -> "connection refused".
pub fn lower_os_error(text: &str) -> String {
    let text = match text.find(" (os error") {
        Some(index) => &text[..index],
        None => text,
    };
    let mut characters = text.chars();
    match characters.next() {
        Some(first) => first.to_lowercase().chain(characters).collect(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The numbers scripts branch on, pinned here: every other file names a kind.
    #[test]
    fn every_failure_kind_keeps_its_exit_number() {
        let cases = [
            (FailureKind::Other, 1),
            (FailureKind::Usage, 2),
            (FailureKind::OutOfMemory, 3),
            (FailureKind::CannotConnect, 4),
            (FailureKind::Authentication, 5),
            (FailureKind::NotFound, 6),
            (FailureKind::InvalidArgument, 7),
            (FailureKind::ResourceExhausted, 8),
            (FailureKind::JobFailed, 10),
            (FailureKind::JobCancelled, 11),
            (FailureKind::Interrupted, 130),
        ];
        for (kind, number) in cases {
            assert_eq!(kind.exit_code(), number, "{kind:?}");
            assert_eq!(ExitCode::from(kind), ExitCode::from(number), "{kind:?}");
            let listed = format!("\n  {number:<3} ");
            assert!(EXIT_CODES_HELP.contains(&listed), "{kind:?}: {listed:?}");
        }
    }

    #[test]
    fn every_status_code_a_script_branches_on_gets_its_exit_code() {
        let cases = [
            (Code::Unauthenticated, 5),
            (Code::PermissionDenied, 5),
            (Code::NotFound, 6),
            (Code::InvalidArgument, 7),
            (Code::ResourceExhausted, 8),
            (Code::Unavailable, 4),
            (Code::FailedPrecondition, 1),
            (Code::Internal, 1),
        ];
        for (code, exit) in cases {
            let failure = status_failure(&tonic::Status::new(code, "x"), "http://h:1", "doing");
            assert_eq!(failure.kind.exit_code(), exit, "{code:?}");
        }
    }

    #[test]
    fn a_job_reference_that_names_several_jobs_is_a_usage_error() {
        let status = tonic::Status::from(carve_proto::ApiError::invalid_argument(
            "job_id",
            "\"again\" is ambiguous: it names 2 jobs: j-2 (again, queued), j-1 (again, failed)",
        ));
        let failure = status_failure(&status, "http://h:1", "cannot get job again");
        assert_eq!(failure.kind.exit_code(), 2);
        assert_eq!(
            failure.message,
            "cannot get job again: \"again\" is ambiguous: it names 2 jobs: \
             j-2 (again, queued), j-1 (again, failed)"
        );
        // Another field stays an invalid argument.
        let status = tonic::Status::from(carve_proto::ApiError::invalid_argument("tail", "x"));
        let failure = status_failure(&status, "http://h:1", "doing");
        assert_eq!(failure.kind.exit_code(), 7);
    }

    #[test]
    fn the_exit_code_comes_from_a_failure_anywhere_in_the_chain() {
        let error =
            anyhow::Error::new(ClientFailure::new(FailureKind::NotFound, "job j not found"))
                .context("while getting");
        assert_eq!(exit_code_for_error(&error), ExitCode::from(6));
        assert_eq!(
            exit_code_for_error(&anyhow::anyhow!("plain")),
            ExitCode::from(1)
        );
    }

    #[test]
    fn an_unauthenticated_status_says_which_setting_to_change() {
        let failure = status_failure(
            &tonic::Status::unauthenticated("token rejected"),
            "http://127.0.0.1:7470",
            "cannot list jobs",
        );
        assert_eq!(
            failure.message,
            "token rejected by http://127.0.0.1:7470: token rejected (set --token or CARVE_TOKEN)"
        );
    }

    #[test]
    fn a_broken_connection_is_a_scheduler_not_reached_and_plain_http_suggests_https() {
        let broken = tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::BrokenPipe,
            "Broken pipe (os error 32)",
        )));
        let failure = status_failure(&broken, "http://h:1", "cannot list jobs");
        assert_eq!(failure.kind, FailureKind::CannotConnect);
        assert_eq!(
            failure.message,
            "cannot reach the scheduler at http://h:1: broken pipe \
             (if the scheduler serves TLS, use https://)"
        );
        // The same code sent by the scheduler itself is not a connection failure.
        let sent = status_failure(&tonic::Status::unknown("x"), "http://h:1", "doing");
        assert_eq!(sent.kind, FailureKind::Other);
        assert!(connection_lost(&broken));
        assert!(connection_lost(&tonic::Status::unavailable("a standby")));
        assert!(!connection_lost(&tonic::Status::unknown("x")));
        assert!(!connection_lost(&tonic::Status::not_found(
            "job j-1 not found"
        )));
    }

    #[test]
    fn os_errors_read_as_lowercase_words() {
        assert_eq!(
            lower_os_error("Connection refused (os error 111)"),
            "connection refused"
        );
        assert_eq!(lower_os_error(""), "");
    }
}
