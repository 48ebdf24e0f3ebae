//! What every program that talks to or runs a Carve server shares, so it is written once:
//! the bearer token each call carries (`authorization: Bearer <secret>`, the one header
//! the scheduler's `auth.rs` reads), and the shutdown signal the three binaries' servers
//! and loops stop on.

use tonic::Request;
use tonic::metadata::{Ascii, MetadataValue};

use crate::ApiError;

/// The metadata key the scheduler reads the token from.
pub const AUTHORIZATION_METADATA_KEY: &str = "authorization";

/// A token's `authorization` metadata, checked once and added to each request.
///
/// It is also a tonic interceptor (`Client::with_interceptor(channel, token)`), for
/// clients that authenticate every call.
#[derive(Debug, Clone)]
pub struct BearerToken {
    header_value: MetadataValue<Ascii>,
}

impl BearerToken {
    /// A token must be printable ASCII without spaces, since it travels as an HTTP/2
    /// header; anything else is an `InvalidArgument` naming the `token` field.
    pub fn new(token: &str) -> Result<BearerToken, ApiError> {
        let header_value = MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| {
            ApiError::invalid_argument("token", "must be printable ascii without spaces")
        })?;
        Ok(BearerToken { header_value })
    }

    /// `message` as a request that carries the token.
    pub fn request<T>(&self, message: T) -> Request<T> {
        self.authorize(Request::new(message))
    }

    /// `request` with the token's metadata (replacing any it had).
    pub fn authorize<T>(&self, mut request: Request<T>) -> Request<T> {
        request
            .metadata_mut()
            .insert(AUTHORIZATION_METADATA_KEY, self.header_value.clone());
        request
    }
}

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, tonic::Status> {
        Ok(self.authorize(request))
    }
}

/// `message` as a request carrying `token`, for one-off calls.
pub fn authorized_request<T>(message: T, token: &str) -> Result<Request<T>, ApiError> {
    Ok(BearerToken::new(token)?.request(message))
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (what systemd, Docker and Kubernetes send).
///
/// SIGTERM's handler is installed when this is called, not when the future is first
/// polled, so a SIGTERM that arrives in between still stops the program gracefully. Must
/// be called inside a tokio runtime. Where SIGTERM cannot be watched, Ctrl-C alone stops.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    let terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    async move {
        match terminate {
            Some(mut terminate) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = terminate.recv() => {}
                }
            }
            None => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tonic::service::Interceptor;

    use super::*;

    #[test]
    fn a_request_carries_the_bearer_header() {
        let request = authorized_request(5_u32, "carve_abc123").expect("a valid token");
        assert_eq!(
            request.metadata().get(AUTHORIZATION_METADATA_KEY).unwrap(),
            "Bearer carve_abc123"
        );
        let mut interceptor = BearerToken::new("other").expect("a valid token");
        let intercepted = interceptor.call(Request::new(())).expect("never refuses");
        assert_eq!(
            intercepted
                .metadata()
                .get(AUTHORIZATION_METADATA_KEY)
                .unwrap(),
            "Bearer other"
        );
    }

    #[test]
    fn a_token_that_cannot_be_a_header_names_the_field() {
        let error = BearerToken::new("line\nbreak").expect_err("a newline is not a header");
        assert_eq!(
            error.to_string(),
            ApiError::invalid_argument("token", "must be printable ascii without spaces")
                .to_string()
        );
        assert!(error.to_string().contains("token"), "{error}");
    }

    #[tokio::test]
    async fn the_shutdown_signal_resolves_on_sigterm() {
        let signal = shutdown_signal();
        // The handler is installed already, so raising SIGTERM now does not kill the test.
        std::process::Command::new("kill")
            .args(["-TERM", &std::process::id().to_string()])
            .status()
            .expect("kill runs");
        tokio::time::timeout(std::time::Duration::from_secs(10), signal)
            .await
            .expect("the signal resolves");
    }
}
