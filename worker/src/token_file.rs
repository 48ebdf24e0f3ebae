//! Where the worker's token comes from: a file, never the worker's environment or
//! command line.
//!
//! Every program the worker runs for a tenant starts as its descendant, and a descendant
//! inherits the environment and can read `/proc/PID/cmdline` of its ancestors: a token in
//! `CARVE_TOKEN` or `--token` would be the tenant's to take, and with it the node's place
//! in the cluster. So the token is read once, at start, from a file:
//!
//! - `--token-file PATH` (`CARVE_WORKER_TOKEN_FILE` names the path, never the token);
//! - else systemd's credential `carve-worker-token` (`LoadCredential=carve-worker-token:
//!   /etc/carve/worker-token` in the unit), found in `$CREDENTIALS_DIRECTORY`;
//! - else the worker refuses to start and says to give `--token-file`.
//!
//! Like ssh with a private key, the worker refuses a token file that other users may read
//! or write: its owner alone may (0600 or 0400; the fix is `chmod 600 PATH`). The group may
//! also read (never write) a file that the platform handed over rather than a person wrote,
//! because that is the only way the platform gives an unprivileged service a secret:
//!
//! - a file in systemd's credentials directory: systemd writes credentials root-owned 0400
//!   with an ACL for the service's user, which `stat` shows as 0440;
//! - a file owned by root while the worker runs as another user: Kubernetes writes a
//!   Secret volume's files root:fsGroup and adds group read whatever `defaultMode` says
//!   when the pod has an `fsGroup` (kubernetes/kubernetes#57923), and the worker reads
//!   the file through that group.
//!
//! Others (the last three mode bits) never get anything. The file holds the token alone:
//! surrounding whitespace and the final newline are trimmed; an empty file, or one with
//! more than one word, is refused rather than sent to the scheduler to be refused there.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::WorkerError;

/// The name of the systemd credential the worker reads when `--token-file` is not
/// given: `LoadCredential=carve-worker-token:/etc/carve/worker-token`.
pub const SYSTEMD_CREDENTIAL_NAME: &str = "carve-worker-token";

/// The mode bits no token file may have: anything for others, and write for the group.
const NEVER_ALLOWED_MODE_BITS: u32 = 0o027;

/// The group's read bit: allowed only for a file the platform handed over.
const GROUP_READ_MODE_BIT: u32 = 0o040;

/// A token is a short line; anything much longer is the wrong file.
const LARGEST_TOKEN_FILE_BYTES: u64 = 64 * 1024;

/// The worker's token: from `token_file` (`--token-file`) when given, else from systemd's
/// credential in `credentials_directory` (the value of `$CREDENTIALS_DIRECTORY`, passed
/// in rather than read here so that tests set no process-wide environment).
pub fn worker_token(
    token_file: Option<&Path>,
    credentials_directory: Option<&Path>,
) -> Result<String, WorkerError> {
    if let Some(path) = token_file {
        // `--token-file %d/carve-worker-token` in a unit names systemd's own file: it
        // gets systemd's rule.
        let handed_over_by_systemd =
            credentials_directory.is_some_and(|directory| path.starts_with(directory));
        return read_token(path, handed_over_by_systemd);
    }
    if let Some(path) = credentials_directory.and_then(systemd_credential_token_file) {
        return read_systemd_credential(&path);
    }
    let systemd = match credentials_directory {
        Some(directory) => format!(
            "{} has no credential {SYSTEMD_CREDENTIAL_NAME}",
            directory.display()
        ),
        None => "$CREDENTIALS_DIRECTORY is not set".to_string(),
    };
    Err(WorkerError::invalid_setting(
        "--token-file",
        format!(
            "no worker token: give --token-file PATH (a file of mode 0600 holding a worker \
             token), or under systemd LoadCredential={SYSTEMD_CREDENTIAL_NAME}:PATH ({systemd}); \
             carve-worker never reads a token from CARVE_TOKEN or its command line, where \
             the programs it runs could read it"
        ),
    ))
}

/// The file of systemd's credential `carve-worker-token` in `credentials_directory`, when
/// it is there.
pub fn systemd_credential_token_file(credentials_directory: &Path) -> Option<PathBuf> {
    let path = credentials_directory.join(SYSTEMD_CREDENTIAL_NAME);
    path.exists().then_some(path)
}

/// The token in a file a person gave (`--token-file`): refused when group or others may
/// read or write it, unless root owns it and the worker is not root (a file the platform
/// provisioned, see the module's documentation).
pub fn read_token_file(path: &Path) -> Result<String, WorkerError> {
    read_token(path, false)
}

/// The token in a file systemd handed over from `$CREDENTIALS_DIRECTORY`: its group may
/// read it, as systemd's own mode for credentials shows it.
pub fn read_systemd_credential(path: &Path) -> Result<String, WorkerError> {
    read_token(path, true)
}

