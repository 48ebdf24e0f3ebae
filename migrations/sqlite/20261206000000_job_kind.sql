-- The job's kind, stored: 'model' (a model Carve's engine trains) or 'command' (a user's
-- own program under the guard), by carve_core::workload::JobKind's names, read back
-- strictly (a name this build does not know is a corrupt row, never a default). Readers
-- take the kind from here and read the spec as that kind instead of sniffing its text.
-- Keep in step with ../postgres.
ALTER TABLE jobs ADD COLUMN kind TEXT NOT NULL DEFAULT 'model';

-- Jobs written before this migration: a command job's spec has a top-level `command`
-- (the rule carve_core::workload::JobKind::of_spec_text keeps). A spec that is not JSON
-- (never written by the scheduler) stays a model job: json_type would fail on it, so
-- only valid JSON is asked.
UPDATE jobs SET kind = 'command'
WHERE CASE WHEN json_valid(spec_json) THEN json_type(spec_json, '$.command') END IS NOT NULL;
