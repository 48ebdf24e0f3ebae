-- Job images (issue 30), the scheduler's side.
--
-- tenant_secrets: credentials a tenant keeps for its jobs (today registry credentials a
-- command job's `command.image_pull_secret` names), by tenant and name. The value is
-- never read back through the API; it goes only into the assignment of an attempt that
-- needs it. Deleting the tenant deletes them.
--
-- job_image_digests: the manifest digest a job's image resolved to at its first pull,
-- kept so that every later attempt runs exactly those bytes whatever its tag names by
-- then. The first one reported stays. Deleting the job deletes it.
CREATE TABLE tenant_secrets (
    tenant        TEXT    NOT NULL REFERENCES tenants (name) ON DELETE CASCADE,
    name          TEXT    NOT NULL,
    value         BYTEA   NOT NULL,
    created_at_ms BIGINT  NOT NULL,
    updated_at_ms BIGINT  NOT NULL,
    PRIMARY KEY (tenant, name)
);

CREATE TABLE job_image_digests (
    job_id         TEXT    NOT NULL PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    digest         TEXT    NOT NULL,
    recorded_at_ms BIGINT  NOT NULL
);
