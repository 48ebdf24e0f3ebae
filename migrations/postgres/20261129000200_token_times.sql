-- When a token was revoked and when it last authenticated a call, for `carve admin
-- tokens list`. Tokens revoked before this migration keep no time (NULL). The scheduler
-- writes last_used_at_ms at most once per token per minute, so it is that coarse. Keep
-- in step with the other database's file.
ALTER TABLE tokens ADD COLUMN revoked_at_ms BIGINT;
ALTER TABLE tokens ADD COLUMN last_used_at_ms BIGINT;
