//! The scheduler's copy of the queue: every queued job as the scheduling pass needs it,
//! so that a pass reads from the store only the jobs queued since the last one instead
//! of the whole queue.
//!
//! The store stays the truth. The copy is filled from it (whole at the first pass, after
//! an error, and whenever it disagrees with the store's queue fingerprint), then kept up
//! to date three ways:
//!
//! - jobs queued since the last pass are read by submit sequence: sequences are handed
//!   out in commit order (a submit group holds the sequence counter until it commits),
//!   so every job up to the fingerprint's highest sequence is committed when the
//!   fingerprint is read, and one index range read after the last one finds them all;
//! - the scheduler notes here every change it makes to a job's state (placements,
//!   cancels, retries, lost leases), all under its job-changes lock, as the pass is;
//! - anything else (another replica placed, cancelled or requeued a job) shows in the
//!   fingerprint, count and highest sequence of the queued jobs: when the copy's own
//!   differ after the range read, the pass reads the whole queue again.

use std::collections::{BTreeMap, HashMap};

use carve_core::job_state::JobState;
use carve_core::scheduling::{PendingJob, WaitReason};

use crate::store::{JobRecord, QueueFingerprint, QueuedJob};

/// One queued job in the copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MirroredJob {
    pub pending: PendingJob,
    /// Its submit sequence as the store has it.
    pub sequence: i64,
    /// The waiting reason the store holds for it.
    pub stored_reason: String,
    /// The reason the last pass gave it, when `stored_reason` is its text: the next pass
    /// compares reasons without formatting them again.
    pub decided: Option<WaitReason>,
}

/// The queued jobs, by id, and their ids by submit sequence (unique: one counter hands
/// them out). A pass looks every waiting job up by id, so that is one hash lookup.
#[derive(Debug, Default)]
pub(crate) struct QueueMirror {
    /// False until the first whole read, and again after anything that may have left
    /// the copy wrong (a pass that failed half way).
    loaded: bool,
    jobs: HashMap<String, MirroredJob>,
    id_by_sequence: BTreeMap<i64, String>,
    /// Every job with a sequence up to this one was read (or noted) already.
    read_through: i64,
}

impl QueueMirror {
    pub fn is_loaded(&self) -> bool {
        self.loaded
    }

    /// The highest submit sequence read so far: the next range read starts above it.
    pub fn read_through(&self) -> i64 {
        self.read_through
    }

    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Forgets everything; the next pass reads the whole queue.
    pub fn invalidate(&mut self) {
        self.loaded = false;
        self.jobs.clear();
        self.id_by_sequence.clear();
    }

    /// Replaces the copy with the whole queue up to `read_through`, as just read.
    pub fn replace_all(&mut self, rows: Vec<QueuedJob>, read_through: i64) {
        self.invalidate();
        self.add(rows, read_through);
        self.loaded = true;
    }

    /// Adds the jobs of a range read that ended at `read_through`.
    pub fn add(&mut self, rows: Vec<QueuedJob>, read_through: i64) {
        for row in rows {
            self.insert(row);
        }
        self.read_through = self.read_through.max(read_through);
    }

    /// Whether the copy has as many jobs, and the same highest sequence, as the store's
    /// queue had when `fingerprint` was read.
    pub fn matches(&self, fingerprint: &QueueFingerprint) -> bool {
        let highest = self
            .id_by_sequence
            .last_key_value()
            .map_or(0, |(sequence, _)| *sequence);
        self.loaded
            && self.jobs.len() as i64 == fingerprint.queued_jobs
            && highest == fingerprint.highest_submit_sequence
    }

    /// Records a job as the scheduler just stored it: queued jobs are added (or replaced),
    /// others removed. A queued job above `read_through` is left to the next range read.
    pub fn note(&mut self, job: &JobRecord) {
        if job.state != JobState::Queued {
            self.remove(&job.id);
            return;
        }
        if job.submit_sequence <= self.read_through {
            self.insert(QueuedJob {
                id: job.id.clone(),
                tenant: job.tenant.clone(),
                priority: job.priority,
                submit_sequence: job.submit_sequence,
                required_bytes: job.required_bytes,
                waiting_reason: job.waiting_reason.clone(),
            });
        }
    }

    pub fn remove(&mut self, job_id: &str) {
        if let Some(job) = self.jobs.remove(job_id)
            && self.id_by_sequence.get(&job.sequence).map(String::as_str) == Some(job_id)
        {
            self.id_by_sequence.remove(&job.sequence);
        }
    }

    pub fn get_mut(&mut self, job_id: &str) -> Option<&mut MirroredJob> {
        self.jobs.get_mut(job_id)
    }

