//! Job images against a real registry on loopback: the Debian `docker-registry` package's
//! binary (distribution 2.8), started by the test, one open and one behind htpasswd. An
//! image the test builds (the static busybox and a shell training stand-in) is pushed
//! with `oci-client`, then the worker's image cache pulls it: once for several attempts,
//! by tag, through a multi-platform index; a wrong digest, a missing tag and a private
//! image without a credential each fail with a reason that says so. Command attempts
//! under runc (`pinned_attempts`): a retry pinned to the digest its first attempt
//! pulled runs those bytes though the tag was pushed again, with the tenant's credential
//! as the scheduler's assignment carries it.
//!
//! Needs `docker-registry` (CI installs it); elsewhere the test says why it cannot run,
//! and in CI (`CI` set) it fails instead.

use std::path::Path;
use std::time::Duration;

use carve_worker::image::layout::{LayerToWrite, WrittenImage, tar_of_files, write_image};
use carve_worker::image::{
    Compression, ImageCache, ImageFailure, ImageRequest, ImageSettings, RegistryAuthority,
    RegistryCredential,
};
use oci_client::Reference;
use oci_client::manifest::{OCI_IMAGE_INDEX_MEDIA_TYPE, OCI_IMAGE_MEDIA_TYPE};
use oci_client::secrets::RegistryAuth;

#[path = "support/registry.rs"]
mod registry_support;
use registry_support::{
    PASSWORD, Registry, USER, client, push, push_manifest, registry_binary, start_registry,
    start_tls_registry, test_image_layers, tls_client,
};

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{:x}", sha2::Sha256::digest(bytes))
}

fn cache(directory: &Path, registries: &[&Registry]) -> ImageCache {
    ImageCache::open(&ImageSettings {
        cache_directory: directory.join("cache"),
        cache_limit_bytes: 1 << 30,
        insecure_registries: registries
            .iter()
            .map(|registry| registry.address.clone())
            .collect(),
        layout_directories: Vec::new(),
        registry_authorities: Vec::new(),
        archives: Vec::new(),
    })
    .unwrap()
}

