//! The one error type of carve-worker's library; the binary wraps it in `anyhow`.

use std::path::PathBuf;

/// Everything that can stop the worker or one of its attempts before it runs.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A flag or setting is not acceptable (e.g. `--sim-gpus 2x`).
    #[error("{setting}: {reason}")]
    InvalidSetting { setting: String, reason: String },
    /// The worker has no GPU to offer.
    #[error("no gpus: {0}")]
    NoGpus(String),
    /// NVML (the NVIDIA driver's management library) is missing or failed.
    #[error("nvml: {0}")]
    Nvml(String),
    /// The scheduler could not be reached or failed; the worker tries again.
    #[error("scheduler: {0}")]
    Scheduler(String),
    /// The scheduler refused the worker's token (unknown, revoked, expired, or not a
    /// worker's): trying again cannot help, so the worker stops and says so.
    #[error(
        "the scheduler refused this worker's token: {0} (check the token in --token-file or \
         the systemd credential carve-worker-token; a revoked or expired token needs a new \
         one: carve admin tokens create --role worker)"
    )]
    TokenRefused(String),
    /// The worker's token file (`--token-file`, or systemd's credential) cannot be read,
    /// is open to other users, or holds no token: the worker does not start.
    #[error("token file {}: {reason}", path.display())]
    TokenFile { path: PathBuf, reason: String },
    /// An attempt's process could not be started or watched.
    #[error("attempt process: {0}")]
    AttemptProcess(String),
    /// The guard could not be set up for an attempt, or its account or OOM record
    /// cannot be read.
    #[error("guard: {0}")]
    Guard(String),
    /// The attempt process (child side) got an unusable assignment.
    #[error("attempt: {0}")]
    Attempt(String),
    /// A command job's image could not be had (`crate::image`); the failure says whether
    /// another try may pass.
    #[error("image {reference}: {failure}")]
    Image {
        reference: String,
        failure: crate::image::ImageFailure,
    },
    /// A file or process operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl WorkerError {
    /// Whether trying again cannot help: the worker stops instead of reconnecting.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            WorkerError::TokenRefused(_)
                | WorkerError::InvalidSetting { .. }
                | WorkerError::TokenFile { .. }
        )
    }

    pub fn invalid_setting(setting: impl Into<String>, reason: impl Into<String>) -> Self {
        WorkerError::InvalidSetting {
            setting: setting.into(),
            reason: reason.into(),
        }
    }

    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        WorkerError::Io {
            context: context.into(),
            source,
        }
    }
}
