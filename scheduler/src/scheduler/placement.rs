//! The scheduling pass: its inputs (and the skip when they did not change), core's pure
//! `solve` over the pass's copy of the queue, the placement of each decision, and the
//! waiting reasons of the jobs left in the queue.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use carve_core::job_state::{AttemptOutcome, JobEvent, JobState};
use carve_core::scheduling::{
    GpuState, Placement, SchedulingOptions, SchedulingProblem, TenantState, WaitReason,
    solve_with_cached_images,
};
use tokio::time::Instant;

use crate::error::SchedulerError;
use crate::metrics::Metrics;
use carve_core::plan::RunConfig;

use crate::store::{
    AttemptDetails, AttemptRecord, JobRecord, QueueFingerprint, TenantRecord, UsageRecord,
};

use super::logs::JobUpdateKind;
use super::worker_reports::{Assignment, AttemptRef, Checkpoint, WorkerCommand};
use super::{RunningAttempt, Scheduler, now_ms, transition};

/// What a scheduling pass decides from, as far as it can tell cheaply: a pass with the
/// same inputs as the last one that finished is skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PassInputs {
    wake_generation: u64,
    queue: QueueFingerprint,
    /// Sorted by worker, then GPU.
    gpus: Vec<GpuState>,
    /// Sorted by tenant.
    tenants: Vec<TenantState>,
    /// Queued jobs left out because they are backing off: when one's backoff ends, the
    /// inputs change and the next pass runs.
    backing_off: Vec<String>,
}

impl Scheduler {
    /// One pass: place what fits, record why the rest waits.
    ///
    /// The pass solves over its copy of the queue (`queue::QueueMirror`), reading from the
    /// store only the jobs queued since the last pass (one range of the
    /// `(state, submit_sequence)` index) and the whole queue only when the copy
    /// disagrees with the store's fingerprint; it loads the whole record of the few jobs
    /// it places, and writes only waiting reasons that changed, grouped by reason. It is
    /// skipped when nothing it decides from changed since the last pass that finished (no
    /// wake-up, the same queue, GPUs and tenants): `solve` is a pure function, so it
    /// would decide the same again.
    pub async fn schedule_once(&self) -> Result<usize, SchedulerError> {
        let _guard = self.job_changes.lock().await;
        let result = self.schedule_once_locked().await;
        if result.is_err() {
            // Half a pass may have left the copy behind the store: read it whole again.
            self.queue().invalidate();
        }
        result
    }

    /// The pass itself, under `job_changes`: gather its inputs (skipped when they are the
    /// last finished pass's), bring the queue's copy up to date, solve, place each
    /// decision, and write the waiting reasons of the rest.
    async fn schedule_once_locked(&self) -> Result<usize, SchedulerError> {
        let Some(inputs) = self.pass_inputs().await? else {
            return Ok(0);
        };
        if self.last_pass_inputs().as_ref() == Some(&inputs) {
            return Ok(0);
        }
        self.refresh_queue(&inputs.queue).await?;
        let claimed = self.place_claimed_jobs().await?;
        if claimed > 0 {
            // The GPUs changed under the same inputs: solve the rest in the next pass.
            *self
                .last_pass_inputs
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
            self.wake();
            return Ok(claimed);
        }
        let now = now_ms();
        let mut problem = self.scheduling_problem(&inputs);
        self.set_decayed_usage(&mut problem.tenants, now).await?;
        let options = SchedulingOptions {
            usage_decay: self.usage_decay(),
            ..SchedulingOptions::default()
        };
        // Best fit's ties go to workers that hold a job's image (core decides).
        let images = self.cached_images_for_pass().await?;
        let decision = solve_with_cached_images(&problem, &options, &images);
        let mut placed = 0;
        for placement in &decision.placements {
            if self.place(placement, now).await? {
                placed += 1;
                Metrics::count(&self.metrics.placements);
            }
        }
        let larger_than_every_gpu: Vec<(String, u64)> = decision
            .waiting
            .iter()
            .filter_map(|(job_id, reason)| match reason {
                WaitReason::NoGpuLargeEnough { largest_gpu, .. } if *largest_gpu > 0 => {
                    Some((job_id.clone(), *largest_gpu))
                }
                _ => None,
            })
            .collect();
        let short_of_free_memory: Vec<(String, WaitReason)> = decision
            .waiting
            .iter()
            .filter(|(_, reason)| matches!(reason, WaitReason::NoGpuFreeEnough { .. }))
            .cloned()
            .collect();
        self.write_waiting_reasons(decision.waiting).await?;
        let refitted = self
            .fit_profiles_to_the_cluster(&larger_than_every_gpu)
            .await?;
        let mut gpus_now = self.gpu_states();
        self.live().preemption.hold_claims(&mut gpus_now);
        let preempted = self
            .preempt_for_waiting_jobs(
                &short_of_free_memory,
                &problem.pending,
                &gpus_now,
                &problem.tenants,
            )
            .await?;
        // A refitted profile changed the queue under the same fingerprint, and a
        // preemption the problem: the next pass must solve again rather than skip.
        let changed = refitted > 0 || preempted > 0;
        *self
            .last_pass_inputs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = (!changed).then_some(inputs);
        if refitted > 0 {
            self.wake();
        }
        Ok(placed)
    }

