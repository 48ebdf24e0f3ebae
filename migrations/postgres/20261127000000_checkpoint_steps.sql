-- The training step of a job's last checkpoint, next to its location, and the step an
-- attempt resumed from, so the API can say where a resumed attempt started. Rows written
-- before this migration say 0 (unknown). Keep in step with the other database's file.
ALTER TABLE jobs ADD COLUMN checkpoint_step BIGINT NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN resumed_from_step BIGINT NOT NULL DEFAULT 0;
