//! The settings' rules: flag over variable over file over default, the files they
//! name, and the errors of bad values.

use super::*;

/// Set in the copy of this test binary that [`run_with_environment`] starts.
const CHILD_MARKER: &str = "CARVE_SETTINGS_TEST_CHILD";

/// Runs `test` (this module's, by name) again in a child copy of this test binary
/// with `environment` and no other `CARVE_*` variable: clap reads the process
/// environment, which the 2024 edition only lets a test change with `unsafe`.
fn run_with_environment(test: &str, environment: &[(&str, &str)]) {
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    command.args([
        &format!("settings::tests::{test}"),
        "--exact",
        "--nocapture",
    ]);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("CARVE_") {
            command.env_remove(name);
        }
    }
    command
        .env(CHILD_MARKER, "1")
        .envs(environment.iter().copied());
    let output = command.output().unwrap();
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{test} failed with {environment:?}:\n{printed}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // libtest exits 0 when the filter matches nothing: make sure the test ran.
    assert!(
        printed.contains("1 passed"),
        "{test} did not run:\n{printed}"
    );
}

fn in_child() -> bool {
    std::env::var_os(CHILD_MARKER).is_some()
}

fn parse(arguments: &[&str]) -> Result<Arguments, clap::Error> {
    Arguments::try_parse_from(std::iter::once("carve-scheduler").chain(arguments.iter().copied()))
}

#[test]
fn nothing_given_means_the_defaults() {
    let settings = resolve(GivenSettings::default(), GivenSettings::default(), None).unwrap();
    // The defaults --help states.
    assert_eq!(settings.listen, "127.0.0.1:7470");
    assert_eq!(settings.database, None);
    assert_eq!(settings.admin_token, None);
    assert_eq!(settings.scheduler.lease_duration, Duration::from_secs(30));
    assert_eq!(
        settings.scheduler.heartbeat_interval,
        Duration::from_secs(5)
    );
    assert_eq!(
        settings.scheduler.scheduling_interval,
        Duration::from_secs(2)
    );
    assert_eq!(settings.ignored, Vec::<String>::new());
    assert_eq!(settings.metrics_listen, None);
    assert_eq!(settings.tls, None);
}

#[test]
fn the_slice_floor_comes_from_the_flag_then_the_file_then_256_mib() {
    let defaults = resolve(GivenSettings::default(), GivenSettings::default(), None).unwrap();
    assert_eq!(defaults.scheduler.min_slice_bytes, 256 << 20);
    let file: GivenSettings = toml::from_str("min_slice_mib = 512").unwrap();
    let from_file = resolve(GivenSettings::default(), file.clone(), None).unwrap();
    assert_eq!(from_file.scheduler.min_slice_bytes, 512 << 20);
    let flags = parse(&["--min-slice-mib", "0"]).unwrap();
    let from_flag = resolve(flags.given, file, None).unwrap();
    assert_eq!(from_flag.scheduler.min_slice_bytes, 0);
}

#[test]
fn preemption_settings_come_from_flags_then_the_file_then_the_defaults() {
    let defaults = resolve(GivenSettings::default(), GivenSettings::default(), None).unwrap();
    assert_eq!(
        defaults.scheduler.preemption,
        PreemptionSettings {
            enabled: true,
            min_run_time: Duration::from_secs(300),
            max_per_job_per_hour: 2,
            grace_period: Duration::from_secs(30),
        }
    );
    let flags = parse(&[
        "--preemption",
        "off",
        "--preemption-min-run-time-seconds",
        "0",
    ])
    .unwrap();
    let file: GivenSettings = toml::from_str(
        "preemption = true\npreemption_min_run_time_seconds = 60\n\
         preemption_max_per_hour = 5\npreemption_grace_seconds = 7",
    )
    .unwrap();
    let settings = resolve(flags.given, file, None).unwrap();
    assert_eq!(
        settings.scheduler.preemption,
        PreemptionSettings {
            enabled: false,
            min_run_time: Duration::ZERO,
            max_per_job_per_hour: 5,
            grace_period: Duration::from_secs(7),
        }
    );
    assert!(parse(&["--preemption", "maybe"]).is_err());
}