    /// What this pass would decide from: the queue's fingerprint, the GPUs, the tenants
    /// with their usage, and the jobs backing off; `None` when nothing is queued.
    async fn pass_inputs(&self) -> Result<Option<PassInputs>, SchedulerError> {
        // Read before anything else, so that a wake-up during the pass causes another.
        let wake_generation = self.wake_generation.load(Ordering::Acquire);
        let queue = self.store.queue_fingerprint().await?;
        if queue.queued_jobs == 0 {
            let mut mirror = self.queue();
            if mirror.len() != 0 {
                // Emptied by someone else (another replica): start again from the store.
                mirror.invalidate();
            }
            return Ok(None);
        }
        let tenants = self.store.list_tenants().await?;
        let mut gpus = self.gpu_states();
        gpus.sort_by(|left, right| {
            (&left.worker_id, &left.gpu_id).cmp(&(&right.worker_id, &right.gpu_id))
        });
        Ok(Some(PassInputs {
            wake_generation,
            queue,
            gpus,
            tenants: self.tenant_states(&tenants),
            backing_off: self.jobs_backing_off(),
        }))
    }

    /// Tenants as `solve` sees them, sorted by name: their quotas and weights, and what
    /// their running attempts hold now.
    fn tenant_states(&self, tenants: &[TenantRecord]) -> Vec<TenantState> {
        let (usage, running_counts) = {
            let live = self.live();
            let mut usage: HashMap<String, u64> = HashMap::new();
            let mut counts: HashMap<String, u32> = HashMap::new();
            for running in live.running.values() {
                *usage.entry(running.tenant.clone()).or_default() += running.slice_bytes;
                *counts.entry(running.tenant.clone()).or_default() += 1;
            }
            (usage, counts)
        };
        let mut tenant_states: Vec<TenantState> = tenants
            .iter()
            .map(|tenant| TenantState {
                tenant: tenant.name.clone(),
                weight: tenant.fair_share_weight.max(1) as u32,
                vram_quota_bytes: tenant.vram_quota_bytes.map(|bytes| bytes as u64),
                running_jobs_quota: tenant.max_running_jobs.map(|count| count as u32),
                vram_in_use_bytes: usage.get(&tenant.name).copied().unwrap_or(0),
                running_jobs: running_counts.get(&tenant.name).copied().unwrap_or(0),
                decayed_usage_byte_seconds: 0,
            })
            .collect();
        tenant_states.sort_by(|left, right| left.tenant.cmp(&right.tenant));
        tenant_states
    }

    /// Queued jobs still backing off after an infrastructure failure, sorted; those whose
    /// backoff ended are forgotten here.
    fn jobs_backing_off(&self) -> Vec<String> {
        let mut live = self.live();
        let now = Instant::now();
        live.backing_off.retain(|_, until| *until > now);
        let mut jobs: Vec<String> = live.backing_off.keys().cloned().collect();
        jobs.sort();
        jobs
    }

    /// The problem `solve` is given: the pass's inputs and the queued jobs of its copy of
    /// the queue, less those backing off and those waiting for their preemptions (whose
    /// claimed bytes are held on their GPUs).
    fn scheduling_problem(&self, inputs: &PassInputs) -> SchedulingProblem {
        let mut gpus = inputs.gpus.clone();
        let claimed = {
            let live = self.live();
            live.preemption.hold_claims(&mut gpus);
            live.preemption.claimed_jobs()
        };
        SchedulingProblem {
            gpus,
            tenants: inputs.tenants.clone(),
            pending: self
                .queue()
                .pending_jobs()
                .into_iter()
                .filter(|job| inputs.backing_off.binary_search(&job.job_id).is_err())
                .filter(|job| !claimed.contains(&job.job_id))
                .collect(),
        }
    }

