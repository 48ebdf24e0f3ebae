//! What a page of jobs shows besides the jobs, read for the whole page at once: the
//! attempts of every job on it in one query rather than one per job (ListJobs was 2N + 1
//! queries); the memory models of their commands are `memory_models.rs`'s.

use std::collections::HashMap;

use super::{AttemptRecord, Store};
use crate::error::SchedulerError;

/// The most keys one `IN (...)` names (one parameter each): a whole page of the largest
/// size (`MAX_PAGE_SIZE`) in one statement, well under SQLite's and PostgreSQL's limits
/// on parameters.
const KEYS_PER_STATEMENT: usize = 1000;

impl Store {
    /// The attempts of each of `job_ids`, by job id, each job's by number; a job with no
    /// attempt has no entry. One statement per [`KEYS_PER_STATEMENT`] ids.
    pub async fn attempts_of_jobs(
        &self,
        job_ids: &[&str],
    ) -> Result<HashMap<String, Vec<AttemptRecord>>, SchedulerError> {
        let mut attempts: HashMap<String, Vec<AttemptRecord>> = HashMap::new();
        for ids in job_ids.chunks(KEYS_PER_STATEMENT) {
            // Every column, as `AttemptRecord` reads them by name: `SELECT *` follows the
            // columns that `attempts.rs` writes without a second list to keep in step.
            let rows: Vec<AttemptRecord> = with_pool!(self, pool => {
                let mut query = sqlx::QueryBuilder::new("SELECT * FROM attempts WHERE job_id IN (");
                let mut separated = query.separated(", ");
                for id in ids {
                    separated.push_bind(id.to_string());
                }
                separated.push_unseparated(") ORDER BY job_id, attempt_number");
                query.build_query_as().fetch_all(pool).await?
            });
            for attempt in rows {
                attempts
                    .entry(attempt.job_id.clone())
                    .or_default()
                    .push(attempt);
            }
        }
        Ok(attempts)
    }
}
