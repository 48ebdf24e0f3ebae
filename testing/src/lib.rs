//! carve-testing: what Carve's tests and benchmarks share — a private PostgreSQL server
//! ([`PgServer`]) started from the machine's PostgreSQL binaries, so that the store contract
//! tests and `carve-submit-bench` measure against a real, durable server without anything
//! installed or configured beforehand.
//!
//! # The PostgreSQL server
//!
//! - Binaries: `$CARVE_PG_BIN_DIR`, else the newest `/usr/lib/postgresql/*/bin` (Debian's
//!   `postgresql` package), else `initdb` on `PATH`. None found is an error saying what to
//!   install.
//! - User: PostgreSQL refuses to run as root, so under root `initdb` and `pg_ctl` run as
//!   an unprivileged user through `runuser -u USER --`: `$CARVE_PG_USER`, else `carve-pg`
//!   (which `.ci/run` creates) when it exists, else `nobody`. Under any other user they run
//!   as that user.
//! - Files: a fresh directory `$TMPDIR/carve-pg-<pid>-<nanos>/` (owned by that user)
//!   holding `data/` (the cluster), `socket/` (the Unix socket, `-k`) and `postgres.log`.
//! - Network: `listen_addresses=127.0.0.1` on a free port found by binding
//!   `127.0.0.1:0`; `fsync=on`, `synchronous_commit=on`; trust authentication for the
//!   `postgres` superuser, which only local processes can reach.
//! - Stopping: [`PgServer`] starts a supervisor shell first, whose stdin is a pipe from
//!   this process. When the pipe closes, the supervisor runs `pg_ctl stop -m immediate`
//!   and removes the directory. Dropping a `PgServer` closes the pipe and waits for that;
//!   a server kept in a `static` is never dropped, but the kernel closes the pipe when the
//!   process exits for any reason (success, panic, abort, kill), so the server never
//!   outlives the process that started it.
//!
//! [`PgServer::start_with_tls`] also turns on `ssl` with a given certificate.
//!
//! # Certificates
//!
//! [`certificates::TestAuthority`] is a private CA issuing server and client certificates.
//!
//! # A tenant on a running scheduler
//!
//! [`cluster::tenant_with_tokens`] creates a tenant and its tokens through the admin API.
//!
//! # The example specs
//!
//! [`examples::example_spec_files`] lists the repository's `examples/*.toml`.

use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::Connection;

pub mod certificates;
pub mod cluster;
pub mod examples;
pub mod source_tree;

pub use certificates::{PemPair, TestAuthority};

/// Why a [`PgServer`] could not start or serve: the message says what failed and, where
/// it can, what to do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TestingError(pub String);

impl From<String> for TestingError {
    fn from(message: String) -> TestingError {
        TestingError(message)
    }
}

/// A PostgreSQL server in a temp dir, stopped (and its files removed) when dropped or
/// when this process exits.
#[derive(Debug)]
pub struct PgServer {
    port: u16,
    root: PathBuf,
    supervisor: Mutex<Option<Child>>,
}

impl PgServer {
    /// Initializes a cluster in a fresh temp dir and starts a server on it.
    pub fn start() -> Result<PgServer, TestingError> {
        PgServer::start_configured(None)
    }

    /// Like [`PgServer::start`], with `ssl=on` and `server` as the server's certificate
    /// and key: clients may then ask for TLS (`sslmode=require`, `verify-full`).
    pub fn start_with_tls(server: &PemPair) -> Result<PgServer, TestingError> {
        PgServer::start_configured(Some(server))
    }

    fn start_configured(tls: Option<&PemPair>) -> Result<PgServer, TestingError> {
        let bin_dir = find_postgres_bin_dir()?;
        let run_as = RunAs::choose()?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|elapsed| elapsed.as_nanos())
            .unwrap_or(0);
        let root = std::env::temp_dir().join(format!("carve-pg-{}-{nanos}", std::process::id()));
        let data = root.join("data");
        let socket = root.join("socket");
        let log = root.join("postgres.log");
        fs::create_dir(&root).map_err(|error| format!("create {}: {error}", root.display()))?;
        fs::set_permissions(&root, fs::Permissions::from_mode(0o700))
            .map_err(|error| format!("chmod {}: {error}", root.display()))?;
        fs::create_dir(&socket).map_err(|error| format!("create {}: {error}", socket.display()))?;
        run_as.give(&root)?;
        run_as.give(&socket)?;

