//! What the store contract tests run against: a SQLite file in a temp dir, or a fresh
//! database on a PostgreSQL server this test binary starts from the machine's PostgreSQL
//! binaries.
//!
//! # The PostgreSQL server
//!
//! One server per test binary, started on first use ([`shared_postgres`]) and shared by
//! every test, each of which creates its own database (`CREATE DATABASE`).
//!
//! The server is [`carve_testing::PgServer`] (re-exported here), which
//! `carve-submit-bench` uses too; its documentation says where the binaries come from,
//! which user runs them, where the files go and how the server is stopped. In short:
//!
//! - Binaries: `$CARVE_PG_BIN_DIR`, else the newest `/usr/lib/postgresql/*/bin` (Debian's
//!   `postgresql` package), else `initdb` on `PATH`. None found fails the test with what
//!   to install (whether or not `CI` is set: the contract suite must run on both
//!   databases).
//! - User: PostgreSQL refuses to run as root, so under root `initdb` and `pg_ctl` run as
//!   an unprivileged user through `runuser -u USER --`: `$CARVE_PG_USER`, else `carve-pg`
//!   (which `.ci/run` creates) when it exists, else `nobody`. Under any other user they run
//!   as that user.
//! - Files: a fresh directory `$TMPDIR/carve-pg-<pid>-<nanos>/` (owned by that user)
//!   holding `data/` (the cluster), `socket/` (the Unix socket, `-k`) and `postgres.log`.
//! - Network: `listen_addresses=127.0.0.1` on a free port found by binding
//!   `127.0.0.1:0`; `fsync=on`, `synchronous_commit=on`; trust authentication for the
//!   `postgres` superuser, which only local processes can reach.
//! - Stopping: [`PgServer`] starts a supervisor shell first, whose stdin is a pipe from
//!   this process. When the pipe closes, the supervisor runs `pg_ctl stop -m immediate`
//!   and removes the directory. Dropping a `PgServer` closes the pipe and waits for that;
//!   the shared server lives in a `static`, which Rust never drops, but the kernel closes
//!   the pipe when the test process exits for any reason (success, panic, abort, kill),
//!   so the server never outlives the tests.

#![allow(dead_code)]

/// Declares each named test once per database, as `sqlite::NAME` and `postgres::NAME`:
/// `NAME` is an `async fn(&TestDb)` at the test file's root. Test files that use it
/// declare `#[macro_use] mod support;`.
#[allow(
    unused_macros,
    reason = "not every test file runs tests on both databases"
)]
macro_rules! on_both_databases {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let db = crate::support::TestDb::sqlite().await;
                    crate::$name(&db).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let db = crate::support::TestDb::postgres().await;
                    crate::$name(&db).await;
                }
            )*
        }
    };
}

use std::sync::OnceLock;

use carve_core::workload::JobKind;
use carve_scheduler::error::SchedulerError;
use carve_scheduler::store::{
    AttemptEnd, AttemptOutcome, AttemptRecord, AttemptResults, Backend, JobRecord, JobState, Store,
    TenantRecord,
};
pub use carve_testing::PgServer;

/// A database for one test: a SQLite file, or a database of its own on the shared
/// PostgreSQL server. [`TestDb::open`] can be called again to reopen it.
#[derive(Debug)]
pub struct TestDb {
    backend: Backend,
    url: String,
    _dir: Option<tempfile::TempDir>,
}

impl TestDb {
    /// A SQLite file in a fresh temp dir (removed when the `TestDb` drops).
    pub async fn sqlite() -> TestDb {
        let dir = tempfile::tempdir().expect("create a temp dir for sqlite");
        let path = dir.path().join("carve.db");
        TestDb {
            backend: Backend::Sqlite,
            url: path.to_str().expect("temp paths are utf-8").to_string(),
            _dir: Some(dir),
        }
    }

