//! The store's own limit: how fast plain `INSERT`s of a job row go through sqlx with the
//! scheduler's durability settings (SQLite: WAL, `synchronous=FULL`, foreign keys;
//! PostgreSQL: `fsync` and `synchronous_commit` on), into the scheduler's own `jobs`
//! table (created by its migrations, so the same columns, indexes and foreign key), one
//! connection, no gRPC, no admission, no idempotency lookups. One row per commit is the
//! flush limit; many rows per transaction is what group commit can approach.

use std::str::FromStr;
use std::time::{Duration, Instant};

use carve_scheduler::store::{JobRecord, Store, TenantRecord};
use serde::Serialize;
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqliteSynchronous};

use crate::{BenchError, DatabaseKind};

/// One connection to a benchmark database, opened the way the store opens its pool.
#[derive(Debug)]
pub enum DatabaseConnection {
    Sqlite(SqliteConnection),
    Postgres(PgConnection),
}

impl DatabaseConnection {
    pub async fn open(kind: DatabaseKind, url: &str) -> Result<DatabaseConnection, BenchError> {
        Ok(match kind {
            DatabaseKind::Sqlite => {
                let options = SqliteConnectOptions::from_str(&format!("sqlite://{url}"))?
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Full)
                    .foreign_keys(true)
                    .busy_timeout(Duration::from_secs(10));
                DatabaseConnection::Sqlite(SqliteConnection::connect_with(&options).await?)
            }
            DatabaseKind::Postgres => {
                DatabaseConnection::Postgres(PgConnection::connect(url).await?)
            }
        })
    }

    /// The single integer `sql` selects.
    pub async fn select_integer(&mut self, sql: &str) -> Result<i64, BenchError> {
        Ok(match self {
            DatabaseConnection::Sqlite(connection) => {
                sqlx::query_scalar(sql).fetch_one(connection).await?
            }
            DatabaseConnection::Postgres(connection) => {
                sqlx::query_scalar(sql).fetch_one(connection).await?
            }
        })
    }

    pub async fn close(self) {
        let _ = match self {
            DatabaseConnection::Sqlite(connection) => connection.close().await,
            DatabaseConnection::Postgres(connection) => connection.close().await,
        };
    }
}

const INSERT_JOB_SQL: &str = "INSERT INTO jobs (id, tenant, name, spec_json, state, priority, \
     submit_sequence, idempotency_key, config_json, estimate_json, required_bytes, \
     waiting_reason, message, created_at_ms, finished_at_ms, checkpoint_location, \
     attempts_count) VALUES \
     ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)";

/// Inserts `sample` (with its id, sequence and key replaced) inside `$executor`.
macro_rules! insert_job {
    ($executor:expr, $sample:expr, $sequence:expr) => {
        sqlx::query(INSERT_JOB_SQL)
            .bind(format!("job-baseline-{}", $sequence))
            .bind(&$sample.tenant)
            .bind(&$sample.name)
            .bind(&$sample.spec_json)
            .bind("queued")
            .bind($sample.priority)
            .bind($sequence)
            .bind(format!("baseline-{}", $sequence))
            .bind(&$sample.config_json)
            .bind(&$sample.estimate_json)
            .bind($sample.required_bytes)
            .bind("")
            .bind("")
            .bind($sample.created_at_ms)
            .bind(None::<i64>)
            .bind(None::<String>)
            .bind(0i64)
            .execute($executor)
            .await
    };
}

/// Rows a second of one baseline run.
#[derive(Debug, Clone, Serialize)]
pub struct StoreLimit {
    pub rows_per_transaction: usize,
    pub rows: u64,
    pub seconds: f64,
    pub rows_per_second: f64,
}

/// Creates the scheduler's schema at `url` (through [`Store::open`], which runs the
/// migrations) with the sample's tenant, then inserts copies of `sample`, committing every
/// `rows_per_transaction` rows, for `duration`.
pub async fn measure_store_limit(
    kind: DatabaseKind,
    url: &str,
    sample: &JobRecord,
    rows_per_transaction: usize,
    duration: Duration,
) -> Result<StoreLimit, BenchError> {
    if rows_per_transaction == 0 {
        return Err(BenchError::invalid_argument(
            "rows_per_transaction",
            "must be at least 1",
        ));
    }
    let store = Store::open(url).await?;
    store
        .create_tenant(&TenantRecord {
            name: sample.tenant.clone(),
            vram_quota_bytes: None,
            max_running_jobs: None,
            fair_share_weight: 1,
            created_at_ms: sample.created_at_ms,
        })
        .await?;
    store.close().await;
    let mut connection = DatabaseConnection::open(kind, url).await?;
    let start = Instant::now();
    let mut sequence: i64 = 0;
    // One commit of `rows_per_transaction` rows; a macro because the two connection
    // types share no trait that `insert_job!` could be written against.
    macro_rules! commit_rows {
        ($connection:expr) => {
            if rows_per_transaction == 1 {
                sequence += 1;
                insert_job!(&mut *$connection, sample, sequence)?;
            } else {
                let mut transaction = $connection.begin().await?;
                for _ in 0..rows_per_transaction {
                    sequence += 1;
                    insert_job!(&mut *transaction, sample, sequence)?;
                }
                transaction.commit().await?;
            }
        };
    }
    while start.elapsed() < duration {
        match &mut connection {
            DatabaseConnection::Sqlite(connection) => commit_rows!(connection),
            DatabaseConnection::Postgres(connection) => commit_rows!(connection),
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    connection.close().await;
    Ok(StoreLimit {
        rows_per_transaction,
        rows: sequence as u64,
        seconds,
        rows_per_second: sequence as f64 / seconds.max(1e-9),
    })
}
