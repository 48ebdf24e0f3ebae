//! Group commit for submits: concurrent submits share one transaction, so submit
//! throughput is not bounded by one disk flush per job.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use carve_proto::ApiError;
use tokio::sync::{mpsc, oneshot};

use carve_core::usage::report::Submitter;

use super::jobs::NewJob;
use super::{JobRecord, Store, SubmitOutcome};
use crate::error::SchedulerError;

type Reply = oneshot::Sender<Result<SubmitOutcome, SchedulerError>>;

/// Gathers submits into groups and commits each group with one
/// [`Store::submit_jobs_with_submitters`].
///
/// A tokio task owns the receiving end of a channel. It waits for one submit, takes every
/// other submit already waiting (up to `max_group`), commits them together and answers
/// each; submits that arrive during that commit form the next group. So one flush covers
/// as many submits as arrived during the previous one, and a lone submit is not delayed.
///
/// When a group fails as a whole (one job names a missing tenant, or reuses a job id),
/// its jobs are committed again one by one, so one bad job does not fail the others.
///
/// Clones share the task, which ends when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct SubmitBatcher {
    sender: mpsc::Sender<(NewJob, Reply)>,
    counters: Arc<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    groups_committed: AtomicU64,
    jobs_committed: AtomicU64,
}

impl SubmitBatcher {
    /// The most submits one group takes by default.
    pub const DEFAULT_MAX_GROUP: usize = 512;

    /// Starts the batching task on the current tokio runtime, with groups of up to
    /// [`SubmitBatcher::DEFAULT_MAX_GROUP`] submits.
    pub fn spawn(store: Store) -> SubmitBatcher {
        SubmitBatcher::spawn_with_max_group(store, SubmitBatcher::DEFAULT_MAX_GROUP)
    }

    /// Starts the batching task with groups of up to `max_group` (at least 1) submits.
    pub fn spawn_with_max_group(store: Store, max_group: usize) -> SubmitBatcher {
        let max_group = max_group.max(1);
        let (sender, receiver) = mpsc::channel(max_group * 4);
        let counters = Arc::new(Counters::default());
        tokio::spawn(run(store, receiver, max_group, Arc::clone(&counters)));
        SubmitBatcher { sender, counters }
    }

    /// Submits one job, with its validated workload as `json_columns::workload_to_json`
    /// writes it (admission always has one), and returns once the group it joined is
    /// committed (durable), with what happened to it: created, or the existing job its
    /// idempotency key matched.
    pub async fn submit(
        &self,
        job: JobRecord,
        workload_json: Option<String>,
    ) -> Result<SubmitOutcome, SchedulerError> {
        self.submit_by(job, workload_json, Submitter::default())
            .await
    }

    /// [`SubmitBatcher::submit`], the job stored with who submitted it (accounting's
    /// per-user figures).
    pub async fn submit_by(
        &self,
        job: JobRecord,
        workload_json: Option<String>,
        submitter: Submitter,
    ) -> Result<SubmitOutcome, SchedulerError> {
        let (reply, answer) = oneshot::channel();
        self.sender
            .send(((job, workload_json, submitter), reply))
            .await
            .map_err(|_| ApiError::Unavailable("the submit batcher has stopped".into()))?;
        answer.await.map_err(|_| {
            ApiError::Unavailable("the submit batcher stopped before answering".into())
        })?
    }

    /// How many groups were committed so far (each one transaction).
    pub fn groups_committed(&self) -> u64 {
        self.counters.groups_committed.load(Ordering::Relaxed)
    }

    /// How many submits were answered from committed groups so far.
    pub fn jobs_committed(&self) -> u64 {
        self.counters.jobs_committed.load(Ordering::Relaxed)
    }
}

async fn run(
    store: Store,
    mut receiver: mpsc::Receiver<(NewJob, Reply)>,
    max_group: usize,
    counters: Arc<Counters>,
) {
    let mut group = Vec::with_capacity(max_group);
    while receiver.recv_many(&mut group, max_group).await > 0 {
        let (jobs, replies): (Vec<NewJob>, Vec<Reply>) = group.drain(..).unzip();
        match store.submit_jobs_with_submitters(jobs.clone()).await {
            Ok(outcomes) => {
                counters.groups_committed.fetch_add(1, Ordering::Relaxed);
                counters
                    .jobs_committed
                    .fetch_add(outcomes.len() as u64, Ordering::Relaxed);
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    // A submitter that went away still has its job committed; it finds
                    // it again by its idempotency key.
                    let _ = reply.send(Ok(outcome));
                }
            }
            Err(error) if jobs.len() == 1 => {
                for reply in replies {
                    let _ = reply.send(Err(error.clone()));
                }
            }
            Err(_) => {
                for (job, reply) in jobs.into_iter().zip(replies) {
                    let answer =
                        store
                            .submit_jobs_with_submitters(vec![job])
                            .await
                            .and_then(|outcomes| {
                                outcomes.into_iter().next().ok_or_else(|| {
                                    SchedulerError::Api(ApiError::Internal(
                                        "a submit of one job answered nothing".into(),
                                    ))
                                })
                            });
                    if answer.is_ok() {
                        counters.groups_committed.fetch_add(1, Ordering::Relaxed);
                        counters.jobs_committed.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = reply.send(answer);
                }
            }
        }
    }
}