    /// A new, empty database on the shared PostgreSQL server.
    pub async fn postgres() -> TestDb {
        let url = shared_postgres()
            .create_database("contract")
            .await
            .unwrap_or_else(|error| panic!("{error}"));
        TestDb {
            backend: Backend::Postgres,
            url,
            _dir: None,
        }
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The URL (or SQLite path) `Store::open` takes.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Opens a new `Store` (a new connection pool) on this database.
    pub async fn open(&self) -> Store {
        let store = Store::open(&self.url)
            .await
            .unwrap_or_else(|error| panic!("open the store at {}: {error}", self.url));
        assert_eq!(store.backend(), self.backend);
        store
    }
}

static SHARED_POSTGRES: OnceLock<Result<PgServer, carve_testing::TestingError>> = OnceLock::new();

/// The PostgreSQL server every test of this binary shares, started on first use. Panics
/// (failing the test) with the reason when it cannot start.
pub fn shared_postgres() -> &'static PgServer {
    match SHARED_POSTGRES.get_or_init(PgServer::start) {
        Ok(server) => server,
        Err(reason) => panic!("{reason}"),
    }
}

/// The time the store tests' records start at (milliseconds since the epoch).
pub const T0: i64 = 1_700_000_000_000;

/// A tenant with no limits, created at [`T0`].
pub fn tenant(name: &str) -> TenantRecord {
    TenantRecord {
        name: name.to_string(),
        vram_quota_bytes: None,
        max_running_jobs: None,
        fair_share_weight: 1,
        created_at_ms: T0,
    }
}

/// A queued job of `tenant` with a small estimate, created at [`T0`].
pub fn job(id: &str, tenant: &str, name: &str) -> JobRecord {
    JobRecord {
        id: id.to_string(),
        tenant: tenant.to_string(),
        name: name.to_string(),
        kind: JobKind::Model,
        spec_json: format!(r#"{{"name":"{name}"}}"#),
        state: JobState::Queued,
        priority: 0,
        submit_sequence: 0,
        idempotency_key: None,
        config_json: r#"{"batch_size":32}"#.to_string(),
        estimate_json: r#"{"required_bytes":1048576}"#.to_string(),
        required_bytes: 1 << 20,
        waiting_reason: String::new(),
        message: String::new(),
        created_at_ms: T0,
        finished_at_ms: None,
        checkpoint_location: None,
        checkpoint_step: 0,
        attempts_count: 0,
    }
}

/// Attempt `number` of `job_id`, running under `lease_epoch` on `w-1`'s `GPU-0`.
pub fn attempt(job_id: &str, number: i64, lease_epoch: i64) -> AttemptRecord {
    AttemptRecord {
        job_id: job_id.to_string(),
        attempt_number: number,
        config_json: r#"{"batch_size":32}"#.to_string(),
        estimate_bytes: 1 << 20,
        slice_bytes: 2 << 20,
        worker_id: "w-1".to_string(),
        gpu_id: "GPU-0".to_string(),
        lease_epoch,
        outcome: AttemptOutcome::Running,
        measured_peak_bytes: None,
        oom: None,
        message: String::new(),
        resumed_from: None,
        resumed_from_step: 0,
        started_at_ms: T0 + number,
        finished_at_ms: None,
        results: AttemptResults::default(),
        details: Default::default(),
    }
}

/// A store on `db` holding the tenant `acme`: where most job tests start.
pub async fn open_with_acme(db: &TestDb) -> Store {
    let store = db.open().await;
    store.create_tenant(&tenant("acme")).await.unwrap();
    store
}

/// Ends attempt `number` of `job_id` with `outcome` at `at`, with no peak, report,
/// message or results. `_lease_epoch` is not read: the store ends an attempt by its
/// number while it runs (no attempt is reassigned under another epoch); it stays for
/// the callers that still pass one.
pub async fn finish_plainly(
    store: &Store,
    job_id: &str,
    number: i64,
    _lease_epoch: i64,
    outcome: AttemptOutcome,
    at: i64,
) -> Result<(), SchedulerError> {
    let results = AttemptResults::default();
    store
        .end_attempt(
            &AttemptEnd {
                job_id: job_id.to_string(),
                attempt_number: number,
                outcome,
                measured_peak_bytes: None,
                oom: None,
                message: String::new(),
                finished_at_ms: at,
                results,
                details: Default::default(),
            },
            None,
        )
        .await
}
