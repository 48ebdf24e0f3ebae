//! What an attempt leaves behind for its researcher (issue 19), end to end: the real
//! scheduler in-process, the real worker in-process with a simulated GPU, and real
//! attempt processes training a tiny job. A finished attempt's results (final loss,
//! steps, throughput, times) are kept; the program's own output and its progress are
//! lines of the attempt in the job's logs; an attempt resumed from a checkpoint shows the
//! step it really loaded. Each test runs on SQLite and on a PostgreSQL server this test
//! binary starts.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use carve_proto::v1;
use carve_testing::PgServer;
use carve_worker::checkpoint_files::promoted_path;

#[path = "support/cluster.rs"]
#[allow(dead_code, reason = "not every helper is used here")]
mod cluster;
use cluster::{Cluster, WAIT};

// The chaos test's helpers are not all used here.
#[allow(dead_code)]
mod support;
use support::{poll_until, tiny_job_spec};

const ADMIN: &str = "carve_attempt_output_admin_secret";

/// Declares each test once per database: `sqlite::NAME` and `postgres::NAME`.
macro_rules! on_both_databases {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let directory = tempfile::tempdir().unwrap();
                    let url = format!("sqlite://{}", directory.path().join("carve.db").display());
                    crate::$name(directory.path(), url).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let directory = tempfile::tempdir().unwrap();
                    let url = crate::postgres_database().await;
                    crate::$name(directory.path(), url).await;
                }
            )*
        }
    };
}

on_both_databases!(
    a_finished_attempt_keeps_its_results_and_its_output_is_in_the_logs,
    a_resumed_attempt_shows_the_step_it_loaded,
);

/// A new database on the PostgreSQL server this binary shares between its tests.
async fn postgres_database() -> String {
    static SERVER: OnceLock<Result<PgServer, carve_testing::TestingError>> = OnceLock::new();
    let server = match SERVER.get_or_init(PgServer::start) {
        Ok(server) => server,
        Err(reason) => panic!("{reason}"),
    };
    server
        .create_database("attempt_output")
        .await
        .unwrap_or_else(|error| panic!("{error}"))
}

fn worker_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_carve-worker"))
}

/// The worker binary behind a script that first writes a warning on stderr, as a
/// training library would.
fn program_warning_first(directory: &Path) -> PathBuf {
    let path = directory.join("warns-then-trains.sh");
    let script = format!(
        "#!/bin/bash\necho 'UserWarning: the data set is small' >&2\nexec \"{}\" \"$@\"\n",
        worker_binary().display()
    );
    std::fs::write(&path, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

async fn a_finished_attempt_keeps_its_results_and_its_output_is_in_the_logs(
    directory: &Path,
    database_url: String,
) {
    let program = program_warning_first(directory);
    // The wrapper execs the worker binary, which its container must see too.
    let cluster = Cluster::start(directory, database_url, program, ADMIN, |config| {
        config.sandbox.read_only_host_paths = vec![worker_binary()];
    })
    .await;
    let job = cluster.submit(tiny_job_spec("results", 20, 50, "")).await;
    let finished = cluster
        .wait_for_state(&job.id, v1::JobState::Succeeded)
        .await;
    let attempt = &finished.attempts[0];
    let loss = attempt.final_loss.expect("a final loss");
    assert!(loss.is_finite() && loss > 0.0, "{loss}");
    assert_eq!(attempt.steps_done, Some(20));
    assert!(
        attempt.samples_per_second.is_some_and(|rate| rate > 0.0),
        "{attempt:#?}"
    );
    let (started, ended) = (attempt.started_at.unwrap(), attempt.finished_at.unwrap());
    assert!(
        (ended.seconds, ended.nanos) >= (started.seconds, started.nanos),
        "{attempt:#?}"
    );
    assert_eq!(attempt.progress, None);

    let lines = cluster.attempt_lines(&job.id, 1).await;
    let messages: Vec<&str> = lines.iter().map(|line| line.message.as_str()).collect();
    let warning = lines
        .iter()
        .find(|line| line.message == "UserWarning: the data set is small")
        .unwrap_or_else(|| panic!("the program's stderr is in the logs: {messages:#?}"));
    assert_eq!(warning.level, "warn");
    // The first step and the last are always reported, whatever the interval.
    for step in ["step 1/20:", "step 20/20:"] {
        assert!(
            messages.iter().any(|message| message.starts_with(step)),
            "{step} {messages:#?}"
        );
    }
    assert!(
        messages
            .last()
            .is_some_and(|message| message.starts_with("ended: 20 steps, final loss ")),
        "{messages:#?}"
    );
}

async fn a_resumed_attempt_shows_the_step_it_loaded(directory: &Path, database_url: String) {
    let mut cluster = Cluster::start(directory, database_url, worker_binary(), ADMIN, |_| {}).await;
    let job = cluster.submit(tiny_job_spec("resumed", 400, 25, "")).await;
    let first = cluster.next_process().await;
    let checkpoint = cluster
        .checkpoints
        .join(&job.id)
        .join(format!("{}.attempt-1.ckpt", job.id));
    poll_until(
        WAIT,
        Duration::from_millis(10),
        "a checkpoint is written",
        || checkpoint.is_file().then_some(()),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Killed from outside: interrupted, and the next attempt resumes from the file.
    let killed = std::process::Command::new("kill")
        .arg("-KILL")
        .arg(first.process_id.to_string())
        .status()
        .unwrap();
    assert!(killed.success());
    let finished = cluster
        .wait_for_state(&job.id, v1::JobState::Succeeded)
        .await;
    assert_eq!(finished.attempts.len(), 2, "{finished:#?}");
    let resumed = &finished.attempts[1];
    let from = resumed.resumed_from.as_ref().expect("it resumed");
    assert!(
        from.step > 0 && from.step.is_multiple_of(25),
        "resumed from step {}: {finished:#?}",
        from.step
    );
    // The recorded file is the checkpoint promoted under its step's name.
    assert_eq!(
        from.location,
        promoted_path(&checkpoint, from.step).display().to_string()
    );
    assert_eq!(resumed.steps_done, Some(400));
    // The interrupted attempt is kept with how far its reports got (its last checkpoint
    // on disk may be newer than its last report).
    let interrupted = &finished.attempts[0];
    assert!(
        interrupted.steps_done.is_some_and(|steps| steps >= 1),
        "{interrupted:#?}"
    );
    let messages: Vec<String> = cluster
        .attempt_lines(&job.id, 2)
        .await
        .into_iter()
        .map(|line| line.message)
        .collect();
    let said = format!("resumed from step {} (checkpoint ", from.step);
    assert!(
        messages
            .first()
            .is_some_and(|first| first.starts_with(&said)),
        "{said} {messages:#?}"
    );
}