#[test]
fn flags_beat_the_file_and_the_file_beats_the_defaults() {
    let flags = parse(&[
        "--listen",
        "127.0.0.1:1",
        "--lease-seconds",
        "11",
        "--scheduling-interval-ms",
        "250",
    ])
    .unwrap();
    let file: GivenSettings = toml::from_str(
        r#"
        listen = "127.0.0.1:2"
        lease_seconds = 22
        heartbeat_seconds = 3
        scheduling_interval_ms = 900
        checkpoint_dir = "/shared/checkpoints"
        metrics_listen = "127.0.0.1:9100"
        "#,
    )
    .unwrap();
    let settings = resolve(flags.given, file, None).unwrap();
    assert_eq!(settings.listen, "127.0.0.1:1");
    assert_eq!(settings.scheduler.lease_duration, Duration::from_secs(11));
    assert_eq!(
        settings.scheduler.scheduling_interval,
        Duration::from_millis(250)
    );
    assert_eq!(
        settings.scheduler.heartbeat_interval,
        Duration::from_secs(3)
    );
    assert_eq!(settings.ignored.len(), 1, "{:?}", settings.ignored);
    assert!(
        settings.ignored[0].starts_with("checkpoint_dir (/shared/checkpoints) is ignored"),
        "{:?}",
        settings.ignored
    );
    assert_eq!(
        settings.metrics_listen,
        Some("127.0.0.1:9100".parse().unwrap())
    );
    assert_eq!(settings.database, None);
}

/// The whole order: flag, then environment, then file, then default.
#[test]
fn the_environment_sits_between_the_flags_and_the_file() {
    if !in_child() {
        return run_with_environment(
            "the_environment_sits_between_the_flags_and_the_file",
            &[
                ("CARVE_LISTEN", "127.0.0.1:2"),
                ("CARVE_LEASE_SECONDS", "12"),
                ("CARVE_SCHEDULING_INTERVAL_MS", "120"),
                ("CARVE_ADMIN_TOKEN", "secret-from-the-environment"),
            ],
        );
    }
    let arguments = parse(&["--listen", "127.0.0.1:1"]).unwrap();
    assert_eq!(
        arguments.admin_token.as_deref(),
        Some("secret-from-the-environment")
    );
    let file: GivenSettings = toml::from_str(
        "listen = \"127.0.0.1:3\"\nlease_seconds = 13\nscheduling_interval_ms = 130\nheartbeat_seconds = 4",
    )
    .unwrap();
    let settings = resolve(arguments.given, file, arguments.admin_token).unwrap();
    assert_eq!(
        settings.listen, "127.0.0.1:1",
        "the flag beats the environment"
    );
    assert_eq!(settings.scheduler.lease_duration, Duration::from_secs(12));
    assert_eq!(
        settings.scheduler.scheduling_interval,
        Duration::from_millis(120)
    );
    assert_eq!(
        settings.scheduler.heartbeat_interval,
        Duration::from_secs(4)
    );
    assert_eq!(
        settings.admin_token,
        Some(AdminTokenSource::Secret(
            "secret-from-the-environment".into()
        ))
    );
}

#[test]
fn a_bad_value_in_the_environment_names_the_flag() {
    if !in_child() {
        return run_with_environment(
            "a_bad_value_in_the_environment_names_the_flag",
            &[("CARVE_HEARTBEAT_SECONDS", "soon")],
        );
    }
    let error = parse(&[]).unwrap_err().to_string();
    assert!(error.contains("--heartbeat-seconds"), "{error}");
    assert!(error.contains("soon"), "{error}");
}

