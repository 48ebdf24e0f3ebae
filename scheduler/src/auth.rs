//! Bearer tokens: generated here, shown once, stored only as SHA-256 hashes, and checked
//! on every call against the store (through a short-lived cache, see `authenticate`).

use std::time::Instant;

use carve_proto::ApiError;
use sha2::{Digest, Sha256};
use tonic::metadata::MetadataMap;

use crate::cache::ShortLivedCache;
use crate::error::SchedulerError;
pub use crate::store::Role;
use crate::store::{Store, TokenRecord};

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub tenant: String,
    pub role: Role,
    pub token_id: String,
    /// The token's description: who a job's submitter was, for accounting.
    pub token_description: String,
}

impl Caller {
    pub fn require(&self, allowed: &[Role]) -> Result<(), SchedulerError> {
        if allowed.contains(&self.role) {
            Ok(())
        } else {
            Err(SchedulerError::Api(ApiError::PermissionDenied(format!(
                "a {} token cannot do this (needs {})",
                self.role.name(),
                allowed
                    .iter()
                    .map(|role| role.name())
                    .collect::<Vec<_>>()
                    .join(" or ")
            ))))
        }
    }

    /// Whether the caller may see and touch `tenant`'s jobs.
    pub fn may_access_tenant(&self, tenant: &str) -> bool {
        self.role == Role::Admin || self.tenant == tenant
    }
}

/// A new secret: `carve_` and 64 hex digits of OS randomness.
pub fn generate_secret() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the operating system provides randomness");
    let mut secret = String::from("carve_");
    for byte in bytes {
        secret.push_str(&format!("{byte:02x}"));
    }
    secret
}

/// A new identifier with a prefix, e.g. `job-0190f3c2a1b24c7d8e9f`: time-ordered, so ids
/// sort roughly by creation.
pub fn generate_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::now_v7().simple())
}

pub fn hash_secret(secret: &str) -> Vec<u8> {
    Sha256::digest(secret.as_bytes()).to_vec()
}

/// Reads `authorization: Bearer <secret>` and finds its token: in `tokens` when it was
/// read from the store less than [`crate::cache::LOOKUP_TIME_TO_LIVE`] ago, else in the store.
///
/// Revoked and expired tokens are judged on every call, cached or not. A token revoked
/// through this scheduler is refused at once (the revoke invalidates its entry, see
/// `Scheduler::revoke_token`); one revoked through another replica, within
/// [`crate::cache::LOOKUP_TIME_TO_LIVE`]. Unknown secrets are never cached, so a token created anywhere
/// works at once.
///
/// A token that authenticates has its last use recorded in the store, unless `uses` says
/// this scheduler recorded it less than [`crate::cache::TOKEN_USE_RECORD_INTERVAL`] ago.
pub async fn authenticate(
    store: &Store,
    tokens: &ShortLivedCache<Vec<u8>, TokenRecord>,
    uses: &ShortLivedCache<String, ()>,
    metadata: &MetadataMap,
    now_ms: i64,
) -> Result<Caller, SchedulerError> {
    let header = metadata
        .get(carve_proto::client::AUTHORIZATION_METADATA_KEY)
        .ok_or_else(|| {
            ApiError::Unauthenticated("missing authorization metadata (bearer token)".into())
        })?
        .to_str()
        .map_err(|_| ApiError::Unauthenticated("authorization metadata is not text".into()))?;
    let secret = header
        .strip_prefix("Bearer ")
        .or_else(|| header.strip_prefix("bearer "))
        .ok_or_else(|| ApiError::Unauthenticated("authorization must be `Bearer <token>`".into()))?
        .trim();
    let secret_hash = hash_secret(secret);
    let token = match tokens.get(&secret_hash, Instant::now()) {
        Some(token) => token,
        None => {
            let ticket = tokens.begin_fill();
            let read_at = Instant::now();
            let token = store
                .find_token_by_hash(&secret_hash)
                .await?
                .ok_or_else(|| ApiError::Unauthenticated("token rejected".into()))?;
            tokens.insert(ticket, secret_hash, token.clone(), read_at);
            token
        }
    };
    let caller = caller_of_token(token, now_ms)?;
    record_use(store, uses, &caller.token_id, now_ms).await;
    Ok(caller)
}

/// Writes the token's last use, at most once per [`crate::cache::TOKEN_USE_RECORD_INTERVAL`] per token
/// and scheduler. A failed write is logged, not returned: the call it came with is
/// authenticated all the same, and the time is only for people.
async fn record_use(
    store: &Store,
    uses: &ShortLivedCache<String, ()>,
    token_id: &str,
    now_ms: i64,
) {
    let now = Instant::now();
    if uses.get(&token_id.to_string(), now).is_some() {
        return;
    }
    let ticket = uses.begin_fill();
    match store.record_token_use(token_id, now_ms).await {
        Ok(()) => uses.insert(ticket, token_id.to_string(), (), now),
        Err(error) => tracing::warn!(%error, token = token_id, "cannot record the token's use"),
    }
}

/// The caller a stored token stands for, if it is still valid at `now_ms`.
fn caller_of_token(token: TokenRecord, now_ms: i64) -> Result<Caller, SchedulerError> {
    if token.revoked {
        return Err(ApiError::Unauthenticated("token rejected: revoked".into()).into());
    }
    if token.expires_at_ms.is_some_and(|expires| expires <= now_ms) {
        return Err(ApiError::Unauthenticated("token rejected: expired".into()).into());
    }
    Ok(Caller {
        tenant: token.tenant,
        role: token.role,
        token_id: token.id,
        token_description: token.description,
    })
}
