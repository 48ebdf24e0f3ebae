//! The durable store: tenants, tokens, jobs, attempts, workers, measured peaks and job
//! log lines, in SQLite (a file, the default) or PostgreSQL (`postgres://...`, for
//! production and several replicas).
//!
//! # One type over two pools
//!
//! [`Store`] holds an enum of a `SqlitePool` and a `PgPool`, and every method runs the
//! same SQL text on whichever it holds: the `with_pool!` / `with_write_tx!` macros expand
//! a method's body once per pool type, so each copy is type-checked against its own
//! driver. Both databases accept `$1` placeholders, `RETURNING` and
//! `ON CONFLICT ... DO NOTHING/UPDATE`, so the SQL is written once; only the schemas
//! (`migrations/sqlite`, `migrations/postgres`) differ. `sqlx::Any` was the alternative;
//! it was not chosen because its type mapping is lossy (booleans, blobs and nulls go
//! through its own value enum), it cannot express SQLite's per-connection settings
//! (`journal_mode`, `synchronous`, `busy_timeout`) as connect options, and it hides which
//! database a row came from in errors.
//!
//! # Durability
//!
//! SQLite runs in WAL mode with `synchronous = FULL`, so a commit is fsynced to the WAL
//! before it returns: an acknowledged write survives a power cut. Foreign keys are on
//! and a busy timeout makes writers wait for one another instead of failing. PostgreSQL
//! keeps its defaults (`fsync`, `synchronous_commit = on`). [`Store::durability_settings`]
//! reports what the database says, for the start-up log and the tests.
//!
//! Writers that read before they write take the write lock first, so concurrent
//! transactions queue instead of failing: SQLite write transactions start with
//! `BEGIN IMMEDIATE`, and a submit group starts by bumping the `submit_sequence` counter
//! row, which in PostgreSQL serializes submits across replicas until the group commits.
//!
//! # Group commit
//!
//! [`Store::submit_jobs`] writes a whole group of jobs in one transaction, so one flush
//! covers them all; [`SubmitBatcher`] gathers concurrent submits into such groups.
//!
//! Migrations are embedded with `sqlx::migrate!` and run at [`Store::open`]. Cargo does
//! not notice a new migration file by itself: touch this file (or `cargo clean -p
//! carve-scheduler`) after adding one.

use std::str::FromStr;
use std::time::Duration;

use carve_proto::ApiError;
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use crate::error::SchedulerError;

/// Runs `$body` with `$pool` bound to the store's pool, whichever database it is.
macro_rules! with_pool {
    ($store:expr, $pool:ident => $body:expr) => {
        match &$store.pools {
            $crate::store::Pools::Sqlite($pool) => $body,
            $crate::store::Pools::Postgres($pool) => $body,
        }
    };
}

/// Runs `$body` inside a write transaction `$tx` and commits it when `$body` finishes;
/// a `?` or `return` inside `$body` drops the transaction, which rolls it back. SQLite
/// transactions take the write lock at `BEGIN IMMEDIATE`, so they wait (busy timeout)
/// rather than fail when they later upgrade from reading to writing.
macro_rules! with_write_tx {
    ($store:expr, $tx:ident => $body:expr) => {
        match &$store.pools {
            $crate::store::Pools::Sqlite(pool) => {
                #[allow(unused_mut)]
                let mut $tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                let value = $body;
                $tx.commit().await?;
                value
            }
            $crate::store::Pools::Postgres(pool) => {
                #[allow(unused_mut)]
                let mut $tx = pool.begin().await?;
                let value = $body;
                $tx.commit().await?;
                value
            }
        }
    };
}

mod attempts;
mod batcher;
mod columns;
mod job_images;
mod job_pages;
mod jobs;
mod json_columns;
pub mod leadership;
mod logs;
mod memory_models;
mod peaks;
mod preemptions;
mod records;
mod tenants;
mod tokens;
mod usage;
mod usage_report;
mod workers;

