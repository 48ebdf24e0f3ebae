//! The one error type of carve-engine.

use carve_core::FieldError;
use carve_core::allocator::OutOfMemory;
use carve_core::plan::OperandError;

/// Everything that can stop a training attempt.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The slice could not hold a buffer: the attempt ends with the numbers, nothing leaks.
    #[error(transparent)]
    OutOfMemory(#[from] OutOfMemory),
    /// The job or its run config is not acceptable.
    #[error("{0}")]
    InvalidJob(#[from] FieldError),
    /// A data file is missing, unreadable or does not match the model.
    #[error("data: {path}: {reason}")]
    Data { path: String, reason: String },
    /// A checkpoint could not be written or read back.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: String, reason: String },
    /// The backend failed for a reason other than memory.
    #[error("backend: {0}")]
    Backend(String),
}

/// The plan's operations do not list the buffers their kind and layer say: the compiler
/// and the engine disagree about the plan, which stops the attempt like a backend failure.
impl From<OperandError> for EngineError {
    fn from(error: OperandError) -> EngineError {
        EngineError::Backend(error.to_string())
    }
}

impl EngineError {
    pub fn data(path: impl Into<String>, reason: impl Into<String>) -> Self {
        EngineError::Data {
            path: path.into(),
            reason: reason.into(),
        }
    }

    pub fn checkpoint(path: impl Into<String>, reason: impl Into<String>) -> Self {
        EngineError::Checkpoint {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
