//! The `carve` client commands, the real binary against a real local cluster: `carve dev`
//! runs as a child process (scheduler with SQLite, worker with simulated GPUs, attempt
//! processes) and each command is a separate `carve` process, as a person or a script
//! would run it. Checked: what they print, what `-o json` / `-o yaml` parse to, and the
//! exit codes scripts branch on.

use std::io::Write;
use std::process::Stdio;

// The local commands' helpers are not used here.
#[allow(dead_code)]
mod support;
use support::dev_cluster::*;

/// The small mnist job, cut to a few steps of a small batch.
const SMALL_JOB: &[&str] = &[
    "submit",
    "examples/mnist-cnn.toml",
    "--set",
    "training.steps=3",
    "--set",
    "training.batch_size=8",
    "--set",
    "name=\"mnist-small\"",
];

#[test]
fn a_user_submits_watches_inspects_and_cancels_jobs_and_tenants_stay_apart() {
    let cluster = DevCluster::start();

    // Submit: the id, state, estimate and config are printed.
    let submitted = cluster.carve(SMALL_JOB).expect_code(0);
    let job = submitted_job_id(&submitted);
    submitted.assert_stdout_contains("estimate:");
    submitted.assert_stdout_contains("config:    batch 8, micro 8, fp32");

    // It is listed, as JSON and as YAML, with proto field names.
    let list = cluster.carve(&["jobs", "-o", "json"]).expect_code(0).json();
    assert!(listed_ids(&list).contains(&job), "{list}");
    let yaml = cluster.carve(&["jobs", "-o", "yaml"]).expect_code(0);
    let from_yaml: serde_json::Value = serde_norway::from_str(&yaml.stdout)
        .unwrap_or_else(|error| panic!("not yaml: {error}\n{}", yaml.context()));
    assert!(listed_ids(&from_yaml).contains(&job), "{from_yaml}");
    let table = cluster.carve(&["jobs"]).expect_code(0);
    assert!(table.stdout.starts_with("ID "), "{}", table.context());
    table.assert_stdout_contains(&job);
    let filtered = cluster
        .carve(&["jobs", "--state", "cancelled", "-o", "json"])
        .expect_code(0)
        .json();
    assert!(!listed_ids(&filtered).contains(&job), "{filtered}");

    // Watched to the end: exit 0.
    let watched = cluster.carve(&["watch", &job]).expect_code(0);
    watched.assert_stdout_contains("succeeded");

    // Its details, for people and for scripts.
    let details = cluster.carve(&["get", &job]).expect_code(0);
    details.assert_stdout_contains("state:      succeeded");
    details.assert_stdout_contains("ATTEMPT");
    let details = cluster
        .carve(&["get", &job, "-o", "json"])
        .expect_code(0)
        .json();
    assert_eq!(details["id"], job.as_str());
    assert_eq!(details["state"], "JOB_STATE_SUCCEEDED");
    assert_eq!(
        details["attempts"][0]["outcome"],
        "ATTEMPT_OUTCOME_SUCCEEDED"
    );
    assert!(
        details["attempts"][0]["measured_peak_bytes"]
            .as_u64()
            .unwrap()
            > 0,
        "{details}"
    );
    assert_eq!(details["current_config"]["batch_size"], 8);

    // Submitted and watched for a script: stdout is one document, the job as it ended;
    // the watch's lines go to stderr.
    let mut watched_json: Vec<&str> = SMALL_JOB.to_vec();
    watched_json.extend(["--watch", "-o", "json"]);
    let watched_json = cluster.carve(&watched_json).expect_code(0);
    let ended = watched_json.json();
    assert_eq!(ended["state"], "JOB_STATE_SUCCEEDED", "{ended}");
    assert_ne!(ended["id"], job.as_str(), "{ended}");
    watched_json.assert_stderr_contains("-> succeeded");

    // Its log: the scheduler's notes of what happened.
    let logs = cluster.carve(&["logs", &job]).expect_code(0);
    logs.assert_stdout_contains("scheduler");
    logs.assert_stdout_contains("succeeded");
    let tail = cluster.carve(&["logs", &job, "--tail", "1"]).expect_code(0);
    assert_eq!(tail.stdout.lines().count(), 1, "{}", tail.context());

    // A long job, cancelled: watching it exits 11.
    let long = cluster
        .carve(&[
            "submit",
            "examples/mnist-cnn.toml",
            "--set",
            "training.steps=100000",
            "--set",
            "training.batch_size=8",
            "-q",
        ])
        .expect_code(0);
    let long_job = long.stdout.trim().to_string();
    assert!(
        !long_job.is_empty() && !long_job.contains(' '),
        "{}",
        long.context()
    );
    // `logs --follow` keeps printing until the job ends, then exits 0.
    let mut follow = cluster.spawn_carve(&["logs", &long_job, "--follow"]);
    cluster
        .carve(&["cancel", &long_job, "--reason", "not needed"])
        .expect_code(0);
    let followed = wait_for(&mut follow, "carve logs --follow").expect_code(0);
    followed.assert_stdout_contains("cancelled: not needed");
    let watched = cluster.carve(&["watch", &long_job]).expect_code(11);
    watched.assert_stderr_contains("cancelled");
    let cancelled = cluster
        .carve(&["get", &long_job, "-o", "json"])
        .expect_code(0)
        .json();
    assert_eq!(cancelled["state"], "JOB_STATE_CANCELLED");

    // A bad field is rejected by the scheduler, naming it: exit 7.
    let rejected = cluster
        .carve(&[
            "submit",
            "examples/mnist-cnn.toml",
            "--set",
            "training.batch_size=0",
        ])
        .expect_code(7);
    rejected.assert_stderr_contains("training.batch_size");
    // An override that cannot apply names its key: exit 7 too, nothing sent.
    let rejected = cluster
        .carve(&[
            "submit",
            "examples/mnist-cnn.toml",
            "--set",
            "model.layers[99].relu={}",
        ])
        .expect_code(7);
    rejected.assert_stderr_contains("model.layers[99]");
    // A spec from stdin (`submit -`) is sent as a file's is: here the scheduler rejects
    // its batch size, so no job is left behind.
    let mut from_stdin = cluster.spawn_carve_with_stdin(&["submit", "-"], Stdio::piped());
    let spec = std::fs::read_to_string(repository_root().join("examples/mnist-cnn.toml"))
        .unwrap()
        .replace("batch_size = ", "batch_size = 0 #");
    from_stdin
        .stdin
        .take()
        .unwrap()
        .write_all(spec.as_bytes())
        .unwrap();
    let rejected = wait_for(&mut from_stdin, "carve submit - (batch size 0)").expect_code(7);
    rejected.assert_stderr_contains("training.batch_size");

    // A missing job: exit 6. A wrong token: exit 5, saying which setting to change.
    let missing = cluster.carve(&["get", "job-does-not-exist"]).expect_code(6);
    missing.assert_stderr_contains("not found");
    let wrong = cluster
        .carve_with_token("carve_not_a_real_token", &["jobs"])
        .expect_code(5);
    wrong.assert_stderr_contains("token rejected by");
    wrong.assert_stderr_contains("CARVE_TOKEN");

    // The cluster: the simulated GPUs, with the memory bars.
    let view = cluster.carve(&["cluster"]).expect_code(0);
    view.assert_stdout_contains("dev-node");
    assert_eq!(
        view.stdout.matches("    [").count(),
        2,
        "{}",
        view.context()
    );
    let workers = cluster
        .carve(&["cluster", "-o", "json"])
        .expect_code(0)
        .json();
    assert_eq!(
        workers["workers"][0]["gpus"].as_array().unwrap().len(),
        2,
        "{workers}"
    );
    // Draining is for admins.
    let worker_id = workers["workers"][0]["id"].as_str().unwrap().to_string();
    cluster
        .carve(&["cluster", "drain", &worker_id])
        .expect_code(5);

    // Tenant isolation: an admin creates tenant B and a user token for it.
    let admin = &cluster.admin_token;
    cluster
        .carve_with_token(
            admin,
            &["admin", "tenants", "create", "team-b", "--weight", "2"],
        )
        .expect_code(0);
    let created = cluster
        .carve_with_token(
            admin,
            &[
                "admin",
                "tokens",
                "create",
                "--tenant",
                "team-b",
                "--role",
                "user",
                "--name",
                "b's laptop",
            ],
        )
        .expect_code(0);
    // The secret is alone on stdout, so `$(carve admin tokens create ...)` captures it.
    let token_b = created.stdout.trim().to_string();
    assert_eq!(created.stdout.lines().count(), 1, "{}", created.context());
    assert!(token_b.starts_with("carve_"), "{}", created.context());
    let tenants = cluster
        .carve_with_token(admin, &["admin", "tenants", "list", "-o", "json"])
        .expect_code(0)
        .json();
    let names: Vec<&str> = tenants["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|tenant| tenant["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"team-b") && names.contains(&"dev"),
        "{tenants}"
    );
    let quota = cluster
        .carve_with_token(
            admin,
            &[
                "admin", "quota", "set", "team-b", "--vram", "1MiB", "-o", "json",
            ],
        )
        .expect_code(0)
        .json();
    assert_eq!(quota["quota"]["vram_bytes"], 1u64 << 20, "{quota}");
    assert_eq!(quota["quota"]["fair_share_weight"], 2.0, "{quota}");
    // A user may not manage tenants.
    cluster.carve(&["admin", "tenants", "list"]).expect_code(5);

    // B sees none of A's jobs: A's job reads as missing, and B's list is empty.
    let hidden = cluster
        .carve_with_token(&token_b, &["get", &job])
        .expect_code(6);
    hidden.assert_stderr_contains(&job);
    let list_b = cluster
        .carve_with_token(&token_b, &["jobs", "-o", "json"])
        .expect_code(0)
        .json();
    assert!(listed_ids(&list_b).is_empty(), "{list_b}");
    // B's 1 MiB quota can never hold the small job: exit 8, saying why.
    let exhausted = cluster.carve_with_token(&token_b, SMALL_JOB).expect_code(8);
    exhausted.assert_stderr_contains("quota");
    cluster
        .carve_with_token(&token_b, &["logs", &job])
        .expect_code(6);
    cluster
        .carve_with_token(&token_b, &["cancel", &job])
        .expect_code(6);

    // Revoked, B's token stops working.
    let tokens = cluster.tenant_tokens_json(admin, "team-b");
    let listed = tokens["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|token| token["description"] == "b's laptop")
        .unwrap_or_else(|| panic!("the new token is not listed: {tokens}"));
    assert_eq!(listed["role"], "ROLE_USER", "{tokens}");
    assert_eq!(listed["tenant"], "team-b", "{tokens}");
    let token_id = listed["id"].as_str().unwrap().to_string();
    let revoked = cluster
        .carve_with_token(admin, &["admin", "tokens", "revoke", &token_id])
        .expect_code(0);
    // Never a made-up time ("revoked at -") when the scheduler sends none.
    revoked.assert_stdout_contains(&format!("token {token_id} revoked"));
    assert!(
        !revoked.stdout.contains("revoked at -"),
        "{}",
        revoked.context()
    );
    cluster.carve_with_token(&token_b, &["jobs"]).expect_code(5);
}

