//! How typed values are read from and written to their columns: the row boundary.
//!
//! Every typed column is text, read through [`TextColumn`]: state columns (a job's
//! state and kind, an attempt's outcome, a worker's state, a token's role) hold the
//! lowercase `name()` of their enum; the out-of-memory report is JSON, read through a private serde
//! struct whose numbers are all required. A value this build cannot read fails the row's
//! decoding with the column and the value, which the scheduler's error turns into a
//! "corrupt row" error: never a default state or a report of zero bytes.

use carve_core::FieldError;
use carve_core::allocator::OutOfMemory;
use carve_core::command::memory_model::ProfilePoint;
use carve_core::command::metrics::Metric;
use carve_core::command::oom::OomSource;
use serde::{Deserialize, Serialize};
use sqlx::error::BoxDynError;
use sqlx::{ColumnIndex, Database, Decode, FromRow, Row, Type};

use super::records::{AttemptOutcome, JobKind, JobRecord, JobState, Role, WorkerState};

/// A value read from a text column (`None`: NULL).
pub(crate) trait FromColumnText: Sized {
    fn from_column_text(text: Option<&str>) -> Result<Self, FieldError>;
}

/// A typed column as read. The records take the value out
/// (`#[sqlx(try_from = "TextColumn<...>")]`).
pub(crate) struct TextColumn<T>(T);

impl<DB: Database, T> Type<DB> for TextColumn<T>
where
    String: Type<DB>,
{
    fn type_info() -> DB::TypeInfo {
        <String as Type<DB>>::type_info()
    }

    fn compatible(type_info: &DB::TypeInfo) -> bool {
        <String as Type<DB>>::compatible(type_info)
    }
}

impl<'r, DB: Database, T: FromColumnText> Decode<'r, DB> for TextColumn<T>
where
    Option<String>: Decode<'r, DB>,
{
    fn decode(value: <DB as Database>::ValueRef<'r>) -> Result<Self, BoxDynError> {
        let text = <Option<String> as Decode<'r, DB>>::decode(value)?;
        Ok(TextColumn(T::from_column_text(text.as_deref())?))
    }
}

/// [`FromColumnText`] for `Option<OutOfMemory>` and enums stored by name (through their
/// `TryFrom<&str>`), and the way out of [`TextColumn`].
macro_rules! text_columns {
    ($($type:ty),* $(,)?) => {$(
        impl From<TextColumn<$type>> for $type {
            fn from(column: TextColumn<$type>) -> Self {
                column.0
            }
        }
    )*};
}

text_columns!(
    JobState,
    JobKind,
    AttemptOutcome,
    WorkerState,
    Role,
    Option<OutOfMemory>,
    Option<OomSource>,
    Vec<String>,
    Vec<ProfilePoint>,
    Vec<Metric>
);

macro_rules! stored_by_name {
    ($($type:ty),* $(,)?) => {$(
        impl FromColumnText for $type {
            fn from_column_text(text: Option<&str>) -> Result<Self, FieldError> {
                <$type>::try_from(text.ok_or_else(|| FieldError::new("", "is NULL"))?)
            }
        }
    )*};
}

stored_by_name!(JobState, JobKind, AttemptOutcome, WorkerState, Role);

