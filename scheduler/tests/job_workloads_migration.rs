//! `jobs.workload_json` (migration 20261220000000_job_workloads) on a database written by
//! the release before it, on SQLite and on PostgreSQL: the database opens; its jobs have
//! no stored form (SQL cannot validate a spec: the scheduler reads such a job's spec once
//! and stores the form, `spec_reads.rs`); and a command job's run config, written then
//! with the engine's knobs as 0, reads as a config without them, a model job's with them.

#[macro_use]
mod support;

use std::path::{Path, PathBuf};

use carve_core::workload::JobKind;
use carve_scheduler::store::{Backend, JobState};
use sqlx::migrate::Migrator;
use support::{T0, TestDb};

on_both_databases!(a_database_written_before_stored_workloads_opens_and_reads_its_jobs,);

/// The first migration this build has that a database written by the previous release
/// has not run.
const JOB_WORKLOADS_MIGRATION: &str = "20261220000000";

/// The migrations of `backend` from before [`JOB_WORKLOADS_MIGRATION`], copied to a
/// directory of their own: the schema the previous release wrote.
fn migrations_before_job_workloads(backend: Backend, into: &Path) -> PathBuf {
    let directory = match backend {
        Backend::Sqlite => "sqlite",
        Backend::Postgres => "postgres",
    };
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../migrations")
        .join(directory);
    assert!(
        source
            .join(format!("{JOB_WORKLOADS_MIGRATION}_job_workloads.sql"))
            .exists(),
        "the job workloads migration is where this test expects it"
    );
    let target = into.join(directory);
    std::fs::create_dir_all(&target).unwrap();
    for entry in std::fs::read_dir(&source).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().into_string().unwrap();
        if name.ends_with(".sql") && name.as_str() < JOB_WORKLOADS_MIGRATION {
            std::fs::copy(entry.path(), target.join(&name)).unwrap();
        }
    }
    target
}

/// Rows as the previous release wrote them: every column it had, no `workload_json`.
const INSERT_TENANT: &str = "INSERT INTO tenants (name, vram_quota_bytes, max_running_jobs, \
     fair_share_weight, created_at_ms) VALUES ('acme', NULL, NULL, 1, $1)";
const INSERT_JOB: &str = "INSERT INTO jobs (id, tenant, name, spec_json, state, priority, \
     submit_sequence, idempotency_key, config_json, estimate_json, required_bytes, \
     waiting_reason, message, created_at_ms, finished_at_ms, checkpoint_location, \
     attempts_count, checkpoint_step, kind) VALUES ($1, 'acme', $1, $2, 'queued', 0, $3, \
     NULL, $4, '{\"peak_bytes\":1024,\"required_bytes\":1024}', 1024, '', '', $5, NULL, \
     NULL, 0, 0, $6)";

const COMMAND_SPEC: &str = r#"{"name":"c","command":{"argv":["python3","/opt/train.py"],"global_batch":256,"steps":10},"resources":{"vram":"auto"}}"#;
const MODEL_SPEC: &str = r#"{"name":"m","model":{"input_shape":[8],"loss":"mse","layers":[{"dense":{"units":2}}]},"training":{"batch_size":4,"steps":2,"optimizer":{"sgd":{"learning_rate":0.1}}},"data":{"format":"synthetic","samples":16}}"#;

/// A command job's config as the previous release wrote it: the engine's knobs as 0.
const OLD_COMMAND_CONFIG: &str = r#"{"batch_size":256,"micro_batch_size":64,"precision":"bf16","prefetch_batches":0,"recompute_segment_layers":null,"workspace_limit_bytes":0}"#;
const OLD_MODEL_CONFIG: &str = r#"{"batch_size":4,"micro_batch_size":4,"precision":"fp32","prefetch_batches":2,"recompute_segment_layers":null,"workspace_limit_bytes":67108864}"#;

async fn write_with_the_previous_release(db: &TestDb) {
    let scratch = tempfile::tempdir().unwrap();
    let migrator = Migrator::new(migrations_before_job_workloads(
        db.backend(),
        scratch.path(),
    ))
    .await
    .unwrap();
    let rows = [
        ("j-command", COMMAND_SPEC, OLD_COMMAND_CONFIG, "command"),
        ("j-model", MODEL_SPEC, OLD_MODEL_CONFIG, "model"),
    ];
    macro_rules! write_rows {
        ($pool:expr) => {{
            let pool = $pool;
            migrator.run(&pool).await.unwrap();
            sqlx::query(INSERT_TENANT)
                .bind(T0)
                .execute(&pool)
                .await
                .unwrap();
            for (sequence, (id, spec, config, kind)) in rows.into_iter().enumerate() {
                sqlx::query(INSERT_JOB)
                    .bind(id)
                    .bind(spec)
                    .bind(sequence as i64 + 1)
                    .bind(config)
                    .bind(T0)
                    .bind(kind)
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

async fn a_database_written_before_stored_workloads_opens_and_reads_its_jobs(db: &TestDb) {
    write_with_the_previous_release(db).await;
    // Opening runs the migrations the database has not run.
    let store = db.open().await;

    let command = store.get_job("j-command").await.unwrap();
    assert_eq!(
        (command.kind, command.state),
        (JobKind::Command, JobState::Queued)
    );
    let config = command.config().unwrap();
    assert_eq!(config.engine, None, "the old 0s read as no engine knobs");
    assert_eq!((config.batch_size, config.micro_batch_size), (256, 64));

    let model = store.get_job("j-model").await.unwrap();
    let config = model.config().unwrap();
    let engine = config
        .engine
        .expect("a model job's config has the engine's knobs");
    assert_eq!(
        (engine.prefetch_batches, engine.workspace_limit_bytes),
        (2, 64 << 20)
    );

    // No stored form yet: the scheduler reads each spec once and stores it then.
    for id in ["j-command", "j-model"] {
        assert_eq!(store.job_workload_json(id).await.unwrap(), None, "{id}");
    }
    // A job written now has its command config stored without the knobs, and reads the
    // same.
    let mut rewritten = command.clone();
    rewritten.config_json = carve_scheduler::store::config_to_json(&command.config().unwrap());
    assert!(
        !rewritten.config_json.contains("prefetch"),
        "{}",
        rewritten.config_json
    );
    store.update_job(&rewritten).await.unwrap();
    let reread = store.get_job("j-command").await.unwrap();
    assert_eq!(reread.config().unwrap(), command.config().unwrap());
}
