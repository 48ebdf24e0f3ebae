//! Job images (issue 30) in the store: a tenant's secrets (`tenant_secrets`, the
//! registry credentials a job's `command.image_pull_secret` names) and the manifest
//! digest each job's image resolved to at its first pull (`job_image_digests`).
//!
//! Every secret statement names the tenant: no read or write of one tenant's secrets can
//! reach another's. A secret's value is read by two methods only:
//! [`Store::secret_value`], which placement calls for the assignment of an attempt that
//! needs it, and [`Store::secrets_with_values`], for sealing them again at start after a
//! key rotation; listings never select the column.

use std::collections::HashMap;

use super::{Store, is_foreign_key_violation, is_unique_violation};
use crate::error::SchedulerError;

/// The most job ids one `IN (...)` names.
const JOB_IDS_PER_STATEMENT: usize = 1000;

/// A secret as listings show it: never its value.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SecretRecord {
    pub tenant: String,
    pub name: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl Store {
    /// Stores `value` as `tenant`'s secret `name`; with `replace`, over an existing one
    /// (keeping its creation time). `AlreadyExists` when the name is taken and `replace`
    /// is false, `NotFound` when there is no such tenant.
    pub async fn create_secret(
        &self,
        tenant: &str,
        name: &str,
        value: &[u8],
        replace: bool,
        now_ms: i64,
    ) -> Result<SecretRecord, SchedulerError> {
        let conflict = if replace {
            "ON CONFLICT (tenant, name) DO UPDATE SET value = excluded.value, \
             updated_at_ms = excluded.updated_at_ms"
        } else {
            ""
        };
        let sql = format!(
            "INSERT INTO tenant_secrets (tenant, name, value, created_at_ms, updated_at_ms) \
             VALUES ($1, $2, $3, $4, $4) {conflict} \
             RETURNING tenant, name, created_at_ms, updated_at_ms"
        );
        let inserted: Result<SecretRecord, sqlx::Error> = with_pool!(self, pool => {
            sqlx::query_as(&sql)
                .bind(tenant)
                .bind(name)
                .bind(value)
                .bind(now_ms)
                .fetch_one(pool)
                .await
        });
        match inserted {
            Ok(record) => Ok(record),
            Err(error) if is_unique_violation(&error) => Err(SchedulerError::already_exists(
                "secret",
                format!("{tenant}/{name}"),
            )),
            Err(error) if is_foreign_key_violation(&error) => {
                Err(SchedulerError::not_found("tenant", tenant))
            }
            Err(error) => Err(error.into()),
        }
    }

    /// `tenant`'s secrets by name, without their values.
    pub async fn list_secrets(&self, tenant: &str) -> Result<Vec<SecretRecord>, SchedulerError> {
        let rows: Vec<SecretRecord> = with_pool!(self, pool => {
            sqlx::query_as(
                "SELECT tenant, name, created_at_ms, updated_at_ms FROM tenant_secrets \
                 WHERE tenant = $1 ORDER BY name",
            )
            .bind(tenant)
            .fetch_all(pool)
            .await?
        });
        Ok(rows)
    }

    /// Deletes `tenant`'s secret `name`; `NotFound` when it has none by that name.
    pub async fn delete_secret(&self, tenant: &str, name: &str) -> Result<(), SchedulerError> {
        let deleted = with_pool!(self, pool => {
            sqlx::query("DELETE FROM tenant_secrets WHERE tenant = $1 AND name = $2")
                .bind(tenant)
                .bind(name)
                .execute(pool)
                .await?
                .rows_affected()
        });
        if deleted == 0 {
            return Err(SchedulerError::not_found(
                "secret",
                format!("{tenant}/{name}"),
            ));
        }
        Ok(())
    }

    /// Whether `tenant` holds a secret named `name` (admission's check; the value is not
    /// read).
    pub async fn secret_exists(&self, tenant: &str, name: &str) -> Result<bool, SchedulerError> {
        let found: Option<(String,)> = with_pool!(self, pool => {
            sqlx::query_as("SELECT name FROM tenant_secrets WHERE tenant = $1 AND name = $2")
                .bind(tenant)
                .bind(name)
                .fetch_optional(pool)
                .await?
        });
        Ok(found.is_some())
    }

    /// The value of `tenant`'s secret `name`, `None` when it has none by that name. Only
    /// for an assignment that needs it: nothing else reads a secret's value.
    pub async fn secret_value(
        &self,
        tenant: &str,
        name: &str,
    ) -> Result<Option<Vec<u8>>, SchedulerError> {
        let found: Option<(Vec<u8>,)> = with_pool!(self, pool => {
            sqlx::query_as("SELECT value FROM tenant_secrets WHERE tenant = $1 AND name = $2")
                .bind(tenant)
                .bind(name)
                .fetch_optional(pool)
                .await?
        });
        Ok(found.map(|(value,)| value))
    }

    /// Every tenant's secrets with their values, for sealing them again after a key
    /// rotation (`sealed_secrets::seal_again`), the one other reader of values.
    pub async fn secrets_with_values(
        &self,
    ) -> Result<Vec<(String, String, Vec<u8>)>, SchedulerError> {
        let rows = with_pool!(self, pool => {
            sqlx::query_as("SELECT tenant, name, value FROM tenant_secrets ORDER BY tenant, name")
                .fetch_all(pool)
                .await?
        });
        Ok(rows)
    }

    /// Replaces `tenant`'s secret `name`'s value by `new` if it is still `expected` (a
    /// value its tenant replaced meanwhile stays); whether it did.
    pub async fn replace_secret_value_if(
        &self,
        tenant: &str,
        name: &str,
        expected: &[u8],
        new: &[u8],
    ) -> Result<bool, SchedulerError> {
        let replaced = with_pool!(self, pool => {
            sqlx::query(
                "UPDATE tenant_secrets SET value = $1 \
                 WHERE tenant = $2 AND name = $3 AND value = $4",
            )
            .bind(new)
            .bind(tenant)
            .bind(name)
            .bind(expected)
            .execute(pool)
            .await?
            .rows_affected()
        });
        Ok(replaced == 1)
    }

    /// Records `digest` as what `job_id`'s image resolved to, unless one is recorded
    /// already: the first stays, so every attempt runs the same bytes. Returns the digest
    /// the job keeps.
    pub async fn record_job_image_digest(
        &self,
        job_id: &str,
        digest: &str,
        now_ms: i64,
    ) -> Result<String, SchedulerError> {
        let kept: (String,) = with_write_tx!(self, tx => {
            sqlx::query(
                "INSERT INTO job_image_digests (job_id, digest, recorded_at_ms) \
                 VALUES ($1, $2, $3) ON CONFLICT (job_id) DO NOTHING",
            )
            .bind(job_id)
            .bind(digest)
            .bind(now_ms)
            .execute(&mut *tx)
            .await?;
            sqlx::query_as("SELECT digest FROM job_image_digests WHERE job_id = $1")
                .bind(job_id)
                .fetch_one(&mut *tx)
                .await?
        });
        Ok(kept.0)
    }

    /// The digest `job_id`'s image resolved to at its first pull, if one was reported.
    pub async fn job_image_digest(&self, job_id: &str) -> Result<Option<String>, SchedulerError> {
        let found: Option<(String,)> = with_pool!(self, pool => {
            sqlx::query_as("SELECT digest FROM job_image_digests WHERE job_id = $1")
                .bind(job_id)
                .fetch_optional(pool)
                .await?
        });
        Ok(found.map(|(digest,)| digest))
    }

    /// The recorded digests of those of `job_ids` that have one (a page of jobs at once).
    pub async fn job_image_digests(
        &self,
        job_ids: &[&str],
    ) -> Result<HashMap<String, String>, SchedulerError> {
        let mut digests = HashMap::new();
        for chunk in job_ids.chunks(JOB_IDS_PER_STATEMENT) {
            let placeholders = (1..=chunk.len())
                .map(|index| format!("${index}"))
                .collect::<Vec<_>>()
                .join(", ");
            let sql = format!(
                "SELECT job_id, digest FROM job_image_digests WHERE job_id IN ({placeholders})"
            );
            let rows: Vec<(String, String)> = with_pool!(self, pool => {
                let mut query = sqlx::query_as(&sql);
                for job_id in chunk {
                    query = query.bind(*job_id);
                }
                query.fetch_all(pool).await?
            });
            digests.extend(rows);
        }
        Ok(digests)
    }

    /// The recorded digests of the queued jobs (placement's preference for workers that
    /// hold a job's image): only jobs whose image was pulled before have a row.
    pub async fn queued_job_image_digests(&self) -> Result<Vec<(String, String)>, SchedulerError> {
        let rows: Vec<(String, String)> = with_pool!(self, pool => {
            sqlx::query_as(
                "SELECT images.job_id, images.digest FROM job_image_digests images \
                 JOIN jobs ON jobs.id = images.job_id WHERE jobs.state = $1",
            )
            .bind(carve_core::job_state::JobState::Queued.name())
            .fetch_all(pool)
            .await?
        });
        Ok(rows)
    }
}