pub use attempts::{AttemptEnd, AttemptEndDetails, AttemptStartDetails};
pub use batcher::SubmitBatcher;
pub use job_images::SecretRecord;
pub use job_pages::{page_token_after, shown_text_bytes};
pub use jobs::NewJob;
pub use jobs::{WAITING_REASON_IDS_PER_STATEMENT, WAITING_REASONS_PER_TRANSACTION};
pub use json_columns::{
    CONFIG_COLUMN, CorruptColumn, ESTIMATE_COLUMN, StoredCategoryBytes, StoredEstimate,
    StoredLayerBytes, WORKLOAD_COLUMN, config_from_json, config_to_json, estimate_from_json,
    estimate_to_json, workload_from_json, workload_to_json,
};
pub use logs::{
    DEFAULT_LOG_PAGE_SIZE, LOG_LEVELS, LogBatcher, LogBatcherSettings, LogLineRecord, LogPage,
    LogQuery, MAX_LOG_LINES_PER_JOB, MAX_LOG_MESSAGE_BYTES, MAX_LOG_PAGE_SIZE, NewLogLine,
    StoredJobEvent,
};
pub use memory_models::{MemoryModelRow, StoredMemoryModel};
pub use preemptions::{StoredClaim, StoredEviction, StoredPreemptions};
pub use records::{
    AttemptDetails, AttemptOutcome, AttemptRecord, AttemptResults, DEFAULT_PAGE_SIZE, JobFilter,
    JobRecord, JobState, MAX_PAGE_SIZE, OomSource, ProfilePoint, QueueFingerprint, QueuedJob, Role,
    SubmitOutcome, TenantRecord, TokenRecord, WorkerRecord, WorkerState,
};
pub use tenants::{MAX_TENANT_NAME_LENGTH, TenantDeletion, check_tenant_name};
pub use usage::UsageRecord;
pub use usage_report::UsageQuery;

static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");
static POSTGRES_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/postgres");

/// Which database a [`Store`] is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// How to open a store. `Default` suits both databases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// The most connections the pool opens (SQLite: 8 by default, PostgreSQL: 10).
    pub max_connections: Option<u32>,
    /// How long a SQLite connection waits for another's write lock before failing.
    pub sqlite_busy_timeout: Duration,
    /// How long PostgreSQL lets one of the pool's sessions sit inside a transaction
    /// without sending anything before it ends the session (PostgreSQL's
    /// `idle_in_transaction_session_timeout`). A replica frozen mid-transaction
    /// (SIGSTOP, a paused VM) otherwise holds its row locks for as long as its socket
    /// stays open, and the replica that leads after it waits on them forever: the new
    /// leader's log writes, and every read that flushes them first, such as a watch.
    /// The scheduler's transactions send their statements back to back, so a healthy
    /// one never comes near it.
    pub postgres_idle_in_transaction_timeout: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            max_connections: None,
            sqlite_busy_timeout: Duration::from_secs(10),
            postgres_idle_in_transaction_timeout: Duration::from_secs(10),
        }
    }
}

/// The scheduler's durable state, on SQLite or PostgreSQL. Cheap to clone (it holds a
/// connection pool); every clone shares the pool.
#[derive(Debug, Clone)]
pub struct Store {
    pub(crate) pools: Pools,
    /// The leader epoch placement and attempt writes are fenced with (see `leadership`),
    /// shared by every clone.
    fence: std::sync::Arc<std::sync::atomic::AtomicI64>,
}

#[derive(Debug, Clone)]
pub(crate) enum Pools {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

impl Store {
    /// Opens the store at `url` with default options and brings its schema up to date.
    /// See [`Store::open_with`].
    pub async fn open(url: &str) -> Result<Store, SchedulerError> {
        Store::open_with(url, &StoreOptions::default()).await
    }

