//! The sandbox with the real OCI runtime: a container runs as its tenant's own host uid,
//! sees its own paths and nothing else, has no network but loopback, and is removed with
//! everything in it. Needs runc (CI installs it) and root; elsewhere it says why it
//! cannot run, and fails in CI.

use std::path::Path;
use std::time::Duration;

use carve_worker::sandbox::{
    ContainerRequest, HostPath, Sandbox, SandboxPolicy, SandboxSettings, container_exit_status,
    give_directory_to,
};

/// A sandbox over `directory` with `settings` (its policy made `Required`), or `None`
/// (with the reason printed) where this machine cannot contain anything; in CI that is a
/// failure.
fn sandbox(directory: &Path, settings: SandboxSettings) -> Option<Sandbox> {
    let settings = SandboxSettings {
        policy: SandboxPolicy::Required,
        ..settings
    };
    match Sandbox::open(&settings, directory, "test-node") {
        Ok(sandbox) => sandbox,
        Err(error) if std::env::var_os("CI").is_none() => {
            eprintln!("skipped: no sandbox on this machine ({error})");
            None
        }
        Err(error) => panic!("CI must be able to contain attempts: {error}"),
    }
}

/// Runs `script` with `sh -c` in a container of `tenant` that sees `host_paths`;
/// returns its exit status, stdout and stderr.
async fn run_in_container(
    sandbox: &Sandbox,
    name: &str,
    tenant: &str,
    script: &str,
    host_paths: Vec<HostPath>,
) -> (std::process::ExitStatus, String, String) {
    let (mut command, container) = sandbox
        .prepare(&ContainerRequest {
            name: name.to_string(),
            tenant: tenant.to_string(),
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            environment: vec![("GREETING".into(), "hello".into())],
            working_directory: "/tmp".into(),
            host_paths,
            devices: Vec::new(),
            simulated_gpu_socket: None,
            asked_limits: Default::default(),
        })
        .unwrap();
    let output = tokio::time::timeout(Duration::from_secs(60), command.output())
        .await
        .expect("the container ended in time")
        .unwrap();
    container.remove();
    (
        container_exit_status(output.status, &[]),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn a_container_sees_its_own_paths_as_its_tenant_and_nothing_of_the_worker() {
    let directory = tempfile::tempdir().unwrap();
    let Some(sandbox) = sandbox(&directory.path().join("worker"), SandboxSettings::default())
    else {
        return;
    };
    let job = directory.path().join("jobs").join("job-a");
    std::fs::create_dir_all(&job).unwrap();
    give_directory_to(&job, sandbox.program_owner("alice").unwrap()).unwrap();
    let secret = directory.path().join("worker-secret");
    std::fs::write(&secret, "token").unwrap();
    let script = format!(
        "id -u; echo $GREETING; echo written > {job}/out; cat {secret} || echo no-secret; \
         ls /proc | grep -c '^[0-9]' ; cat /sys/class/net/*/operstate 2>/dev/null | wc -l; \
         echo $CARVE_TOKEN; touch /usr/x 2>/dev/null || echo read-only",
        job = job.display(),
        secret = secret.display()
    );
    let (status, stdout, stderr) = run_in_container(
        &sandbox,
        "carve-test-1",
        "alice",
        &script,
        vec![HostPath::writable(&job)],
    )
    .await;
    assert!(status.success(), "{status}: {stdout}\n{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "1000", "{stdout}");
    assert_eq!(lines[1], "hello");
    assert_eq!(lines[2], "no-secret", "{stdout}");
    let processes: u32 = lines[3].trim().parse().unwrap();
    assert!(
        processes <= 4,
        "its own pid namespace: {processes} processes seen"
    );
    assert_eq!(lines[4].trim(), "1", "only loopback: {stdout}");
    assert_eq!(lines[5], "", "no token in its environment");
    assert_eq!(lines[6], "read-only");
    // Written as alice's own host uid, not as root.
    use std::os::unix::fs::MetadataExt;
    let written = std::fs::metadata(job.join("out")).unwrap();
    assert_eq!(written.uid(), sandbox.program_owner("alice").unwrap().0);
    assert_ne!(written.uid(), 0);
    assert_ne!(
        sandbox.program_owner("alice").unwrap(),
        sandbox.program_owner("bob").unwrap()
    );
}

/// What a job names (its working directory, a model's data files) is bound into its
/// container past the permissions of the directories above it, so only paths under the
/// operator's job paths are taken, never the worker's own directory, never through a
/// link that leads elsewhere.
#[test]
fn a_job_may_name_only_paths_under_the_operator_s_job_paths() {
    let directory = tempfile::tempdir().unwrap();
    let jobs = directory.path().join("jobs");
    let code = jobs.join("alice-code");
    std::fs::create_dir_all(&code).unwrap();
    let worker = directory.path().join("worker");
    std::fs::create_dir_all(worker.join("job-of-bob")).unwrap();
    let settings = SandboxSettings {
        job_paths: vec![jobs.clone(), directory.path().join("worker")],
        ..SandboxSettings::default()
    };
    let Some(sandbox) = sandbox(&worker, settings) else {
        return;
    };
    let field = "command.working_directory";
    assert_eq!(
        sandbox.job_path(field, &code).unwrap(),
        code.canonicalize().unwrap()
    );
    // Another job's directory in the worker's, even where an operator's job path covers it.
    let error = sandbox
        .job_path(field, &worker.join("job-of-bob"))
        .unwrap_err()
        .to_string();
    assert!(error.contains("worker's own directory"), "{error}");
    // Anywhere else on the host.
    let error = sandbox
        .job_path(field, Path::new("/etc"))
        .unwrap_err()
        .to_string();
    assert!(error.contains("--sandbox-job-path"), "{error}");
    // A link under a job path that leads out of it.
    let link = jobs.join("link-to-etc");
    std::os::unix::fs::symlink("/etc", &link).unwrap();
    let error = sandbox.job_path(field, &link).unwrap_err().to_string();
    assert!(error.contains(field), "{error}");
}

/// A program the kernel kills at its container's host memory limit is told apart from one
/// killed from outside: the first is the job's own failure, the second an interruption.
#[tokio::test]
async fn a_program_killed_at_its_memory_limit_is_told_apart_from_one_killed_from_outside() {
    let directory = tempfile::tempdir().unwrap();
    let settings = SandboxSettings {
        limits: carve_worker::sandbox::AttemptLimits {
            memory_bytes: 128 << 20,
            ..Default::default()
        },
        ..SandboxSettings::default()
    };
    let Some(sandbox) = sandbox(&directory.path().join("worker"), settings) else {
        return;
    };
    let run = |name: &str, script: &str| {
        let (command, container) = sandbox
            .prepare(&ContainerRequest {
                name: name.to_string(),
                tenant: "alice".to_string(),
                argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
                environment: Vec::new(),
                working_directory: "/tmp".into(),
                host_paths: Vec::new(),
                devices: Vec::new(),
                simulated_gpu_socket: None,
                asked_limits: Default::default(),
            })
            .unwrap();
        (command, container)
    };
    use std::os::unix::process::ExitStatusExt;

    let (mut command, container) = run(
        "carve-test-memory",
        "exec python3 -c 'b = bytearray(512 << 20); print(len(b))'",
    );
    let status = container_exit_status(command.status().await.unwrap(), &[]);
    let reached = container.reached_memory_limit();
    container.remove();
    assert_eq!(status.signal(), Some(9), "{status}");
    assert_eq!(reached, Some(128 << 20));

    // Killed from the host, as an operator or a node agent would.
    let (mut command, container) = run("carve-test-killed", "exec sleep 60");
    let mut child = command.spawn().unwrap();
    let program = container.program_process_id().await.expect("it started");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(program as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let status = container_exit_status(child.wait().await.unwrap(), &[]);
    let reached = container.reached_memory_limit();
    container.remove();
    assert_eq!(status.signal(), Some(9), "{status}");
    assert_eq!(reached, None);
}

/// The limits a container is built with: the operator's defaults, a tenant's override,
/// and the job's `[resources]` asks, of which only the lower ones count. A job asking
/// for more than its worker allows gets the worker's limit in its config.json.
#[tokio::test]
async fn a_jobs_ask_lowers_its_containers_limits_and_never_raises_them() {
    use carve_core::spec::HostLimitsRequest;
    use carve_worker::sandbox::{AttemptLimits, TenantLimits};
    let directory = tempfile::tempdir().unwrap();
    let worker = directory.path().join("worker");
    let settings = SandboxSettings {
        limits: AttemptLimits {
            memory_bytes: 256 << 20,
            pids: 64,
            cpus: Some(2.0),
            ..Default::default()
        },
        tenant_limits: [(
            "bob".to_string(),
            TenantLimits {
                pids: Some(32),
                ..Default::default()
            },
        )]
        .into(),
        ..SandboxSettings::default()
    };
    let Some(sandbox) = sandbox(&worker, settings) else {
        return;
    };
    let asks_less = HostLimitsRequest {
        memory_bytes: Some(64 << 20),
        cpus: Some(0.5),
        pids: Some(16),
    };
    let asks_more = HostLimitsRequest {
        memory_bytes: Some(1 << 40),
        cpus: Some(64.0),
        pids: Some(1 << 30),
    };
    // (tenant, ask, memory, pids, cpu quota per 100 ms period)
    let cases = [
        (
            "alice",
            HostLimitsRequest::default(),
            256 << 20,
            64,
            200_000,
        ),
        ("alice", asks_less, 64 << 20, 16, 50_000),
        ("alice", asks_more, 256 << 20, 64, 200_000),
        ("bob", HostLimitsRequest::default(), 256 << 20, 32, 200_000),
        ("bob", asks_more, 256 << 20, 32, 200_000),
    ];
    for (index, (tenant, asked, memory, pids, quota)) in cases.into_iter().enumerate() {
        let name = format!("limits-{index}");
        let (_command, container) = sandbox
            .prepare(&ContainerRequest {
                name: name.clone(),
                tenant: tenant.to_string(),
                argv: vec!["/bin/true".into()],
                working_directory: "/tmp".into(),
                asked_limits: asked,
                ..Default::default()
            })
            .unwrap();
        let config = worker
            .join("sandbox/bundles/test-node")
            .join(&name)
            .join("config.json");
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
        container.remove();
        let resources = &config["linux"]["resources"];
        assert_eq!(resources["memory"]["limit"], memory, "{tenant} {asked:?}");
        assert_eq!(resources["pids"]["limit"], pids, "{tenant} {asked:?}");
        assert_eq!(resources["cpu"]["quota"], quota, "{tenant} {asked:?}");
    }
}
