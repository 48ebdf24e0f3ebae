//! The database connection in production's shapes: the store on the tests' private
//! PostgreSQL with `ssl=on`, under `sslmode=require` and `verify-full`; and the binary
//! refusing to start, naming the host but not the password, when its database does not
//! answer (instead of printing "listening" and failing a minute later).

use std::process::Command;
use std::time::{Duration, Instant};

use carve_scheduler::store::{DATABASE_CHECK_TIMEOUT, Store, check_database};
use carve_testing::{PgServer, TestAuthority};
use sqlx::Connection;

mod support;

#[tokio::test]
async fn the_store_works_over_tls_under_sslmode_require_and_verify_full() {
    let authority = TestAuthority::new("carve test database CA").unwrap();
    let certificate = authority.issue_server(&["127.0.0.1", "localhost"]).unwrap();
    let server = PgServer::start_with_tls(&certificate).unwrap_or_else(|reason| panic!("{reason}"));
    let url = server.create_database("tls").await.unwrap();

    let require = format!("{url}?sslmode=require");
    check_database(&require, DATABASE_CHECK_TIMEOUT)
        .await
        .unwrap();
    let store = Store::open(&require).await.unwrap();
    store
        .create_tenant(&support::tenant("encrypted"))
        .await
        .unwrap();
    let tenants = store.list_tenants().await.unwrap();
    assert!(tenants.iter().any(|tenant| tenant.name == "encrypted"));
    store.close().await;

    // The server says the connection is encrypted, not merely allowed to be.
    let mut connection = sqlx::PgConnection::connect(&require).await.unwrap();
    let encrypted: bool =
        sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&mut connection)
            .await
            .unwrap();
    assert!(encrypted);
    connection.close().await.unwrap();

    // verify-full: the server's certificate must come from the given CA and name the host.
    let directory = tempfile::tempdir().unwrap();
    let trusted = directory.path().join("ca.pem");
    std::fs::write(&trusted, authority.certificate_pem()).unwrap();
    let verified = format!(
        "{url}?sslmode=verify-full&sslrootcert={}",
        trusted.display()
    );
    let store = Store::open(&verified).await.unwrap();
    assert_eq!(store.list_tenants().await.unwrap().len(), tenants.len());
    store.close().await;

    let stranger = directory.path().join("other-ca.pem");
    let other_authority = TestAuthority::new("another CA").unwrap();
    std::fs::write(&stranger, other_authority.certificate_pem()).unwrap();
    let unverifiable = format!(
        "{url}?sslmode=verify-full&sslrootcert={}",
        stranger.display()
    );
    let error = check_database(&unverifiable, DATABASE_CHECK_TIMEOUT)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains(&format!("127.0.0.1:{}", server.port())),
        "{error}"
    );
}

#[test]
fn the_binary_names_an_unreachable_database_and_never_its_password() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_carve-scheduler"))
        .args(["--listen", "127.0.0.1:0", "--database"])
        .arg(format!(
            "postgres://carve:hunter2-secret@127.0.0.1:{port}/carve?sslmode=require"
        ))
        .env("CARVE_ADMIN_TOKEN", "carve_unreachable_admin")
        .env_remove("CARVE_CONFIG")
        .env_remove("CARVE_LISTEN")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(30), "{stderr}");
    assert!(stderr.contains(&format!("127.0.0.1:{port}")), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
    assert!(!stderr.contains("listening"), "{stderr}");
}
