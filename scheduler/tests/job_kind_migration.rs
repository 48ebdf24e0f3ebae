//! `jobs.kind` (migration 20261206000000_job_kind): a database written before it, with
//! model and command jobs in it, opens and reads each job's kind as it was submitted; and
//! the kind round-trips through the store's writes. On SQLite and on PostgreSQL.

#[macro_use]
mod support;

use std::path::{Path, PathBuf};

use carve_core::workload::{JobKind, Workload};
use carve_scheduler::store::{Backend, JobRecord, JobState};
use sqlx::migrate::Migrator;
use support::{T0, TestDb, job, tenant};

on_both_databases!(
    a_database_written_before_the_kind_column_reads_each_job_s_kind,
    the_kind_round_trips_through_submit_update_and_list,
);

/// The first migration this build has that a database written by the previous release
/// has not run.
const JOB_KIND_MIGRATION: &str = "20261206000000";

/// A command job as `carve submit` sent it (what the previous release stored).
const COMMAND_SPEC: &str = r#"{"name":"pytorch","command":{"argv":["python3","train.py","--steps","{max_steps}"],"global_batch":32,"steps":10},"resources":{"vram":"auto"}}"#;

/// A model job.
const MODEL_SPEC: &str = r#"{"name":"mnist","model":{"input_shape":[8],"loss":"mse","layers":[{"dense":{"units":2}}]},"training":{"batch_size":4,"steps":2,"optimizer":{"sgd":{"learning_rate":0.1}}},"data":{"format":"synthetic","samples":16}}"#;

/// A model job whose text says "command" (a layer's name), not at its top level.
const MODEL_SPEC_SAYING_COMMAND: &str = r#"{"name":"command","model":{"input_shape":[8],"loss":"mse","layers":[{"dense":{"units":2},"name":"command"}]},"training":{"batch_size":4,"steps":2,"optimizer":{"sgd":{"learning_rate":0.1}}},"data":{"format":"synthetic","samples":16}}"#;

/// The migrations of `backend` from before [`JOB_KIND_MIGRATION`], copied to a directory
/// of their own: the schema the previous release wrote.
fn migrations_before_job_kind(backend: Backend, into: &Path) -> PathBuf {
    let directory = match backend {
        Backend::Sqlite => "sqlite",
        Backend::Postgres => "postgres",
    };
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../migrations")
        .join(directory);
    let target = into.join(directory);
    std::fs::create_dir_all(&target).unwrap();
    let mut copied = 0;
    for entry in std::fs::read_dir(&source).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().into_string().unwrap();
        if name.ends_with(".sql") && name.as_str() < JOB_KIND_MIGRATION {
            std::fs::copy(entry.path(), target.join(&name)).unwrap();
            copied += 1;
        }
    }
    assert!(copied > 0, "no migrations in {}", source.display());
    assert!(
        source
            .join(format!("{JOB_KIND_MIGRATION}_job_kind.sql"))
            .exists(),
        "the job kind migration is where this test expects it"
    );
    target
}

/// Rows as the previous release wrote them: every column it had, no `kind`.
const INSERT_TENANT: &str = "INSERT INTO tenants (name, vram_quota_bytes, max_running_jobs, \
     fair_share_weight, created_at_ms) VALUES ('acme', NULL, NULL, 1, $1)";
const INSERT_JOB: &str = "INSERT INTO jobs (id, tenant, name, spec_json, state, priority, \
     submit_sequence, idempotency_key, config_json, estimate_json, required_bytes, \
     waiting_reason, message, created_at_ms, finished_at_ms, checkpoint_location, \
     attempts_count, checkpoint_step) VALUES ($1, 'acme', $2, $3, 'queued', 0, $4, NULL, \
     '{}', '{}', 1024, '', '', $5, NULL, NULL, 0, 0)";

