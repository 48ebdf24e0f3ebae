-- Usage over time (issue 32): every attempt's use of its slice, from placement to end,
-- for fair share over decayed usage and for accounting (`carve usage`). A row is
-- written when the attempt is placed and its end (and the measured peak, where the
-- worker reported one) when it ends; it is never rewritten after that. The tenant is
-- named, not referenced: usage stays accountable after its job or tenant is gone.
-- `gpu_type` is the worker's GPU model name. Keep in step with ../sqlite.
CREATE TABLE attempt_usage (
    job_id TEXT NOT NULL,
    attempt_number BIGINT NOT NULL,
    tenant TEXT NOT NULL,
    gpu_type TEXT NOT NULL,
    slice_bytes BIGINT NOT NULL,
    placed_at_ms BIGINT NOT NULL,
    ended_at_ms BIGINT,
    measured_peak_bytes BIGINT,
    PRIMARY KEY (job_id, attempt_number)
);

CREATE INDEX attempt_usage_by_end ON attempt_usage (ended_at_ms);
CREATE INDEX attempt_usage_by_tenant ON attempt_usage (tenant, placed_at_ms);
