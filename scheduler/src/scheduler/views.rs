//! Read views of the live state and of jobs, as the job and cluster services and the
//! metrics page show them.

use std::collections::HashMap;

use carve_proto::ApiError;

use crate::auth::{Caller, Role};
use crate::error::SchedulerError;
use crate::metrics::{ClusterGauges, Metrics, MetricsSource};
use crate::store::{AttemptRecord, JobFilter, JobRecord};

use super::memory_models::{KnownMemoryModel, stored_memory_model, stored_shape_key};
use super::worker_reports::{Gpu, TrainingProgress};
use super::{RunningAttempt, Scheduler, WorkerState};

impl Scheduler {
    /// The job `reference` names among those the caller may see: its whole id, a prefix
    /// of its id (with or without `job-`), the last hex digits of its id (at least four),
    /// or its name; NotFound when it names none (another tenant's job included),
    /// INVALID_ARGUMENT on `job_id` listing the candidates when it names several. A name
    /// several jobs share means the one of them still going (queued, placed or running)
    /// when there is exactly one: a job file resubmitted keeps its name, and the finished
    /// runs before it are not what a person means. A whole id costs one lookup by key, as
    /// before references were accepted. Every lookup past the whole id is the caller's
    /// tenant's alone (an admin's, every tenant's), so another tenant's jobs can be
    /// neither named nor counted through a short reference.
    pub async fn visible_job(
        &self,
        caller: &Caller,
        reference: &str,
    ) -> Result<JobRecord, SchedulerError> {
        caller.require(&[Role::User, Role::Admin])?;
        if reference.is_empty() {
            return Err(SchedulerError::invalid_argument(
                "job_id",
                "must not be empty",
            ));
        }
        match self.store.get_job(reference).await {
            Ok(job) if caller.may_access_tenant(&job.tenant) => return Ok(job),
            Ok(_) | Err(SchedulerError::Api(ApiError::NotFound { .. })) => {}
            Err(other) => return Err(other),
        }
        let tenant = (caller.role != Role::Admin).then_some(caller.tenant.as_str());
        let (by_id, by_name) = self
            .store
            .jobs_matching_reference(tenant, reference, LISTED_CANDIDATES + 1)
            .await?;
        let only_names = by_id.is_empty();
        let mut candidates = by_id;
        candidates.extend(by_name);
        candidates.sort_by_key(|job| std::cmp::Reverse(job.submit_sequence));
        match candidates.len() {
            0 => Err(SchedulerError::not_found("job", reference)),
            1 => Ok(candidates.remove(0)),
            _ if only_names => {
                let mut active = self.store.active_jobs_named(tenant, reference, 2).await?;
                if active.len() == 1 {
                    return Ok(active.remove(0));
                }
                Err(ambiguous_reference(
                    reference,
                    &candidates,
                    tenant.is_none(),
                ))
            }
            _ => Err(ambiguous_reference(
                reference,
                &candidates,
                tenant.is_none(),
            )),
        }
    }

    /// A job's attempts, by number.
    pub async fn attempts(&self, job_id: &str) -> Result<Vec<AttemptRecord>, SchedulerError> {
        self.store.list_attempts(job_id).await
    }

    /// `job` as reads show it (see [`JobView`]); the same reads as a page of one.
    pub async fn job_view(&self, job: JobRecord) -> Result<JobView, SchedulerError> {
        let mut views = self.job_views(vec![job]).await?;
        Ok(views.remove(0))
    }

