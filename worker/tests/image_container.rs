//! A run in its job's image with the real OCI runtime: the program sees the image's files
//! (a static busybox and a training stand-in), not the host's; the root is read-only;
//! its job's directory is there at its host path; the cached image is left exactly as it
//! was; and an image whose links point at host paths makes its mount points inside its
//! own root. Needs runc and root (CI has both) and the static busybox
//! (`busybox-static`, which CI installs); elsewhere it says why it cannot run, and
//! fails in CI.

use std::path::{Path, PathBuf};
use std::time::Duration;

use carve_worker::image::layout::{LayerToWrite, is_static_executable, tar_of_files, write_image};
use carve_worker::image::{Compression, ImageCache, ImageRequest, ImageSettings, PulledImage};
use carve_worker::sandbox::{
    ContainerRequest, HostPath, Sandbox, SandboxPolicy, SandboxSettings, container_exit_status,
    give_directory_to,
};

const BUSYBOX: &str = "/bin/busybox";

fn sandbox(directory: &Path) -> Option<Sandbox> {
    let settings = SandboxSettings {
        policy: SandboxPolicy::Required,
        ..SandboxSettings::default()
    };
    let busybox_is_static = std::fs::read(BUSYBOX).is_ok_and(|bytes| is_static_executable(&bytes));
    let ready = match Sandbox::open(&settings, directory, "test-node") {
        Ok(Some(sandbox)) if busybox_is_static => Ok(sandbox),
        Ok(Some(_)) => Err(format!(
            "no static {BUSYBOX} (apt-get install busybox-static)"
        )),
        Ok(None) => Err("no sandbox".to_string()),
        Err(error) => Err(error.to_string()),
    };
    match ready {
        Ok(sandbox) => Some(sandbox),
        Err(reason) if std::env::var_os("CI").is_none() => {
            eprintln!("skipped: {reason}");
            None
        }
        Err(reason) => panic!("CI must be able to run image containers: {reason}"),
    }
}

/// The test image, from an OCI layout (the cache's air-gapped source): busybox with its
/// applets linked, the stand-in, a marker file, and `extra_links`.
async fn image(
    directory: &Path,
    extra_links: &[(&str, &str)],
) -> (ImageCache, PulledImage, PathBuf) {
    let busybox = std::fs::read(BUSYBOX).unwrap();
    let train = b"#!/bin/sh\necho \"training in $(cat /etc/carve-image)\"\n";
    let mut links = vec![
        ("bin/sh", "busybox"),
        ("bin/cat", "busybox"),
        ("bin/ls", "busybox"),
        ("bin/touch", "busybox"),
        ("bin/echo", "busybox"),
        ("bin/id", "busybox"),
    ];
    links.extend_from_slice(extra_links);
    let layout = directory.join("layout");
    write_image(
        &layout,
        "carve.test/team/busybox:1",
        &[
            LayerToWrite {
                tar: tar_of_files(&[("bin/busybox", &busybox, 0o755)], &links),
                compression: Compression::Gzip,
            },
            LayerToWrite {
                tar: tar_of_files(
                    &[
                        ("etc/carve-image", b"carve test image", 0o644),
                        ("opt/train.sh", train, 0o755),
                    ],
                    &[],
                ),
                compression: Compression::Zstd,
            },
        ],
        &[
            "PATH=/bin:/opt".to_string(),
            "IMAGE_ONLY=from-the-image".to_string(),
        ],
        None,
    )
    .unwrap();
    let cache = ImageCache::open(&ImageSettings {
        cache_directory: directory.join("worker/images"),
        cache_limit_bytes: 1 << 30,
        insecure_registries: Vec::new(),
        layout_directories: vec![layout],
        registry_authorities: Vec::new(),
        archives: Vec::new(),
    })
    .unwrap();
    let pulled = cache
        .acquire(
            &ImageRequest {
                reference: "carve.test/team/busybox:1".to_string(),
                pinned_digest: None,
                credential: None,
            },
            None,
        )
        .await
        .unwrap();
    let rootfs = pulled.rootfs.clone();
    (cache, pulled, rootfs)
}

/// Every path under `root`, relative, sorted: what an image's cached root holds.
fn listing(root: &Path) -> Vec<String> {
    let mut paths = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).unwrap() {
            let entry = entry.unwrap();
            paths.push(
                entry
                    .path()
                    .strip_prefix(root)
                    .unwrap()
                    .display()
                    .to_string(),
            );
            if entry.file_type().unwrap().is_dir() {
                pending.push(entry.path());
            }
        }
    }
    paths.sort();
    paths
}