    /// Places one of the pass's decisions: the job becomes placed with its new attempt
    /// (stored together), its slice is held, and its worker is sent the assignment.
    /// False when the job left the queue since the pass's copy was read.
    pub(super) async fn place(
        &self,
        placement: &Placement,
        now: i64,
    ) -> Result<bool, SchedulerError> {
        if !self.queue().contains(&placement.job_id) {
            return Ok(false);
        }
        // Only placed jobs need their whole record (spec, config, checkpoint).
        let mut job = self.store.get_job(&placement.job_id).await?;
        if job.state != JobState::Queued {
            self.queue().remove(&job.id);
            return Ok(false);
        }
        let attempt_number = job.attempts_count + 1;
        let config = job.config()?;
        // The estimate of the job's configuration is stored with it (admission and
        // OOM shrinks keep it current): nothing is estimated here.
        let estimate_bytes = job.estimate()?.required_bytes;
        // Not `move_job`: the placed job is stored with its attempt, in one transaction.
        let (profile, chosen_because) = self
            .why_this_configuration(&job, &config, attempt_number)
            .await?;
        let (image_digest, image_pull_credential) = self.assignment_image(&job).await?;
        let change = transition(&mut job, JobEvent::Placed)?;
        job.attempts_count = attempt_number;
        job.waiting_reason.clear();
        let attempt = AttemptRecord {
            job_id: job.id.clone(),
            attempt_number,
            config_json: job.config_json.clone(),
            estimate_bytes: estimate_bytes as i64,
            slice_bytes: placement.slice_bytes as i64,
            worker_id: placement.worker_id.clone(),
            gpu_id: placement.gpu_id.clone(),
            lease_epoch: attempt_number,
            outcome: AttemptOutcome::Running,
            measured_peak_bytes: None,
            oom: None,
            message: String::new(),
            resumed_from: job.checkpoint_location.clone(),
            resumed_from_step: job.checkpoint_step,
            started_at_ms: now,
            finished_at_ms: None,
            results: Default::default(),
            details: AttemptDetails {
                profile,
                chosen_because,
                ..Default::default()
            },
        };
        // The attempt's use of its slice is recorded from its placement, with it.
        let usage = UsageRecord {
            job_id: job.id.clone(),
            attempt_number,
            tenant: job.tenant.clone(),
            gpu_type: self.gpu_type(&placement.worker_id, &placement.gpu_id),
            slice_bytes: placement.slice_bytes as i64,
            placed_at_ms: now,
            ended_at_ms: None,
            measured_peak_bytes: None,
        };
        self.store
            .record_placement(&job, &attempt, Some(&usage))
            .await?;
        self.queue().remove(&job.id);
        self.live().running.insert(
            job.id.clone(),
            RunningAttempt {
                attempt_number: attempt_number as u32,
                lease_epoch: attempt_number as u64,
                worker_id: placement.worker_id.clone(),
                gpu_id: placement.gpu_id.clone(),
                slice_bytes: placement.slice_bytes,
                tenant: job.tenant.clone(),
                estimate_bytes,
                measured_peak_bytes: 0,
                latest_progress: None,
                priority: job.priority.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32,
                started_at_ms: now,
            },
        );
        self.send_to_worker(
            &placement.worker_id,
            WorkerCommand::Assignment(Box::new(Assignment {
                attempt: AttemptRef {
                    job_id: job.id.clone(),
                    attempt_number: attempt_number as u32,
                    lease_epoch: attempt_number as u64,
                },
                spec_json: job.spec_json.clone(),
                config,
                gpu_uuid: placement.gpu_id.clone(),
                slice_bytes: placement.slice_bytes,
                // Only what an attempt reported: each worker's own directory layout says
                // where its attempts write, and the scheduler does not guess a path.
                resume_from: job.checkpoint_location.clone().map(|location| Checkpoint {
                    step: job.checkpoint_step.max(0) as u64,
                    location,
                }),
                profile,
                tenant: job.tenant.clone(),
                kind: job.kind,
                image_digest,
                image_pull_credential,
            })),
        );
        self.emit_state(
            &job.id,
            change,
            &format!("placed on {} ({})", placement.gpu_id, placement.worker_id),
        );
        self.emit(&job.id, JobUpdateKind::AttemptStarted(attempt));
        Ok(true)
    }

