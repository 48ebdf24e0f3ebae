//! Job images through the real scheduler (issue 30), with a test worker that speaks the
//! protocol by hand: a pull secret is its own tenant's (another tenant's job naming it
//! is refused at admission), its credential travels only in its job's assignments and
//! never shows in a read, a listing, a job's logs or the scheduler's own log; the first
//! attempt's digest is recorded and named in the retry's assignment; a pull under way
//! is the attempt's state; a worker holding the image is preferred on a tie. The real
//! registry, worker and container are in worker/tests/image_registry.rs.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::secret_service_client::SecretServiceClient;
use carve_scheduler::scheduler::sealed_secrets::{Sealing, SecretsKey};
use tonic::Code;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::authorized;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{
    all_job_logs, get, list_jobs, start_with_worker, submit, tenant_with_tokens, wait_for_state,
};

/// The credential's password: it must never be shown.
const PASSWORD: &str = "hunter2-Zx9-never-shown";
const DIGEST: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";

/// Everything the scheduler logs in this test binary, at every level.
fn scheduler_log() -> Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let writer = SharedWriter(log.clone());
        tracing::subscriber::set_global_default(
            tracing_subscriber::fmt()
                .with_max_level(tracing::Level::TRACE)
                .with_ansi(false)
                .with_writer(move || writer.clone())
                .finish(),
        )
        .expect("the only subscriber");
        log
    })
    .clone()
}

#[derive(Clone)]
struct SharedWriter(Arc<Mutex<Vec<u8>>>);

impl Write for SharedWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A command job in `registry.example.org/team/train:v1`, pulled with `secret` if any.
fn image_job(name: &str, secret: Option<&str>) -> String {
    let mut command = serde_json::json!({
        "argv": ["python3", "train.py"],
        "global_batch": 8,
        "steps": 4,
        "image": "registry.example.org/team/train:v1",
    });
    if let Some(secret) = secret {
        command["image_pull_secret"] = secret.into();
    }
    serde_json::json!({
        "name": name,
        "command": command,
        "resources": { "vram": "1GiB" },
    })
    .to_string()
}

async fn create_secret(
    channel: &tonic::transport::Channel,
    token: &str,
    tenant: &str,
    name: &str,
    value: &str,
) -> Result<v1::Secret, tonic::Status> {
    SecretServiceClient::new(channel.clone())
        .create_secret(authorized(
            v1::CreateSecretRequest {
                tenant: tenant.into(),
                name: name.into(),
                value: value.as_bytes().to_vec(),
                replace: false,
            },
            token,
        ))
        .await
        .map(|response| response.into_inner().secret.unwrap())
}

