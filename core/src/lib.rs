//! carve-core: the pure heart of Carve.
//!
//! Everything the scheduler decides and everything the estimator computes is a pure
//! function of this crate: no IO, no async, no clock, no randomness (time and seeds come
//! in as arguments). See ARCHITECTURE.md for the map.

pub mod admission;
pub mod allocator;
pub mod bytes;
pub mod command;
pub mod error;
pub mod estimator;
pub mod gang;
pub mod job_state;
pub mod model;
pub mod plan;
pub mod scheduling;
pub mod shrink;
pub mod simulation;
pub mod spec;
pub mod step_rate;
pub mod usage;
pub mod validate;
pub mod workload;

pub use error::{CoreError, FieldError};