/// A job from its row, by column name. A value that cannot be read (a state or kind this
/// build does not know, a NULL) is a decode error naming the column and the job's id, so
/// the "corrupt row" error says which job to look at: `column "kind" of job "job-1":
/// "batch" is not a job kind (model, command)`.
impl<'r, R> FromRow<'r, R> for JobRecord
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
    TextColumn<JobState>: Decode<'r, R::Database> + Type<R::Database>,
    TextColumn<JobKind>: Decode<'r, R::Database> + Type<R::Database>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        let id: String = row.try_get("id")?;
        let of_this_job = |error: sqlx::Error| match error {
            sqlx::Error::ColumnDecode { index, source } => sqlx::Error::ColumnDecode {
                index: format!("{index} of job {id:?}"),
                source,
            },
            other => other,
        };
        let state: TextColumn<JobState> = row.try_get("state").map_err(of_this_job)?;
        let kind: TextColumn<JobKind> = row.try_get("kind").map_err(of_this_job)?;
        Ok(JobRecord {
            tenant: row.try_get("tenant").map_err(of_this_job)?,
            name: row.try_get("name").map_err(of_this_job)?,
            kind: kind.into(),
            spec_json: row.try_get("spec_json").map_err(of_this_job)?,
            state: state.into(),
            priority: row.try_get("priority").map_err(of_this_job)?,
            submit_sequence: row.try_get("submit_sequence").map_err(of_this_job)?,
            idempotency_key: row.try_get("idempotency_key").map_err(of_this_job)?,
            config_json: row.try_get("config_json").map_err(of_this_job)?,
            estimate_json: row.try_get("estimate_json").map_err(of_this_job)?,
            required_bytes: row.try_get("required_bytes").map_err(of_this_job)?,
            waiting_reason: row.try_get("waiting_reason").map_err(of_this_job)?,
            message: row.try_get("message").map_err(of_this_job)?,
            created_at_ms: row.try_get("created_at_ms").map_err(of_this_job)?,
            finished_at_ms: row.try_get("finished_at_ms").map_err(of_this_job)?,
            checkpoint_location: row.try_get("checkpoint_location").map_err(of_this_job)?,
            checkpoint_step: row.try_get("checkpoint_step").map_err(of_this_job)?,
            attempts_count: row.try_get("attempts_count").map_err(of_this_job)?,
            id,
        })
    }
}

impl FromColumnText for Option<OutOfMemory> {
    fn from_column_text(text: Option<&str>) -> Result<Self, FieldError> {
        text.map(oom_from_json).transpose()
    }
}

/// Who detected an attempt's out-of-memory, by [`OomSource::name`]; '' (or NULL, in rows
/// from before the column) for none.
impl FromColumnText for Option<OomSource> {
    fn from_column_text(text: Option<&str>) -> Result<Self, FieldError> {
        match text {
            None | Some("") => Ok(None),
            Some(name) => OomSource::from_name(name).map(Some),
        }
    }
}

/// A command job's rendered argv, a JSON list of strings; '' (or NULL) for none.
impl FromColumnText for Vec<String> {
    fn from_column_text(text: Option<&str>) -> Result<Self, FieldError> {
        json_list_from_column(text, "an argv (a JSON list of strings)")
    }
}

/// A command job's metrics, a JSON list of `Metric`s (name and value); '' (or NULL) for
/// none.
impl FromColumnText for Vec<Metric> {
    fn from_column_text(text: Option<&str>) -> Result<Self, FieldError> {
        json_list_from_column(text, "metrics (a JSON list)")
    }
}

/// A profile's points, a JSON list of `ProfilePoint`s; '' (or NULL) for none.
impl FromColumnText for Vec<ProfilePoint> {
    fn from_column_text(text: Option<&str>) -> Result<Self, FieldError> {
        json_list_from_column(text, "profile points (a JSON list)")
    }
}

fn json_list_from_column<T: serde::de::DeserializeOwned>(
    text: Option<&str>,
    what: &str,
) -> Result<Vec<T>, FieldError> {
    match text {
        None | Some("") => Ok(Vec::new()),
        Some(text) => serde_json::from_str(text)
            .map_err(|error| FieldError::new("", format!("is not {what}: {error}"))),
    }
}

/// The text a list column holds (see the [`FromColumnText`] of `Vec<String>` and
/// `Vec<ProfilePoint>`): '' for an empty list, else JSON.
pub(super) fn json_list_column<T: Serialize>(items: &[T]) -> String {
    if items.is_empty() {
        return String::new();
    }
    // A list of strings or of plain numbers and booleans always serialises.
    serde_json::to_string(items).unwrap_or_default()
}

