//! What every program that talks to or runs a Carve server shares, so it is written once:
//! the bearer token each call carries (`authorization: Bearer <secret>`, the one header
//! the scheduler's `auth.rs` reads), the authenticated channel to a scheduler (endpoint,
//! TLS and that token), and the shutdown signal the three binaries' servers and loops
//! stop on.

use std::time::Duration;

use tonic::Request;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::ApiError;
use crate::v1;
use crate::v1::admin_service_client::AdminServiceClient;

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

/// A channel whose every call carries a bearer token: what `connect` opens, for the
/// generated clients (`JobServiceClient::new(channel)`).
pub type AuthenticatedChannel = InterceptedService<Channel, BearerToken>;

/// A client's own certificate chain and private key (PEM), shown to a scheduler that
/// requires client certificates (mutual TLS, its `--tls-client-ca`).
#[derive(Clone)]
pub struct ClientIdentity {
    pub certificate_chain_pem: Vec<u8>,
    pub private_key_pem: Vec<u8>,
}

impl std::fmt::Debug for ClientIdentity {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        formatter
            .debug_struct("ClientIdentity")
            .field(
                "certificate_chain_pem",
                &format!("{} bytes", self.certificate_chain_pem.len()),
            )
            .finish_non_exhaustive()
    }
}

/// How often a client's channel pings the scheduler over HTTP/2 ([`connect`]).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);

/// How long a ping may go unanswered before the channel's connection is closed.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Opens a channel to the scheduler at `endpoint` whose calls carry `token`. An https://
/// endpoint is reached over TLS, trusting `ca_certificate_pem` (a private authority or a
/// self-signed certificate) when given and the system's roots otherwise, and showing
/// `client_identity` when given (mutual TLS; an http:// endpoint with one is an
/// `InvalidArgument` on `tls_cert`, since it would never be shown).
///
/// A malformed endpoint is an `InvalidArgument` on `endpoint`, an unusable certificate
/// one on `ca_cert`; a scheduler that cannot be reached in `connect_timeout` is
/// `Unavailable`, its message the innermost cause (the operating system's or the TLS
/// library's words, where tonic's own say only "transport error").
pub async fn connect(
    endpoint: &str,
    ca_certificate_pem: Option<&[u8]>,
    client_identity: Option<&ClientIdentity>,
    token: BearerToken,
    connect_timeout: Duration,
) -> Result<AuthenticatedChannel, ApiError> {
    let mut builder = Endpoint::from_shared(endpoint.to_string())
        .map_err(|error| {
            ApiError::invalid_argument(
                "endpoint",
                format!("{endpoint:?} is not an address: {error}"),
            )
        })?
        .connect_timeout(connect_timeout)
        // A peer that froze (SIGSTOP) or vanished without a FIN leaves the connection
        // standing: a worker would keep its session with a leader that cannot act, and
        // a call would wait on it for as long as the freeze. HTTP/2 pings find it out
        // within the interval and the timeout, idle or not.
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true);
    if endpoint.starts_with("https://") {
        let mut tls = match ca_certificate_pem {
            Some(pem) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)),
            None => ClientTlsConfig::new().with_native_roots(),
        };
        if let Some(identity) = client_identity {
            tls = tls.identity(Identity::from_pem(
                &identity.certificate_chain_pem,
                &identity.private_key_pem,
            ));
        }
        builder = builder.tls_config(tls).map_err(|error| match client_identity {
            Some(_) => ApiError::invalid_argument(
                "tls_cert",
                format!("cannot set up tls with the ca certificate and client certificate and key: {error}"),
            ),
            None => ApiError::invalid_argument("ca_cert", format!("cannot set up tls: {error}")),
        })?;
    } else if client_identity.is_some() {
        return Err(ApiError::invalid_argument(
            "tls_cert",
            format!("a client certificate is given but the endpoint {endpoint} is not https://"),
        ));
    }
    let channel = builder
        .connect()
        .await
        .map_err(|error| ApiError::Unavailable(deepest_cause(&error)))?;
    Ok(InterceptedService::new(channel, token))
}

/// The schedulers a comma-separated `endpoints` list names, in order, for clients that
/// fail over (the worker's `--scheduler a,b,c`, carve's `--endpoint a,b,c`): each entry
/// as given, except that an `http://` name resolving to several addresses stands for
/// each of them (one per replica behind a DNS name, e.g. a Kubernetes headless service),
/// since any of them may be the leader. An `https://` name stays one entry (its
/// certificate names the host, not the addresses); the connection tries its addresses
/// in turn when one refuses. A name that does not resolve stays as given, so connecting
/// reports why.
pub async fn failover_endpoints(endpoints: &str) -> Vec<String> {
    let mut expanded = Vec::new();
    for endpoint in endpoints
        .split(',')
        .map(str::trim)
        .filter(|text| !text.is_empty())
    {
        for one in resolve_http_endpoint(endpoint).await {
            if !expanded.contains(&one) {
                expanded.push(one);
            }
        }
    }
    expanded
}

/// `endpoint`, or one `http://ADDRESS` per address its name resolves to.
async fn resolve_http_endpoint(endpoint: &str) -> Vec<String> {
    let as_given = vec![endpoint.to_string()];
    let Some(rest) = endpoint.strip_prefix("http://") else {
        return as_given;
    };
    let authority = rest.split('/').next().unwrap_or(rest);
    let Ok(uri) = format!("http://{authority}").parse::<tonic::codegen::http::Uri>() else {
        return as_given;
    };
    let (Some(host), Some(port)) = (uri.host(), uri.port_u16()) else {
        return as_given;
    };
    if host.parse::<std::net::IpAddr>().is_ok() || host.starts_with('[') {
        return as_given;
    }
    match tokio::net::lookup_host((host, port)).await {
        Ok(addresses) => {
            let resolved: Vec<String> = addresses
                .map(|address| format!("http://{address}"))
                .collect();
            if resolved.len() > 1 {
                resolved
            } else {
                as_given
            }
        }
        Err(_) => as_given,
    }
}

/// The innermost cause of an error.
fn deepest_cause(error: &(dyn std::error::Error + 'static)) -> String {
    let mut deepest = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        deepest = cause.to_string();
        source = cause.source();
    }
    deepest
}

/// Creates `tenant` with `quota` (keeping one that exists already, as in a reused data
/// directory) and one token for each of `roles`, in order, described by `description`;
/// returns their secrets. `admin` must carry an admin token. A scheduler that was just
/// started may answer UNAVAILABLE for a moment: the tenant is asked for again for up to
/// 30 seconds.
pub async fn create_tenant_with_tokens(
    admin: AuthenticatedChannel,
    tenant: &str,
    quota: v1::Quota,
    roles: &[v1::Role],
    description: &str,
) -> Result<Vec<String>, tonic::Status> {
    let mut admin = AdminServiceClient::new(admin);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let created = admin
            .create_tenant(v1::CreateTenantRequest {
                name: tenant.into(),
                quota: Some(quota),
            })
            .await;
        match created {
            Ok(_) => break,
            Err(status) if status.code() == tonic::Code::AlreadyExists => break,
            Err(status)
                if status.code() == tonic::Code::Unavailable
                    && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(status) => return Err(status),
        }
    }
    let mut secrets = Vec::with_capacity(roles.len());
    for role in roles {
        let created = admin
            .create_token(v1::CreateTokenRequest {
                tenant: tenant.into(),
                role: *role as i32,
                description: description.into(),
                time_to_live: None,
            })
            .await?;
        secrets.push(created.into_inner().secret);
    }
    Ok(secrets)
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