async fn list_secrets(
    channel: &tonic::transport::Channel,
    token: &str,
    tenant: &str,
) -> Result<v1::ListSecretsResponse, tonic::Status> {
    SecretServiceClient::new(channel.clone())
        .list_secrets(authorized(
            v1::ListSecretsRequest {
                tenant: tenant.into(),
            },
            token,
        ))
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test]
async fn a_pull_secret_is_its_tenants_and_travels_only_in_its_jobs_assignments() {
    let log = scheduler_log();
    let (_cluster, channel, alice, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    let (bob, _) = tenant_with_tokens(&channel, "bob", v1::Quota::default()).await;

    let created = create_secret(
        &channel,
        &alice,
        "",
        "registry",
        &format!("robot:{PASSWORD}\n"),
    )
    .await
    .unwrap();
    assert_eq!(
        (created.tenant.as_str(), created.name.as_str()),
        ("alice", "registry")
    );
    // A value that is no credential is refused without being quoted.
    let refused = create_secret(&channel, &alice, "", "other", PASSWORD)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        !refused.message().contains(PASSWORD),
        "{}",
        refused.message()
    );

    // Bob can neither see Alice's secrets nor pull with one: his job naming hers is
    // refused at admission, naming the field.
    let denied = list_secrets(&channel, &bob, "alice").await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    assert!(
        list_secrets(&channel, &bob, "")
            .await
            .unwrap()
            .secrets
            .is_empty()
    );
    let refused = submit(&channel, &bob, &image_job("bobs", Some("registry")), "")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().contains("command.image_pull_secret"),
        "{}",
        refused.message()
    );

    // Alice's own job: its assignment carries her credential.
    let job = submit(&channel, &alice, &image_job("alices", Some("registry")), "")
        .await
        .unwrap()
        .job
        .unwrap();
    let first = worker.next_assignment().await;
    let credential = first.image_pull_credential.clone().expect("a credential");
    assert_eq!(
        (credential.username.as_str(), credential.password.as_str()),
        ("robot", PASSWORD)
    );
    assert_eq!(first.image_digest, "", "nothing pulled yet");

    // The pull under way is the attempt's state.
    worker
        .send(v1::worker_message::Body::ImagePull(
            v1::worker_message::ImagePullProgress {
                attempt: first.attempt.clone(),
                pull: Some(v1::ImagePull {
                    image: "registry.example.org/team/train:v1".into(),
                    done_bytes: 3 << 20,
                    total_bytes: 10 << 20,
                }),
            },
        ))
        .await;
    let pulling = get(&channel, &alice, &job.id).await.unwrap();
    let pull = pulling.attempts[0].image_pull.clone().expect("the pull");
    assert_eq!((pull.done_bytes, pull.total_bytes), (3 << 20, 10 << 20));

    // It started in the image it resolved; a lost attempt is retried in exactly it.
    worker
        .send(v1::worker_message::Body::AttemptStarted(
            v1::worker_message::AttemptStarted {
                attempt: first.attempt.clone(),
                reserved_bytes: first.slice_bytes,
                resumed_from: None,
                command_argv: vec!["python3".into(), "train.py".into()],
                uncontained: false,
                image_digest: DIGEST.into(),
            },
        ))
        .await;
    let running = get(&channel, &alice, &job.id).await.unwrap();
    assert_eq!(running.image_digest, DIGEST);
    assert!(running.attempts[0].image_pull.is_none(), "started: no pull");
    worker
        .finish(
            first.attempt.as_ref().unwrap(),
            v1::AttemptOutcome::Interrupted,
            0,
        )
        .await;
    let second = worker.next_assignment().await;
    assert_eq!(second.attempt.as_ref().unwrap().attempt_number, 2);
    assert_eq!(
        second.image_digest, DIGEST,
        "the retry runs the first digest"
    );
    assert!(second.image_pull_credential.is_some());
    worker.started(&second).await;
    worker
        .finish(
            second.attempt.as_ref().unwrap(),
            v1::AttemptOutcome::Succeeded,
            1 << 20,
        )
        .await;
    wait_for_state(&channel, &alice, &job.id, v1::JobState::Succeeded).await;

    // A job that names no secret gets no credential.
    submit(&channel, &alice, &image_job("public", None), "")
        .await
        .unwrap();
    let public = worker.next_assignment().await;
    assert!(public.image_pull_credential.is_none());

    // Nothing shows the password: reads, listings, logs, the scheduler's own log.
    let shown = format!(
        "{:?} {:?} {:?} {:?}",
        get(&channel, &alice, &job.id).await.unwrap(),
        list_jobs(&channel, &alice, v1::ListJobsRequest::default())
            .await
            .unwrap(),
        all_job_logs(&channel, &alice, &job.id).await,
        list_secrets(&channel, &alice, "").await.unwrap(),
    );
    assert!(shown.contains(DIGEST), "the reads are the job's");
    assert!(!shown.contains(PASSWORD), "{shown}");
    let logged = String::from_utf8_lossy(&log.lock().unwrap()).to_string();
    assert!(logged.contains("secret stored"), "the log is captured");
    assert!(!logged.contains(PASSWORD), "{logged}");
}

/// The key the sealing test's scheduler keeps secrets with.
const SECRETS_KEY: &str = "5b1f0e9c2d7a4e3b8c6f1a0d9e2b7c4a3f8e1d6c0b9a2e7f4d3c8b1a6e0f9d2c";