/// The text [`Option<OomSource>`]'s column holds (see its [`FromColumnText`]).
pub(super) fn oom_detector_column(detector: Option<OomSource>) -> &'static str {
    detector.map_or("", OomSource::name)
}

/// By [`WorkerState::name`].
impl TryFrom<&str> for WorkerState {
    type Error = FieldError;

    fn try_from(name: &str) -> Result<Self, FieldError> {
        WorkerState::ALL
            .into_iter()
            .find(|state| state.name() == name)
            .ok_or_else(|| {
                let names = WorkerState::ALL.map(WorkerState::name);
                FieldError::not_one_of(name, "a worker state", &names)
            })
    }
}

/// By [`Role::name`].
impl TryFrom<&str> for Role {
    type Error = FieldError;

    fn try_from(name: &str) -> Result<Self, FieldError> {
        Role::from_name(name)
            .ok_or_else(|| FieldError::not_one_of(name, "a role", &Role::ALL.map(Role::name)))
    }
}

/// An out-of-memory report as its column stores it, keys in alphabetical order as the
/// text has always been written.
#[derive(Debug, Serialize, Deserialize)]
struct StoredOutOfMemory {
    in_use_bytes: u64,
    largest_free_bytes: u64,
    limit_bytes: u64,
    peak_bytes: u64,
    requested_bytes: u64,
}

fn oom_from_json(text: &str) -> Result<OutOfMemory, FieldError> {
    let stored: StoredOutOfMemory = serde_json::from_str(text).map_err(|error| {
        FieldError::new(
            "",
            format!("{text:?} is not an out-of-memory report: {error}"),
        )
    })?;
    Ok(OutOfMemory {
        requested: stored.requested_bytes,
        in_use: stored.in_use_bytes,
        limit: stored.limit_bytes,
        largest_free: stored.largest_free_bytes,
        peak: stored.peak_bytes,
    })
}