fn request(reference: &str) -> ImageRequest {
    ImageRequest {
        reference: reference.to_string(),
        pinned_digest: None,
        credential: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_image_pushed_to_a_registry_is_pulled_once_for_every_attempt() {
    let Some(binary) = registry_binary() else {
        return;
    };
    let registry = start_registry(&binary, false);
    let directory = tempfile::tempdir().unwrap();
    let layout = directory.path().join("layout");
    let image = write_image(
        &layout,
        "train:1",
        &test_image_layers(),
        &["PATH=/bin:/opt".to_string()],
        Some("/opt"),
    )
    .unwrap();
    let client = client();
    let tagged = format!("{}/team/train:1", registry.address);
    push(&client, &tagged, &image, &RegistryAuth::Anonymous).await;

    // A multi-platform index under another tag: this node's manifest and another
    // platform's (which the worker must not choose: its files say so).
    let other_image = write_image(
        &layout,
        "train:other-platform",
        &[LayerToWrite {
            tar: tar_of_files(&[("etc/carve-image", b"wrong platform\n", 0o644)], &[]),
            compression: Compression::Gzip,
        }],
        &[],
        None,
    )
    .unwrap();
    push(
        &client,
        &format!("{}/team/train:other-platform", registry.address),
        &other_image,
        &RegistryAuth::Anonymous,
    )
    .await;
    let other = other_image.manifest_digest.clone();
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_IMAGE_INDEX_MEDIA_TYPE,
        "manifests": [
            {"mediaType": OCI_IMAGE_MEDIA_TYPE, "digest": other,
             "size": other_image.manifest_bytes.len(),
             "platform": {"architecture": "s390x", "os": "linux"}},
            {"mediaType": OCI_IMAGE_MEDIA_TYPE, "digest": image.manifest_digest,
             "size": image.manifest_bytes.len(),
             "platform": {"architecture": carve_worker::image::layout::oci_architecture(), "os": "linux"}},
        ],
    });
    let index_bytes = serde_json::to_vec(&index).unwrap();
    let multi: Reference = format!("{}/team/train:multi", registry.address)
        .parse()
        .unwrap();
    push_manifest(
        &client,
        &multi,
        index_bytes.clone(),
        OCI_IMAGE_INDEX_MEDIA_TYPE,
    )
    .await;

    let cache = cache(directory.path(), &[&registry]);
    // Three attempts at once, as three slices of one node start together.
    let mut attempts = Vec::new();
    for _ in 0..3 {
        let cache = cache.clone();
        let tagged = tagged.clone();
        attempts.push(tokio::spawn(async move {
            cache.acquire(&request(&tagged), None).await
        }));
    }
    let mut held = Vec::new();
    for attempt in attempts {
        held.push(attempt.await.unwrap().unwrap());
    }
    assert_eq!(cache.pulls_done(), 1, "one pull for three attempts");
    assert_eq!(held.iter().filter(|image| image.pulled_now).count(), 1);
    let rootfs = &held[0].rootfs;
    assert_eq!(
        std::fs::read_to_string(rootfs.join("etc/carve-image")).unwrap(),
        "carve test image\n"
    );
    assert_eq!(held[0].record.digest, image.manifest_digest);
    assert_eq!(held[0].record.env, ["PATH=/bin:/opt"]);
    // The image's own files, not the host's: no /etc/passwd, /usr, ... in it.
    assert!(!rootfs.join("etc/passwd").exists());
    assert!(!rootfs.join("usr").exists());

    // Pinned to its digest (as the scheduler records it), a later attempt asks no
    // registry at all: the registry is gone and it still starts.
    let pinned = ImageRequest {
        pinned_digest: Some(image.manifest_digest.clone()),
        ..request(&tagged)
    };
    // The index resolves to its own digest and unpacks this platform's manifest.
    let through_index = cache
        .acquire(&request(&multi.to_string()), None)
        .await
        .unwrap();
    assert_eq!(through_index.record.digest, sha256(&index_bytes));
    assert_eq!(
        std::fs::read_to_string(through_index.rootfs.join("etc/carve-image")).unwrap(),
        "carve test image\n"
    );
    drop(registry);
    let again = cache.acquire(&pinned, None).await.unwrap();
    assert!(!again.pulled_now);
    assert_eq!(cache.pulls_done(), 2);

    // A second worker (its own cache) pulls it too, by digest.
    let registry = start_registry(&binary, false);
    let tagged = format!("{}/team/train:1", registry.address);
    push(&client, &tagged, &image, &RegistryAuth::Anonymous).await;
    let second_directory = tempfile::tempdir().unwrap();
    let second = cache_at(second_directory.path(), &registry);
    let by_digest = format!("{}/team/train@{}", registry.address, image.manifest_digest);
    let pulled = second.acquire(&request(&by_digest), None).await.unwrap();
    assert!(pulled.pulled_now);
    assert!(pulled.rootfs.join("opt/train.sh").exists());
}

/// A registry on loopback that speaks only TLS, its certificate signed by a private CA
/// (`--registry-ca`): with that CA named for it the worker pulls over HTTPS; with
/// another CA named for it (an impostor's certificate, as far as the worker knows) the
/// pull is refused, and so it is with no CA named (loopback means plain HTTP then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_behind_a_private_ca_is_pulled_from_only_with_that_ca_named() {
    let Some(binary) = registry_binary() else {
        return;
    };
    let directory = tempfile::tempdir().unwrap();
    let authority = carve_testing::certificates::TestAuthority::new("carve registry CA").unwrap();
    let server = authority.issue_server(&["127.0.0.1", "localhost"]).unwrap();
    let (certificate, key) = (
        directory.path().join("registry.pem"),
        directory.path().join("registry.key"),
    );
    std::fs::write(&certificate, &server.certificate_pem).unwrap();
    std::fs::write(&key, &server.private_key_pem).unwrap();
    let registry = start_tls_registry(&binary, &certificate, &key);
    let image = write_image(
        &directory.path().join("layout"),
        "train:1",
        &test_image_layers(),
        &[],
        None,
    )
    .unwrap();
    let tagged = format!("{}/team/train:1", registry.address);
    push(
        &tls_client(&authority.certificate_pem()),
        &tagged,
        &image,
        &RegistryAuth::Anonymous,
    )
    .await;

    let cache_trusting = |name: &str, authority_pem: Option<String>| {
        ImageCache::open(&ImageSettings {
            cache_directory: directory.path().join(name),
            cache_limit_bytes: 1 << 30,
            insecure_registries: Vec::new(),
            layout_directories: Vec::new(),
            registry_authorities: authority_pem
                .map(|pem| RegistryAuthority {
                    registry: registry.address.clone(),
                    certificates_pem: pem.into_bytes(),
                })
                .into_iter()
                .collect(),
            archives: Vec::new(),
        })
        .unwrap()
    };
    let trusting = cache_trusting("trusting", Some(authority.certificate_pem()));
    let pulled = trusting.acquire(&request(&tagged), None).await.unwrap();
    assert!(pulled.pulled_now);
    assert_eq!(pulled.record.digest, image.manifest_digest);

    let other = carve_testing::certificates::TestAuthority::new("another CA").unwrap();
    let impostor = cache_trusting("impostor", Some(other.certificate_pem()));
    let failure = impostor.acquire(&request(&tagged), None).await.unwrap_err();
    assert!(
        failure.to_string().to_lowercase().contains("certificate"),
        "{failure}"
    );
    let naming_none = cache_trusting("naming-none", None);
    assert!(naming_none.acquire(&request(&tagged), None).await.is_err());
}

