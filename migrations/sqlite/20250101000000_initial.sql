-- The scheduler's schema, SQLite flavour. Keep in step with ../postgres: the store's
-- contract tests run the same SQL against both.
-- Times are milliseconds since the Unix epoch; JSON blobs are TEXT. STRICT tables reject
-- values of the wrong type instead of converting them.

CREATE TABLE tenants (
    name              TEXT    NOT NULL PRIMARY KEY,
    vram_quota_bytes  INTEGER,
    max_running_jobs  INTEGER,
    fair_share_weight INTEGER NOT NULL,
    created_at_ms     INTEGER NOT NULL
) STRICT;

-- Tokens are stored by the hash of their secret. `tenant` is empty for admin and worker
-- tokens, so it is not a foreign key.
CREATE TABLE tokens (
    id            TEXT    NOT NULL PRIMARY KEY,
    tenant        TEXT    NOT NULL,
    role          TEXT    NOT NULL,
    secret_hash   BLOB    NOT NULL UNIQUE,
    description   TEXT    NOT NULL,
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER,
    revoked       INTEGER NOT NULL DEFAULT 0
) STRICT;

CREATE INDEX tokens_by_tenant ON tokens (tenant, created_at_ms);

-- Counters the store hands out. A submit group bumps `submit_sequence` first, which
-- takes the write lock for the whole group.
CREATE TABLE counters (
    name  TEXT    NOT NULL PRIMARY KEY,
    value INTEGER NOT NULL
) STRICT;

INSERT INTO counters (name, value) VALUES ('submit_sequence', 0);

CREATE TABLE jobs (
    id                  TEXT    NOT NULL PRIMARY KEY,
    tenant              TEXT    NOT NULL REFERENCES tenants (name),
    name                TEXT    NOT NULL,
    spec_json           TEXT    NOT NULL,
    state               TEXT    NOT NULL,
    priority            INTEGER NOT NULL,
    submit_sequence     INTEGER NOT NULL UNIQUE,
    -- NULLs are distinct in a unique index, so jobs without a key never collide.
    idempotency_key     TEXT,
    config_json         TEXT    NOT NULL,
    estimate_json       TEXT    NOT NULL,
    required_bytes      INTEGER NOT NULL,
    waiting_reason      TEXT    NOT NULL,
    message             TEXT    NOT NULL,
    created_at_ms       INTEGER NOT NULL,
    finished_at_ms      INTEGER,
    checkpoint_location TEXT,
    attempts_count      INTEGER NOT NULL,
    UNIQUE (tenant, idempotency_key)
) STRICT;

CREATE INDEX jobs_by_tenant ON jobs (tenant, submit_sequence);
CREATE INDEX jobs_by_state ON jobs (state, submit_sequence);

CREATE TABLE attempts (
    job_id              TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt_number      INTEGER NOT NULL,
    config_json         TEXT    NOT NULL,
    estimate_bytes      INTEGER NOT NULL,
    slice_bytes         INTEGER NOT NULL,
    worker_id           TEXT    NOT NULL,
    gpu_id              TEXT    NOT NULL,
    lease_epoch         INTEGER NOT NULL,
    outcome             TEXT    NOT NULL,
    measured_peak_bytes INTEGER,
    oom_json            TEXT,
    message             TEXT    NOT NULL,
    resumed_from        TEXT,
    started_at_ms       INTEGER NOT NULL,
    finished_at_ms      INTEGER,
    PRIMARY KEY (job_id, attempt_number)
) STRICT;

CREATE INDEX attempts_by_worker ON attempts (worker_id, outcome);

CREATE TABLE workers (
    id                TEXT    NOT NULL PRIMARY KEY,
    hostname          TEXT    NOT NULL,
    gpus_json         TEXT    NOT NULL,
    state             TEXT    NOT NULL,
    last_heartbeat_ms INTEGER NOT NULL,
    registered_at_ms  INTEGER NOT NULL,
    version           TEXT    NOT NULL
) STRICT;

-- Every measured peak against its estimate, by job shape; the largest ratio raises
-- later estimates of the same shape.
CREATE TABLE peak_measurements (
    id              INTEGER NOT NULL PRIMARY KEY,
    shape_key       TEXT    NOT NULL,
    estimated_bytes INTEGER NOT NULL,
    measured_bytes  INTEGER NOT NULL,
    ratio           REAL    NOT NULL,
    recorded_at_ms  INTEGER NOT NULL
) STRICT;

CREATE INDEX peak_measurements_by_shape ON peak_measurements (shape_key, ratio);