    /// Opens the store at `url` and runs the migrations it has not run yet.
    ///
    /// `url` is `postgres://...` (or `postgresql://...`) for PostgreSQL, `sqlite:...` for
    /// a SQLite URL (`sqlite://carve.db`, `sqlite::memory:`), and otherwise the path of a
    /// SQLite file, created when missing.
    pub async fn open_with(url: &str, options: &StoreOptions) -> Result<Store, SchedulerError> {
        let store = if is_postgres_url(url) {
            let pool = PgPoolOptions::new()
                .max_connections(options.max_connections.unwrap_or(10))
                .acquire_timeout(Duration::from_secs(30))
                .connect_with(postgres_connect_options(url, options)?)
                .await?;
            POSTGRES_MIGRATOR.run(&pool).await?;
            Store {
                pools: Pools::Postgres(pool),
                fence: Default::default(),
            }
        } else {
            let connect_options = if url.starts_with("sqlite:") {
                SqliteConnectOptions::from_str(url)?
            } else if url.is_empty() {
                return Err(SchedulerError::invalid_argument(
                    "database_url",
                    "must not be empty",
                ));
            } else {
                SqliteConnectOptions::new().filename(url)
            };
            let connect_options = connect_options
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full)
                .foreign_keys(true)
                .busy_timeout(options.sqlite_busy_timeout)
                // Statement journals (what rolls back one multi-row statement inside a
                // transaction) in memory rather than in temporary files: a profile of
                // group commits showed ~10 % of the connection thread writing them to
                // disk. They are not part of durability: the WAL is.
                .pragma("temp_store", "memory");
            let in_memory = url.contains(":memory:") || url.contains("mode=memory");
            if !in_memory {
                create_private_database_file(connect_options.get_filename())?;
            }
            // No ping before each acquire: a connection to a local file cannot go stale,
            // and with sqlx-sqlite a ping is a round trip to the connection's thread,
            // as costly as a small query (about a tenth of a submit's CPU, measured by
            // carve-submit-bench).
            let mut pool_options = SqlitePoolOptions::new()
                .max_connections(options.max_connections.unwrap_or(8))
                .test_before_acquire(false);
            if in_memory {
                // An in-memory database lives as long as one connection to it does.
                pool_options = pool_options
                    .min_connections(1)
                    .idle_timeout(None)
                    .max_lifetime(None);
            }
            let pool = pool_options.connect_with(connect_options).await?;
            SQLITE_MIGRATOR.run(&pool).await?;
            Store {
                pools: Pools::Sqlite(pool),
                fence: Default::default(),
            }
        };
        Ok(store)
    }

    /// Which database this store is on.
    pub fn backend(&self) -> Backend {
        match &self.pools {
            Pools::Sqlite(_) => Backend::Sqlite,
            Pools::Postgres(_) => Backend::Postgres,
        }
    }

    /// Closes every connection, waiting for those in use to come back. Later calls fail.
    pub async fn close(&self) {
        with_pool!(self, pool => pool.close().await)
    }

    /// The settings durability depends on, as the database reports them on one of the
    /// pool's connections: for SQLite `journal_mode` (`wal`), `synchronous` (`full`),
    /// `foreign_keys` (`on`) and `busy_timeout_ms`; for PostgreSQL `fsync` and
    /// `synchronous_commit` (both `on`).
    pub async fn durability_settings(&self) -> Result<Vec<(String, String)>, SchedulerError> {
        match &self.pools {
            Pools::Sqlite(pool) => {
                let mut connection = pool.acquire().await?;
                let journal_mode: String = sqlx::query_scalar("PRAGMA journal_mode")
                    .fetch_one(&mut *connection)
                    .await?;
                let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
                    .fetch_one(&mut *connection)
                    .await?;
                let foreign_keys: i64 = sqlx::query_scalar("PRAGMA foreign_keys")
                    .fetch_one(&mut *connection)
                    .await?;
                let busy_timeout: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
                    .fetch_one(&mut *connection)
                    .await?;
                let synchronous = match synchronous {
                    0 => "off".to_string(),
                    1 => "normal".to_string(),
                    2 => "full".to_string(),
                    3 => "extra".to_string(),
                    other => other.to_string(),
                };
                let on_off = |value: i64| if value != 0 { "on" } else { "off" }.to_string();
                Ok(vec![
                    ("journal_mode".into(), journal_mode.to_lowercase()),
                    ("synchronous".into(), synchronous),
                    ("foreign_keys".into(), on_off(foreign_keys)),
                    ("busy_timeout_ms".into(), busy_timeout.to_string()),
                ])
            }
            Pools::Postgres(pool) => {
                let rows: Vec<(String, String)> = sqlx::query_as(
                    "SELECT name, setting FROM pg_settings \
                     WHERE name IN ('fsync', 'synchronous_commit') ORDER BY name",
                )
                .fetch_all(pool)
                .await?;
                Ok(rows)
            }
        }
    }
}

