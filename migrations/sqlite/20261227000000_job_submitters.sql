-- Who submitted each job (issue 32's per-user accounting): the token's id and its
-- description as they were at submit. Rows from before this column read as '' for both:
-- the submitter is unknown. Named, not referenced: a job keeps its submitter after the
-- token is revoked or gone. Keep in step with the other database's migration.
ALTER TABLE jobs ADD COLUMN submitted_by_token_id TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN submitted_by TEXT NOT NULL DEFAULT '';
