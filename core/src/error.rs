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

    /// A name that is none of `names`, without a field (the caller knows which column or
    /// field held it): `"sleeping" is not a job state (queued, placed, ...)`.
    pub fn not_one_of(name: &str, what: &str, names: &[&str]) -> Self {
        FieldError::new("", format!("{name:?} is not {what} ({})", names.join(", ")))
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
    /// The shrink planner stopped before its search was done: trying every configuration
    /// the job allows would replay more plan steps than its budget
    /// ([`crate::shrink::SHRINK_BUDGET_PLAN_STEPS`]), which only very deep models with
    /// many candidate levels reach.
    #[error(
        "the shrink planner gave up after {candidate_replays} candidate replays ({plan_steps_replayed} plan steps; the budget is {budget_plan_steps}) without finding a configuration that fits in {}; the one it had reached needs {} ({smallest_config}); give the job more memory or a smaller model",
        HumanBytes(*available_bytes),
        HumanBytes(*smallest_required_bytes)
    )]
    ShrinkBudgetExhausted {
        /// Candidate configurations compiled and estimated before giving up.
        candidate_replays: u64,
        /// Plan steps compiled and replayed, the unit of the budget.
        plan_steps_replayed: u64,
        budget_plan_steps: u64,
        available_bytes: u64,
        smallest_required_bytes: u64,
        smallest_config: String,
    },
    /// A replay ran out of the slice's memory.
    #[error(transparent)]
    OutOfMemory(#[from] OutOfMemory),
}
