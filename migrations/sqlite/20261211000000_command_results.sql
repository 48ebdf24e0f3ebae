-- Command jobs' own results and output streams. `metrics_json`: the metrics an attempt's
-- program reported (`val_loss`, `metric_<name>`: at most 16, bounded names, finite
-- values) as a JSON list of {"name", "value"}; '' for none (model jobs, rows written
-- before this migration). `stream`: "stdout" or "stderr" for a line of a program's
-- output, '' for every other line. Keep in step with ../postgres.
ALTER TABLE attempts ADD COLUMN metrics_json TEXT NOT NULL DEFAULT '';
ALTER TABLE job_log_lines ADD COLUMN stream TEXT NOT NULL DEFAULT '';