#[test]
fn commands_without_a_scheduler_fail_with_the_codes_scripts_expect() {
    // Nothing listens on a port that was just released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let config_home = tempfile::tempdir().unwrap();
    let config_home = config_home.path().display().to_string();
    let unreachable = run_carve(
        &["jobs"],
        &[
            ("CARVE_ENDPOINT", &endpoint),
            ("CARVE_TOKEN", "carve_x"),
            ("XDG_CONFIG_HOME", &config_home),
        ],
    )
    .expect_code(4);
    unreachable.assert_stderr_contains(&format!(
        "cannot reach the scheduler at {endpoint}: connection refused"
    ));
    unreachable.assert_stderr_contains("CARVE_ENDPOINT");

    // No token anywhere: exit 5 before anything is sent.
    let no_token = run_carve(
        &["jobs", "--endpoint", &endpoint],
        &[("XDG_CONFIG_HOME", &config_home)],
    )
    .expect_code(5);
    no_token.assert_stderr_contains("no token");

    // A config file is read when no flag or variable says otherwise.
    let config = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(config.path().join("carve")).unwrap();
    std::fs::write(
        config.path().join("carve/config.toml"),
        format!("endpoint = \"{endpoint}\"\ntoken = \"carve_from_file\"\n"),
    )
    .unwrap();
    let from_file = run_carve(
        &["get", "job-x"],
        &[("XDG_CONFIG_HOME", &config.path().display().to_string())],
    )
    .expect_code(4);
    from_file.assert_stderr_contains(&endpoint);

    // Usage errors are clap's: exit 2.
    run_carve(&["jobs", "--state", "sleeping"], &[]).expect_code(2);

    // The exit codes are documented in the long help.
    let help = run_carve(&["--help"], &[]).expect_code(0);
    help.assert_stdout_contains("Exit codes:");
    help.assert_stdout_contains("11  the watched job was cancelled");

    for shell in ["bash", "zsh", "fish", "powershell", "elvish"] {
        let completions = run_carve(&["completions", shell], &[]).expect_code(0);
        completions.assert_stdout_contains("submit");
    }
}

