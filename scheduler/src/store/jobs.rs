//! Jobs: group-committed submits with idempotency keys, lookups, keyset-paged listings,
//! whole-row updates, and the narrow reads and writes of the scheduling pass over the
//! queue (which must stay cheap with a million queued jobs).

use std::collections::HashMap;

use carve_core::usage::report::Submitter;

use super::json_columns::WORKLOAD_COLUMN;
use super::leadership::check_fence;
use super::{
    JobRecord, JobState, QueueFingerprint, QueuedJob, Store, SubmitOutcome, insert_error,
    is_foreign_key_violation, is_unique_violation,
};
use crate::error::SchedulerError;

pub(super) const JOB_COLUMNS: &str = "id, tenant, name, spec_json, state, priority, \
     submit_sequence, idempotency_key, config_json, estimate_json, required_bytes, \
     waiting_reason, message, created_at_ms, finished_at_ms, checkpoint_location, \
     attempts_count, checkpoint_step, kind";

/// Who submitted a job (`usage/report.rs`'s per-user figures): written at submit, read
/// only by accounting (`store/usage_report.rs`), so job reads leave them out.
pub(super) const SUBMITTER_COLUMNS: &str = "submitted_by_token_id, submitted_by";

/// A job to create: the row, its validated workload as its column stores it, and who
/// submitted it.
pub type NewJob = (JobRecord, Option<String>, Submitter);

/// What every job id starts with; the rest is hex digits (see `auth::generate_id`).
const JOB_ID_PREFIX: &str = "job-";

/// The fewest hex digits a reference must have to be tried as the end of an id: shorter
/// ones would name a good part of a tenant's jobs (and read them all to say so). The
/// last digits of an id are random, so four tell apart the jobs a person has in mind.
const SHORTEST_ID_SUFFIX: usize = 4;

/// Whether `reference` could be (part of) the hex digits of a job id: 1 to 32 lowercase
/// hex digits.
fn is_id_digits(reference: &str) -> bool {
    (1..=32).contains(&reference.len())
        && reference
            .bytes()
            .all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte))
}

/// Binds a job's columns in the order of [`JOB_COLUMNS`] ($1 to $19).
macro_rules! bind_job_columns {
    ($query:expr, $job:expr) => {
        $query
            .bind(&$job.id)
            .bind(&$job.tenant)
            .bind(&$job.name)
            .bind(&$job.spec_json)
            .bind($job.state.name())
            .bind($job.priority)
            .bind($job.submit_sequence)
            .bind(&$job.idempotency_key)
            .bind(&$job.config_json)
            .bind(&$job.estimate_json)
            .bind($job.required_bytes)
            .bind(&$job.waiting_reason)
            .bind(&$job.message)
            .bind($job.created_at_ms)
            .bind($job.finished_at_ms)
            .bind(&$job.checkpoint_location)
            .bind($job.attempts_count)
            .bind($job.checkpoint_step)
            .bind($job.kind.name())
    };
}

/// What [`Store::update_job`] rewrites: everything but the job's identity (`id`,
/// `tenant`, `submit_sequence`, `idempotency_key`, `created_at_ms`).
pub(super) const UPDATE_JOB_SQL: &str = "UPDATE jobs SET name = $2, spec_json = $3, \
     state = $4, priority = $5, config_json = $6, estimate_json = $7, required_bytes = $8, \
     waiting_reason = $9, message = $10, finished_at_ms = $11, checkpoint_location = $12, \
     attempts_count = $13, checkpoint_step = $14, kind = $15 WHERE id = $1";

/// Binds the parameters of [`UPDATE_JOB_SQL`].
macro_rules! bind_job_update {
    ($query:expr, $job:expr) => {
        $query
            .bind(&$job.id)
            .bind(&$job.name)
            .bind(&$job.spec_json)
            .bind($job.state.name())
            .bind($job.priority)
            .bind(&$job.config_json)
            .bind(&$job.estimate_json)
            .bind($job.required_bytes)
            .bind(&$job.waiting_reason)
            .bind(&$job.message)
            .bind($job.finished_at_ms)
            .bind(&$job.checkpoint_location)
            .bind($job.attempts_count)
            .bind($job.checkpoint_step)
            .bind($job.kind.name())
    };
}
pub(super) use bind_job_update;

