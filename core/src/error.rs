//! The one error type of carve-core.
//!
//! Every rejection names the field it is about (a path into the job spec such as
//! `model.layers[3].conv2d.kernel`, or a run setting such as `micro_batch_size`) and the
//! reason, so the API can answer `InvalidArgument` with a message a person can act on.

use std::fmt;

use crate::allocator::OutOfMemory;
use crate::bytes::HumanBytes;

/// A bad value with the field it is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Path of the offending field; empty when the whole document is at fault (a TOML
    /// syntax error).
    pub field: String,
    pub reason: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        FieldError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            formatter.write_str(&self.reason)
        } else {
            write!(formatter, "{}: {}", self.field, self.reason)
        }
    }
}

impl std::error::Error for FieldError {}

/// Everything carve-core can refuse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CoreError {
    /// The job spec (or a run setting) is malformed or inconsistent.
    #[error("{0}")]
    InvalidSpec(#[from] FieldError),
    /// No configuration the job allows fits in the memory it could get.
    #[error(
        "no configuration fits in {}: the smallest the allowed strategies ({strategies}) reach needs {} ({smallest_config})",
        HumanBytes(*available_bytes),
        HumanBytes(*smallest_required_bytes)
    )]
    DoesNotFit {
        available_bytes: u64,
        smallest_required_bytes: u64,
        smallest_config: String,
        strategies: String,
    },
    /// A replay ran out of the slice's memory.
    #[error(transparent)]
    OutOfMemory(#[from] OutOfMemory),
}
