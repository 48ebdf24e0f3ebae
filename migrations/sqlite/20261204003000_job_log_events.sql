-- The event a scheduler's log line was made from, encoded as the wire's JobEvent
-- (protobuf), so that a watch can be resumed from the job's stored story on any replica
-- (WatchJobRequest.after_log_sequence). NULL for lines that are only text: an attempt's
-- output and the scheduler's notes, which a watch replays as log events. Keep in step
-- with ../postgres.
ALTER TABLE job_log_lines ADD COLUMN event BLOB;
