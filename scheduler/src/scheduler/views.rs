//! Read views of the live state and of jobs, as the job and cluster services and the
//! metrics page show them.

use carve_proto::ApiError;
use carve_proto::v1;

use crate::auth::{Caller, Role};
use crate::convert::{job_to_proto, timestamp};
use crate::error::SchedulerError;
use crate::metrics::{ClusterGauges, Metrics, MetricsSource};
use crate::store::JobRecord;

use super::{RunningAttempt, Scheduler, WorkerLiveness};

impl Scheduler {
    /// A job the caller may see, or NotFound (also for another tenant's job).
    pub async fn visible_job(
        &self,
        caller: &Caller,
        job_id: &str,
    ) -> Result<JobRecord, SchedulerError> {
        caller.require(&[Role::User, Role::Admin])?;
        if job_id.is_empty() {
            return Err(ApiError::InvalidArgument {
                field: "job_id".into(),
                reason: "must not be empty".into(),
            }
            .into());
        }
        let job = self.store.get_job(job_id).await?;
        if !caller.may_access_tenant(&job.tenant) {
            return Err(ApiError::NotFound {
                what: "job",
                id: job_id.to_string(),
            }
            .into());
        }
        Ok(job)
    }

    pub async fn job_proto(&self, job: &JobRecord) -> Result<v1::Job, SchedulerError> {
        let attempts = self.store.list_attempts(&job.id).await?;
        job_to_proto(job, &attempts)
    }

    pub fn workers_proto(&self) -> Vec<v1::Worker> {
        let live = self.live();
        let mut workers: Vec<v1::Worker> = live
            .workers
            .iter()
            .map(|(worker_id, worker)| v1::Worker {
                id: worker_id.clone(),
                hostname: worker.record.hostname.clone(),
                state: match worker.state {
                    WorkerLiveness::Ready => v1::WorkerState::Ready,
                    WorkerLiveness::Draining => v1::WorkerState::Draining,
                    WorkerLiveness::Lost => v1::WorkerState::Lost,
                } as i32,
                gpus: worker
                    .gpus
                    .iter()
                    .map(|gpu| v1::Gpu {
                        slices: live
                            .running
                            .iter()
                            .filter(|(_, running)| {
                                running.worker_id == *worker_id && running.gpu_id == gpu.uuid
                            })
                            .map(|(job_id, running)| slice_proto(job_id, running))
                            .collect(),
                        ..gpu.clone()
                    })
                    .collect(),
                last_heartbeat_at: Some(timestamp(worker.record.last_heartbeat_ms)),
                registered_at: Some(timestamp(worker.record.registered_at_ms)),
                version: worker.record.version.clone(),
            })
            .collect();
        workers.sort_by(|left, right| left.id.cmp(&right.id));
        workers
    }

    pub fn slices_proto(&self) -> Vec<v1::Slice> {
        let live = self.live();
        let mut slices: Vec<v1::Slice> = live
            .running
            .iter()
            .map(|(job_id, running)| slice_proto(job_id, running))
            .collect();
        slices.sort_by(|left, right| left.id.cmp(&right.id));
        slices
    }

    /// The gauges of the metrics page, read now.
    pub async fn cluster_gauges_now(&self) -> ClusterGauges {
        let mut gauges = ClusterGauges {
            submit_groups_committed: self.batcher.groups_committed(),
            submit_jobs_committed: self.batcher.jobs_committed(),
            queue_full_reads: self.queue_reloads(),
            log_lines_stored: self.logs.lines_stored(),
            log_lines_dropped: self.logs.lines_dropped(),
            ..ClusterGauges::default()
        };
        // Counted by the database: a scrape must not load a million queued jobs.
        if let Ok(queued) = self.store.queued_jobs_by_tenant().await {
            for (tenant, count) in queued {
                gauges.queued_jobs.insert(tenant, count.max(0) as u64);
            }
        }
        {
            let live = self.live();
            for running in live.running.values() {
                *gauges
                    .running_jobs
                    .entry(running.tenant.clone())
                    .or_default() += 1;
                *gauges
                    .vram_allocated_bytes
                    .entry(running.tenant.clone())
                    .or_default() += running.slice_bytes;
                *gauges
                    .vram_estimated_bytes
                    .entry(running.tenant.clone())
                    .or_default() += running.estimate_bytes;
                *gauges
                    .vram_measured_bytes
                    .entry(running.tenant.clone())
                    .or_default() += running.measured_peak_bytes;
            }
            for worker in live.workers.values() {
                match worker.state {
                    WorkerLiveness::Lost => gauges.workers_lost += 1,
                    _ => gauges.workers_ready += 1,
                }
            }
        }
        gauges
    }

    /// VRAM in use and running jobs of a tenant now.
    pub fn tenant_usage(&self, tenant: &str) -> (u64, u32) {
        let live = self.live();
        live.running
            .values()
            .filter(|running| running.tenant == tenant)
            .fold((0, 0), |(bytes, count), running| {
                (bytes + running.slice_bytes, count + 1)
            })
    }
}

fn slice_proto(job_id: &str, running: &RunningAttempt) -> v1::Slice {
    v1::Slice {
        id: format!("{job_id}/{}", running.attempt_number),
        gpu_uuid: running.gpu_id.clone(),
        bytes: running.slice_bytes,
        job_id: job_id.to_string(),
        attempt_number: running.attempt_number,
        worker_id: running.worker_id.clone(),
        tenant: running.tenant.clone(),
    }
}

/// The metrics page reads its counters and gauges from here.
impl MetricsSource for Scheduler {
    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    async fn cluster_gauges(&self) -> ClusterGauges {
        self.cluster_gauges_now().await
    }
}
