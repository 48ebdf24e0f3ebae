-- Jobs are addressed by name as well as by id (`carve cancel my-run`): finding a name's
-- jobs, newest first, reads this index instead of every job. A prefix of an id is a
-- range of the primary key and needs no index of its own. Keep in step with the other
-- database's file.
CREATE INDEX jobs_by_name ON jobs (name, submit_sequence);