fn read_token(path: &Path, handed_over_by_systemd: bool) -> Result<String, WorkerError> {
    let problem = |reason: String| WorkerError::TokenFile {
        path: path.to_path_buf(),
        reason,
    };
    // The mode is read from the open file, so it is the mode of what is read.
    let file = File::open(path).map_err(|error| problem(format!("cannot open it: {error}")))?;
    let metadata = file
        .metadata()
        .map_err(|error| problem(format!("cannot read its mode: {error}")))?;
    if !metadata.is_file() {
        return Err(problem("is not a regular file".into()));
    }
    let group_may_read = group_may_read(
        handed_over_by_systemd,
        metadata.uid(),
        rustix::process::geteuid().as_raw(),
    );
    if let Some(reason) = mode_problem(metadata.mode(), group_may_read, path) {
        return Err(problem(reason));
    }
    if metadata.len() > LARGEST_TOKEN_FILE_BYTES {
        return Err(problem(format!(
            "holds {} bytes: a token file holds one token, a short line",
            metadata.len()
        )));
    }
    let mut contents = String::new();
    file.take(LARGEST_TOKEN_FILE_BYTES)
        .read_to_string(&mut contents)
        .map_err(|error| problem(format!("cannot read it as text: {error}")))?;
    let token = contents.trim();
    if token.is_empty() {
        return Err(problem(
            "is empty: write a worker token into it (carve admin tokens create --role worker)"
                .into(),
        ));
    }
    if token.chars().any(|character| character.is_whitespace()) {
        return Err(problem(
            "holds more than one word or line: a token file holds the token alone".into(),
        ));
    }
    Ok(token.to_string())
}

/// Whether the group may read the token file: when systemd handed it over, or when root
/// owns it and the worker runs as another user (only root or the platform could have
/// made it so, and the group is the one the platform chose for this service). A worker
/// running as root holds a root-owned file to the owner-only rule like any other.
fn group_may_read(handed_over_by_systemd: bool, file_owner: u32, worker_user: u32) -> bool {
    handed_over_by_systemd || (file_owner == 0 && worker_user != 0)
}

