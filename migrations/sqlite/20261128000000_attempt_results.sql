-- What each attempt achieved, kept like sacct keeps a job step's accounting: the final
-- training loss, the test accuracy, the steps done (counting those before a resume) and
-- the mean throughput over its own steps. NULL when unknown, as for every row written
-- before this migration. Keep in step with the other database's file.
ALTER TABLE attempts ADD COLUMN final_loss REAL;
ALTER TABLE attempts ADD COLUMN test_accuracy REAL;
ALTER TABLE attempts ADD COLUMN steps_done INTEGER;
ALTER TABLE attempts ADD COLUMN samples_per_second REAL;