/// Rewrites `job`'s row in the transaction `tx` ([`UPDATE_JOB_SQL`]), returning
/// `NotFound` from the enclosing function (the transaction dropped, nothing written)
/// when the job does not exist. Every write that moves a job uses it, alone or with an
/// attempt's row.
macro_rules! update_job_row {
    ($tx:ident, $job:expr) => {
        let updated = bind_job_update!(sqlx::query(UPDATE_JOB_SQL), $job)
            .execute(&mut *$tx)
            .await?
            .rows_affected();
        if updated == 0 {
            return Err(SchedulerError::not_found("job", &$job.id));
        }
    };
}
pub(super) use update_job_row;

/// The most waiting reasons [`Store::set_waiting_reasons`] writes in one transaction.
pub const WAITING_REASONS_PER_TRANSACTION: usize = 4096;

/// A value bound to a query built at run time.
pub(super) enum Arg {
    Text(String),
    Int(i64),
}

/// Binds `args` in order to `$query` (a `sqlx::query_as`), whichever the database.
macro_rules! bind_args {
    ($query:expr, $args:expr) => {{
        let mut query = $query;
        for arg in $args {
            query = match arg {
                Arg::Text(text) => query.bind(text),
                Arg::Int(int) => query.bind(*int),
            };
        }
        query
    }};
}
pub(super) use bind_args;

impl Store {
    /// Submits a group of jobs in ONE transaction (one flush to disk for all of them) and
    /// answers, in order, what happened to each.
    ///
    /// Each created job gets the next `submit_sequence` (increasing in the order of
    /// `jobs`, and above every earlier group's). A job whose `(tenant, idempotency_key)`
    /// was used before, in the database or earlier in the same group, is not created: its
    /// outcome is the job the key first created, with `created == false`. An empty key is
    /// stored as no key.
    ///
    /// Any failure rolls the whole group back: `AlreadyExists` for a job id that is taken,
    /// `NotFound` for a tenant that does not exist.
    pub async fn submit_jobs(
        &self,
        jobs: Vec<JobRecord>,
    ) -> Result<Vec<SubmitOutcome>, SchedulerError> {
        self.submit_jobs_with_workloads(jobs.into_iter().map(|job| (job, None)).collect())
            .await
    }