    /// Each of `jobs` as reads show it, in order, in two queries whatever their number:
    /// the attempts of them all, and the memory models of their commands' distinct
    /// shapes. Nothing is validated or estimated: a command's shape key is read from its
    /// spec as stored.
    pub async fn job_views(&self, jobs: Vec<JobRecord>) -> Result<Vec<JobView>, SchedulerError> {
        let ids: Vec<&str> = jobs.iter().map(|job| job.id.as_str()).collect();
        let mut attempts = self.store.attempts_of_jobs(&ids).await?;
        // A command's model is its tenant's: the key is (tenant, shape).
        let mut model_keys: Vec<Option<(String, String)>> = Vec::with_capacity(jobs.len());
        for job in &jobs {
            model_keys
                .push(stored_shape_key(job)?.map(|shape_key| (job.tenant.clone(), shape_key)));
        }
        let mut distinct: Vec<(&str, &str)> = model_keys
            .iter()
            .flatten()
            .map(|(tenant, shape_key)| (tenant.as_str(), shape_key.as_str()))
            .collect();
        distinct.sort_unstable();
        distinct.dedup();
        let mut models: HashMap<(String, String), KnownMemoryModel> = HashMap::new();
        for ((tenant, shape_key), stored) in self.store.command_memory_models(&distinct).await? {
            let model = stored_memory_model(&tenant, &shape_key, &stored)?;
            models.insert((tenant, shape_key), model);
        }
        let mut image_digests = self.image_digests_of(&jobs).await?;
        Ok(jobs
            .into_iter()
            .zip(model_keys)
            .map(|(job, model_key)| JobView {
                attempts: attempts.remove(&job.id).unwrap_or_default(),
                memory_model: model_key.and_then(|key| models.get(&key).cloned()),
                progress: self.latest_progress(&job.id),
                image_digest: image_digests.remove(&job.id),
                image_pull: self.image_pull(&job.id),
                job,
            })
            .collect())
    }

    /// One page of the jobs the caller may see (see `list_jobs`), each as reads show it,
    /// for a response of at most `budget_bytes` of jobs: jobs whose stored text alone
    /// (`store::shown_text_bytes`, less than its encoded size) would pass it are left to
    /// the next page, unread, before their attempts and models are read (the caller cuts
    /// the page exactly, by the encoded size; see [`JobPage::keep_first`]).
    pub async fn job_page(
        &self,
        caller: &Caller,
        filter: JobFilter,
        budget_bytes: usize,
    ) -> Result<JobPage, SchedulerError> {
        let (jobs, next_page_token) = self
            .list_jobs_within(caller, filter, budget_bytes as u64)
            .await?;
        Ok(JobPage {
            jobs: self.job_views(jobs).await?,
            next_page_token,
        })
    }

    /// The number and the latest progress report of the attempt of `job_id` running on
    /// this scheduler, if it reported any.
    pub fn latest_progress(&self, job_id: &str) -> Option<(u32, TrainingProgress)> {
        let live = self.live();
        let running = live.running.get(job_id)?;
        Some((running.attempt_number, running.latest_progress?))
    }

    /// Every live worker with its GPUs and the slices running on them, by id.
    pub fn workers(&self) -> Vec<WorkerView> {
        let live = self.live();
        let mut workers: Vec<WorkerView> = live
            .workers
            .iter()
            .map(|(worker_id, worker)| WorkerView {
                id: worker_id.clone(),
                hostname: worker.record.hostname.clone(),
                state: worker.state,
                gpus: worker
                    .gpus
                    .iter()
                    .map(|gpu| GpuView {
                        gpu: gpu.clone(),
                        slices: live
                            .running
                            .iter()
                            .filter(|(_, running)| {
                                running.worker_id == *worker_id && running.gpu_id == gpu.uuid
                            })
                            .map(|(job_id, running)| slice_view(job_id, running))
                            .collect(),
                    })
                    .collect(),
                last_heartbeat_ms: worker.record.last_heartbeat_ms,
                registered_at_ms: worker.record.registered_at_ms,
                version: worker.record.version.clone(),
                drain_reason: worker.record.drain_reason.clone(),
            })
            .collect();
        workers.sort_by(|left, right| left.id.cmp(&right.id));
        workers
    }

    /// The live workers as `caller` may see them: every slice keeps its size (so a GPU's
    /// memory still adds up), but a slice of a tenant the caller may not access has no
    /// owner: which jobs other tenants run is theirs to know.
    pub fn workers_seen_by(&self, caller: &Caller) -> Vec<WorkerView> {
        let mut workers = self.workers();
        for slice in workers
            .iter_mut()
            .flat_map(|worker| &mut worker.gpus)
            .flat_map(|gpu| &mut gpu.slices)
        {
            if !slice.may_be_seen_by(caller) {
                slice.owner = None;
            }
        }
        workers
    }

    /// The slices running now of the tenants `caller` may access, by id.
    pub fn slices_seen_by(&self, caller: &Caller) -> Vec<SliceView> {
        let mut slices = self.slices();
        slices.retain(|slice| slice.may_be_seen_by(caller));
        slices
    }

