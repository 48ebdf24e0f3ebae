-- Command jobs (a user's own program run under the guard). Keep in step with the other
-- database's file.
--
-- Per attempt: whether it was a profile, why it ran with its configuration, the argv
-- the worker rendered, what a profile measured (JSON list of points) and who detected an
-- out-of-memory. Empty for rows written before this migration and for model jobs.
ALTER TABLE attempts ADD COLUMN profile INTEGER NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN chosen_because TEXT NOT NULL DEFAULT '';
ALTER TABLE attempts ADD COLUMN command_argv_json TEXT NOT NULL DEFAULT '';
ALTER TABLE attempts ADD COLUMN profile_points_json TEXT NOT NULL DEFAULT '';
ALTER TABLE attempts ADD COLUMN oom_detected_by TEXT NOT NULL DEFAULT '';

-- The memory model of a command, by its shape (argv, environment, working directory,
-- precisions and recompute arguments; not its batch sizes): fitted from a profile and
-- raised by later measured peaks. One row per shape, replaced as it is refined.
CREATE TABLE command_memory_models (
    shape_key     TEXT    NOT NULL PRIMARY KEY,
    model_json    TEXT    NOT NULL,
    updated_at_ms INTEGER NOT NULL
) STRICT;
