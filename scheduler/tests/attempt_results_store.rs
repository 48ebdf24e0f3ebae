//! What the store keeps of each attempt's results and start (issue 19): the final loss,
//! test accuracy, steps and throughput stored with its outcome, and the start and
//! checkpoint the attempt itself reported (and whether it ran uncontained). Every test runs against SQLite and against the
//! PostgreSQL server this binary starts (`support/mod.rs`), as `sqlite::NAME` and
//! `postgres::NAME`, like the store contract suite.

#[macro_use]
mod support;

use carve_scheduler::convert::attempt_to_proto;
use carve_scheduler::store::{
    AttemptEnd, AttemptEndDetails, AttemptOutcome, AttemptRecord, AttemptResults,
    AttemptStartDetails, Backend, JobRecord, JobState, OomSource, Store,
};
use support::{T0, TestDb, attempt, finish_plainly, job, open_with_acme};

on_both_databases!(
    results_are_stored_with_the_outcome_and_shown,
    an_attempt_s_start_and_resume_step_are_its_own_word,
    an_unreadable_detail_column_is_an_error_naming_it_not_an_empty_value,
    a_tenants_argv_is_stored_and_shown_exactly_whatever_it_holds,
);

/// A store holding tenant `acme` and its placed job `j` with attempt 1 (lease epoch 1),
/// which the scheduler expected to resume from step 100 of `/ckpt/j.ckpt`.
async fn store_with_a_running_attempt(db: &TestDb) -> (Store, AttemptRecord) {
    let store = open_with_acme(db).await;
    let checkpointed = JobRecord {
        checkpoint_location: Some("/ckpt/j.ckpt".into()),
        checkpoint_step: 100,
        ..job("j", "acme", "x")
    };
    let submitted = store.submit_jobs(vec![checkpointed]).await.unwrap();
    let placed = JobRecord {
        state: JobState::Placed,
        attempts_count: 1,
        ..submitted[0].job.clone()
    };
    let running = AttemptRecord {
        resumed_from: Some("/ckpt/j.ckpt".into()),
        resumed_from_step: 100,
        started_at_ms: T0,
        ..attempt("j", 1, 1)
    };
    store
        .record_job_and_attempt(&placed, &running)
        .await
        .unwrap();
    (store, running)
}

async fn results_are_stored_with_the_outcome_and_shown(db: &TestDb) {
    let (store, running) = store_with_a_running_attempt(db).await;
    assert_eq!(
        store.list_attempts("j").await.unwrap(),
        vec![running.clone()],
        "a running attempt has no results yet"
    );
    let results = AttemptResults {
        final_loss: Some(0.125),
        test_accuracy: Some(0.875),
        steps_done: Some(500),
        samples_per_second: Some(1234.5),
        metrics: Vec::new(),
    };
    store
        .end_attempt(
            &AttemptEnd {
                job_id: "j".into(),
                attempt_number: 1,
                outcome: AttemptOutcome::Succeeded,
                measured_peak_bytes: Some(3 << 20),
                oom: None,
                message: String::new(),
                finished_at_ms: T0 + 9_000,
                results: results.clone(),
                details: AttemptEndDetails {
                    profile_points: Vec::new(),
                    oom_detected_by: Some(OomSource::Guard),
                },
            },
            None,
        )
        .await
        .unwrap();
    let stored = store.list_attempts("j").await.unwrap().remove(0);
    assert_eq!(stored.results, results);
    assert_eq!(stored.finished_at_ms, Some(T0 + 9_000));
    let shown = attempt_to_proto(&stored);
    assert_eq!(shown.final_loss, Some(0.125));
    assert_eq!(shown.test_accuracy, Some(0.875));
    assert_eq!(shown.steps_done, Some(500));
    assert_eq!(shown.samples_per_second, Some(1234.5));
    assert_eq!(shown.oom_detected_by, "guard");
    assert_eq!(
        (
            shown.started_at.unwrap().seconds,
            shown.finished_at.unwrap().seconds
        ),
        (T0 / 1000, (T0 + 9_000) / 1000)
    );
    // Reopened, the results are still there (they are columns, not memory).
    let reopened = db.open().await;
    assert_eq!(
        reopened.list_attempts("j").await.unwrap().remove(0).results,
        results
    );
}