    /// Every slice running now, by id.
    fn slices(&self) -> Vec<SliceView> {
        let live = self.live();
        let mut slices: Vec<SliceView> = live
            .running
            .iter()
            .map(|(job_id, running)| slice_view(job_id, running))
            .collect();
        slices.sort_by_key(SliceView::id);
        slices
    }

    /// The gauges of the metrics page, read now.
    pub async fn cluster_gauges_now(&self) -> ClusterGauges {
        // The usage counters are the metrics' own (a read of the store, not a gauge).
        self.refresh_usage_counters().await;
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
                    WorkerState::Ready => gauges.workers_ready += 1,
                    WorkerState::Draining => gauges.workers_draining += 1,
                    WorkerState::Lost => {
                        gauges.workers_lost += 1;
                        continue;
                    }
                }
                // The same test placement uses for a GPU that takes new slices.
                let schedulable = worker.state == WorkerState::Ready && worker.session.is_some();
                for gpu in &worker.gpus {
                    let capacity = gauges
                        .gpu_capacity
                        .entry(gpu.model_name.clone())
                        .or_default();
                    capacity.gpus += 1;
                    capacity.total_bytes += gpu.total_bytes;
                    if schedulable {
                        capacity.allocatable_bytes +=
                            gpu.total_bytes.saturating_sub(gpu.context_bytes);
                    }
                }
            }
        }
        // Every tenant has every per-tenant gauge, at 0 when it has nothing.
        if let Ok(tenants) = self.store.list_tenants().await {
            for tenant in tenants {
                gauges.include_tenant(&tenant.name);
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

fn slice_view(job_id: &str, running: &RunningAttempt) -> SliceView {
    SliceView {
        owner: Some(SliceOwner {
            job_id: job_id.to_string(),
            attempt_number: running.attempt_number,
            tenant: running.tenant.clone(),
        }),
        gpu_id: running.gpu_id.clone(),
        worker_id: running.worker_id.clone(),
        bytes: running.slice_bytes,
    }
}

/// A job as reads (GetJob, ListJobs, CancelJob) show it.
#[derive(Debug, Clone)]
pub struct JobView {
    pub job: JobRecord,
    /// Its attempts, by number.
    pub attempts: Vec<AttemptRecord>,
    /// The memory model its command is sized by (its tenant's model of the command,
    /// with what it rests on): a command job's once a profile ran for its shape, `None`
    /// for model jobs and before the profile.
    pub memory_model: Option<KnownMemoryModel>,
    /// The number and the latest progress report of its attempt running on this
    /// scheduler, if that reported any.
    pub progress: Option<(u32, TrainingProgress)>,
    /// A command job's image digest, recorded at its first pull.
    pub image_digest: Option<String>,
    /// The number of its attempt whose worker is pulling its image, and how far.
    pub image_pull: Option<(u32, super::worker_reports::ImagePullProgress)>,
}

/// One page of ListJobs: jobs newest first, and the token of the next page (`None` on
/// the last).
#[derive(Debug, Clone)]
pub struct JobPage {
    pub jobs: Vec<JobView>,
    pub next_page_token: Option<String>,
}

impl JobPage {
    /// Keeps the first `count` jobs (at least one, when the page has any): the next page
    /// then starts right after the last one kept, so a page cut short (ListJobs' byte
    /// budget) loses and repeats nothing.
    pub fn keep_first(&mut self, count: usize) {
        cut_page(&mut self.jobs, &mut self.next_page_token, count, |view| {
            &view.job
        });
    }
}

/// Keeps the first `count` (at least one) of a page's `jobs`; when that drops any, the
/// page's `token` becomes the one after the last kept.
fn cut_page<T>(
    jobs: &mut Vec<T>,
    token: &mut Option<String>,
    count: usize,
    record: impl Fn(&T) -> &JobRecord,
) {
    let count = count.max(1);
    if count < jobs.len() {
        jobs.truncate(count);
        *token = jobs
            .last()
            .map(|last| crate::store::page_token_after(record(last)));
    }
}

/// A worker as reads show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerView {
    pub id: String,
    pub hostname: String,
    pub state: WorkerState,
    pub gpus: Vec<GpuView>,
    pub last_heartbeat_ms: i64,
    pub registered_at_ms: i64,
    pub version: String,
    /// Why it was drained; empty when not draining or when no reason was given.
    pub drain_reason: String,
}

/// A worker's GPU with the slices running on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuView {
    pub gpu: Gpu,
    pub slices: Vec<SliceView>,
}