/// An out-of-memory report as the `oom_json` column stores it.
pub(crate) fn oom_to_json(report: &OutOfMemory) -> String {
    let stored = StoredOutOfMemory {
        in_use_bytes: report.in_use,
        largest_free_bytes: report.largest_free,
        limit_bytes: report.limit,
        peak_bytes: report.peak,
        requested_bytes: report.requested,
    };
    // Five numbers: serializing them cannot fail.
    serde_json::to_string(&stored).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use carve_proto::ApiError;

    use super::*;
    use crate::error::SchedulerError;
    use crate::store::{AttemptRecord, JobRecord, Store, TenantRecord};

    /// Writes `sql` as it is, past the store's typed writes: what another version, a
    /// hand edit or a broken disk may leave in a row.
    async fn corrupt(store: &Store, sql: &str) {
        with_pool!(store, pool => {
            sqlx::query(sql).execute(pool).await.unwrap();
        });
    }

    /// `error` is the corrupt-row error of `column`, saying `says` of its value.
    fn assert_corrupt_row(error: SchedulerError, column: &str, says: &str) {
        let SchedulerError::Api(ApiError::Internal(message)) = error else {
            panic!("expected an internal error, got {error:?}");
        };
        assert!(
            message.starts_with("corrupt row: column ")
                && message.contains(column)
                && message.contains(says),
            "{message}"
        );
    }

    #[tokio::test]
    async fn a_corrupt_state_or_oom_report_reads_back_as_an_error() {
        let store = Store::open("sqlite::memory:").await.unwrap();
        store
            .create_tenant(&TenantRecord {
                name: "acme".into(),
                vram_quota_bytes: None,
                max_running_jobs: None,
                fair_share_weight: 1,
                created_at_ms: 0,
            })
            .await
            .unwrap();
        let job = JobRecord {
            id: "j".into(),
            tenant: "acme".into(),
            name: "j".into(),
            kind: JobKind::Model,
            spec_json: "{}".into(),
            state: JobState::Queued,
            priority: 0,
            submit_sequence: 0,
            idempotency_key: None,
            config_json: "{}".into(),
            estimate_json: "{}".into(),
            required_bytes: 1,
            waiting_reason: String::new(),
            message: String::new(),
            created_at_ms: 0,
            finished_at_ms: None,
            checkpoint_location: None,
            checkpoint_step: 0,
            attempts_count: 1,
        };
        store.submit_jobs(vec![job]).await.unwrap();
        let report = OutOfMemory {
            requested: 4096,
            in_use: 1024,
            limit: 2048,
            largest_free: 512,
            peak: 1536,
        };
        let attempt = AttemptRecord {
            job_id: "j".into(),
            attempt_number: 1,
            config_json: "{}".into(),
            estimate_bytes: 1,
            slice_bytes: 1,
            worker_id: "w".into(),
            gpu_id: "g".into(),
            lease_epoch: 1,
            outcome: AttemptOutcome::OutOfMemory,
            measured_peak_bytes: None,
            oom: Some(report),
            message: String::new(),
            resumed_from: None,
            resumed_from_step: 0,
            started_at_ms: 0,
            finished_at_ms: None,
            results: Default::default(),
            details: Default::default(),
        };
        store.create_attempt(&attempt).await.unwrap();
        assert_eq!(store.list_attempts("j").await.unwrap(), vec![attempt]);

        corrupt(&store, "UPDATE jobs SET state = 'sleeping'").await;
        let error = store.get_job("j").await.unwrap_err();
        assert_corrupt_row(error, "state", "\"sleeping\" is not a job state");
        // A kind this build does not know is not a model job.
        corrupt(
            &store,
            "UPDATE jobs SET state = 'queued', kind = 'distributed'",
        )
        .await;
        let error = store.get_job("j").await.unwrap_err();
        assert_corrupt_row(
            error,
            "\"kind\" of job \"j\"",
            "\"distributed\" is not a job kind (model, command)",
        );
        corrupt(&store, "UPDATE jobs SET kind = 'model'").await;

        // Numbers missing or of the wrong kind are not zeros.
        for report in [
            r#"{"requested_bytes":4096}"#,
            r#"{"requested_bytes":"x","in_use_bytes":1,"limit_bytes":1,"largest_free_bytes":1,"peak_bytes":1}"#,
            "not json",
        ] {
            corrupt(
                &store,
                &format!("UPDATE attempts SET oom_json = '{report}'"),
            )
            .await;
            let error = store.list_attempts("j").await.unwrap_err();
            assert_corrupt_row(error, "oom_json", "is not an out-of-memory report");
        }

        corrupt(
            &store,
            "UPDATE attempts SET oom_json = NULL, outcome = 'exploded'",
        )
        .await;
        let error = store.list_attempts("j").await.unwrap_err();
        assert_corrupt_row(error, "outcome", "\"exploded\" is not an attempt outcome");
    }

    #[test]
    fn an_oom_report_reads_back_as_it_was_written() {
        let report = OutOfMemory {
            requested: 1,
            in_use: 2,
            limit: 3,
            largest_free: 4,
            peak: 5,
        };
        let text = oom_to_json(&report);
        assert_eq!(
            text,
            r#"{"in_use_bytes":2,"largest_free_bytes":4,"limit_bytes":3,"peak_bytes":5,"requested_bytes":1}"#
        );
        assert_eq!(oom_from_json(&text), Ok(report));
    }

    #[test]
    fn worker_states_and_roles_read_back_by_name() {
        for state in WorkerState::ALL {
            assert_eq!(WorkerState::try_from(state.name()), Ok(state));
        }
        for role in Role::ALL {
            assert_eq!(Role::try_from(role.name()), Ok(role));
        }
        assert!(WorkerState::try_from("asleep").is_err());
        assert!(Role::try_from("root").is_err());
    }
}
