-- The scheduler's schema, PostgreSQL flavour. Keep in step with ../sqlite: the store's
-- contract tests run the same SQL against both.
-- Times are milliseconds since the Unix epoch; JSON blobs are TEXT.

CREATE TABLE tenants (
    name              TEXT   NOT NULL PRIMARY KEY,
    vram_quota_bytes  BIGINT,
    max_running_jobs  BIGINT,
    fair_share_weight BIGINT NOT NULL,
    created_at_ms     BIGINT NOT NULL
);

-- Tokens are stored by the hash of their secret. `tenant` is empty for admin and worker
-- tokens, so it is not a foreign key.
CREATE TABLE tokens (
    id            TEXT    NOT NULL PRIMARY KEY,
    tenant        TEXT    NOT NULL,
    role          TEXT    NOT NULL,
    secret_hash   BYTEA   NOT NULL UNIQUE,
    description   TEXT    NOT NULL,
    created_at_ms BIGINT  NOT NULL,
    expires_at_ms BIGINT,
    revoked       BOOLEAN NOT NULL DEFAULT FALSE
);

CREATE INDEX tokens_by_tenant ON tokens (tenant, created_at_ms);

-- Counters the store hands out. A submit group bumps `submit_sequence` first; the row
-- lock serializes submit groups across scheduler replicas until the group commits.
CREATE TABLE counters (
    name  TEXT   NOT NULL PRIMARY KEY,
    value BIGINT NOT NULL
);

INSERT INTO counters (name, value) VALUES ('submit_sequence', 0);

CREATE TABLE jobs (
    id                  TEXT   NOT NULL PRIMARY KEY,
    tenant              TEXT   NOT NULL REFERENCES tenants (name),
    name                TEXT   NOT NULL,
    spec_json           TEXT   NOT NULL,
    state               TEXT   NOT NULL,
    priority            BIGINT NOT NULL,
    submit_sequence     BIGINT NOT NULL UNIQUE,
    -- NULLs are distinct in a unique index, so jobs without a key never collide.
    idempotency_key     TEXT,
    config_json         TEXT   NOT NULL,
    estimate_json       TEXT   NOT NULL,
    required_bytes      BIGINT NOT NULL,
    waiting_reason      TEXT   NOT NULL,
    message             TEXT   NOT NULL,
    created_at_ms       BIGINT NOT NULL,
    finished_at_ms      BIGINT,
    checkpoint_location TEXT,
    attempts_count      BIGINT NOT NULL,
    UNIQUE (tenant, idempotency_key)
);

CREATE INDEX jobs_by_tenant ON jobs (tenant, submit_sequence);
CREATE INDEX jobs_by_state ON jobs (state, submit_sequence);

CREATE TABLE attempts (
    job_id              TEXT   NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt_number      BIGINT NOT NULL,
    config_json         TEXT   NOT NULL,
    estimate_bytes      BIGINT NOT NULL,
    slice_bytes         BIGINT NOT NULL,
    worker_id           TEXT   NOT NULL,
    gpu_id              TEXT   NOT NULL,
    lease_epoch         BIGINT NOT NULL,
    outcome             TEXT   NOT NULL,
    measured_peak_bytes BIGINT,
    oom_json            TEXT,
    message             TEXT   NOT NULL,
    resumed_from        TEXT,
    started_at_ms       BIGINT NOT NULL,
    finished_at_ms      BIGINT,
    PRIMARY KEY (job_id, attempt_number)
);

CREATE INDEX attempts_by_worker ON attempts (worker_id, outcome);

CREATE TABLE workers (
    id                TEXT   NOT NULL PRIMARY KEY,
    hostname          TEXT   NOT NULL,
    gpus_json         TEXT   NOT NULL,
    state             TEXT   NOT NULL,
    last_heartbeat_ms BIGINT NOT NULL,
    registered_at_ms  BIGINT NOT NULL,
    version           TEXT   NOT NULL
);

-- Every measured peak against its estimate, by job shape; the largest ratio raises
-- later estimates of the same shape.
CREATE TABLE peak_measurements (
    id              BIGINT           GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    shape_key       TEXT             NOT NULL,
    estimated_bytes BIGINT           NOT NULL,
    measured_bytes  BIGINT           NOT NULL,
    ratio           DOUBLE PRECISION NOT NULL,
    recorded_at_ms  BIGINT           NOT NULL
);

CREATE INDEX peak_measurements_by_shape ON peak_measurements (shape_key, ratio);