/// An attempt's slice of a GPU, running now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceView {
    /// Whose it is; `None` in a view for a caller who may not know (another tenant's).
    pub owner: Option<SliceOwner>,
    pub gpu_id: String,
    pub worker_id: String,
    pub bytes: u64,
}

/// The attempt a slice runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceOwner {
    pub job_id: String,
    pub attempt_number: u32,
    pub tenant: String,
}

impl SliceView {
    /// `job/attempt`, the slice's id; empty when its owner is not shown.
    pub fn id(&self) -> String {
        self.owner
            .as_ref()
            .map(|owner| format!("{}/{}", owner.job_id, owner.attempt_number))
            .unwrap_or_default()
    }

    fn may_be_seen_by(&self, caller: &Caller) -> bool {
        self.owner
            .as_ref()
            .is_some_and(|owner| caller.may_access_tenant(&owner.tenant))
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

/// The most jobs an ambiguous reference's error lists.
const LISTED_CANDIDATES: usize = 10;

/// The error for a reference that names several jobs: each candidate's id (to copy), name
/// and state, and its tenant when the caller sees every tenant's jobs.
fn ambiguous_reference(
    reference: &str,
    candidates: &[JobRecord],
    with_tenant: bool,
) -> SchedulerError {
    let mut listed: Vec<String> = candidates
        .iter()
        .take(LISTED_CANDIDATES)
        .map(|job| {
            let tenant = if with_tenant {
                format!(", tenant {}", job.tenant)
            } else {
                String::new()
            };
            format!("{} ({}, {}{tenant})", job.id, job.name, job.state)
        })
        .collect();
    if candidates.len() > LISTED_CANDIDATES {
        listed.push("and more".into());
    }
    SchedulerError::invalid_argument(
        "job_id",
        format!(
            "\"{reference}\" is ambiguous: it names {}: {}; use more of the id, or the whole id",
            if candidates.len() > LISTED_CANDIDATES {
                format!("more than {LISTED_CANDIDATES} jobs")
            } else {
                format!("{} jobs", candidates.len())
            },
            listed.join(", ")
        ),
    )
}

#[cfg(test)]
mod tests {
    use carve_core::job_state::JobState;
    use carve_core::workload::JobKind;

    use super::super::memory_models::stored_shape_key;
    use crate::store::JobRecord;

    fn stored(kind: JobKind, spec_json: &str) -> JobRecord {
        JobRecord {
            id: "job-1".into(),
            tenant: "acme".into(),
            name: "pinned".into(),
            kind,
            spec_json: spec_json.into(),
            state: JobState::Queued,
            priority: 0,
            submit_sequence: 0,
            idempotency_key: None,
            config_json: "{}".into(),
            estimate_json: "{}".into(),
            required_bytes: 1,
            waiting_reason: String::new(),
            message: String::new(),
            created_at_ms: 0,
            finished_at_ms: None,
            checkpoint_location: None,
            checkpoint_step: 0,
            attempts_count: 0,
        }
    }

    /// Reads find a job's memory model by its command as stored (core's key, pinned in
    /// `carve_core::workload::memory_model_key`'s tests), without validating it; an
    /// unreadable command is a corrupt row named by job and column.
    #[test]
    fn a_stored_jobs_memory_model_key_is_read_from_its_command_alone() {
        let lax = r#"{"name": "x", "command": {"argv": ["python3", "t.py"], "global_batch": 0,
                      "working_directory": "relative"}}"#;
        assert!(
            stored_shape_key(&stored(JobKind::Command, lax))
                .unwrap()
                .is_some()
        );
        assert_eq!(
            stored_shape_key(&stored(JobKind::Model, lax)).unwrap(),
            None
        );
        let error =
            stored_shape_key(&stored(JobKind::Command, r#"{"command": {"argv": 3}}"#)).unwrap_err();
        assert!(
            error
                .to_string()
                .contains(r#"jobs "job-1" spec_json: command"#),
            "{error}"
        );
    }
}