async fn an_attempt_s_start_and_resume_step_are_its_own_word(db: &TestDb) {
    let (store, running) = store_with_a_running_attempt(db).await;
    // A report of an attempt the job does not have changes nothing.
    let stale = store
        .record_attempt_started(
            "j",
            7,
            T0 + 5,
            Some(("/elsewhere.ckpt", 1)),
            &AttemptStartDetails::default(),
        )
        .await
        .unwrap();
    assert!(!stale);
    assert_eq!(
        store.list_attempts("j").await.unwrap(),
        vec![running.clone()]
    );
    // A worker that does not say where it resumed leaves the expected checkpoint.
    assert!(
        store
            .record_attempt_started("j", 1, T0 + 10, None, &AttemptStartDetails::default())
            .await
            .unwrap()
    );
    let started = store.list_attempts("j").await.unwrap().remove(0);
    assert_eq!(started.started_at_ms, T0 + 10);
    assert_eq!(
        (started.resumed_from.as_deref(), started.resumed_from_step),
        (Some("/ckpt/j.ckpt"), 100)
    );
    // A worker that does not say it is uncontained (contained, or too old): contained.
    assert!(!started.details.uncontained);
    assert!(!attempt_to_proto(&started).uncontained);
    // The checkpoint the attempt really loaded wins over the scheduler's guess.
    assert!(
        store
            .record_attempt_started(
                "j",
                1,
                T0 + 20,
                Some(("/ckpt/j.attempt-1.ckpt", 300)),
                &AttemptStartDetails {
                    command_argv: vec!["python3".into(), "train.py".into()],
                    uncontained: true,
                },
            )
            .await
            .unwrap()
    );
    let resumed = store.list_attempts("j").await.unwrap().remove(0);
    assert_eq!(
        (resumed.resumed_from.as_deref(), resumed.resumed_from_step),
        (Some("/ckpt/j.attempt-1.ckpt"), 300)
    );
    // A command job's worker says what it ran.
    assert_eq!(
        attempt_to_proto(&resumed).command_argv,
        vec!["python3".to_string(), "train.py".to_string()]
    );
    // A worker without a container says its attempt ran with the worker's rights.
    assert!(resumed.details.uncontained);
    assert!(attempt_to_proto(&resumed).uncontained);
    let shown = attempt_to_proto(&resumed).resumed_from.unwrap();
    assert_eq!(shown.step, 300);
    // An attempt that ended is not started again.
    finish_plainly(&store, "j", 1, 1, AttemptOutcome::Cancelled, T0 + 30)
        .await
        .unwrap();
    assert!(
        !store
            .record_attempt_started(
                "j",
                1,
                T0 + 40,
                None,
                &AttemptStartDetails {
                    command_argv: vec!["sh".into()],
                    uncontained: false,
                },
            )
            .await
            .unwrap()
    );
    let ended = store.list_attempts("j").await.unwrap().remove(0);
    assert_eq!(ended.details.command_argv, ["python3", "train.py"]);
    assert!(
        ended.details.uncontained,
        "the start's word is kept at the end"
    );
    // Reopened, it is still there (a column, not memory).
    let reopened = db.open().await;
    assert!(
        reopened.list_attempts("j").await.unwrap()[0]
            .details
            .uncontained
    );
}

/// Runs `sql` on `db` through a connection of its own, as an operator's typo would.
async fn run_sql(db: &TestDb, sql: &str) {
    match db.backend() {
        Backend::Sqlite => {
            let pool = sqlx::SqlitePool::connect_with(
                sqlx::sqlite::SqliteConnectOptions::new().filename(db.url()),
            )
            .await
            .unwrap();
            sqlx::query(sql).execute(&pool).await.unwrap();
            pool.close().await;
        }
        Backend::Postgres => {
            let pool = sqlx::PgPool::connect(db.url()).await.unwrap();
            sqlx::query(sql).execute(&pool).await.unwrap();
            pool.close().await;
        }
    }
}

/// An attempt's argv, profile points and OOM detector are typed columns: a value this
/// build cannot read fails the read naming the column, rather than showing the attempt
/// with no argv, no points or no detector.
async fn an_unreadable_detail_column_is_an_error_naming_it_not_an_empty_value(db: &TestDb) {
    let (store, _) = store_with_a_running_attempt(db).await;
    for (column, value) in [
        ("command_argv_json", "python3 train.py"),
        ("profile_points_json", "[{\"micro_batch\": \"many\"}]"),
        ("oom_detected_by", "telepathy"),
    ] {
        run_sql(
            db,
            &format!("UPDATE attempts SET {column} = '{value}' WHERE job_id = 'j'"),
        )
        .await;
        let read = store.list_attempts("j").await;
        let error = read
            .expect_err("an unreadable column is an error")
            .to_string();
        assert!(
            error.contains("corrupt row") && error.contains(column),
            "{column}: {error}"
        );
        run_sql(
            db,
            &format!("UPDATE attempts SET {column} = '' WHERE job_id = 'j'"),
        )
        .await;
        assert!(
            store.list_attempts("j").await.is_ok(),
            "{column} '' is none"
        );
    }
}

/// A command job's argv is the tenant's own text: quotes, brackets, SQL, line breaks and
/// empty arguments are stored and shown as exactly the arguments they were, never split,
/// joined or read as the column's own syntax.
async fn a_tenants_argv_is_stored_and_shown_exactly_whatever_it_holds(db: &TestDb) {
    let (store, _) = store_with_a_running_attempt(db).await;
    let argv: Vec<String> = [
        "python3",
        "",
        "\"]",
        "'; UPDATE attempts SET outcome = 'succeeded'; --",
        "a\nb",
        "[\"x\", \"y\"]",
        "\\",
    ]
    .map(String::from)
    .to_vec();
    assert!(
        store
            .record_attempt_started(
                "j",
                1,
                T0 + 10,
                None,
                &AttemptStartDetails {
                    command_argv: argv.clone(),
                    uncontained: false,
                },
            )
            .await
            .unwrap()
    );
    let started = store.list_attempts("j").await.unwrap().remove(0);
    assert_eq!(started.details.command_argv, argv);
    assert_eq!(started.outcome, AttemptOutcome::Running);
    assert_eq!(attempt_to_proto(&started).command_argv, argv);
}
