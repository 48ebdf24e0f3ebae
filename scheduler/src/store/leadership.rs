//! Leadership among scheduler replicas on one PostgreSQL database: the lease row
//! (`leadership`, one row with an epoch) and the fence that placement and attempt writes
//! check, so that a deposed leader (paused, partitioned, slow to notice) can never place
//! a job or end an attempt after another replica took over.
//!
//! The lease is timed by the database's clock (`clock_timestamp()`), so replicas' clocks
//! need not agree. A takeover raises the epoch by one; a fenced write locks the row
//! `FOR SHARE` and compares its epoch with the writer's, so a takeover (an `UPDATE` of
//! the row) waits for fenced writes in flight and every later one sees the new epoch.

use std::sync::atomic::Ordering;
use std::time::Duration;

use carve_proto::ApiError;

use super::{Pools, Store};
use crate::error::SchedulerError;

/// The fence of a store whose writes are not fenced: SQLite, and stores used without
/// leadership (tests, tools).
pub(crate) const UNFENCED: i64 = 0;

/// The fence of a replica that does not lead: every fenced write is refused.
pub(crate) const NOT_LEADING: i64 = -1;

/// The database's clock, in milliseconds since the Unix epoch.
const DATABASE_NOW_MS: &str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT";

/// The leadership row: who leads (or last led) and until when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeadershipRecord {
    pub epoch: i64,
    pub holder: String,
    pub endpoint: String,
    /// Whether its lease still runs, by the database's clock.
    pub current: bool,
    /// How long its lease still runs, by the database's clock (zero once it ran out):
    /// when a standby tries to take over next.
    pub lease_left: Duration,
}

/// The error of a fenced write refused because `fence` is no longer the leader's epoch.
pub(crate) fn deposed(fence: i64, stored: Option<i64>) -> SchedulerError {
    SchedulerError::Api(ApiError::Unavailable(match (fence, stored) {
        (NOT_LEADING, _) => "this scheduler replica is a standby: only the leader places jobs \
                             and ends attempts"
            .to_string(),
        (_, Some(stored)) => format!(
            "this scheduler replica no longer leads (it led under epoch {fence}; \
             the leader's epoch is {stored})"
        ),
        (_, None) => "the leadership row is missing".to_string(),
    }))
}

/// Refuses (returns the error of) a write in transaction `$tx` when the store's fence is
/// not the current leader's epoch; nothing is checked on an unfenced store.
macro_rules! check_fence {
    ($store:expr, $tx:ident) => {
        let fence = $store.fence_epoch();
        if fence != $crate::store::leadership::UNFENCED {
            let stored: Option<i64> =
                sqlx::query_scalar("SELECT epoch FROM leadership WHERE id = 1 FOR SHARE")
                    .fetch_optional(&mut *$tx)
                    .await?;
            if stored != Some(fence) {
                return Err($crate::store::leadership::deposed(fence, stored));
            }
        }
    };
}
pub(crate) use check_fence;

impl Store {
    /// Fences this store's placement and attempt writes (every clone's) with `epoch`:
    /// `Some` while this replica leads under it, `None` while it does not (they are
    /// refused). A store never fenced writes unchecked.
    pub fn set_leader_epoch(&self, epoch: Option<i64>) {
        self.fence
            .store(epoch.unwrap_or(NOT_LEADING), Ordering::SeqCst);
    }

    /// The epoch fenced writes carry ([`UNFENCED`], [`NOT_LEADING`] or an epoch).
    pub(crate) fn fence_epoch(&self) -> i64 {
        self.fence.load(Ordering::SeqCst)
    }

    /// Takes the leadership for `holder` when nobody's lease runs (or `holder`'s own ran
    /// out), for `lease`: returns the new epoch, or `None` when another replica leads.
    /// PostgreSQL only (a SQLite store is never shared).
    pub async fn try_take_leadership(
        &self,
        holder: &str,
        endpoint: &str,
        lease: Duration,
    ) -> Result<Option<i64>, SchedulerError> {
        let pool = self.postgres_pool()?;
        let epoch: Option<i64> = sqlx::query_scalar(&format!(
            "UPDATE leadership SET epoch = epoch + 1, holder = $1, endpoint = $2, \
             expires_at_ms = {DATABASE_NOW_MS} + $3 \
             WHERE id = 1 AND expires_at_ms < {DATABASE_NOW_MS} RETURNING epoch"
        ))
        .bind(holder)
        .bind(endpoint)
        .bind(lease_ms(lease))
        .fetch_optional(pool)
        .await?;
        Ok(epoch)
    }

