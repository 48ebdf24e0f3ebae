//! carve-scheduler: the gRPC scheduler (job, cluster, admin and worker services), its
//! store (sqlx: SQLite embedded, PostgreSQL in production), the scheduling loop and leases.
//!
//! Empty until the scheduler issue lands. Architecture invariant: this crate never depends
//! on carve-engine or on GPU crates; it sees GPUs only through what workers report and
//! estimates through carve-core.