/// A scheduler in this process serving `tls` (admin token `carve_tls_admin`) with its
/// database in `directory`: its port, the sender that stops it, and its task. `carve
/// dev` has no TLS, and the certificates are the point where this is used.
fn start_tls_scheduler(
    runtime: &tokio::runtime::Runtime,
    directory: &std::path::Path,
    tls: carve_scheduler::server::TlsIdentity,
) -> (
    u16,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), carve_scheduler::error::SchedulerError>>,
) {
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let config = carve_scheduler::server::SchedulerConfig {
        database_url: format!("sqlite://{}", directory.join("carve.db").display()),
        settings: carve_scheduler::scheduler::SchedulerSettings::default(),
        admin_token: Some("carve_tls_admin".into()),
        metrics_address: None,
        tls: Some(tls),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = runtime.spawn(carve_scheduler::server::run(config, listener, async {
        let _ = stopped.await;
    }));
    (port, stop, server)
}

/// `carve admin tenants list -o json` with `flags` succeeds and lists the tenant `default`.
fn lists_the_default_tenant(flags: &[&str], environment: &[(&str, &str)]) {
    let mut arguments = vec!["admin", "tenants", "list", "-o", "json"];
    arguments.extend_from_slice(flags);
    let tenants = run_carve(&arguments, environment).expect_code(0).json();
    assert_eq!(tenants["tenants"][0]["name"], "default", "{tenants}");
}

#[test]
fn https_endpoints_are_verified_against_the_given_certificate_authority() {
    // A scheduler serving TLS with a self-signed certificate for localhost, in this
    // process: `carve dev` has no TLS, and the certificate is the point here.
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let directory = tempfile::tempdir().unwrap();
    let ca_cert = directory.path().join("ca.pem");
    std::fs::write(&ca_cert, certified.cert.pem()).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (port, stop, server) = start_tls_scheduler(
        &runtime,
        directory.path(),
        carve_scheduler::server::TlsIdentity {
            certificate_chain_pem: certified.cert.pem().into_bytes(),
            private_key_pem: certified.signing_key.serialize_pem().into_bytes(),
            client_ca_certificate_pem: None,
        },
    );
    let endpoint = format!("https://localhost:{port}");
    let config_home = directory.path().display().to_string();
    let environment = [
        ("CARVE_ENDPOINT", endpoint.as_str()),
        ("CARVE_TOKEN", "carve_tls_admin"),
        ("XDG_CONFIG_HOME", config_home.as_str()),
    ];
    let ca_cert = ca_cert.display().to_string();
    // The listener is bound already, so the first connection is served.
    lists_the_default_tenant(&["--ca-cert", &ca_cert], &environment);

    // Without the authority, the self-signed certificate is not trusted: no connection.
    let untrusted = run_carve(&["admin", "tenants", "list"], &environment).expect_code(4);
    assert!(
        untrusted
            .stderr
            .contains("cannot reach the scheduler at https://localhost")
            && untrusted.stderr.contains("--ca-cert"),
        "{}",
        untrusted.context()
    );
    // A certificate authority for a plain-text endpoint is a mistake worth naming.
    let plain = format!("http://localhost:{port}");
    let mixed = run_carve(
        &["jobs", "--endpoint", &plain, "--ca-cert", &ca_cert],
        &environment,
    )
    .expect_code(7);
    mixed.assert_stderr_contains("ca_cert");
    // Plain HTTP against the TLS port: the scheduler cannot be reached that way (exit 4),
    // and the message says which scheme it speaks.
    let plain_to_tls = run_carve(&["jobs", "--endpoint", &plain], &environment).expect_code(4);
    plain_to_tls.assert_stderr_contains(&format!("cannot reach the scheduler at {plain}"));
    plain_to_tls.assert_stderr_contains("use https://");

    let _ = stop.send(());
    runtime.block_on(server).unwrap().unwrap();
}

#[test]
fn a_scheduler_requiring_client_certificates_serves_carve_with_tls_cert_and_tls_key() {
    let authority = carve_testing::TestAuthority::new("carve test CA").unwrap();
    let server_certificate = authority.issue_server(&["localhost"]).unwrap();
    let client_certificate = authority.issue_client("operator").unwrap();
    let directory = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = directory.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let ca_cert = write("ca.pem", &authority.certificate_pem());
    let tls_cert = write("client.pem", &client_certificate.certificate_pem);
    let tls_key = write("client.key", &client_certificate.private_key_pem);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (port, stop, server) = start_tls_scheduler(
        &runtime,
        directory.path(),
        carve_scheduler::server::TlsIdentity {
            certificate_chain_pem: server_certificate.certificate_pem.into_bytes(),
            private_key_pem: server_certificate.private_key_pem.into_bytes(),
            client_ca_certificate_pem: Some(authority.certificate_pem().into_bytes()),
        },
    );
    let endpoint = format!("https://localhost:{port}");
    let config_home = directory.path().display().to_string();
    let environment = [
        ("CARVE_ENDPOINT", endpoint.as_str()),
        ("CARVE_TOKEN", "carve_tls_admin"),
        ("CARVE_CA_CERT", ca_cert.as_str()),
        ("XDG_CONFIG_HOME", config_home.as_str()),
    ];
    lists_the_default_tenant(
        &["--tls-cert", &tls_cert, "--tls-key", &tls_key],
        &environment,
    );

    // Without a client certificate the handshake is refused: not reached (exit 4), and
    // the advice names the flags.
    let refused = run_carve(&["admin", "tenants", "list"], &environment).expect_code(4);
    refused.assert_stderr_contains(&format!("cannot reach the scheduler at {endpoint}"));
    refused.assert_stderr_contains("--tls-cert");
    // A certificate without its key is a usage mistake named before connecting.
    run_carve(
        &["admin", "tenants", "list", "--tls-cert", &tls_cert],
        &environment,
    )
    .expect_code(7)
    .assert_stderr_contains("tls_key");

    let _ = stop.send(());
    runtime.block_on(server).unwrap().unwrap();
}

#[test]
fn submit_shows_the_spec_warnings_the_scheduler_found() {
    let cluster = DevCluster::start();
    let directory = tempfile::tempdir().unwrap();
    let spec = directory.path().join("chw.toml");
    std::fs::write(
        &spec,
        r#"name = "channels-first"

[model]
input_shape = [3, 16, 16]
loss = "softmax_cross_entropy"
layers = [{ flatten = {} }, { dense = { units = 4 } }]

[training]
batch_size = 8
steps = 2
optimizer = { sgd = { learning_rate = 0.1 } }

[data]
format = "synthetic"
samples = 32
"#,
    )
    .unwrap();
    let spec = spec.display().to_string();

    // Admitted, with the warning on stderr, named as `carve estimate` names it.
    let submitted = cluster.carve(&["submit", &spec]).expect_code(0);
    submitted.assert_stderr_contains(
        "chw.toml: warning: model.input_shape: [3, 16, 16] looks channels-first",
    );
    submitted_job_id(&submitted);
    // In the document too, and stdout stays the document alone.
    let document = cluster
        .carve(&["submit", &spec, "-o", "json"])
        .expect_code(0);
    document.assert_stderr_contains("warning: model.input_shape:");
    let warnings = document.json()["warnings"].clone();
    assert!(
        warnings[0]
            .as_str()
            .is_some_and(|warning| warning.starts_with("model.input_shape: [3, 16, 16]")),
        "{warnings}"
    );
    // A spec without anything odd: no warning.
    let plain = cluster.carve(SMALL_JOB).expect_code(0);
    assert!(!plain.stderr.contains("warning"), "{}", plain.context());
}
