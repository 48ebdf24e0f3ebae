//! carve-scheduler: the gRPC scheduler (job, cluster, admin and worker services), its
//! store (sqlx: SQLite embedded, PostgreSQL in production), the scheduling loop and leases.
//!
//! - `server::run(config, listener, shutdown)` serves everything on a given socket;
//! - `scheduler` holds the live state and makes every decision, one file per concern
//!   (`admission`, worker `sessions` and fencing, attempt `outcomes` with OOM retries
//!   through the shrink planner, leases and cancellation, `placement` through
//!   `carve_core::scheduling::solve`, read `views`, job `logs`, `recovery`);
//! - `services` are the tonic handlers; `auth` the bearer tokens; `cache` the short-lived
//!   copies that keep the submit path off the database; `queue` the pass's copy of the
//!   queued jobs; `store` the database; `convert` turns records into messages.
//!
//! Architecture invariant: this crate never depends on carve-engine or on GPU crates; it
//! sees GPUs only through what workers report and estimates through carve-core.

pub mod auth;
pub mod cache;
mod compute_pool;
pub mod convert;
pub mod error;
pub mod metrics;
mod queue;
pub mod scheduler;
pub mod server;
pub mod services;
pub mod store;