        // The supervisor comes first, so that whatever happens from here on, the server
        // and the directory go away with this process.
        let pg_ctl = bin_dir.join("pg_ctl");
        let stop = run_as.shell_command(&[
            &pg_ctl.to_string_lossy(),
            "stop",
            "-D",
            &data.to_string_lossy(),
            "-m",
            "immediate",
            "-w",
        ]);
        let script = format!(
            "trap '' INT TERM HUP\nread _closed\n{stop} >/dev/null 2>&1\nrm -rf {}\n",
            shell_quote(&root.to_string_lossy())
        );
        let supervisor = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|error| format!("start the postgres supervisor (sh): {error}"))?;
        let mut server = PgServer {
            port: 0,
            root: root.clone(),
            supervisor: Mutex::new(Some(supervisor)),
        };

        let initdb = bin_dir.join("initdb");
        run_as.run(
            &root,
            &initdb,
            &[
                "-D",
                &data.to_string_lossy(),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",
            ],
        )?;

        let tls_options = match tls {
            Some(server) => {
                // Relative paths are read from the data directory; the server insists its
                // key be its own user's and private.
                for (name, text, mode) in [
                    ("server.crt", &server.certificate_pem, 0o644),
                    ("server.key", &server.private_key_pem, 0o600),
                ] {
                    let path = data.join(name);
                    fs::write(&path, text)
                        .and_then(|()| fs::set_permissions(&path, fs::Permissions::from_mode(mode)))
                        .map_err(|error| format!("write {}: {error}", path.display()))?;
                    run_as.give(&path)?;
                }
                " -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key"
            }
            None => "",
        };
        let mut last_error = String::new();
        for _ in 0..5 {
            let port = free_port()?;
            let options = format!(
                "-c listen_addresses=127.0.0.1 -p {port} -k {} -c fsync=on \
                 -c synchronous_commit=on -c max_connections=300{tls_options}",
                socket.to_string_lossy()
            );
            let started = run_as.run(
                &root,
                &pg_ctl,
                &[
                    "start",
                    "-D",
                    &data.to_string_lossy(),
                    "-l",
                    &log.to_string_lossy(),
                    "-w",
                    "-t",
                    "60",
                    "-o",
                    &options,
                ],
            );
            match started {
                Ok(()) => {
                    server.port = port;
                    return Ok(server);
                }
                Err(error) => {
                    let log_text = fs::read_to_string(&log).unwrap_or_default();
                    last_error = format!("{error}\n--- {}:\n{log_text}", log.display());
                    if !log_text.contains("could not bind") && !log_text.contains("in use") {
                        break;
                    }
                }
            }
        }
        Err(TestingError(format!(
            "postgres did not start: {last_error}"
        )))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory holding the cluster, its socket and its log.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The URL of `database` on this server, as the superuser.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Creates a database no other user of this server has and returns its URL. Names
    /// are `{prefix}_{n}` with `n` counting up in this process.
    pub async fn create_database(&self, prefix: &str) -> Result<String, TestingError> {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        if prefix.is_empty()
            || !prefix
                .chars()
                .all(|character| character.is_ascii_lowercase() || character == '_')
        {
            return Err(TestingError(format!(
                "database prefix {prefix:?}: must be lowercase ascii letters and underscores"
            )));
        }
        let name = format!("{prefix}_{}", NEXT.fetch_add(1, Ordering::Relaxed));
        let mut admin = sqlx::PgConnection::connect(&self.url("postgres"))
            .await
            .map_err(|error| TestingError(format!("connect to the postgres server: {error}")))?;
        sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .map_err(|error| TestingError(format!("create database {name}: {error}")))?;
        admin.close().await.ok();
        Ok(self.url(&name))
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let supervisor = self
            .supervisor
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(mut supervisor) = supervisor {
            // Closing its stdin tells the supervisor to stop the server and clean up.
            if let Some(mut stdin) = supervisor.stdin.take() {
                let _ = stdin.write_all(b"\n");
            }
            let _ = supervisor.wait();
        }
    }
}

/// Who runs `initdb` and `pg_ctl`: this process's own user, or (under root) an
/// unprivileged one through `runuser`.
#[derive(Debug)]
enum RunAs {
    Myself,
    User { name: String, uid: u32, gid: u32 },
}

impl RunAs {
    fn choose() -> Result<RunAs, String> {
        let my_uid = fs::metadata("/proc/self")
            .map(|metadata| metadata.uid())
            .map_err(|error| format!("read /proc/self to find out who runs the tests: {error}"))?;
        if my_uid != 0 {
            return Ok(RunAs::Myself);
        }
        let name = match std::env::var("CARVE_PG_USER") {
            Ok(name) if !name.is_empty() => name,
            _ if id_of("carve-pg", "-u").is_ok() => "carve-pg".to_string(),
            _ => "nobody".to_string(),
        };
        let uid = id_of(&name, "-u")?;
        let gid = id_of(&name, "-g")?;
        if uid == 0 {
            return Err(format!(
                "the postgres test user {name} is root; postgres refuses to run as root"
            ));
        }
        Ok(RunAs::User { name, uid, gid })
    }

