//! Recovery after a start: the live state rebuilt from the store.

use std::collections::HashMap;

use carve_core::job_state::{AttemptOutcome, JobState};
use tokio::time::Instant;

use crate::error::SchedulerError;

use super::sessions::GpuJson;
use super::worker_reports::Gpu;
use super::{LiveWorker, RunningAttempt, Scheduler, WorkerState};

impl Scheduler {
    /// Rebuilds the live state from the store after a start: attempts still running keep
    /// their slices, and their workers get one lease to come back.
    pub async fn recover(&self) -> Result<(), SchedulerError> {
        let workers = self.store.list_workers().await?;
        let active = self
            .store
            .jobs_in_states(&[JobState::Placed, JobState::Running])
            .await?;
        let mut running = HashMap::new();
        for job in active {
            let attempts = self.store.list_attempts(&job.id).await?;
            if let Some(attempt) = attempts
                .iter()
                .rev()
                .find(|attempt| attempt.outcome == AttemptOutcome::Running)
            {
                running.insert(
                    job.id.clone(),
                    RunningAttempt {
                        attempt_number: attempt.attempt_number as u32,
                        lease_epoch: attempt.lease_epoch as u64,
                        worker_id: attempt.worker_id.clone(),
                        gpu_id: attempt.gpu_id.clone(),
                        slice_bytes: attempt.slice_bytes as u64,
                        tenant: job.tenant.clone(),
                        estimate_bytes: attempt.estimate_bytes as u64,
                        measured_peak_bytes: 0,
                        latest_progress: None,
                        priority: job.priority.clamp(i64::from(i32::MIN), i64::from(i32::MAX))
                            as i32,
                        started_at_ms: attempt.started_at_ms,
                    },
                );
            }
        }
        let mut live = self.live();
        for worker in workers {
            if worker.state == WorkerState::Lost {
                continue;
            }
            let gpus: Vec<Gpu> = serde_json::from_str::<Vec<GpuJson>>(&worker.gpus_json)
                .unwrap_or_default()
                .into_iter()
                .map(GpuJson::into_gpu)
                .collect();
            let state = worker.state;
            live.workers.insert(
                worker.id.clone(),
                LiveWorker {
                    record: worker,
                    gpus,
                    state,
                    last_heartbeat: Instant::now(),
                    session: None,
                },
            );
        }
        live.running = running;
        Ok(())
    }
}