#[tokio::test]
async fn a_program_runs_in_its_image_and_sees_the_image_not_the_host() {
    let directory = tempfile::tempdir().unwrap();
    let Some(sandbox) = sandbox(&directory.path().join("worker")) else {
        return;
    };
    let (cache, pulled, rootfs) = image(directory.path(), &[]).await;
    let before = listing(&rootfs);
    let job_directory = directory.path().join("worker/job-1");
    std::fs::create_dir_all(&job_directory).unwrap();
    give_directory_to(&job_directory, sandbox.program_owner("alice").unwrap()).unwrap();
    let script = format!(
        "train.sh; echo \"env $IMAGE_ONLY $GREETING\"; \
         test -e /usr/bin/python3 && echo host-python; test -e /etc/passwd && echo host-etc; \
         touch /written 2>/dev/null && echo root-writable; \
         echo checkpoint > {job}/checkpoint && echo job-writable; id -u",
        job = job_directory.display()
    );
    let request = ContainerRequest {
        name: "carve-test-image".to_string(),
        tenant: "alice".to_string(),
        argv: vec!["/bin/sh".into(), "-c".into(), script],
        environment: vec![("GREETING".into(), "hello".into())],
        working_directory: job_directory.clone(),
        host_paths: vec![HostPath::writable(&job_directory)],
        ..ContainerRequest::default()
    };
    let (output, stdout, stderr) = run_in_image(&sandbox, &request, &pulled, &cache).await;
    let status = container_exit_status(output.status, &[]);
    assert!(status.success(), "{status}: {stdout}\n{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines,
        [
            "training in carve test image",
            "env from-the-image hello",
            "job-writable",
            "1000"
        ],
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(job_directory.join("checkpoint")).unwrap(),
        "checkpoint\n"
    );
    // The cache's copy is untouched (no mount points, no /written), and the run's
    // overlay is gone.
    assert_eq!(listing(&rootfs), before);
    assert_eq!(
        std::fs::read_dir(cache.runs_directory()).unwrap().count(),
        0,
        "the run's root was left behind"
    );
}

#[tokio::test]
async fn an_image_whose_links_point_at_host_paths_gets_its_mount_points_inside() {
    let directory = tempfile::tempdir().unwrap();
    let Some(sandbox) = sandbox(&directory.path().join("worker")) else {
        return;
    };
    // The host directory the image's link names, which nothing may touch (outside
    // /tmp, which the link itself replaces in the image).
    let host_parent = tempfile::tempdir_in("/var/tmp").unwrap();
    let host = host_parent.path().join("host-directory");
    std::fs::create_dir(&host).unwrap();
    let host_text = host.to_str().unwrap().to_string();
    let (cache, pulled, _rootfs) = image(directory.path(), &[("tmp", host_text.as_str())]).await;
    let request = ContainerRequest {
        name: "carve-test-image-links".to_string(),
        tenant: "alice".to_string(),
        argv: vec![
            "/bin/sh".into(),
            "-c".into(),
            "echo escaped > /tmp/escaped 2>/dev/null; echo ran".into(),
        ],
        environment: Vec::new(),
        working_directory: "/".into(),
        ..ContainerRequest::default()
    };
    let (output, stdout, stderr) = run_in_image(&sandbox, &request, &pulled, &cache).await;
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "ran");
    assert_eq!(
        std::fs::read_dir(&host).unwrap().count(),
        0,
        "a mount point or a file landed in the host directory the image's link names"
    );
}

/// A command job naming the test image, run through the worker's attempt module in a
/// sandbox whose image cache reads `layout`.
mod command_attempts {
    use std::sync::Arc;

    use carve_core::command::validate::{ValidatedSpec, parse_spec_json};
    use carve_proto::v1;
    use carve_proto::v1::worker_message::Body;
    use carve_worker::command_attempt::{CommandAttemptLaunch, run_command_attempt};
    use serde_json::json;
    use tokio::sync::mpsc;

    use super::*;

    fn launch(
        directory: &Path,
        sandbox: &Arc<Sandbox>,
        number: u32,
        command: serde_json::Value,
    ) -> CommandAttemptLaunch {
        let spec = json!({"name": "image-test", "command": command,
                          "resources": {"vram": "1GiB"}});
        let ValidatedSpec::Command(job) = parse_spec_json(&spec.to_string()).unwrap() else {
            panic!("not a command job");
        };
        CommandAttemptLaunch {
            attempt: v1::AttemptRef {
                job_id: "job-1".into(),
                attempt_number: number,
                ..Default::default()
            },
            config: job.initial_config(),
            job,
            slice_bytes: 64 << 20,
            gpu_uuid: "GPU-sim-test".into(),
            guard_library: None,
            checkpoint_dir: directory.join("worker/job-1"),
            attempt_directory: directory.join(format!("worker/job-1.attempt-{number}.run")),
            profile: false,
            resume_from: None,
            sandbox: Some(sandbox.clone()),
            tenant: "alice".into(),
            image: Default::default(),
            devices: Default::default(),
            simulated_gpu_socket: None,
            container_name: format!("carve-image-job-1-{number}"),
            supervision: None,
        }
    }