    /// Extends `holder`'s lease under `epoch` by `lease` from now; `false` when it no
    /// longer holds it (another replica took over).
    pub async fn renew_leadership(
        &self,
        holder: &str,
        epoch: i64,
        lease: Duration,
    ) -> Result<bool, SchedulerError> {
        let pool = self.postgres_pool()?;
        let updated = sqlx::query(&format!(
            "UPDATE leadership SET expires_at_ms = {DATABASE_NOW_MS} + $3 \
             WHERE id = 1 AND holder = $1 AND epoch = $2"
        ))
        .bind(holder)
        .bind(epoch)
        .bind(lease_ms(lease))
        .execute(pool)
        .await?
        .rows_affected();
        Ok(updated == 1)
    }

    /// Ends `holder`'s lease under `epoch` now, so a standby takes over at once (a
    /// graceful stop). Nothing happens when it no longer holds it.
    pub async fn release_leadership(&self, holder: &str, epoch: i64) -> Result<(), SchedulerError> {
        let pool = self.postgres_pool()?;
        sqlx::query(
            "UPDATE leadership SET expires_at_ms = 0 WHERE id = 1 AND holder = $1 AND epoch = $2",
        )
        .bind(holder)
        .bind(epoch)
        .execute(pool)
        .await?;
        Ok(())
    }

    /// The leadership row as it is now.
    pub async fn leadership(&self) -> Result<LeadershipRecord, SchedulerError> {
        let pool = self.postgres_pool()?;
        let (epoch, holder, endpoint, left_ms): (i64, String, String, i64) =
            sqlx::query_as(&format!(
                "SELECT epoch, holder, endpoint, expires_at_ms - {DATABASE_NOW_MS} \
                 FROM leadership WHERE id = 1"
            ))
            .fetch_one(pool)
            .await?;
        Ok(LeadershipRecord {
            epoch,
            holder,
            endpoint,
            current: left_ms >= 0,
            lease_left: Duration::from_millis(u64::try_from(left_ms).unwrap_or(0)),
        })
    }

    fn postgres_pool(&self) -> Result<&sqlx::PgPool, SchedulerError> {
        match &self.pools {
            Pools::Postgres(pool) => Ok(pool),
            Pools::Sqlite(_) => Err(SchedulerError::Api(ApiError::FailedPrecondition(
                "leadership is for replicas on PostgreSQL; SQLite is single-node".into(),
            ))),
        }
    }
}

fn lease_ms(lease: Duration) -> i64 {
    i64::try_from(lease.as_millis()).unwrap_or(i64::MAX / 4)
}

/// Holds an exclusive SQLite lock on a small database beside a SQLite store
/// (`<database>.lock`) for as long as the scheduler runs, so a second scheduler on the
/// same file is refused: the store's own locks let two processes share it (WAL), and two
/// schedulers would each place the same jobs. The lock is SQLite's (exclusive locking
/// mode, kept by one open connection), so the operating system drops it when the process
/// dies, however it dies.
#[derive(Debug)]
pub struct SingleNodeLock {
    connection: sqlx::SqliteConnection,
}

impl SingleNodeLock {
    /// Locks the file beside the SQLite database `database_file`, or says that another
    /// scheduler holds it.
    pub async fn acquire(
        database_file: &std::path::Path,
    ) -> Result<SingleNodeLock, SchedulerError> {
        use sqlx::ConnectOptions;
        let mut path = database_file.as_os_str().to_owned();
        path.push(".lock");
        let path = std::path::PathBuf::from(path);
        // SQLITE_BUSY, at the connection's first statements or at the lock itself:
        // another process holds the lock.
        let failed = |error: sqlx::Error| {
            let busy = error
                .as_database_error()
                .and_then(|database| database.code())
                .is_some_and(|code| code == "5");
            SchedulerError::Api(if busy {
                ApiError::FailedPrecondition(format!(
                    "another carve-scheduler already runs on the SQLite database {} \
                     (it holds {}): SQLite is single-node; run several replicas on \
                     PostgreSQL instead",
                    database_file.display(),
                    path.display()
                ))
            } else {
                ApiError::Unavailable(format!("cannot lock {}: {error}", path.display()))
            })
        };
        let mut connection = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Delete)
            .locking_mode(sqlx::sqlite::SqliteLockingMode::Exclusive)
            .busy_timeout(Duration::ZERO)
            .connect()
            .await
            .map_err(failed)?;
        // In exclusive locking mode the write lock a transaction takes is kept after it
        // ends, until the connection closes.
        for statement in ["BEGIN EXCLUSIVE", "COMMIT"] {
            sqlx::query(statement)
                .execute(&mut connection)
                .await
                .map_err(failed)?;
        }
        Ok(SingleNodeLock { connection })
    }

    /// Releases the lock, waiting until it is released (dropping it releases it a
    /// moment later, on the connection's own thread): a scheduler started right after
    /// this one stopped finds it free.
    pub async fn release(self) {
        use sqlx::Connection;
        if let Err(error) = self.connection.close().await {
            tracing::warn!(%error, "could not close the single-node lock");
        }
    }
}