    /// Hands `path` to the user the server runs as.
    fn give(&self, path: &Path) -> Result<(), String> {
        match self {
            RunAs::Myself => Ok(()),
            RunAs::User { name, uid, gid } => {
                std::os::unix::fs::chown(path, Some(*uid), Some(*gid))
                    .map_err(|error| format!("chown {} to {name}: {error}", path.display()))
            }
        }
    }

    fn command(&self, program: &Path) -> Command {
        match self {
            RunAs::Myself => Command::new(program),
            RunAs::User { name, .. } => {
                let mut command = Command::new(runuser());
                command.args(["-u", name, "--"]).arg(program);
                command
            }
        }
    }

    /// `program args...` as one shell command line, run as this user.
    fn shell_command(&self, program_and_args: &[&str]) -> String {
        let quoted: Vec<String> = program_and_args
            .iter()
            .map(|arg| shell_quote(arg))
            .collect();
        match self {
            RunAs::Myself => quoted.join(" "),
            RunAs::User { name, .. } => {
                format!(
                    "{} -u {} -- {}",
                    shell_quote(&runuser().to_string_lossy()),
                    shell_quote(name),
                    quoted.join(" ")
                )
            }
        }
    }

    /// Runs `program args...` in `dir` and fails with its output when it fails.
    fn run(&self, dir: &Path, program: &Path, args: &[&str]) -> Result<(), String> {
        let mut command = self.command(program);
        let output = command
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|error| format!("run {:?}: {error}", command))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{} {} failed ({}):\n{}{}",
                program.display(),
                args.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ))
        }
    }
}

/// `runuser` (util-linux), which root uses to run a command as another user; it lives in
/// an `sbin` directory that is not always on `PATH`.
fn runuser() -> PathBuf {
    ["/usr/sbin/runuser", "/sbin/runuser", "/usr/bin/runuser"]
        .iter()
        .map(PathBuf::from)
        .find(|path| path.is_file())
        .unwrap_or_else(|| PathBuf::from("runuser"))
}

fn id_of(user: &str, flag: &str) -> Result<u32, String> {
    let output = Command::new("id")
        .args([flag, user])
        .output()
        .map_err(|error| format!("run id {flag} {user}: {error}"))?;
    if !output.status.success() {
        return Err(format!("no user {user}"));
    }
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .map_err(|error| format!("id {flag} {user}: {error}"))
}

fn free_port() -> Result<u16, String> {
    let listener =
        TcpListener::bind("127.0.0.1:0").map_err(|error| format!("bind 127.0.0.1:0: {error}"))?;
    listener
        .local_addr()
        .map(|address| address.port())
        .map_err(|error| format!("read the bound port: {error}"))
}

fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

/// The directory with `initdb`, `pg_ctl` and `postgres`.
fn find_postgres_bin_dir() -> Result<PathBuf, String> {
    let has_binaries = |dir: &Path| {
        ["initdb", "pg_ctl", "postgres"]
            .iter()
            .all(|binary| dir.join(binary).is_file())
    };
    if let Ok(dir) = std::env::var("CARVE_PG_BIN_DIR") {
        let dir = PathBuf::from(dir);
        return if has_binaries(&dir) {
            Ok(dir)
        } else {
            Err(format!(
                "CARVE_PG_BIN_DIR={} has no initdb, pg_ctl and postgres",
                dir.display()
            ))
        };
    }
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            has_binaries(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Ok(bin);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if has_binaries(&dir) {
                return Ok(dir);
            }
        }
    }
    let ci = if std::env::var_os("CI").is_some() {
        "CI is set, and CI must run the store contract tests on PostgreSQL too: "
    } else {
        ""
    };
    Err(format!(
        "{ci}the store contract tests and carve-submit-bench need the PostgreSQL 15 (or \
         newer) server binaries initdb, pg_ctl and postgres, and found none in \
         $CARVE_PG_BIN_DIR, \
         /usr/lib/postgresql/*/bin or PATH. install them (Debian/Ubuntu: \
         `apt-get install -y postgresql`, which .ci/run does), or set CARVE_PG_BIN_DIR \
         to the directory that holds them"
    ))
}