    /// The model name of a worker's GPU (its GPU type for usage), "unknown" for a GPU the
    /// live state does not know.
    fn gpu_type(&self, worker_id: &str, gpu_id: &str) -> String {
        self.live()
            .workers
            .get(worker_id)
            .and_then(|worker| worker.gpus.iter().find(|gpu| gpu.uuid == gpu_id))
            .map_or_else(|| "unknown".to_string(), |gpu| gpu.model_name.clone())
    }

    /// Whether the next attempt of `job` (number `attempt_number`, to run `config`) is a
    /// command job's profile, and why it runs with that configuration, for people: the
    /// spec's own, shrunk at submit, sized by a profile, or shrunk after an OOM.
    async fn why_this_configuration(
        &self,
        job: &JobRecord,
        config: &RunConfig,
        attempt_number: i64,
    ) -> Result<(bool, String), SchedulerError> {
        // The spec is read as its stored kind (checked, never estimated): what it asks
        // for and whether its memory must be measured first.
        let workload = self.stored_workload(job).await?;
        let measured = self.measured_memory_model(&job.tenant, &workload).await?;
        if let Some(profile) = workload.profile_plan(measured.as_ref()) {
            let [first, second] = profile.micro_batches;
            return Ok((
                true,
                format!(
                    "profile: {} steps at micro-batches {first} and {second} measure the program's memory",
                    profile.steps
                ),
            ));
        }
        let spec_config = workload.initial_config();
        let previous = if attempt_number > 1 {
            self.store.list_attempts(&job.id).await?.pop()
        } else {
            None
        };
        let with_change = |text: String, before: &RunConfig| {
            let change = config.describe_change_from(before);
            if change.is_empty() {
                text
            } else {
                format!("{text}: {change}")
            }
        };
        let why = match previous {
            None if *config == spec_config => "the spec's configuration".to_string(),
            None => with_change("shrunk at submit to fit".to_string(), &spec_config),
            Some(previous) if previous.details.profile => {
                with_change("sized by the profile".to_string(), &spec_config)
            }
            Some(previous) => {
                let before = previous.config().unwrap_or(spec_config);
                let text = if previous.outcome == AttemptOutcome::OutOfMemory {
                    format!(
                        "after attempt {} ran out of memory",
                        previous.attempt_number
                    )
                } else {
                    format!(
                        "again after attempt {} ended {}",
                        previous.attempt_number, previous.outcome
                    )
                };
                with_change(text, &before)
            }
        };
        Ok((false, why))
    }

    /// Stores the waiting reasons that changed since the last pass, grouped by reason.
    async fn write_waiting_reasons(
        &self,
        waiting: Vec<(String, WaitReason)>,
    ) -> Result<(), SchedulerError> {
        // Reasons are compared as values first: most are what the last pass said, and
        // are not formatted again.
        let changed_reasons: Vec<(String, String)> = {
            let mut mirror = self.queue();
            let mut changed = Vec::new();
            for (job_id, reason) in waiting {
                let Some(job) = mirror.get_mut(&job_id) else {
                    continue;
                };
                if job.decided.as_ref() == Some(&reason) {
                    continue;
                }
                let text = reason.to_string();
                if job.stored_reason != text {
                    job.stored_reason.clone_from(&text);
                    changed.push((job_id, text));
                }
                job.decided = Some(reason);
            }
            changed
        };
        self.store.set_waiting_reasons(&changed_reasons).await?;
        Ok(())
    }

    /// Brings the pass's copy of the queue up to the store's, as `fingerprint` (read
    /// just before, under `job_changes`) describes it: the jobs queued since the last
    /// read, or the whole queue when the copy still disagrees.
    async fn refresh_queue(&self, fingerprint: &QueueFingerprint) -> Result<(), SchedulerError> {
        let through = fingerprint.highest_submit_sequence;
        let (loaded, after) = {
            let mirror = self.queue();
            (mirror.is_loaded(), mirror.read_through())
        };
        if loaded && after < through {
            let rows = self
                .store
                .queued_jobs_in_sequence_range(after, through)
                .await?;
            self.queue().add(rows, through);
        }
        if !self.queue().matches(fingerprint) {
            let rows = self
                .store
                .queued_jobs_in_sequence_range(i64::MIN, through)
                .await?;
            self.queue().replace_all(rows, through);
            self.queue_reloads.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// What the last pass that finished decided from.
    fn last_pass_inputs(&self) -> Option<PassInputs> {
        self.last_pass_inputs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}
