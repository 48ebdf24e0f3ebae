//! Command jobs: a user's own training program (PyTorch, TensorFlow, JAX...) run as it is
//! inside a slice enforced by the guard, instead of a model Carve's engine trains.
//!
//! Carve cannot see inside such a program, so it treats it as a black box with knobs: the
//! job file names the program's argv with placeholders (`{micro_batch}`,
//! `{accumulation_steps}`, `{precision}`, `{checkpoint_dir}`, ...), and Carve turns them.
//! Its memory is modelled as `fixed + per_sample x micro_batch`, fitted from a short
//! profile run under the guard; the shrink planner, admission and the simulator use that
//! model where model jobs use the estimator.
//!
//! - `spec`: the `[command]` job file format;
//! - `validate`: its checks, with field paths; [`validate::ValidatedSpec`], either kind
//!   of job, is `crate::workload::Workload` under its older name;
//! - `image`: the image a program runs in and the secret that pulls it;
//! - `checkpoint`: the checkpoints a program reports (`CARVE_CHECKPOINT`) and the
//!   variables its next attempt resumes from;
//! - `render`: placeholders to the argv and environment of one attempt;
//! - `memory_model`: the fitted model, its predictions and refinement;
//! - `metrics`: the results a program reports (`accuracy`, `val_loss`, `metric_*`) and
//!   their bounds;
//! - `shrink`: the next configuration after an OOM, in one step;
//! - `oom`: telling an OOM from other failures by the guard's record and the frameworks'
//!   messages.

pub mod checkpoint;
pub mod image;
pub mod memory_model;
pub mod metrics;
pub mod oom;
pub mod render;
pub mod shrink;
pub mod spec;
pub mod validate;
