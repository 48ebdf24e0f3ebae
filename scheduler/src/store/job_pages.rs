//! ListJobs' pages: the filter, pages cut by count and by the bytes of what a page shows
//! (sized in the database, so a page never reads the rows it will not show), and what a
//! page shows besides the jobs, read for the whole page at once: the attempts of every
//! job on it in one query rather than one per job (ListJobs was 2N + 1 queries); the
//! memory models of their commands are `memory_models.rs`'s.

use std::collections::HashMap;

use super::jobs::{Arg, JOB_COLUMNS, bind_args};
use super::{AttemptRecord, DEFAULT_PAGE_SIZE, JobFilter, JobRecord, MAX_PAGE_SIZE, Store};
use crate::error::SchedulerError;

/// The most keys one `IN (...)` names (one parameter each): a whole page of the largest
/// size (`MAX_PAGE_SIZE`) in one statement, well under SQLite's and PostgreSQL's limits
/// on parameters.
const KEYS_PER_STATEMENT: usize = 1000;

/// The bytes of a job's row that a page shows as text and that grow with what a tenant
/// sent (id, tenant, name, spec, message, waiting reason), as the database counts them
/// without reading them (`octet_length` reads a value's length from its header on
/// SQLite, and from the TOAST pointer on PostgreSQL). [`shown_text_bytes`] is the same
/// sum over a read row.
const SHOWN_TEXT_BYTES_SQL: &str = "CAST(octet_length(id) + octet_length(tenant) + \
     octet_length(name) + octet_length(spec_json) + octet_length(message) + \
     octet_length(waiting_reason) AS BIGINT)";

/// [`SHOWN_TEXT_BYTES_SQL`] of a job read whole.
pub fn shown_text_bytes(job: &JobRecord) -> usize {
    job.id.len()
        + job.tenant.len()
        + job.name.len()
        + job.spec_json.len()
        + job.message.len()
        + job.waiting_reason.len()
}

/// A filter as SQL: its conditions (`$n` placeholders, in the order of the arguments)
/// and the page size it asks for.
struct FilterSql {
    conditions: Vec<String>,
    args: Vec<Arg>,
    page_size: usize,
}

impl FilterSql {
    fn new(filter: &JobFilter) -> Result<FilterSql, SchedulerError> {
        let page_size = match filter.page_size {
            0 => DEFAULT_PAGE_SIZE,
            size => size.min(MAX_PAGE_SIZE),
        } as usize;
        let mut sql = FilterSql {
            conditions: Vec::new(),
            args: Vec::new(),
            page_size,
        };
        if let Some(tenant) = &filter.tenant {
            sql.condition("tenant = $", Arg::Text(tenant.clone()));
        }
        if !filter.states.is_empty() {
            let mut placeholders = Vec::with_capacity(filter.states.len());
            for state in &filter.states {
                sql.args.push(Arg::Text(state.name().to_string()));
                placeholders.push(format!("${}", sql.args.len()));
            }
            sql.conditions
                .push(format!("state IN ({})", placeholders.join(", ")));
        }
        if let Some(prefix) = filter
            .name_prefix
            .as_deref()
            .filter(|prefix| !prefix.is_empty())
        {
            // substr rather than LIKE: no wildcards to escape, and case-sensitive in both
            // databases.
            sql.args.push(Arg::Text(prefix.to_string()));
            let n = sql.args.len();
            sql.conditions
                .push(format!("substr(name, 1, length(${n})) = ${n}"));
        }
        if let Some(token) = filter
            .page_token
            .as_deref()
            .filter(|token| !token.is_empty())
        {
            sql.condition("submit_sequence < $", Arg::Int(parse_page_token(token)?));
        }
        Ok(sql)
    }

    /// Adds `condition` followed by the placeholder of `arg`.
    fn condition(&mut self, condition: &str, arg: Arg) {
        self.args.push(arg);
        self.conditions
            .push(format!("{condition}{}", self.args.len()));
    }

    fn where_clause(&self) -> String {
        if self.conditions.is_empty() {
            String::new()
        } else {
            format!("WHERE {}", self.conditions.join(" AND "))
        }
    }
}

