-- Whether an attempt ran without its container, with its worker's rights (the worker had
-- no OCI runtime or was started with --insecure-no-sandbox), as its worker said when it
-- started: `carve get` says so. 0 for rows written before this migration, for attempts
-- not started yet and for attempts of workers too old to say. Keep in step with
-- ../postgres.
ALTER TABLE attempts ADD COLUMN uncontained INTEGER NOT NULL DEFAULT 0;