#[test]
fn a_bad_flag_value_names_the_flag() {
    let error = parse(&["--lease-seconds", "thirty"])
        .unwrap_err()
        .to_string();
    assert!(error.contains("--lease-seconds"), "{error}");
    assert!(error.contains("thirty"), "{error}");
    let error = parse(&["--metrics-listen", "everywhere"])
        .unwrap_err()
        .to_string();
    assert!(error.contains("--metrics-listen"), "{error}");
}

#[test]
fn the_log_format_is_text_unless_the_flag_or_environment_says_json() {
    if !in_child() {
        run_with_environment(
            "the_log_format_is_text_unless_the_flag_or_environment_says_json",
            &[("CARVE_LOG_FORMAT", "json")],
        );
        assert_eq!(parse(&[]).unwrap().log_format, LogFormat::Text);
        let error = parse(&["--log-format", "yaml"]).unwrap_err().to_string();
        assert!(error.contains("--log-format"), "{error}");
        return;
    }
    assert_eq!(parse(&[]).unwrap().log_format, LogFormat::Json);
    let flag = parse(&["--log-format", "text"]).unwrap();
    assert_eq!(flag.log_format, LogFormat::Text);
}

#[test]
fn a_bad_file_names_the_file_and_the_key() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("scheduler.toml");
    std::fs::write(&path, "lease_seconds = \"thirty\"\n").unwrap();
    let error = format!("{:#}", GivenSettings::from_file(&path).unwrap_err());
    assert!(error.contains("scheduler.toml"), "{error}");
    assert!(error.contains("lease_seconds"), "{error}");
    std::fs::write(&path, "lease_second = 30\n").unwrap();
    let error = format!("{:#}", GivenSettings::from_file(&path).unwrap_err());
    assert!(error.contains("unknown field `lease_second`"), "{error}");
}

#[test]
fn a_zero_scheduling_interval_is_refused_by_name() {
    let given = GivenSettings {
        scheduling_interval_ms: Some(0),
        ..GivenSettings::default()
    };
    let error = resolve(given, GivenSettings::default(), None)
        .unwrap_err()
        .to_string();
    assert!(error.contains("--scheduling-interval-ms"), "{error}");
}

#[test]
fn a_zero_heartbeat_or_lease_is_refused_by_name() {
    for (file, flag) in [
        ("heartbeat_seconds = 0", "--heartbeat-seconds"),
        ("lease_seconds = 0", "--lease-seconds"),
    ] {
        let file: GivenSettings = toml::from_str(file).unwrap();
        let error = resolve(GivenSettings::default(), file, None)
            .unwrap_err()
            .to_string();
        assert!(error.contains(flag), "{error}");
    }
}

#[test]
fn a_certificate_without_a_key_is_refused() {
    assert!(parse(&["--tls-cert", "chain.pem"]).is_err());
    let file = GivenSettings {
        tls_cert: Some("chain.pem".into()),
        ..GivenSettings::default()
    };
    let error = resolve(GivenSettings::default(), file, None)
        .unwrap_err()
        .to_string();
    assert!(error.contains("tls_key"), "{error}");
}

#[test]
fn a_client_ca_without_tls_is_refused() {
    assert!(parse(&["--tls-client-ca", "clients.pem"]).is_err());
    let file = GivenSettings {
        tls_client_ca: Some("clients.pem".into()),
        ..GivenSettings::default()
    };
    let error = resolve(GivenSettings::default(), file, None)
        .unwrap_err()
        .to_string();
    assert!(error.contains("tls_client_ca"), "{error}");
}