    /// [`Store::submit_jobs_with_workloads`], each job stored with who submitted it.
    pub async fn submit_jobs_with_submitters(
        &self,
        jobs: Vec<NewJob>,
    ) -> Result<Vec<SubmitOutcome>, SchedulerError> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        match self.submit_jobs_together(jobs.clone()).await {
            // The group was rolled back, and a multi-row statement does not say which
            // row broke it: the row-by-row path does the same work again in a new
            // transaction and names the job or tenant (it fails the same way, or
            // succeeds if what was in the way went meanwhile).
            Ok(None) => self.submit_jobs_row_by_row(jobs).await,
            Ok(Some(outcomes)) => Ok(outcomes),
            Err(error) => Err(error),
        }
    }

    /// [`Store::submit_jobs`], each created job stored with its validated workload
    /// (`workload_json`, `json_columns::workload_to_json`) in the same transaction, so a
    /// job is never stored without the form admission validated (`None`: without one, as
    /// rows from before the column; readers then read the spec once).
    pub async fn submit_jobs_with_workloads(
        &self,
        jobs: Vec<(JobRecord, Option<String>)>,
    ) -> Result<Vec<SubmitOutcome>, SchedulerError> {
        self.submit_jobs_with_submitters(
            jobs.into_iter()
                .map(|(job, workload_json)| (job, workload_json, Submitter::default()))
                .collect(),
        )
        .await
    }

    /// [`Store::submit_jobs`] with a constant number of statements per group: one
    /// idempotency lookup and one multi-row insert per chunk, instead of two statements
    /// per job. Each statement is a round trip (to sqlx-sqlite's connection thread or to
    /// PostgreSQL), and the group holds the write lock throughout, so this is what
    /// bounds how fast groups commit. `None` (rolled back) when a job id was taken or a
    /// tenant did not exist: a multi-row statement does not say which.
    async fn submit_jobs_together(
        &self,
        jobs: Vec<NewJob>,
    ) -> Result<Option<Vec<SubmitOutcome>>, SchedulerError> {
        /// Keys per lookup statement (one parameter each, plus the tenant).
        const KEYS_PER_LOOKUP: usize = 200;
        /// Rows per insert statement (22 parameters each; SQLite allows 32,766).
        const ROWS_PER_INSERT: usize = 100;
        let reserved = i64::try_from(jobs.len())
            .map_err(|_| SchedulerError::invalid_argument("jobs", "too many jobs in one group"))?;
        let mut jobs = jobs;
        for (job, _, _) in &mut jobs {
            if job.idempotency_key.as_deref() == Some("") {
                job.idempotency_key = None;
            }
        }
        let mut keys: Vec<(String, String)> = jobs
            .iter()
            .filter_map(|(job, _, _)| Some((job.tenant.clone(), job.idempotency_key.clone()?)))
            .collect();
        keys.sort();
        keys.dedup();
        let result: Result<Vec<SubmitOutcome>, sqlx::Error> = async {
            Ok(with_write_tx!(self, tx => {
                // As in the row-by-row path: the counter first, so the lookups below see
                // every earlier group.
                let reserved_end: i64 = sqlx::query_scalar(
                    "UPDATE counters SET value = value + $1 WHERE name = 'submit_sequence' \
                     RETURNING value",
                )
                .bind(reserved)
                .fetch_one(&mut *tx)
                .await?;
                let mut existing: HashMap<(String, String), JobRecord> = HashMap::new();
                // One tenant and a list of its keys per lookup: an index range per key
                // (`= ANY` of the list on PostgreSQL), where an OR of (tenant, key) pairs
                // made PostgreSQL recheck every pair against every candidate row.
                for tenant_keys in keys.chunk_by(|left, right| left.0 == right.0) {
                    for chunk in tenant_keys.chunks(KEYS_PER_LOOKUP) {
                        let mut lookup = sqlx::QueryBuilder::new(format!(
                            "SELECT {JOB_COLUMNS} FROM jobs WHERE tenant = "
                        ));
                        lookup
                            .push_bind(chunk[0].0.clone())
                            .push(" AND idempotency_key IN (");
                        let mut separated = lookup.separated(", ");
                        for (_, key) in chunk {
                            separated.push_bind(key.clone());
                        }
                        separated.push_unseparated(")");
                        let found: Vec<JobRecord> =
                            lookup.build_query_as().fetch_all(&mut *tx).await?;
                        for job in found {
                            if let Some(key) = job.idempotency_key.clone() {
                                existing.insert((job.tenant.clone(), key), job);
                            }
                        }
                    }
                }
                let mut last_sequence = reserved_end - reserved;
                let mut outcomes: Vec<SubmitOutcome> = Vec::with_capacity(jobs.len());
                let mut to_insert: Vec<NewJob> = Vec::with_capacity(jobs.len());
                let mut first_with_key: HashMap<(String, String), usize> = HashMap::new();
                for (mut job, workload_json, submitter) in jobs {
                    if let Some(key) = &job.idempotency_key {
                        let tenant_and_key = (job.tenant.clone(), key.clone());
                        if let Some(found) = existing.get(&tenant_and_key) {
                            outcomes.push(SubmitOutcome { job: found.clone(), created: false });
                            continue;
                        }
                        if let Some(&earlier) = first_with_key.get(&tenant_and_key) {
                            let job = outcomes[earlier].job.clone();
                            outcomes.push(SubmitOutcome { job, created: false });
                            continue;
                        }
                        first_with_key.insert(tenant_and_key, outcomes.len());
                    }
                    last_sequence += 1;
                    job.submit_sequence = last_sequence;
                    to_insert.push((job.clone(), workload_json, submitter));
                    outcomes.push(SubmitOutcome { job, created: true });
                }
                for chunk in to_insert.chunks(ROWS_PER_INSERT) {
                    let mut insert = sqlx::QueryBuilder::new(format!(
                        "INSERT INTO jobs ({JOB_COLUMNS}, {WORKLOAD_COLUMN}, {SUBMITTER_COLUMNS}) "
                    ));
                    insert.push_values(chunk, |mut row, (job, workload_json, submitter)| {
                        row.push_bind(job.id.clone())
                            .push_bind(job.tenant.clone())
                            .push_bind(job.name.clone())
                            .push_bind(job.spec_json.clone())
                            .push_bind(job.state.name())
                            .push_bind(job.priority)
                            .push_bind(job.submit_sequence)
                            .push_bind(job.idempotency_key.clone())
                            .push_bind(job.config_json.clone())
                            .push_bind(job.estimate_json.clone())
                            .push_bind(job.required_bytes)
                            .push_bind(job.waiting_reason.clone())
                            .push_bind(job.message.clone())
                            .push_bind(job.created_at_ms)
                            .push_bind(job.finished_at_ms)
                            .push_bind(job.checkpoint_location.clone())
                            .push_bind(job.attempts_count)
                            .push_bind(job.checkpoint_step)
                            .push_bind(job.kind.name())
                            .push_bind(workload_json.clone())
                            .push_bind(submitter.token_id.clone())
                            .push_bind(submitter.description.clone());
                    });
                    insert.build().execute(&mut *tx).await?;
                }
                if last_sequence != reserved_end {
                    // Give back the numbers reserved for jobs that matched a key.
                    sqlx::query("UPDATE counters SET value = $1 WHERE name = 'submit_sequence'")
                        .bind(last_sequence)
                        .execute(&mut *tx)
                        .await?;
                }
                outcomes
            }))
        }
        .await;
        match result {
            Ok(outcomes) => Ok(Some(outcomes)),
            Err(error) if is_unique_violation(&error) || is_foreign_key_violation(&error) => {
                Ok(None)
            }
            Err(error) => Err(error.into()),
        }
    }

    /// [`Store::submit_jobs`] one statement per job, which can name the job whose id is
    /// taken or whose tenant does not exist.
    async fn submit_jobs_row_by_row(
        &self,
        jobs: Vec<NewJob>,
    ) -> Result<Vec<SubmitOutcome>, SchedulerError> {
        let reserved = i64::try_from(jobs.len())
            .map_err(|_| SchedulerError::invalid_argument("jobs", "too many jobs in one group"))?;
        let select_by_key =
            format!("SELECT {JOB_COLUMNS} FROM jobs WHERE tenant = $1 AND idempotency_key = $2");
        let insert = format!(
            "INSERT INTO jobs ({JOB_COLUMNS}, {WORKLOAD_COLUMN}, {SUBMITTER_COLUMNS}) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, \
             $20, $21, $22)"
        );
        let outcomes = with_write_tx!(self, tx => {
            // Bumping the counter first takes the write lock (SQLite) or the counter's row
            // lock (PostgreSQL) for the whole group, so the idempotency lookups below see
            // every earlier group and sequences are handed out in commit order.
            let reserved_end: i64 = sqlx::query_scalar(
                "UPDATE counters SET value = value + $1 WHERE name = 'submit_sequence' \
                 RETURNING value",
            )
            .bind(reserved)
            .fetch_one(&mut *tx)
            .await?;
            let mut last_sequence = reserved_end - reserved;
            let mut outcomes: Vec<SubmitOutcome> = Vec::with_capacity(jobs.len());
            let mut first_with_key: HashMap<(String, String), usize> = HashMap::new();
            for (mut job, workload_json, submitter) in jobs {
                if job.idempotency_key.as_deref() == Some("") {
                    job.idempotency_key = None;
                }
                if let Some(key) = &job.idempotency_key {
                    let tenant_and_key = (job.tenant.clone(), key.clone());
                    if let Some(&earlier) = first_with_key.get(&tenant_and_key) {
                        let existing = outcomes[earlier].job.clone();
                        outcomes.push(SubmitOutcome { job: existing, created: false });
                        continue;
                    }
                    first_with_key.insert(tenant_and_key, outcomes.len());
                    let existing: Option<JobRecord> = sqlx::query_as(&select_by_key)
                        .bind(&job.tenant)
                        .bind(key)
                        .fetch_optional(&mut *tx)
                        .await?;
                    if let Some(existing) = existing {
                        outcomes.push(SubmitOutcome { job: existing, created: false });
                        continue;
                    }
                }
                last_sequence += 1;
                job.submit_sequence = last_sequence;
                bind_job_columns!(sqlx::query(&insert), job)
                    .bind(&workload_json)
                    .bind(&submitter.token_id)
                    .bind(&submitter.description)
                    .execute(&mut *tx)
                    .await
                    .map_err(|error| {
                        insert_error(error, "job", &job.id, Some(("tenant", &job.tenant)))
                    })?;
                outcomes.push(SubmitOutcome { job, created: true });
            }
            if last_sequence != reserved_end {
                // Give back the numbers reserved for jobs that matched a key.
                sqlx::query("UPDATE counters SET value = $1 WHERE name = 'submit_sequence'")
                    .bind(last_sequence)
                    .execute(&mut *tx)
                    .await?;
            }
            outcomes
        });
        Ok(outcomes)
    }

    /// The validated workload stored with the job at admission (`workload_json`, read
    /// with `json_columns::workload_from_json`): `None` for a job stored without one
    /// (before the column existed); `NotFound` when there is no such job. Job reads never
    /// carry it ([`JOB_COLUMNS`] leaves it out): only what acts on a job reads it.
    pub async fn job_workload_json(&self, id: &str) -> Result<Option<String>, SchedulerError> {
        let sql = format!("SELECT {WORKLOAD_COLUMN} FROM jobs WHERE id = $1");
        let row: Option<(Option<String>,)> = with_pool!(self, pool => {
            sqlx::query_as(&sql).bind(id).fetch_optional(pool).await?
        });
        row.map(|(text,)| text)
            .ok_or_else(|| SchedulerError::not_found("job", id))
    }

    /// Stores a job's validated workload where it has none (a job stored before the
    /// column, read from its spec once): a later read takes it from here. A job that has
    /// one keeps it; `NotFound` when there is no such job.
    pub async fn backfill_job_workload(
        &self,
        id: &str,
        workload_json: &str,
    ) -> Result<(), SchedulerError> {
        let sql = format!(
            "UPDATE jobs SET {WORKLOAD_COLUMN} = coalesce({WORKLOAD_COLUMN}, $2) WHERE id = $1"
        );
        let updated = with_pool!(self, pool => {
            sqlx::query(&sql).bind(id).bind(workload_json).execute(pool).await?.rows_affected()
        });
        if updated == 0 {
            return Err(SchedulerError::not_found("job", id));
        }
        Ok(())
    }

    /// The job with this id; `NotFound` when there is none.
    pub async fn get_job(&self, id: &str) -> Result<JobRecord, SchedulerError> {
        let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1");
        let job: Option<JobRecord> = with_pool!(self, pool => {
            sqlx::query_as(&sql).bind(id).fetch_optional(pool).await?
        });
        job.ok_or_else(|| SchedulerError::not_found("job", id))
    }

    /// The jobs a person may mean by `reference`, of `tenant` (every tenant's for
    /// `None`), at most `limit` of each kind, newest first and without repeats: first
    /// those its id names (the id starts with it; for a reference of hex digits, the id
    /// starts with `job-` and it, or ends with it when it has at least
    /// [`SHORTEST_ID_SUFFIX`] digits), then those named exactly it.
    ///
    /// The id prefix is a range of the primary key: from the prefix itself to the prefix
    /// followed by `z`s, past any id's length. Ids are lowercase letters, digits and
    /// dashes, which sort the same by bytes and in PostgreSQL's collations (where a dash
    /// may be ignored), so the range holds every id with the prefix on both databases;
    /// the `substr` test then keeps exactly those. A suffix has no index to use: it reads
    /// the tenant's jobs (`jobs_by_tenant`), which is why it needs enough digits to be
    /// worth asking and is never asked for a reference that no id can end with.
    pub async fn jobs_matching_reference(
        &self,
        tenant: Option<&str>,
        reference: &str,
        limit: usize,
    ) -> Result<(Vec<JobRecord>, Vec<JobRecord>), SchedulerError> {
        let tenant_condition = |placeholder: &str| match tenant {
            Some(_) => format!("AND tenant = {placeholder}"),
            None => String::new(),
        };
        let hex = is_id_digits(reference);
        // Ids are `job-` and hex digits, so hex digits alone are the id without its
        // prefix (a person copies the part that differs).
        let id_prefix = if hex {
            format!("{JOB_ID_PREFIX}{reference}")
        } else {
            reference.to_string()
        };
        let by_id = format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE id >= $1 AND id <= $2 \
             AND substr(id, 1, length($1)) = $1 {} ORDER BY id LIMIT {limit}",
            tenant_condition("$3")
        );
        let by_suffix = format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE length(id) > length($1) \
             AND substr(id, length(id) - length($1) + 1) = $1 {} \
             ORDER BY submit_sequence DESC LIMIT {limit}",
            tenant_condition("$2")
        );
        let by_name = format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE name = $1 {} \
             ORDER BY submit_sequence DESC LIMIT {limit}",
            tenant_condition("$2")
        );
        let ask_suffix = hex && reference.len() >= SHORTEST_ID_SUFFIX;
        let id_upper_bound = format!("{id_prefix}{}", "z".repeat(64));
        let (mut by_id_jobs, suffixed, named): (Vec<JobRecord>, Vec<JobRecord>, Vec<JobRecord>) = with_pool!(self, pool => {
            let by_id = sqlx::query_as(&by_id).bind(&id_prefix).bind(&id_upper_bound);
            let by_suffix = sqlx::query_as(&by_suffix).bind(reference);
            let by_name = sqlx::query_as(&by_name).bind(reference);
            match tenant {
                Some(tenant) => (
                    by_id.bind(tenant).fetch_all(pool).await?,
                    if ask_suffix {
                        by_suffix.bind(tenant).fetch_all(pool).await?
                    } else {
                        Vec::new()
                    },
                    by_name.bind(tenant).fetch_all(pool).await?,
                ),
                None => (
                    by_id.fetch_all(pool).await?,
                    if ask_suffix { by_suffix.fetch_all(pool).await? } else { Vec::new() },
                    by_name.fetch_all(pool).await?,
                ),
            }
        });
        for job in suffixed {
            if !by_id_jobs.iter().any(|seen| seen.id == job.id) {
                by_id_jobs.push(job);
            }
        }
        by_id_jobs.sort_by_key(|job| std::cmp::Reverse(job.submit_sequence));
        let named = named
            .into_iter()
            .filter(|job| !by_id_jobs.iter().any(|seen| seen.id == job.id))
            .collect();
        Ok((by_id_jobs, named))
    }

    /// The jobs of `tenant` (every tenant's for `None`) named exactly `name` that are
    /// still going (queued, placed or running), at most `limit`, newest first: a name
    /// a file keeps across resubmits means the one of them still going.
    pub async fn active_jobs_named(
        &self,
        tenant: Option<&str>,
        name: &str,
        limit: usize,
    ) -> Result<Vec<JobRecord>, SchedulerError> {
        let active: Vec<String> = JobState::ALL
            .iter()
            .filter(|state| !state.is_terminal())
            .map(|state| format!("'{}'", state.name()))
            .collect();
        let sql = format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE name = $1 AND state IN ({}) {} \
             ORDER BY submit_sequence DESC LIMIT {limit}",
            active.join(", "),
            match tenant {
                Some(_) => "AND tenant = $2",
                None => "",
            }
        );
        Ok(with_pool!(self, pool => {
            let query = sqlx::query_as(&sql).bind(name);
            match tenant {
                Some(tenant) => query.bind(tenant).fetch_all(pool).await?,
                None => query.fetch_all(pool).await?,
            }
        }))
    }

    /// Rewrites a job by id: every column but its identity (`id`, `tenant`,
    /// `submit_sequence`, `idempotency_key`, `created_at_ms`), which never change.
    /// `NotFound` when there is no such job.
    pub async fn update_job(&self, job: &JobRecord) -> Result<(), SchedulerError> {
        // Fenced like placements: a deposed leader must not requeue or fail a job the
        // new leader placed (no check on an unfenced store).
        with_write_tx!(self, tx => {
            check_fence!(self, tx);
            update_job_row!(tx, job);
        });
        Ok(())
    }

    /// Every job in one of `states`, oldest (lowest `submit_sequence`) first: what the
    /// scheduling loop loads at start-up.
    pub async fn jobs_in_states(
        &self,
        states: &[JobState],
    ) -> Result<Vec<JobRecord>, SchedulerError> {
        if states.is_empty() {
            return Ok(Vec::new());
        }
        let args: Vec<Arg> = states
            .iter()
            .map(|state| Arg::Text(state.name().to_string()))
            .collect();
        let placeholders: Vec<String> = (1..=states.len()).map(|n| format!("${n}")).collect();
        let sql = format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE state IN ({}) ORDER BY submit_sequence",
            placeholders.join(", ")
        );
        Ok(with_pool!(self, pool => {
            bind_args!(sqlx::query_as(&sql), &args).fetch_all(pool).await?
        }))
    }

    /// Every queued job as the scheduling pass needs it (see [`QueuedJob`]), oldest
    /// (lowest `submit_sequence`) first.
    pub async fn queued_jobs_for_scheduling(&self) -> Result<Vec<QueuedJob>, SchedulerError> {
        let sql = "SELECT id, tenant, priority, submit_sequence, required_bytes, \
                   waiting_reason FROM jobs WHERE state = 'queued' ORDER BY submit_sequence";
        Ok(with_pool!(self, pool => {
            sqlx::query_as(sql).fetch_all(pool).await?
        }))
    }

    /// The queued jobs with `after < submit_sequence <= through`, as the scheduling pass
    /// needs them, oldest first: how the pass brings its copy of the queue up to date
    /// (`after` is what it read up to before, `through` the highest sequence of the
    /// queue's fingerprint), a range of the `(state, submit_sequence)` index.
    pub async fn queued_jobs_in_sequence_range(
        &self,
        after: i64,
        through: i64,
    ) -> Result<Vec<QueuedJob>, SchedulerError> {
        let sql = "SELECT id, tenant, priority, submit_sequence, required_bytes, \
                   waiting_reason FROM jobs WHERE state = 'queued' \
                   AND submit_sequence > $1 AND submit_sequence <= $2 ORDER BY submit_sequence";
        Ok(with_pool!(self, pool => {
            sqlx::query_as(sql).bind(after).bind(through).fetch_all(pool).await?
        }))
    }

    /// How many jobs are queued and the highest `submit_sequence` among them, from the
    /// `(state, submit_sequence)` index alone.
    pub async fn queue_fingerprint(&self) -> Result<QueueFingerprint, SchedulerError> {
        let sql = "SELECT count(*), coalesce(max(submit_sequence), 0) FROM jobs \
                   WHERE state = 'queued'";
        let (queued_jobs, highest_submit_sequence): (i64, i64) = with_pool!(self, pool => {
            sqlx::query_as(sql).fetch_one(pool).await?
        });
        Ok(QueueFingerprint {
            queued_jobs,
            highest_submit_sequence,
        })
    }

    /// The number of queued jobs of each tenant that has any, by tenant name.
    pub async fn queued_jobs_by_tenant(&self) -> Result<Vec<(String, i64)>, SchedulerError> {
        let sql = "SELECT tenant, count(*) FROM jobs WHERE state = 'queued' \
                   GROUP BY tenant ORDER BY tenant";
        Ok(with_pool!(self, pool => {
            sqlx::query_as(sql).fetch_all(pool).await?
        }))
    }

    /// How many of `tenant`'s jobs are in `state`, counted by the database (a tenant's
    /// view shows its queued jobs, which may be far more than a page).
    pub async fn count_jobs(&self, tenant: &str, state: JobState) -> Result<i64, SchedulerError> {
        let sql = "SELECT count(*) FROM jobs WHERE tenant = $1 AND state = $2";
        let (count,): (i64,) = with_pool!(self, pool => {
            sqlx::query_as(sql).bind(tenant).bind(state.name()).fetch_one(pool).await?
        });
        Ok(count)
    }

    /// Sets the waiting reason of each `(job id, reason)` whose job is still queued, in
    /// transactions of up to [`WAITING_REASONS_PER_TRANSACTION`] updates: a pass that
    /// explains a million waiting jobs costs a few hundred flushes, not a million, and
    /// does not hold the write lock (which submits need) for the whole of it. Within a
    /// transaction the jobs that get the same reason are updated together, one statement
    /// per [`WAITING_REASON_IDS_PER_STATEMENT`] of them (many jobs wait for the same
    /// reason), not one per job. Returns how many jobs were updated; ids that are unknown
    /// or no longer queued are skipped.
    pub async fn set_waiting_reasons(
        &self,
        reasons: &[(String, String)],
    ) -> Result<u64, SchedulerError> {
        let mut updated = 0;
        for chunk in reasons.chunks(WAITING_REASONS_PER_TRANSACTION) {
            // By reason, in the order each reason first appears; a job named twice gets
            // the last reason given for it, as with one update per pair.
            let mut last_reason: HashMap<&str, &str> = HashMap::with_capacity(chunk.len());
            for (job_id, reason) in chunk {
                last_reason.insert(job_id.as_str(), reason.as_str());
            }
            let mut reason_order: Vec<&str> = Vec::new();
            let mut ids_by_reason: HashMap<&str, Vec<&str>> = HashMap::new();
            for (job_id, _) in chunk {
                let Some(reason) = last_reason.remove(job_id.as_str()) else {
                    continue;
                };
                let ids = ids_by_reason.entry(reason).or_insert_with(|| {
                    reason_order.push(reason);
                    Vec::new()
                });
                ids.push(job_id.as_str());
            }
            updated += with_write_tx!(self, tx => {
                let mut updated_in_chunk = 0;
                for reason in &reason_order {
                    let ids = &ids_by_reason[reason];
                    for ids in ids.chunks(WAITING_REASON_IDS_PER_STATEMENT) {
                        let mut update = sqlx::QueryBuilder::new(
                            "UPDATE jobs SET waiting_reason = ",
                        );
                        // `state || ''` keeps SQLite's planner on the primary key: with
                        // `state = 'queued'` and no statistics it chose the (state,
                        // submit_sequence) index and scanned every queued job per
                        // statement (a million of them in the queue-memory bench).
                        update
                            .push_bind(reason.to_string())
                            .push(" WHERE id IN (");
                        let mut separated = update.separated(", ");
                        for id in ids {
                            separated.push_bind(id.to_string());
                        }
                        separated.push_unseparated(") AND state || '' = 'queued'");
                        updated_in_chunk += update.build().execute(&mut *tx).await?.rows_affected();
                    }
                }
                updated_in_chunk
            });
        }
        Ok(updated)
    }
}

/// The most job ids one waiting-reason `UPDATE` names (one parameter each).
pub const WAITING_REASON_IDS_PER_STATEMENT: usize = 500;