/// The jobs the old database holds: id, spec, the kind it must read back as.
fn old_jobs() -> Vec<(&'static str, &'static str, JobKind)> {
    vec![
        ("j-command", COMMAND_SPEC, JobKind::Command),
        ("j-model", MODEL_SPEC, JobKind::Model),
        (
            "j-model-says-command",
            MODEL_SPEC_SAYING_COMMAND,
            JobKind::Model,
        ),
        // Never written by the scheduler, but must not stop the migration.
        ("j-not-json", "not json, \"command\"", JobKind::Model),
        ("j-array", r#"["command"]"#, JobKind::Model),
    ]
}

/// Writes the old schema and the old rows into `db`.
async fn write_with_the_previous_release(db: &TestDb) {
    let scratch = tempfile::tempdir().unwrap();
    let migrator = Migrator::new(migrations_before_job_kind(db.backend(), scratch.path()))
        .await
        .unwrap();
    macro_rules! write_rows {
        ($pool:expr) => {{
            let pool = $pool;
            migrator.run(&pool).await.unwrap();
            sqlx::query(INSERT_TENANT)
                .bind(T0)
                .execute(&pool)
                .await
                .unwrap();
            for (sequence, (id, spec, _)) in old_jobs().into_iter().enumerate() {
                sqlx::query(INSERT_JOB)
                    .bind(id)
                    .bind(id)
                    .bind(spec)
                    .bind(sequence as i64 + 1)
                    .bind(T0)
                    .execute(&pool)
                    .await
                    .unwrap();
            }
            pool.close().await;
        }};
    }
    match db.backend() {
        Backend::Sqlite => write_rows!(
            sqlx::SqlitePool::connect_with(
                sqlx::sqlite::SqliteConnectOptions::new()
                    .filename(db.url())
                    .create_if_missing(true)
                    .foreign_keys(true),
            )
            .await
            .unwrap()
        ),
        Backend::Postgres => write_rows!(sqlx::PgPool::connect(db.url()).await.unwrap()),
    }
}

async fn a_database_written_before_the_kind_column_reads_each_job_s_kind(db: &TestDb) {
    write_with_the_previous_release(db).await;
    // Opening runs the migrations the database has not run: the kind column, backfilled.
    let store = db.open().await;
    for (id, spec, kind) in old_jobs() {
        let job = store.get_job(id).await.unwrap();
        assert_eq!(job.kind, kind, "{id}");
        assert_eq!(job.spec_json, spec, "{id}: the spec is kept as it was");
        assert_eq!(job.state, JobState::Queued);
        if spec.starts_with('{') {
            // The stored kind reads the stored spec: nothing sniffs its text again.
            let workload = Workload::from_stored(job.kind, &job.spec_json).unwrap();
            assert_eq!(workload.kind(), kind, "{id}");
        }
    }
    // Listing reads the same kinds.
    let (listed, _) = store.list_jobs(&Default::default()).await.unwrap();
    let command_jobs: Vec<&str> = listed
        .iter()
        .filter(|job| job.kind == JobKind::Command)
        .map(|job| job.id.as_str())
        .collect();
    assert_eq!(command_jobs, ["j-command"]);
    // A second open runs nothing again and reads the same.
    drop(store);
    let store = db.open().await;
    assert_eq!(
        store.get_job("j-command").await.unwrap().kind,
        JobKind::Command
    );
}

async fn the_kind_round_trips_through_submit_update_and_list(db: &TestDb) {
    let store = db.open().await;
    store.create_tenant(&tenant("acme")).await.unwrap();
    let command = JobRecord {
        kind: JobKind::Command,
        spec_json: COMMAND_SPEC.to_string(),
        ..job("j-command", "acme", "pytorch")
    };
    let model = JobRecord {
        spec_json: MODEL_SPEC.to_string(),
        ..job("j-model", "acme", "mnist")
    };
    let outcomes = store
        .submit_jobs(vec![command.clone(), model.clone()])
        .await
        .unwrap();
    let stored: Vec<JobKind> = outcomes.iter().map(|outcome| outcome.job.kind).collect();
    assert_eq!(stored, [JobKind::Command, JobKind::Model]);
    let mut read = store.get_job("j-command").await.unwrap();
    assert_eq!(read, outcomes[0].job);
    // A whole-row update keeps it (and writes what it is given).
    read.waiting_reason = "waiting".into();
    store.update_job(&read).await.unwrap();
    assert_eq!(store.get_job("j-command").await.unwrap(), read);
    let (listed, _) = store.list_jobs(&Default::default()).await.unwrap();
    let mut kinds: Vec<(String, JobKind)> =
        listed.into_iter().map(|job| (job.id, job.kind)).collect();
    kinds.sort_by(|left, right| left.0.cmp(&right.0));
    assert_eq!(
        kinds,
        [
            ("j-command".to_string(), JobKind::Command),
            ("j-model".to_string(), JobKind::Model)
        ]
    );
    // The row-by-row submit path (a group that breaks a key falls back to it, to name
    // the job) binds the kind too: it inserts `again` and then names the taken id,
    // rather than failing on its statement.
    let again = JobRecord {
        kind: JobKind::Command,
        spec_json: COMMAND_SPEC.to_string(),
        ..job("j-second", "acme", "pytorch")
    };
    let taken = job("j-model", "acme", "duplicate id");
    let error = store
        .submit_jobs(vec![again.clone(), taken])
        .await
        .unwrap_err();
    assert!(
        matches!(
            &error,
            carve_scheduler::error::SchedulerError::Api(
                carve_proto::ApiError::AlreadyExists { .. }
            )
        ),
        "{error:?}"
    );
    let outcomes = store.submit_jobs(vec![again]).await.unwrap();
    assert_eq!(outcomes[0].job.kind, JobKind::Command);
    assert_eq!(
        store.get_job("j-second").await.unwrap().kind,
        JobKind::Command
    );
}
