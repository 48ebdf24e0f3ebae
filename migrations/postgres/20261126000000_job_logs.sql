-- Log lines of jobs: what their attempts wrote (attempt_number >= 1) and the scheduler's
-- own notes about them (attempt_number 0). Keep in step with ../sqlite.
--
-- The store keeps the newest lines of each job (10,000 by default) and trims older ones
-- when it appends, so the table stays bounded per job. The primary key is the only index
-- the reads need: "lines of job X after sequence S" is a range scan of it and "the last N
-- lines" a reverse scan; an attempt filter reads one job's (bounded) lines in that order.
CREATE TABLE job_log_lines (
    job_id         TEXT   NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    sequence       BIGINT NOT NULL,
    time_ms        BIGINT NOT NULL,
    attempt_number BIGINT NOT NULL,
    level          TEXT   NOT NULL,
    message        TEXT   NOT NULL,
    PRIMARY KEY (job_id, sequence)
);

-- The last sequence handed out to each job's lines. Appending bumps it first, which locks
-- the job's row until the append commits, so concurrent appenders (scheduler replicas)
-- never hand out the same sequence; and since sequences are contiguous, trimming is one
-- range delete (sequence <= last - kept).
CREATE TABLE job_log_sequences (
    job_id        TEXT   NOT NULL PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    last_sequence BIGINT NOT NULL
);
