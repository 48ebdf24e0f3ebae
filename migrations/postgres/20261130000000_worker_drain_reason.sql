-- Why an admin drained a worker (`carve cluster drain NODE --reason TEXT`), shown with
-- the worker; empty when it is not draining or no reason was given.
ALTER TABLE workers ADD COLUMN drain_reason TEXT NOT NULL DEFAULT '';