    async fn run(launch: CommandAttemptLaunch) -> Vec<Body> {
        let (reports, mut incoming) = mpsc::unbounded_channel();
        let (_control, control_receiver) = mpsc::unbounded_channel();
        tokio::time::timeout(
            Duration::from_secs(120),
            run_command_attempt(launch, reports, control_receiver, (), || {}),
        )
        .await
        .expect("the attempt ended in time");
        let mut all = Vec::new();
        while let Ok(body) = incoming.try_recv() {
            all.push(body);
        }
        all
    }

    fn finish(reports: &[Body]) -> (v1::AttemptOutcome, String) {
        match reports.last() {
            Some(Body::AttemptFinished(finished)) => (
                v1::AttemptOutcome::try_from(finished.outcome).unwrap(),
                finished.message.clone(),
            ),
            other => panic!("no final report: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_command_job_runs_in_its_image_pulled_once_for_three_attempts() {
        let directory = tempfile::tempdir().unwrap();
        let worker = directory.path().join("worker");
        std::fs::create_dir_all(&worker).unwrap();
        // The image, written as a layout the sandbox's cache reads.
        let (_, held, _) = image(directory.path(), &[]).await;
        drop(held);
        let settings = SandboxSettings {
            policy: SandboxPolicy::Required,
            images: Some(ImageSettings {
                cache_directory: worker.join("image-cache"),
                cache_limit_bytes: 1 << 30,
                insecure_registries: Vec::new(),
                layout_directories: vec![directory.path().join("layout")],
                registry_authorities: Vec::new(),
                archives: Vec::new(),
            }),
            ..SandboxSettings::default()
        };
        // Whether this machine can contain anything (and, in CI, must).
        if super::sandbox(&directory.path().join("probe")).is_none() {
            return;
        }
        let sandbox = Arc::new(
            Sandbox::open(&settings, &worker, "test-node")
                .unwrap()
                .expect("a sandbox"),
        );
        let command = json!({"argv": ["/opt/train.sh"], "global_batch": 8, "steps": 4,
                             "image": "carve.test/team/busybox:1"});
        for number in 1..=3 {
            let reports = run(launch(directory.path(), &sandbox, number, command.clone())).await;
            let (outcome, message) = finish(&reports);
            assert_eq!(
                outcome,
                v1::AttemptOutcome::Succeeded,
                "{message}: {reports:#?}"
            );
            let said = reports.iter().any(|body| {
                matches!(body, Body::Log(line) if line.message.contains("training in carve test image"))
            });
            assert!(said, "the program did not run in its image: {reports:#?}");
            let whence = if number == 1 {
                "pulled into this node's cache"
            } else {
                "from this node's cache"
            };
            let told = reports
                .iter()
                .any(|body| matches!(body, Body::Log(line) if line.message.contains(whence)));
            assert!(told, "attempt {number} did not say its image was {whence}");
        }
        assert_eq!(
            sandbox.images().pulls_done(),
            1,
            "one pull for three attempts"
        );

        // A registry that is not there: interrupted (a retry may find it), not an OOM.
        let unreachable = json!({"argv": ["/opt/train.sh"], "global_batch": 8, "steps": 4,
                                 "image": "127.0.0.1:1/team/train:1"});
        let reports = run(launch(directory.path(), &sandbox, 4, unreachable)).await;
        let (outcome, message) = finish(&reports);
        assert_eq!(outcome, v1::AttemptOutcome::Interrupted, "{message}");
        assert!(message.contains("registry unavailable"), "{message}");
        assert!(!reports.iter().any(|body| matches!(body, Body::Oom(_))));
        // A pull secret whose credential the assignment did not carry: it fails saying so.
        let private = json!({"argv": ["/opt/train.sh"], "global_batch": 8, "steps": 4,
                             "image": "carve.test/team/busybox:1",
                             "image_pull_secret": "team-registry"});
        let reports = run(launch(directory.path(), &sandbox, 5, private)).await;
        let (outcome, message) = finish(&reports);
        assert_eq!(outcome, v1::AttemptOutcome::Failed, "{message}");
        assert!(message.contains("command.image_pull_secret"), "{message}");
    }
}

/// Runs `request` in `pulled` as its root, removes the container and its run's overlay,
/// and returns the output with its stdout and stderr as text.
async fn run_in_image(
    sandbox: &Sandbox,
    request: &ContainerRequest,
    pulled: &PulledImage,
    cache: &ImageCache,
) -> (std::process::Output, String, String) {
    let (mut command, container, run_root) = sandbox
        .prepare_in_image(request, pulled, &cache.runs_directory(), &[])
        .unwrap();
    let output = tokio::time::timeout(Duration::from_secs(60), command.output())
        .await
        .expect("the container ended in time")
        .unwrap();
    container.remove();
    drop(run_root);
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    (output, stdout, stderr)
}