/// How long [`check_database`] waits for the database to answer when the scheduler
/// starts: long enough for a managed database across a region, short enough that a
/// wrong host is reported before anyone waits on a scheduler that cannot work.
pub const DATABASE_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether `url` names a PostgreSQL database rather than a SQLite one.
pub fn is_postgres_url(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// How the store connects to the PostgreSQL database at `url`: the URL's options, and
/// the session settings of [`StoreOptions`].
pub fn postgres_connect_options(
    url: &str,
    options: &StoreOptions,
) -> Result<PgConnectOptions, SchedulerError> {
    let idle_ms = options
        .postgres_idle_in_transaction_timeout
        .as_millis()
        .max(1);
    Ok(PgConnectOptions::from_str(url)?
        .options([("idle_in_transaction_session_timeout", idle_ms.to_string())]))
}

/// Checks that the PostgreSQL database at `url` answers a trivial query within
/// `timeout`, over one connection made as the pool would make it (TLS included, per
/// `sslmode`). The error names the host and port (never the URL, which may hold a
/// password). A SQLite URL passes: its file is opened, or refused, by [`Store::open`].
pub async fn check_database(url: &str, timeout: Duration) -> Result<(), SchedulerError> {
    if !is_postgres_url(url) {
        return Ok(());
    }
    // The pool's own options: what this connection meets is what the pool's will.
    let options = postgres_connect_options(url, &StoreOptions::default()).map_err(|error| {
        SchedulerError::invalid_argument(
            "database_url",
            format!("not a usable PostgreSQL URL: {error}"),
        )
    })?;
    let place = format!("{}:{}", options.get_host(), options.get_port());
    let answered = async {
        let mut connection = PgConnection::connect_with(&options).await?;
        let _: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut connection)
            .await?;
        connection.close().await
    };
    let reason = match tokio::time::timeout(timeout, answered).await {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(error)) => error.to_string(),
        Err(_) => format!("no answer within {} s", timeout.as_secs_f64()),
    };
    Err(SchedulerError::Api(ApiError::Unavailable(format!(
        "cannot reach the PostgreSQL database at {place}: {reason}"
    ))))
}

/// Creates a missing SQLite database file readable and writable by its owner alone
/// (0600; SQLite gives its `-wal` and `-shm` files the same mode). It holds token
/// hashes and every tenant's jobs, and SQLite would create it with the umask's mode,
/// usually 0644. An existing file is left as it is: whoever made it chose its mode.
fn create_private_database_file(path: &std::path::Path) -> Result<(), SchedulerError> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(error) => Err(SchedulerError::Api(ApiError::Unavailable(format!(
            "cannot create the database file {}: {error}",
            path.display()
        )))),
    }
}

/// What a failed INSERT of the `what` named `id` means: `AlreadyExists` when its key is
/// taken, `NotFound` for the missing row `parent` names (`(what, id)`) when a foreign key
/// refused it, and otherwise the database's error.
pub(crate) fn insert_error(
    error: sqlx::Error,
    what: &'static str,
    id: &str,
    parent: Option<(&'static str, &str)>,
) -> SchedulerError {
    match parent {
        _ if is_unique_violation(&error) => SchedulerError::already_exists(what, id),
        Some((parent, parent_id)) if is_foreign_key_violation(&error) => {
            SchedulerError::not_found(parent, parent_id)
        }
        _ => error.into(),
    }
}

/// Whether `error` is a violation of a unique index or primary key.
pub(crate) fn is_unique_violation(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .is_some_and(|database| database.is_unique_violation())
}

/// Whether `error` is a violation of a foreign key.
pub(crate) fn is_foreign_key_violation(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .is_some_and(|database| database.is_foreign_key_violation())
}
