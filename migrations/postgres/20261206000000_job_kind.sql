-- The job's kind, stored: 'model' (a model Carve's engine trains) or 'command' (a user's
-- own program under the guard), by carve_core::workload::JobKind's names, read back
-- strictly (a name this build does not know is a corrupt row, never a default). Readers
-- take the kind from here and read the spec as that kind instead of sniffing its text.
-- Keep in step with ../sqlite.
ALTER TABLE jobs ADD COLUMN kind TEXT NOT NULL DEFAULT 'model';

-- Jobs written before this migration: a command job's spec is a JSON object with a
-- top-level `command` (the rule carve_core::workload::JobKind::of_spec_text keeps). A
-- spec that is not JSON (never written by the scheduler) stays a model job rather than
-- failing the migration: the cast is tried inside a function that catches its error,
-- and only for the specs whose text mentions "command" at all.
CREATE FUNCTION pg_temp.carve_spec_has_command(spec text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    document jsonb;
BEGIN
    document := spec::jsonb;
    RETURN jsonb_typeof(document) = 'object' AND document ? 'command';
EXCEPTION WHEN others THEN
    RETURN false;
END;
$$;

UPDATE jobs SET kind = 'command'
WHERE spec_json LIKE '%"command"%' AND pg_temp.carve_spec_has_command(spec_json);

DROP FUNCTION pg_temp.carve_spec_has_command(text);
