-- A worker is bound to the token that registered it: only that token may register again
-- under its id, open its session and report its attempts, so one worker token cannot
-- impersonate another node. Workers registered before this migration have no token
-- (''); the first token that registers again under the id claims it. Keep in step with
-- the other database's file.
ALTER TABLE workers ADD COLUMN token_id TEXT NOT NULL DEFAULT '';
