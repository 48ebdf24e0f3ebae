//! A replica frozen in the middle of a transaction (SIGSTOP, a paused VM) on PostgreSQL:
//! its session keeps its row locks for as long as its socket stays open, and the
//! replica that leads after it would wait on them forever. The store's sessions carry
//! `idle_in_transaction_session_timeout` (`StoreOptions`), so PostgreSQL ends the frozen
//! one and the next writer goes on. Here the frozen replica is a session opened the way
//! the store opens its own, holding the lock a log write takes; without the setting the
//! second store's write never finishes and the test fails at its deadline.

mod support;

use std::time::Duration;

use carve_scheduler::store::{NewLogLine, Store, StoreOptions, postgres_connect_options};
use sqlx::Connection;
use support::{T0, TestDb, job, tenant};

/// The guard against hanging: far above the session timeout below, never reached when
/// PostgreSQL ends the frozen session.
const PATIENCE: Duration = Duration::from_secs(60);

fn line(message: &str) -> NewLogLine {
    NewLogLine {
        job_id: "j-1".into(),
        time_ms: T0,
        attempt_number: 0,
        level: "info".into(),
        message: message.into(),
        event: None,
        stream: String::new(),
    }
}

#[tokio::test]
async fn a_replica_frozen_mid_transaction_does_not_block_the_next_leader_for_ever() {
    let database = TestDb::postgres().await;
    let options = StoreOptions {
        postgres_idle_in_transaction_timeout: Duration::from_secs(1),
        ..StoreOptions::default()
    };
    let next_leader = Store::open_with(database.url(), &options).await.unwrap();
    next_leader.create_tenant(&tenant("acme")).await.unwrap();
    next_leader
        .submit_jobs(vec![job("j-1", "acme", "x")])
        .await
        .unwrap();
    next_leader
        .append_log_lines(&[line("before the freeze")])
        .await
        .unwrap();

    // The frozen replica: mid-transaction, holding the job's log sequence row, sending
    // nothing more.
    let mut frozen = sqlx::PgConnection::connect_with(
        &postgres_connect_options(database.url(), &options).unwrap(),
    )
    .await
    .unwrap();
    sqlx::query("BEGIN").execute(&mut frozen).await.unwrap();
    sqlx::query("SELECT last_sequence FROM job_log_sequences WHERE job_id = 'j-1' FOR UPDATE")
        .execute(&mut frozen)
        .await
        .unwrap();

    let written = tokio::time::timeout(
        PATIENCE,
        next_leader.append_log_lines(&[line("after the freeze")]),
    )
    .await;
    assert!(
        matches!(written, Ok(Ok(()))),
        "the next leader's log write waited on the frozen session: {written:?}"
    );
    // PostgreSQL ended the frozen session; its transaction is gone.
    assert!(
        sqlx::query("COMMIT").execute(&mut frozen).await.is_err(),
        "the frozen session was left open"
    );
    let page = next_leader
        .read_log_lines(&carve_scheduler::store::LogQuery {
            job_id: "j-1".into(),
            attempt_number: None,
            after_sequence: 0,
            page_size: 0,
            tail: None,
        })
        .await
        .unwrap();
    let messages: Vec<&str> = page
        .lines
        .iter()
        .map(|line| line.message.as_str())
        .collect();
    assert_eq!(messages, ["before the freeze", "after the freeze"]);
}
