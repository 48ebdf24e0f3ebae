//! A command job in its own image through the whole system (issue 30): the real
//! scheduler (gRPC, SQLite) and the real worker with runc, a private registry on
//! loopback (`docker-registry`), the tenant's pull secret kept by the scheduler. A job
//! names the image by tag; the worker pulls it with the credential the scheduler sends in
//! the assignment, the program runs in it and sees the image's files, and the job
//! records the digest the tag resolved to. A second job naming the same tag starts from
//! the node's cache; a job naming a tag the registry lacks fails saying so, not as an
//! OOM and without a retry.
//!
//! Needs `docker-registry`, runc and root (CI has all three); elsewhere it says why it
//! cannot run, and in CI it fails instead.

use std::path::PathBuf;

use carve_proto::v1;
use carve_proto::v1::secret_service_client::SecretServiceClient;
use carve_worker::image::ImageSettings;
use carve_worker::image::layout::write_image;
use carve_worker::sandbox::SandboxPolicy;
use oci_client::secrets::RegistryAuth;

#[path = "support/cluster.rs"]
#[allow(dead_code, reason = "not every helper is used here")]
mod cluster;
#[path = "support/registry.rs"]
#[allow(dead_code, reason = "not every helper is used here")]
mod registry_support;
#[allow(dead_code, reason = "not every helper is used here")]
mod support;

use cluster::Cluster;
use registry_support::{
    PASSWORD, USER, client, push, registry_binary, start_registry, test_image_layers,
};
use support::{authorized, can_contain};

const ADMIN: &str = "carve_image_end_to_end_admin_secret";

fn image_job(name: &str, image: &str) -> String {
    serde_json::json!({
        "name": name,
        "command": {
            "argv": ["/opt/train.sh"],
            "image": image,
            "image_pull_secret": "team-registry",
            "global_batch": 8, "micro_batch": 8, "steps": 1,
        },
        "resources": { "vram": "256MiB" },
    })
    .to_string()
}

fn messages(lines: &[v1::JobLogLine]) -> Vec<&str> {
    lines.iter().map(|line| line.message.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_runs_in_its_private_image_pulled_with_the_secret_the_scheduler_keeps() {
    let Some(binary) = registry_binary() else {
        return;
    };
    if !can_contain() {
        eprintln!("skipped: this machine cannot contain attempts (runc and root); CI must");
        return;
    }
    let registry = start_registry(&binary, true);
    let directory = tempfile::tempdir().unwrap();
    let image = write_image(
        &directory.path().join("layout"),
        "train:1",
        &test_image_layers(),
        &["PATH=/bin:/opt".to_string()],
        None,
    )
    .unwrap();
    let tag = format!("{}/team/train:1", registry.address);
    push(
        &client(),
        &tag,
        &image,
        &RegistryAuth::Basic(USER.to_string(), PASSWORD.to_string()),
    )
    .await;

    let url = format!("sqlite://{}", directory.path().join("carve.db").display());
    let cluster = Cluster::start(
        directory.path(),
        url,
        PathBuf::from(env!("CARGO_BIN_EXE_carve-worker")),
        ADMIN,
        |config| {
            config.sandbox.policy = SandboxPolicy::Required;
            config.sandbox.images = Some(ImageSettings::under(&config.checkpoint_directory));
        },
    )
    .await;
    SecretServiceClient::new(cluster.channel.clone())
        .create_secret(authorized(
            v1::CreateSecretRequest {
                tenant: String::new(),
                name: "team-registry".into(),
                value: format!("{USER}:{PASSWORD}").into_bytes(),
                replace: false,
            },
            &cluster.user,
        ))
        .await
        .unwrap();

    let first = cluster.submit(image_job("in-its-image", &tag)).await;
    let done = cluster
        .wait_for_state(&first.id, v1::JobState::Succeeded)
        .await;
    assert_eq!(done.image_digest, image.manifest_digest, "{done:#?}");
    let lines = cluster.attempt_lines(&first.id, 1).await;
    let said = messages(&lines);
    assert!(
        said.contains(&"training in carve test image"),
        "the program saw the image's files: {said:#?}"
    );
    assert!(
        said.iter()
            .any(|line| line.contains("pulled into this node's cache")),
        "{said:#?}"
    );
    // The credential never shows in the job's log.
    assert!(
        !said.iter().any(|line| line.contains(PASSWORD)),
        "{said:#?}"
    );

    let second = cluster.submit(image_job("from-the-cache", &tag)).await;
    cluster
        .wait_for_state(&second.id, v1::JobState::Succeeded)
        .await;
    let lines = cluster.attempt_lines(&second.id, 1).await;
    let said = messages(&lines);
    assert!(said.contains(&"training in carve test image"), "{said:#?}");
    assert!(
        !said
            .iter()
            .any(|line| line.contains("pulled into this node's cache")),
        "the second job pulled again: {said:#?}"
    );

    let missing = cluster
        .submit(image_job(
            "missing-tag",
            &format!("{}/team/train:2", registry.address),
        ))
        .await;
    let failed = cluster
        .wait_for_state(&missing.id, v1::JobState::Failed)
        .await;
    assert_eq!(failed.attempts.len(), 1, "not retried: {failed:#?}");
    let reason = &failed.attempts[0].failure_message;
    assert!(reason.contains("team/train:2"), "{reason}");
    assert_ne!(
        failed.attempts[0].outcome,
        v1::AttemptOutcome::OutOfMemory as i32
    );
}
