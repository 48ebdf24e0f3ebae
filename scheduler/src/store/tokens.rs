//! Bearer tokens, stored by the hash of their secret.

use super::{Store, TokenRecord, insert_error};
use crate::error::SchedulerError;

pub(super) const TOKEN_COLUMNS: &str = "id, tenant, role, secret_hash, description, created_at_ms, \
     expires_at_ms, revoked, revoked_at_ms, last_used_at_ms";

impl Store {
    /// Stores a token. `AlreadyExists` when its id or its secret hash is taken.
    pub async fn create_token(&self, token: &TokenRecord) -> Result<(), SchedulerError> {
        if token.secret_hash.is_empty() {
            return Err(SchedulerError::invalid_argument(
                "secret_hash",
                "must not be empty",
            ));
        }
        let result = with_pool!(self, pool => {
            sqlx::query(
                "INSERT INTO tokens (id, tenant, role, secret_hash, description, \
                 created_at_ms, expires_at_ms, revoked, revoked_at_ms, last_used_at_ms) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            )
            .bind(&token.id)
            .bind(&token.tenant)
            .bind(token.role.name())
            .bind(&token.secret_hash)
            .bind(&token.description)
            .bind(token.created_at_ms)
            .bind(token.expires_at_ms)
            .bind(token.revoked)
            .bind(token.revoked_at_ms)
            .bind(token.last_used_at_ms)
            .execute(pool)
            .await
            .map(drop)
        });
        result.map_err(|error| insert_error(error, "token", &token.id, None))
    }

    /// The token whose secret hashes to `secret_hash`, revoked or expired ones included
    /// (the caller decides what those mean); `None` when no token has that hash.
    pub async fn find_token_by_hash(
        &self,
        secret_hash: &[u8],
    ) -> Result<Option<TokenRecord>, SchedulerError> {
        let sql = format!("SELECT {TOKEN_COLUMNS} FROM tokens WHERE secret_hash = $1");
        Ok(with_pool!(self, pool => {
            sqlx::query_as(&sql).bind(secret_hash).fetch_optional(pool).await?
        }))
    }

    /// The token with this id, revoked or expired included; `NotFound` when there is none.
    pub async fn get_token(&self, id: &str) -> Result<TokenRecord, SchedulerError> {
        let sql = format!("SELECT {TOKEN_COLUMNS} FROM tokens WHERE id = $1");
        let token: Option<TokenRecord> = with_pool!(self, pool => {
            sqlx::query_as(&sql).bind(id).fetch_optional(pool).await?
        });
        token.ok_or_else(|| SchedulerError::not_found("token", id))
    }

    /// Tokens of `tenant` (every token when `None`), newest first, revoked ones included.
    pub async fn list_tokens(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<TokenRecord>, SchedulerError> {
        const ORDER: &str = "ORDER BY created_at_ms DESC, id DESC";
        Ok(match tenant {
            Some(tenant) => {
                let sql = format!("SELECT {TOKEN_COLUMNS} FROM tokens WHERE tenant = $1 {ORDER}");
                with_pool!(self, pool => {
                    sqlx::query_as(&sql).bind(tenant).fetch_all(pool).await?
                })
            }
            None => {
                let sql = format!("SELECT {TOKEN_COLUMNS} FROM tokens {ORDER}");
                with_pool!(self, pool => sqlx::query_as(&sql).fetch_all(pool).await?)
            }
        })
    }

    /// Revokes a token at `now_ms` and returns it. Revoking a revoked token changes
    /// nothing (it keeps its first revoke time); `NotFound` when there is no such token.
    pub async fn revoke_token(&self, id: &str, now_ms: i64) -> Result<TokenRecord, SchedulerError> {
        let sql = format!(
            "UPDATE tokens SET revoked = $2, revoked_at_ms = COALESCE(revoked_at_ms, $3) \
             WHERE id = $1 RETURNING {TOKEN_COLUMNS}"
        );
        let token: Option<TokenRecord> = with_pool!(self, pool => {
            sqlx::query_as(&sql).bind(id).bind(true).bind(now_ms).fetch_optional(pool).await?
        });
        token.ok_or_else(|| SchedulerError::not_found("token", id))
    }

    /// Records that the token `id` authenticated a call at `used_at_ms`. Never moves the
    /// time back (two replicas may record out of order); an unknown id changes nothing.
    pub async fn record_token_use(&self, id: &str, used_at_ms: i64) -> Result<(), SchedulerError> {
        with_pool!(self, pool => {
            sqlx::query(
                "UPDATE tokens SET last_used_at_ms = $2 \
                 WHERE id = $1 AND (last_used_at_ms IS NULL OR last_used_at_ms < $2)",
            )
            .bind(id)
            .bind(used_at_ms)
            .execute(pool)
            .await?;
        });
        Ok(())
    }
}
