//! The worker's attempts as its two watchers see them: the watchdog ([`WatchedAttempts`]:
//! those on real GPUs, with their GPU's context allowance) and the worker's own limits
//! ([`LimitedAttempts`]: every one that runs), both read from the shared table and
//! stopped through each attempt's control channel.

use std::collections::HashMap;

use carve_proto::v1;

use super::{Shared, attempt_key, lock};
use crate::attempt_limits::{LimitedAttempt, LimitedAttempts};
use crate::attempt_process::AttemptControl;
use crate::watchdog::{WatchedAttempt, WatchedAttempts};

/// The watchdog's view of the worker's attempts: those on real GPUs, each with its GPU's
/// context allowance.
pub(super) struct WorkerAttempts {
    pub(super) shared: Shared,
    /// By GPU uuid, real GPUs only.
    pub(super) context_bytes: HashMap<String, u64>,
}

impl WatchedAttempts for WorkerAttempts {
    fn running(&self) -> Vec<WatchedAttempt> {
        lock(&self.shared)
            .running
            .values()
            // 0: a command attempt between two of its programs' runs.
            .filter(|running| running.process_id != 0)
            .filter_map(|running| {
                Some(WatchedAttempt {
                    attempt: running.attempt.clone(),
                    gpu_uuid: running.gpu_uuid.clone(),
                    process_id: running.process_id,
                    slice_bytes: running.slice_bytes,
                    context_bytes: *self.context_bytes.get(&running.gpu_uuid)?,
                    guard_account: running.guard_account.clone(),
                    container_processes: running.container_processes.clone(),
                })
            })
            .collect()
    }

    fn stop(&self, attempt: &v1::AttemptRef, control: AttemptControl) {
        if let Some(running) = lock(&self.shared).running.get(&attempt_key(attempt)) {
            let _ = running.control.send(control);
        }
    }
}

/// The limits' view of the worker's attempts: every one that runs, on any GPU.
pub(super) struct WorkerLimitedAttempts {
    pub(super) shared: Shared,
}

impl LimitedAttempts for WorkerLimitedAttempts {
    fn running(&self) -> Vec<LimitedAttempt> {
        lock(&self.shared)
            .running
            .values()
            .map(|running| LimitedAttempt {
                attempt: running.attempt.clone(),
                started: running.started,
                max_duration: running.max_duration,
                directories: running.directories.clone(),
            })
            .collect()
    }

    fn stop(&self, attempt: &v1::AttemptRef, control: AttemptControl) {
        if let Some(running) = lock(&self.shared).running.get(&attempt_key(attempt)) {
            let _ = running.control.send(control);
        }
    }
}
