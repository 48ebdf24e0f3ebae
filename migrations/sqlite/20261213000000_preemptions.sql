-- Preemptions under way, kept so that a restarted scheduler (or a new leader) finishes
-- what the last one began: a victim's stop is read as preempted, never as a user's
-- cancel, and no second victim is evicted for the same claim. Rows are written before
-- any worker is told to stop and removed when the preemption completes or lapses.
-- `preemption_claims`: an urgent job's bytes held on one GPU; its victims are the
-- evictions naming it. `preemption_evictions`: a victim asked to stop (its job and
-- attempt), the urgent job it stops for, when its grace runs out and why.
-- `preemption_times`: when each job was preempted (the cap per job per hour; rows older
-- than an hour are removed as new ones are written). No foreign keys: the scheduler
-- drops a row whose job is gone. Keep in step with ../postgres.
CREATE TABLE preemption_claims (
    urgent_job_id TEXT PRIMARY KEY NOT NULL,
    gpu_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    slice_bytes INTEGER NOT NULL,
    claimed_at_ms INTEGER NOT NULL
) STRICT;

CREATE TABLE preemption_evictions (
    victim_job_id TEXT PRIMARY KEY NOT NULL,
    attempt_number INTEGER NOT NULL,
    urgent_job_id TEXT NOT NULL,
    grace_ends_at_ms INTEGER NOT NULL,
    message TEXT NOT NULL,
    evicted_at_ms INTEGER NOT NULL
) STRICT;

CREATE TABLE preemption_times (
    job_id TEXT NOT NULL,
    preempted_at_ms INTEGER NOT NULL
) STRICT;

CREATE INDEX preemption_times_by_time ON preemption_times (preempted_at_ms);