/// With a secrets key, the database holds no credential: whoever reads its file (a
/// backup, a database administrator) finds neither the password nor the user name, and
/// the assignment still carries the credential. Someone who can write the database moves
/// Alice's sealed value into Bob's secret of the same name: Bob's job gets no credential
/// (the value opens only in its own row). Fails with sealing off (values stored as they
/// are): the file holds the password and Bob's job pulls with Alice's credential.
#[tokio::test]
async fn with_a_secrets_key_the_database_holds_no_credential_and_a_moved_value_opens_nowhere() {
    let key = SecretsKey::from_hex(SECRETS_KEY).unwrap();
    let cluster = cluster::start_adjusted(Duration::from_secs(30), |settings| {
        settings.sealing.key = Some(key);
    })
    .await;
    let channel = cluster::channel(&cluster).await;
    let (alice, worker_token) = tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    let (bob, _) = tenant_with_tokens(&channel, "bob", v1::Quota::default()).await;
    let mut worker =
        test_worker::TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    create_secret(
        &channel,
        &alice,
        "",
        "registry",
        &format!("robot:{PASSWORD}"),
    )
    .await
    .unwrap();
    create_secret(&channel, &bob, "", "registry", "bob:bobs-own-password")
        .await
        .unwrap();

    // The database's files, as a reader of them sees them.
    let mut files = Vec::new();
    for entry in std::fs::read_dir(cluster._directory.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            files.extend(std::fs::read(&path).unwrap());
        }
    }
    let contains = |needle: &[u8]| files.windows(needle.len()).any(|window| window == needle);
    assert!(
        !contains(PASSWORD.as_bytes()),
        "the password is in the database"
    );
    assert!(!contains(b"robot:"), "the user name is in the database");

    // Alice's job pulls with her credential.
    submit(&channel, &alice, &image_job("alices", Some("registry")), "")
        .await
        .unwrap();
    let assignment = worker.next_assignment().await;
    let credential = assignment.image_pull_credential.expect("a credential");
    assert_eq!(
        (credential.username.as_str(), credential.password.as_str()),
        ("robot", PASSWORD)
    );

    // Alice's sealed value, moved into Bob's row, opens there as nothing.
    let store = cluster.other_replica().await;
    let sealed = store
        .secret_value("alice", "registry")
        .await
        .unwrap()
        .unwrap();
    let database = sqlx::SqlitePool::connect(&cluster::sqlite_url(cluster._directory.path()))
        .await
        .unwrap();
    sqlx::query("UPDATE tenant_secrets SET value = $1 WHERE tenant = 'bob' AND name = 'registry'")
        .bind(&sealed)
        .execute(&database)
        .await
        .unwrap();
    submit(&channel, &bob, &image_job("bobs", Some("registry")), "")
        .await
        .unwrap();
    let bobs = worker.next_assignment().await;
    assert!(
        bobs.image_pull_credential.is_none(),
        "Bob's job pulls with {:?}",
        bobs.image_pull_credential
    );
}

/// A scheduler on the SQLite database at `url` with `sealing`: its address and what
/// stops it (awaited: the database's lock is free again after).
async fn scheduler_with_sealing(
    url: &str,
    sealing: Sealing,
) -> (
    String,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let mut config = cluster::test_config(url.to_string(), Duration::from_secs(30), None);
    config.settings.sealing = sealing;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        carve_scheduler::server::run(config, listener, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    (address, stop, running)
}

/// A key rotation: the scheduler restarted with a new `--secrets-key-file` and the old
/// key as `--secrets-previous-key-file` still gives a job the credential the old key
/// sealed, and has sealed it again with the new key: it opens with the new key alone
/// and no longer with the old one, so the old key can be retired. Fails without the
/// previous key (the job pulls with no credential) and without sealing again at start
/// (the stored value still needs the old key).
#[tokio::test]
async fn after_a_key_rotation_old_secrets_still_pull_and_are_sealed_again_with_the_new_key() {
    let old = SecretsKey::from_hex(SECRETS_KEY).unwrap();
    let new = SecretsKey::from_hex(&"5a".repeat(32)).unwrap();
    let directory = tempfile::tempdir().unwrap();
    let url = cluster::sqlite_url(directory.path());
    let value = format!("robot:{PASSWORD}");

    let (address, stop, running) = scheduler_with_sealing(
        &url,
        Sealing {
            key: Some(old.clone()),
            previous_keys: Vec::new(),
        },
    )
    .await;
    let channel = cluster::connect(&address).await;
    let (alice, worker_token) = tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    create_secret(&channel, &alice, "", "registry", &value)
        .await
        .unwrap();
    let _ = stop.send(());
    running.await.unwrap();

    let (address, _stop, _running) = scheduler_with_sealing(
        &url,
        Sealing {
            key: Some(new.clone()),
            previous_keys: vec![old.clone()],
        },
    )
    .await;
    let channel = cluster::connect(&address).await;
    let mut worker =
        test_worker::TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    submit(
        &channel,
        &alice,
        &image_job("rotated", Some("registry")),
        "",
    )
    .await
    .unwrap();
    let credential = worker
        .next_assignment()
        .await
        .image_pull_credential
        .expect("the credential the old key sealed");
    assert_eq!(
        (credential.username.as_str(), credential.password.as_str()),
        ("robot", PASSWORD)
    );

    let stored = carve_scheduler::store::Store::open(&url)
        .await
        .unwrap()
        .secret_value("alice", "registry")
        .await
        .unwrap()
        .unwrap();
    let opened_by = |key: &SecretsKey| {
        Sealing {
            key: Some(key.clone()),
            previous_keys: Vec::new(),
        }
        .open("alice", "registry", &stored)
    };
    assert_eq!(opened_by(&new).unwrap(), value.as_bytes());
    assert!(opened_by(&old).is_err(), "still sealed with the old key");
}