impl Store {
    /// One page of the jobs that match `filter`, newest (highest `submit_sequence`)
    /// first, and the token of the next page (`None` on the last page). Paging is by
    /// key, so jobs submitted while a client pages do not shift or repeat its pages.
    pub async fn list_jobs(
        &self,
        filter: &JobFilter,
    ) -> Result<(Vec<JobRecord>, Option<String>), SchedulerError> {
        let sql = FilterSql::new(filter)?;
        let query = format!(
            "SELECT {JOB_COLUMNS} FROM jobs {} ORDER BY submit_sequence DESC LIMIT {}",
            sql.where_clause(),
            sql.page_size + 1
        );
        let mut jobs: Vec<JobRecord> = with_pool!(self, pool => {
            bind_args!(sqlx::query_as(&query), &sql.args).fetch_all(pool).await?
        });
        let next_page_token = if jobs.len() > sql.page_size {
            jobs.truncate(sql.page_size);
            jobs.last().map(page_token_after)
        } else {
            None
        };
        Ok((jobs, next_page_token))
    }

    /// [`Store::list_jobs`] cut, as well, where the jobs shown pass `budget_bytes` of
    /// [`shown_text_bytes`] (the first job is always shown), reading only the rows it
    /// shows: the database sums the sizes first ([`SHOWN_TEXT_BYTES_SQL`], which reads
    /// no spec), then the shown rows are read by their range of `submit_sequence`. A
    /// page of large specs costs what its shown jobs do, not `page_size` rows.
    ///
    /// The two reads are not one snapshot: a job that stops matching the filter in
    /// between is left out (the page's token still continues after the range, so no
    /// job is skipped), and one that starts matching within the range is shown, which
    /// may pass the budget by that job (a caller that must fit a limit checks what it
    /// sends, as ListJobs does).
    pub async fn list_jobs_within(
        &self,
        filter: &JobFilter,
        budget_bytes: u64,
    ) -> Result<(Vec<JobRecord>, Option<String>), SchedulerError> {
        let mut sql = FilterSql::new(filter)?;
        let sizes_query = format!(
            "SELECT submit_sequence, {SHOWN_TEXT_BYTES_SQL} FROM jobs {} \
             ORDER BY submit_sequence DESC LIMIT {}",
            sql.where_clause(),
            sql.page_size + 1
        );
        let sizes: Vec<(i64, i64)> = with_pool!(self, pool => {
            bind_args!(sqlx::query_as(&sizes_query), &sql.args).fetch_all(pool).await?
        });
        let mut shown_bytes: u64 = 0;
        let mut shown: usize = 0;
        for (_, bytes) in sizes.iter().take(sql.page_size) {
            shown_bytes = shown_bytes.saturating_add(u64::try_from(*bytes).unwrap_or(0));
            if shown_bytes > budget_bytes && shown > 0 {
                break;
            }
            shown += 1;
        }
        let (Some(&(newest, _)), Some(&(oldest, _))) = (
            sizes.first(),
            shown.checked_sub(1).and_then(|last| sizes.get(last)),
        ) else {
            return Ok((Vec::new(), None));
        };
        sql.condition("submit_sequence <= $", Arg::Int(newest));
        sql.condition("submit_sequence >= $", Arg::Int(oldest));
        let rows_query = format!(
            "SELECT {JOB_COLUMNS} FROM jobs {} ORDER BY submit_sequence DESC",
            sql.where_clause()
        );
        let jobs: Vec<JobRecord> = with_pool!(self, pool => {
            bind_args!(sqlx::query_as(&rows_query), &sql.args).fetch_all(pool).await?
        });
        let next_page_token = (sizes.len() > shown).then(|| oldest.to_string());
        Ok((jobs, next_page_token))
    }

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

/// The `next_page_token` of a page of [`Store::list_jobs`] whose last job is `last`: the
/// next page starts right after it (tokens are keys, newest first: the jobs submitted
/// before it). A caller that shows fewer jobs than the store listed (ListJobs cuts a page
/// that would not fit its byte budget) gives the token after the last job it shows.
pub fn page_token_after(last: &JobRecord) -> String {
    last.submit_sequence.to_string()
}

fn parse_page_token(token: &str) -> Result<i64, SchedulerError> {
    token
        .parse::<i64>()
        .ok()
        .filter(|sequence| *sequence > 0)
        .ok_or_else(|| {
            SchedulerError::invalid_argument(
                "page_token",
                format!("{token:?} is not a page token this server issued"),
            )
        })
}
