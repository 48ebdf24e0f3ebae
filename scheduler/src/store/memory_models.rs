//! Command memory models, one per tenant and command shape (`command_memory_models`):
//! read for one job, for a page of jobs at once, written as a profile or a measurement
//! teaches them, and deleted when a tenant resets them. Every statement names the
//! tenant: no read or write of one tenant's models can reach another's.

use std::collections::HashMap;

use super::Store;
use crate::error::SchedulerError;

/// The most shape keys one `IN (...)` names: a whole page of jobs in one statement, well
/// under SQLite's and PostgreSQL's limits on parameters.
const KEYS_PER_STATEMENT: usize = 1000;

/// A stored model as its row has it: the JSON of core's `LearnedModel` and what it rests
/// on, for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMemoryModel {
    pub model_json: String,
    pub basis: String,
    pub updated_at_ms: i64,
}

/// One row of a tenant's models, as listings show them.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct MemoryModelRow {
    pub tenant: String,
    pub shape_key: String,
    pub model_json: String,
    pub basis: String,
    pub updated_at_ms: i64,
}

impl From<MemoryModelRow> for StoredMemoryModel {
    fn from(row: MemoryModelRow) -> Self {
        StoredMemoryModel {
            model_json: row.model_json,
            basis: row.basis,
            updated_at_ms: row.updated_at_ms,
        }
    }
}

impl Store {
    /// `tenant`'s memory model of the command shape `shape_key`, `None` when none was
    /// learned.
    pub async fn command_memory_model(
        &self,
        tenant: &str,
        shape_key: &str,
    ) -> Result<Option<StoredMemoryModel>, SchedulerError> {
        let row: Option<MemoryModelRow> = with_pool!(self, pool => {
            sqlx::query_as(
                "SELECT tenant, shape_key, model_json, basis, updated_at_ms \
                 FROM command_memory_models WHERE tenant = $1 AND shape_key = $2",
            )
            .bind(tenant)
            .bind(shape_key)
            .fetch_optional(pool)
            .await?
        });
        Ok(row.map(StoredMemoryModel::from))
    }

    /// Stores (or replaces) `tenant`'s memory model of the command shape `shape_key`.
    pub async fn put_command_memory_model(
        &self,
        tenant: &str,
        shape_key: &str,
        model_json: &str,
        basis: &str,
        at_ms: i64,
    ) -> Result<(), SchedulerError> {
        with_pool!(self, pool => {
            sqlx::query(
                "INSERT INTO command_memory_models \
                 (tenant, shape_key, model_json, basis, updated_at_ms) \
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tenant, shape_key) DO UPDATE SET \
                 model_json = excluded.model_json, basis = excluded.basis, \
                 updated_at_ms = excluded.updated_at_ms",
            )
            .bind(tenant)
            .bind(shape_key)
            .bind(model_json)
            .bind(basis)
            .bind(at_ms)
            .execute(pool)
            .await?
            .rows_affected()
        });
        Ok(())
    }

    /// The models stored for each `(tenant, shape_key)` of `keys`, by that pair; a pair
    /// with no model has no entry. One statement per tenant (and per
    /// [`KEYS_PER_STATEMENT`] shapes of it): a page of one tenant's jobs is one query.
    pub async fn command_memory_models(
        &self,
        keys: &[(&str, &str)],
    ) -> Result<HashMap<(String, String), StoredMemoryModel>, SchedulerError> {
        let mut by_tenant: HashMap<&str, Vec<&str>> = HashMap::new();
        for (tenant, shape_key) in keys {
            by_tenant.entry(tenant).or_default().push(shape_key);
        }
        let mut models = HashMap::new();
        for (tenant, shape_keys) in by_tenant {
            for chunk in shape_keys.chunks(KEYS_PER_STATEMENT) {
                let rows: Vec<MemoryModelRow> = with_pool!(self, pool => {
                    let mut query = sqlx::QueryBuilder::new(
                        "SELECT tenant, shape_key, model_json, basis, updated_at_ms \
                         FROM command_memory_models WHERE tenant = ",
                    );
                    query.push_bind(tenant.to_string());
                    query.push(" AND shape_key IN (");
                    let mut separated = query.separated(", ");
                    for key in chunk {
                        separated.push_bind(key.to_string());
                    }
                    separated.push_unseparated(")");
                    query.build_query_as().fetch_all(pool).await?
                });
                for row in rows {
                    models.insert((row.tenant.clone(), row.shape_key.clone()), row.into());
                }
            }
        }
        Ok(models)
    }

    /// Deletes `tenant`'s model of `shape_key`, or every model of `tenant` when
    /// `shape_key` is `None`; returns how many were deleted.
    pub async fn delete_command_memory_models(
        &self,
        tenant: &str,
        shape_key: Option<&str>,
    ) -> Result<u64, SchedulerError> {
        Ok(with_pool!(self, pool => {
            match shape_key {
                Some(shape_key) => sqlx::query(
                    "DELETE FROM command_memory_models WHERE tenant = $1 AND shape_key = $2",
                )
                .bind(tenant)
                .bind(shape_key)
                .execute(pool)
                .await?
                .rows_affected(),
                None => sqlx::query("DELETE FROM command_memory_models WHERE tenant = $1")
                    .bind(tenant)
                    .execute(pool)
                    .await?
                    .rows_affected(),
            }
        }))
    }
}