/// The secrets key opens every tenant's credentials: a file other users may read is
/// refused, as is one that holds no key; the error never quotes the file.
#[test]
fn a_secrets_key_file_is_the_schedulers_alone_and_holds_a_key() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("secrets-key");
    let key = "ab".repeat(32);
    std::fs::write(&path, format!("{key}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let refused = read_secrets_key(&path).unwrap_err().to_string();
    assert!(refused.contains("chmod 600"), "{refused}");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(read_secrets_key(&path).is_ok());
    std::fs::write(&path, "not-a-key-at-all").unwrap();
    let refused = read_secrets_key(&path).unwrap_err().to_string();
    assert!(refused.contains("64 hexadecimal digits"), "{refused}");
    assert!(!refused.contains("not-a-key-at-all"), "{refused}");
}

/// As before this type existed: a token file, from any source, wins over the secret.
#[test]
fn an_admin_token_file_wins_over_the_secret() {
    let file = GivenSettings {
        admin_token_file: Some("/etc/carve/admin-token".into()),
        ..GivenSettings::default()
    };
    let settings = resolve(
        GivenSettings::default(),
        file,
        Some("the-admin-secret-itself".to_string()),
    )
    .unwrap();
    assert_eq!(
        settings.admin_token,
        Some(AdminTokenSource::File("/etc/carve/admin-token".into()))
    );
    assert!(!format!("{settings:?}").contains("the-admin-secret-itself"));
    let settings = resolve(
        GivenSettings::default(),
        GivenSettings::default(),
        Some("the-admin-secret-itself".to_string()),
    )
    .unwrap();
    assert!(
        !format!("{settings:?}").contains("the-admin-secret-itself"),
        "{settings:?}"
    );
}

#[test]
fn help_names_every_environment_variable_and_hides_secrets() {
    if !in_child() {
        return run_with_environment(
            "help_names_every_environment_variable_and_hides_secrets",
            &[
                ("CARVE_ADMIN_TOKEN", "do-not-print-me"),
                ("CARVE_DATABASE_URL", "postgres://carve:password@db/carve"),
            ],
        );
    }
    let help = <Arguments as clap::CommandFactory>::command()
        .render_long_help()
        .to_string();
    for variable in [
        "CARVE_CONFIG",
        "CARVE_ADMIN_TOKEN",
        "CARVE_LISTEN",
        "CARVE_DATABASE_URL",
        "CARVE_ADMIN_TOKEN_FILE",
        "CARVE_LEASE_SECONDS",
        "CARVE_HEARTBEAT_SECONDS",
        "CARVE_SCHEDULING_INTERVAL_MS",
        "CARVE_METRICS_LISTEN",
        "CARVE_TLS_CERT",
        "CARVE_TLS_KEY",
        "CARVE_TLS_CLIENT_CA",
    ] {
        assert!(
            help.contains(&format!("[env: {variable}")),
            "{variable} missing:\n{help}"
        );
    }
    assert!(!help.contains("do-not-print-me"), "{help}");
    assert!(!help.contains("password"), "{help}");
    // Ignored, kept only so old configurations start: not offered to new ones.
    assert!(!help.contains("CARVE_CHECKPOINT_DIR"), "{help}");
}

/// A rotation's old key alone would seal nothing and open only old values: refused
/// without the key that replaced it; with it, both keys are read.
#[test]
fn a_previous_secrets_key_needs_the_current_one() {
    let directory = tempfile::tempdir().unwrap();
    let key_file = |name: &str, digits: &str| {
        let path = directory.path().join(name);
        std::fs::write(&path, digits.repeat(32)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    };
    let (current, previous) = (key_file("current", "ab"), key_file("previous", "cd"));
    let given = |current: Option<&Path>| GivenSettings {
        database: Some(format!(
            "sqlite://{}",
            directory.path().join("carve.db").display()
        )),
        secrets_key_file: current.map(Path::to_path_buf),
        secrets_previous_key_files: vec![previous.clone()],
        ..GivenSettings::default()
    };
    let refused = resolve(given(None), GivenSettings::default(), None)
        .unwrap()
        .load()
        .unwrap_err()
        .to_string();
    assert!(refused.contains("needs --secrets-key-file"), "{refused}");
    let (_, config) = resolve(given(Some(&current)), GivenSettings::default(), None)
        .unwrap()
        .load()
        .unwrap();
    assert!(config.settings.sealing.key.is_some());
    assert_eq!(config.settings.sealing.previous_keys.len(), 1);
}