    pub fn contains(&self, job_id: &str) -> bool {
        self.jobs.contains_key(job_id)
    }

    /// The queued jobs as the solver takes them (in no particular order: `solve` does
    /// not depend on the order of its inputs).
    pub fn pending_jobs(&self) -> Vec<PendingJob> {
        self.jobs.values().map(|job| job.pending.clone()).collect()
    }

    fn insert(&mut self, row: QueuedJob) {
        self.remove(&row.id);
        let sequence = row.submit_sequence;
        if let Some(replaced) = self.id_by_sequence.insert(sequence, row.id.clone()) {
            // Sequences are unique in the store; a different job under the same one
            // would be a copy gone wrong, so keep the two maps consistent.
            self.jobs.remove(&replaced);
        }
        self.jobs.insert(
            row.id.clone(),
            MirroredJob {
                pending: PendingJob {
                    job_id: row.id,
                    tenant: row.tenant,
                    priority: i32::try_from(row.priority).unwrap_or(if row.priority < 0 {
                        i32::MIN
                    } else {
                        i32::MAX
                    }),
                    submit_sequence: u64::try_from(sequence).unwrap_or(0),
                    slice_bytes: u64::try_from(row.required_bytes).unwrap_or(0),
                },
                sequence,
                stored_reason: row.waiting_reason,
                decided: None,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::QueueMirror;
    use crate::store::{JobRecord, JobState, QueueFingerprint, QueuedJob};

    fn row(id: &str, sequence: i64) -> QueuedJob {
        QueuedJob {
            id: id.into(),
            tenant: "alpha".into(),
            priority: 0,
            submit_sequence: sequence,
            required_bytes: 100,
            waiting_reason: String::new(),
        }
    }

    fn record(id: &str, sequence: i64, state: JobState) -> JobRecord {
        JobRecord {
            id: id.into(),
            tenant: "alpha".into(),
            name: id.into(),
            kind: carve_core::workload::JobKind::Model,
            spec_json: "{}".into(),
            state,
            priority: 0,
            submit_sequence: sequence,
            idempotency_key: None,
            config_json: "{}".into(),
            estimate_json: "{}".into(),
            required_bytes: 200,
            waiting_reason: "retrying".into(),
            message: String::new(),
            created_at_ms: 1,
            finished_at_ms: None,
            checkpoint_location: None,
            checkpoint_step: 0,
            attempts_count: 1,
        }
    }

    fn fingerprint(queued_jobs: i64, highest_submit_sequence: i64) -> QueueFingerprint {
        QueueFingerprint {
            queued_jobs,
            highest_submit_sequence,
        }
    }

    #[test]
    fn range_reads_and_notes_keep_it_equal_to_the_queue() {
        let mut mirror = QueueMirror::default();
        assert!(!mirror.matches(&fingerprint(0, 0)), "never read yet");
        mirror.replace_all(vec![row("job-1", 1), row("job-2", 2)], 2);
        assert!(mirror.matches(&fingerprint(2, 2)));
        mirror.add(vec![row("job-3", 3)], 4);
        assert_eq!(mirror.read_through(), 4);
        assert!(mirror.matches(&fingerprint(3, 3)));

        mirror.note(&record("job-3", 3, JobState::Placed));
        mirror.note(&record("job-1", 1, JobState::Cancelled));
        assert!(mirror.matches(&fingerprint(1, 2)));
        let pending = mirror.pending_jobs();
        assert_eq!(pending.len(), 1);
        assert_eq!(mirror.len(), 1);
        assert_eq!(pending[0].job_id, "job-2");

        // A retry puts the job back with its old sequence and its new size.
        mirror.note(&record("job-3", 3, JobState::Queued));
        assert!(mirror.matches(&fingerprint(2, 3)));
        let retried = mirror.get_mut("job-3").unwrap();
        assert_eq!(retried.pending.slice_bytes, 200);
        assert_eq!(retried.stored_reason, "retrying");

        // Above what was read: left to the next range read.
        mirror.note(&record("job-9", 9, JobState::Queued));
        assert!(!mirror.contains("job-9"));
    }

    #[test]
    fn a_queue_changed_elsewhere_does_not_match() {
        let mut mirror = QueueMirror::default();
        mirror.replace_all(vec![row("job-1", 1), row("job-2", 2)], 2);
        // Another replica placed job-1: the count differs.
        assert!(!mirror.matches(&fingerprint(1, 2)));
        // Another replica requeued an older job: same count, other jobs.
        mirror.remove("job-2");
        assert!(!mirror.matches(&fingerprint(1, 2)));
        mirror.invalidate();
        assert!(!mirror.is_loaded());
        assert_eq!(mirror.len(), 0);
    }
}