/// Why a token file with `mode` is refused, or `None` when its mode is acceptable; the
/// reason says the mode and how to fix it, as ssh does for a private key.
fn mode_problem(mode: u32, group_may_read: bool, path: &Path) -> Option<String> {
    let mut refused_bits = NEVER_ALLOWED_MODE_BITS;
    if !group_may_read {
        refused_bits |= GROUP_READ_MODE_BIT;
    }
    if mode & refused_bits == 0 {
        return None;
    }
    let who = if group_may_read {
        "others must have no access to it and its group may only read it"
    } else {
        "it must be readable by its owner alone"
    };
    Some(format!(
        "permissions {:04o} are too open: it holds the worker's token, so {who} \
         (run chmod 600 {})",
        mode & 0o7777,
        path.display()
    ))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// `contents` in a file named `name` in `directory`, with `mode`.
    fn write_file(directory: &Path, name: &str, contents: &str, mode: u32) -> PathBuf {
        let path = directory.join(name);
        std::fs::write(&path, contents).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    fn error_text(result: Result<String, WorkerError>) -> String {
        result.unwrap_err().to_string()
    }

    #[test]
    fn a_token_file_group_or_others_may_read_or_write_is_refused_with_its_mode_and_the_fix() {
        let directory = tempfile::tempdir().unwrap();
        for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o660, 0o666, 0o440] {
            let path = write_file(directory.path(), "worker-token", "carve_secret\n", mode);
            let error = read_token_file(&path).unwrap_err();
            assert!(error.is_permanent(), "{error}");
            let message = error.to_string();
            assert!(
                message.contains(&format!("permissions {mode:04o} are too open")),
                "{message}"
            );
            assert!(
                message.contains(&format!("chmod 600 {}", path.display())),
                "{message}"
            );
            assert!(
                message.starts_with(&format!("token file {}: ", path.display())),
                "{message}"
            );
        }
    }

    #[test]
    fn a_token_file_its_owner_alone_may_read_is_accepted() {
        let directory = tempfile::tempdir().unwrap();
        for mode in [0o600, 0o400] {
            let path = write_file(directory.path(), "worker-token", "carve_secret\n", mode);
            assert_eq!(read_token_file(&path).unwrap(), "carve_secret");
        }
    }

    #[test]
    fn the_token_is_trimmed_of_whitespace_and_its_newline() {
        let directory = tempfile::tempdir().unwrap();
        for contents in [
            "carve_secret",
            "carve_secret\n",
            "  carve_secret \r\n\n",
            "\tcarve_secret",
        ] {
            let path = write_file(directory.path(), "worker-token", contents, 0o600);
            assert_eq!(
                read_token_file(&path).unwrap(),
                "carve_secret",
                "{contents:?}"
            );
        }
    }

    #[test]
    fn an_empty_token_file_is_refused() {
        let directory = tempfile::tempdir().unwrap();
        for contents in ["", "\n", "  \n\t\n"] {
            let path = write_file(directory.path(), "worker-token", contents, 0o600);
            let message = error_text(read_token_file(&path));
            assert!(message.contains("is empty"), "{message}");
        }
    }

    #[test]
    fn a_token_file_with_more_than_one_word_is_refused() {
        let directory = tempfile::tempdir().unwrap();
        let path = write_file(
            directory.path(),
            "worker-token",
            "carve_a\ncarve_b\n",
            0o600,
        );
        let message = error_text(read_token_file(&path));
        assert!(message.contains("more than one word or line"), "{message}");
    }

    #[test]
    fn a_missing_token_file_is_named_in_the_error() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("no-such-token");
        let message = error_text(read_token_file(&path));
        assert!(
            message.starts_with(&format!("token file {}: cannot open it", path.display())),
            "{message}"
        );
    }

    #[test]
    fn a_directory_is_not_a_token_file() {
        let directory = tempfile::tempdir().unwrap();
        std::fs::set_permissions(directory.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let message = error_text(read_token_file(directory.path()));
        assert!(message.contains("is not a regular file"), "{message}");
    }

    #[test]
    fn the_systemd_credential_is_found_in_the_credentials_directory() {
        let credentials = tempfile::tempdir().unwrap();
        assert_eq!(systemd_credential_token_file(credentials.path()), None);
        let path = write_file(
            credentials.path(),
            SYSTEMD_CREDENTIAL_NAME,
            "carve_from_systemd\n",
            0o400,
        );
        assert_eq!(
            systemd_credential_token_file(credentials.path()),
            Some(path)
        );
        assert_eq!(
            worker_token(None, Some(credentials.path())).unwrap(),
            "carve_from_systemd"
        );
    }

    #[test]
    fn a_systemd_credential_its_group_may_read_is_accepted_but_not_one_others_may() {
        // systemd's credentials show as 0440 (root-owned 0400 with an ACL for the
        // service's user); group read is allowed there and nowhere a person wrote.
        let credentials = tempfile::tempdir().unwrap();
        write_file(
            credentials.path(),
            SYSTEMD_CREDENTIAL_NAME,
            "carve_from_systemd\n",
            0o440,
        );
        assert_eq!(
            worker_token(None, Some(credentials.path())).unwrap(),
            "carve_from_systemd"
        );
        for mode in [0o444, 0o460, 0o404] {
            let path = write_file(
                credentials.path(),
                SYSTEMD_CREDENTIAL_NAME,
                "carve_from_systemd\n",
                mode,
            );
            let message = error_text(worker_token(None, Some(credentials.path())));
            assert!(
                message.contains(&format!("permissions {mode:04o} are too open"))
                    && message.contains("others must have no access")
                    && message.contains(&format!("chmod 600 {}", path.display())),
                "{message}"
            );
        }
    }

    #[test]
    fn a_token_file_named_inside_the_credentials_directory_gets_systemds_rule() {
        // `--token-file %d/carve-worker-token` in a unit.
        let credentials = tempfile::tempdir().unwrap();
        let path = write_file(
            credentials.path(),
            "worker-token",
            "carve_percent_d\n",
            0o440,
        );
        assert_eq!(
            worker_token(Some(&path), Some(credentials.path())).unwrap(),
            "carve_percent_d"
        );
        let elsewhere = tempfile::tempdir().unwrap();
        assert!(worker_token(Some(&path), Some(elsewhere.path())).is_err());
    }

    #[test]
    fn the_token_file_flag_wins_over_the_systemd_credential() {
        let credentials = tempfile::tempdir().unwrap();
        write_file(
            credentials.path(),
            SYSTEMD_CREDENTIAL_NAME,
            "carve_from_systemd\n",
            0o400,
        );
        let given = tempfile::tempdir().unwrap();
        let path = write_file(given.path(), "worker-token", "carve_from_flag\n", 0o600);
        assert_eq!(
            worker_token(Some(&path), Some(credentials.path())).unwrap(),
            "carve_from_flag"
        );
    }

    #[test]
    fn without_a_token_file_or_a_credential_the_error_names_the_token_file_flag() {
        let credentials = tempfile::tempdir().unwrap();
        for credentials_directory in [None, Some(credentials.path())] {
            let error = worker_token(None, credentials_directory).unwrap_err();
            assert!(error.is_permanent(), "{error}");
            let message = error.to_string();
            assert!(
                message.starts_with("--token-file: no worker token: give --token-file PATH"),
                "{message}"
            );
            assert!(message.contains("CARVE_TOKEN"), "{message}");
        }
    }

    #[test]
    fn the_group_may_read_only_a_file_systemd_or_root_handed_over() {
        // Kubernetes: a Secret volume's file is root:fsGroup 0440, the worker uid 10001.
        assert!(group_may_read(false, 0, 10001));
        assert!(group_may_read(true, 10001, 10001));
        assert!(!group_may_read(false, 10001, 10001));
        // A worker running as root gets the owner-only rule for its own root files.
        assert!(!group_may_read(false, 0, 0));
        assert!(mode_problem(0o100440, true, Path::new("t")).is_none());
        assert!(mode_problem(0o100400, false, Path::new("t")).is_none());
        assert!(mode_problem(0o100440, false, Path::new("t")).is_some());
        assert!(mode_problem(0o100460, true, Path::new("t")).is_some());
        assert!(mode_problem(0o100441, true, Path::new("t")).is_some());
    }
}