fn cache_at(directory: &Path, registry: &Registry) -> ImageCache {
    cache(directory, &[registry])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_digest_a_missing_tag_and_a_private_image_without_a_secret_fail_clearly() {
    let Some(binary) = registry_binary() else {
        return;
    };
    let open = start_registry(&binary, false);
    let private = start_registry(&binary, true);
    let directory = tempfile::tempdir().unwrap();
    let image = write_image(
        &directory.path().join("layout"),
        "train:1",
        &test_image_layers(),
        &[],
        None,
    )
    .unwrap();
    let client = client();
    push(
        &client,
        &format!("{}/team/train:1", open.address),
        &image,
        &RegistryAuth::Anonymous,
    )
    .await;
    let credential = RegistryAuth::Basic(USER.to_string(), PASSWORD.to_string());
    push(
        &client,
        &format!("{}/team/secret:1", private.address),
        &image,
        &credential,
    )
    .await;
    let cache = cache(directory.path(), &[&open, &private]);

    // The job was pinned to other bytes than the tag now names (a retag).
    let wrong = format!("sha256:{}", "0".repeat(64));
    let retagged = ImageRequest {
        pinned_digest: Some(wrong.clone()),
        ..request(&format!("{}/team/train:1", open.address))
    };
    let failure = cache.acquire(&retagged, None).await.unwrap_err();
    assert!(
        matches!(
            &failure,
            ImageFailure::NotFound(_) | ImageFailure::DigestMismatch(_)
        ),
        "{failure}"
    );
    assert!(!failure.is_transient());
    // A reference that names a digest the tag does not resolve to.
    let failure = cache
        .acquire(
            &ImageRequest {
                pinned_digest: Some(wrong),
                ..request(&format!(
                    "{}/team/train@{}",
                    open.address, image.manifest_digest
                ))
            },
            None,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&failure, ImageFailure::DigestMismatch(reason) if reason.contains("pinned")),
        "{failure}"
    );

    let failure = cache
        .acquire(&request(&format!("{}/team/train:2", open.address)), None)
        .await
        .unwrap_err();
    assert!(
        matches!(&failure, ImageFailure::NotFound(reason) if reason.contains("team/train:2")),
        "{failure}"
    );
    assert_eq!(
        failure.to_string().split(':').next(),
        Some("image not found")
    );

    let private_reference = format!("{}/team/secret:1", private.address);
    let failure = cache
        .acquire(&request(&private_reference), None)
        .await
        .unwrap_err();
    assert!(
        matches!(&failure, ImageFailure::Unauthorized(reason) if reason.contains("image_pull_secret")),
        "{failure}"
    );
    let wrong_password = ImageRequest {
        credential: Some(RegistryCredential {
            username: USER.to_string(),
            password: "not-the-password".to_string(),
        }),
        ..request(&private_reference)
    };
    let failure = cache.acquire(&wrong_password, None).await.unwrap_err();
    assert!(
        matches!(failure, ImageFailure::Unauthorized(_)),
        "{failure}"
    );
    assert!(!failure.to_string().contains("not-the-password"));

    let with_secret = ImageRequest {
        credential: Some(RegistryCredential {
            username: USER.to_string(),
            password: PASSWORD.to_string(),
        }),
        ..request(&private_reference)
    };
    let pulled = cache.acquire(&with_secret, None).await.unwrap();
    assert!(pulled.rootfs.join("etc/carve-image").exists());
    assert!(cache.cached_digests().contains(&image.manifest_digest));
    // Another job (another tenant) naming the same private image without the secret is
    // refused, although the node has it cached and has used a credential for that
    // registry: the registry is asked for every unpinned reference, with the job's own
    // credential only.
    let failure = cache
        .acquire(&request(&private_reference), None)
        .await
        .unwrap_err();
    assert!(
        matches!(failure, ImageFailure::Unauthorized(_)),
        "{failure}"
    );
    let failure = cache
        .acquire(
            &request(&format!(
                "{}/team/secret@{}",
                private.address, image.manifest_digest
            )),
            None,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(failure, ImageFailure::Unauthorized(_)),
        "{failure}"
    );
}

/// The test image saying `marker` in /etc/carve-image (what its stand-in prints).
fn image_saying(layout: &Path, marker: &str) -> WrittenImage {
    let mut layers = test_image_layers();
    let train = b"#!/bin/sh\necho \"training in $(cat /etc/carve-image)\"\n";
    layers[1] = LayerToWrite {
        tar: tar_of_files(
            &[
                ("etc/carve-image", marker.as_bytes(), 0o644),
                ("opt/train.sh", train, 0o755),
            ],
            &[],
        ),
        compression: Compression::Zstd,
    };
    write_image(
        layout,
        "train:v1",
        &layers,
        &["PATH=/bin:/opt".to_string()],
        None,
    )
    .unwrap()
}

/// Command attempts in a job's image from the private registry, under runc, as the
/// worker runs them with what the scheduler's assignment says of the image.
mod pinned_attempts {
    use std::sync::Arc;

    use carve_core::command::validate::{ValidatedSpec, parse_spec_json};
    use carve_proto::v1;
    use carve_proto::v1::worker_message::Body;
    use carve_worker::command_attempt::{AssignedImage, CommandAttemptLaunch, run_command_attempt};
    use carve_worker::sandbox::{Sandbox, SandboxPolicy, SandboxSettings};
    use serde_json::json;
    use tokio::sync::mpsc;

    use super::*;

    /// A sandbox whose image cache reaches `registry` over plain HTTP; `None` (the test
    /// says why) where this machine cannot contain a program, which CI must.
    fn sandbox(worker: &Path, registry: &Registry) -> Option<Arc<Sandbox>> {
        let settings = SandboxSettings {
            policy: SandboxPolicy::Required,
            images: Some(ImageSettings {
                cache_directory: worker.join("image-cache"),
                cache_limit_bytes: 1 << 30,
                insecure_registries: vec![registry.address.clone()],
                layout_directories: Vec::new(),
                registry_authorities: Vec::new(),
                archives: Vec::new(),
            }),
            ..SandboxSettings::default()
        };
        match Sandbox::open(&settings, worker, "test-node") {
            Ok(Some(sandbox)) => Some(Arc::new(sandbox)),
            other if std::env::var_os("CI").is_none() => {
                eprintln!("skipped: no sandbox on this machine ({other:?})");
                None
            }
            other => panic!("CI must be able to run image containers: {other:?}"),
        }
    }

    fn launch(
        worker: &Path,
        sandbox: &Arc<Sandbox>,
        number: u32,
        image: &str,
        assigned: AssignedImage,
    ) -> CommandAttemptLaunch {
        let spec = json!({"name": "pinned", "resources": {"vram": "1GiB"},
                          "command": {"argv": ["/opt/train.sh"], "global_batch": 8,
                                      "steps": 4, "image": image,
                                      "image_pull_secret": "registry"}});
        let ValidatedSpec::Command(job) = parse_spec_json(&spec.to_string()).unwrap() else {
            panic!("not a command job");
        };
        CommandAttemptLaunch {
            attempt: v1::AttemptRef {
                job_id: "job-pinned".into(),
                attempt_number: number,
                ..Default::default()
            },
            config: job.initial_config(),
            job,
            slice_bytes: 64 << 20,
            gpu_uuid: "GPU-sim-test".into(),
            guard_library: None,
            checkpoint_dir: worker.join("job-pinned"),
            attempt_directory: worker.join(format!("job-pinned.attempt-{number}.run")),
            profile: false,
            resume_from: None,
            sandbox: Some(sandbox.clone()),
            tenant: "alice".into(),
            image: assigned,
            devices: Default::default(),
            simulated_gpu_socket: None,
            container_name: format!("carve-pinned-{number}"),
            supervision: None,
        }
    }

    /// Runs one attempt to its end (within a deadline): its outcome and message, the
    /// digest its start reported, and what its program printed.
    async fn run(launch: CommandAttemptLaunch) -> (v1::AttemptOutcome, String, String, String) {
        let (reports, mut incoming) = mpsc::unbounded_channel();
        let (_control, control_receiver) = mpsc::unbounded_channel();
        tokio::time::timeout(
            Duration::from_secs(120),
            run_command_attempt(launch, reports, control_receiver, (), || {}),
        )
        .await
        .expect("the attempt ended in time");
        let (mut digest, mut printed) = (String::new(), String::new());
        let mut end = None;
        while let Ok(body) = incoming.try_recv() {
            match body {
                Body::AttemptStarted(started) => digest = started.image_digest,
                Body::Log(line) if line.message.starts_with("training in ") => {
                    printed = line.message
                }
                // The worker's word on the image (pulled, with its time, or cached).
                Body::Log(line) if line.message.starts_with("image ") => {
                    eprintln!("{}", line.message)
                }
                Body::AttemptFinished(finished) => {
                    end = Some((
                        v1::AttemptOutcome::try_from(finished.outcome).unwrap(),
                        finished.message,
                    ))
                }
                _ => {}
            }
        }
        let (outcome, message) = end.expect("a final report");
        (outcome, message, digest, printed)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retry_runs_the_digest_its_first_attempt_pulled_though_the_tag_moved() {
        let Some(binary) = registry_binary() else {
            return;
        };
        let private = start_registry(&binary, true);
        let directory = tempfile::tempdir().unwrap();
        let worker = directory.path().join("worker");
        std::fs::create_dir_all(&worker).unwrap();
        let Some(sandbox) = sandbox(&worker, &private) else {
            return;
        };
        let client = client();
        let auth = RegistryAuth::Basic(USER.to_string(), PASSWORD.to_string());
        let tag = format!("{}/team/train:v1", private.address);
        let first = image_saying(&directory.path().join("layout"), "first push");
        push(&client, &tag, &first, &auth).await;
        // The tenant's secret, as the scheduler sends it with the assignment.
        let credential = Some(RegistryCredential {
            username: USER.into(),
            password: PASSWORD.into(),
        });

        // Attempt 1 resolves the tag and says which digest it ran. Each attempt's wall
        // time to its end is printed for BENCHMARKS.md (the first pulls and unpacks, the
        // next start from the cache); nothing is asserted on it.
        let started = std::time::Instant::now();
        let (outcome, message, digest, printed) = run(launch(
            &worker,
            &sandbox,
            1,
            &tag,
            AssignedImage {
                pinned_digest: None,
                credential: credential.clone(),
            },
        ))
        .await;
        assert_eq!(outcome, v1::AttemptOutcome::Succeeded, "{message}");
        assert_eq!(digest, first.manifest_digest);
        assert_eq!(printed, "training in first push");
        eprintln!("attempt 1 (pull and unpack): {:?}", started.elapsed());

        // The tag is pushed again with other bytes; the retry is pinned to the first
        // digest (Assignment.image_digest) and runs exactly those.
        let second = image_saying(&directory.path().join("layout-2"), "second push");
        push(&client, &tag, &second, &auth).await;
        let started = std::time::Instant::now();
        let (outcome, message, digest, printed) = run(launch(
            &worker,
            &sandbox,
            2,
            &tag,
            AssignedImage {
                pinned_digest: Some(first.manifest_digest.clone()),
                credential: credential.clone(),
            },
        ))
        .await;
        assert_eq!(outcome, v1::AttemptOutcome::Succeeded, "{message}");
        assert_eq!(digest, first.manifest_digest);
        assert_eq!(printed, "training in first push");
        eprintln!(
            "attempt 2 (pinned, from the cache): {:?}",
            started.elapsed()
        );

        // Without the pin the same tag now runs the second push: the pin is what keeps
        // the job on its bytes.
        let (outcome, message, digest, printed) = run(launch(
            &worker,
            &sandbox,
            3,
            &tag,
            AssignedImage {
                pinned_digest: None,
                credential: credential.clone(),
            },
        ))
        .await;
        assert_eq!(outcome, v1::AttemptOutcome::Succeeded, "{message}");
        assert_eq!(digest, second.manifest_digest);
        assert_eq!(printed, "training in second push");

        // A job naming a secret whose credential did not come fails saying so.
        let (outcome, message, _, _) = run(launch(
            &worker,
            &sandbox,
            4,
            &format!("{}/team/train:other", private.address),
            AssignedImage::default(),
        ))
        .await;
        assert_eq!(outcome, v1::AttemptOutcome::Failed, "{message}");
        assert!(message.contains("command.image_pull_secret"), "{message}");
    }
}
