//! Job log lines: what attempts wrote and the scheduler's notes about a job, appended in
//! groups (one transaction each), read in pages or as a tail, and trimmed to the newest
//! lines of each job; plus [`LogBatcher`], which gathers lines arriving one by one into
//! such groups.
//!
//! Sequences are per job, contiguous and increasing (1, 2, 3, ...): an append bumps the
//! job's row in `job_log_sequences` first, which also serializes appenders of one job
//! across scheduler replicas until the append commits.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::{Store, is_foreign_key_violation};
use crate::error::SchedulerError;

/// How many lines of one job the store keeps by default; appending more drops the oldest.
pub const MAX_LOG_LINES_PER_JOB: u64 = 10_000;

/// The page size of a read that does not choose one.
pub const DEFAULT_LOG_PAGE_SIZE: u32 = 1_000;

/// The most lines one read returns (larger page sizes and tails are capped to it).
pub const MAX_LOG_PAGE_SIZE: u32 = 10_000;

/// Levels a line may have (`NewLogLine::level`).
pub const LOG_LEVELS: &[&str] = &["error", "warn", "info", "debug"];

/// The streams a program's line may come from (`NewLogLine::stream`, or empty).
pub const LOG_STREAMS: &[&str] = &["stdout", "stderr"];

/// The most bytes of one line's message the store accepts.
pub const MAX_LOG_MESSAGE_BYTES: usize = 16 * 1024;

/// Rows per INSERT statement (lines: 8 parameters each; sequences: 2) stays far below
/// SQLite's limit of 32766 parameters per statement (and PostgreSQL's 65535).
const INSERT_CHUNK_ROWS: usize = 1_000;

/// A line to append; the store gives it its sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewLogLine {
    pub job_id: String,
    /// When the scheduler received it (ms since the Unix epoch).
    pub time_ms: i64,
    /// The attempt that wrote it; 0 for the scheduler's own notes.
    pub attempt_number: i64,
    /// One of [`LOG_LEVELS`].
    pub level: String,
    /// Without a trailing newline; at most [`MAX_LOG_MESSAGE_BYTES`].
    pub message: String,
    /// The event the line was made from, encoded (the wire's `JobEvent`), for a watch
    /// resumed from the store; `None` for a line that is only text.
    pub event: Option<Vec<u8>>,
    /// A command's program output: one of [`LOG_STREAMS`]; empty for other lines.
    pub stream: String,
}

impl NewLogLine {
    /// A line with its level and message made acceptable to the store, for text that
    /// comes from outside (a worker): the level lowercased, "warning" read as "warn" and
    /// anything else unknown as "info"; trailing newlines removed; a message over
    /// [`MAX_LOG_MESSAGE_BYTES`] cut at a character boundary and marked as cut.
    pub fn normalized(
        job_id: &str,
        time_ms: i64,
        attempt_number: i64,
        level: &str,
        message: &str,
    ) -> NewLogLine {
        let level = level.trim().to_ascii_lowercase();
        let level = match level.as_str() {
            "warning" => "warn".to_string(),
            known if LOG_LEVELS.contains(&known) => level,
            _ => "info".to_string(),
        };
        let message = message.trim_end_matches(['\n', '\r']);
        let message = if message.len() > MAX_LOG_MESSAGE_BYTES {
            const MARK: &str = " [cut]";
            let mut end = MAX_LOG_MESSAGE_BYTES - MARK.len();
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            format!("{}{MARK}", &message[..end])
        } else {
            message.to_string()
        };
        NewLogLine {
            job_id: job_id.to_string(),
            time_ms,
            attempt_number,
            level,
            message,
            event: None,
            stream: String::new(),
        }
    }

    /// The line marked as output of the program's `stream` (anything but
    /// [`LOG_STREAMS`] reads as none).
    pub fn from_stream(mut self, stream: &str) -> NewLogLine {
        self.stream = if LOG_STREAMS.contains(&stream) {
            stream.to_string()
        } else {
            String::new()
        };
        self
    }
}

/// A stored line.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct LogLineRecord {
    pub job_id: String,
    /// Increases from line to line of one job, starting at 1.
    pub sequence: i64,
    pub time_ms: i64,
    pub attempt_number: i64,
    pub level: String,
    pub message: String,
    /// "stdout" or "stderr" for a command's program output; empty otherwise.
    pub stream: String,
}

/// Which lines of a job to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogQuery {
    pub job_id: String,
    /// Only this attempt's lines; `None` for every attempt and the scheduler's notes.
    pub attempt_number: Option<i64>,
    /// Only lines with a larger sequence (0 for the first page). Ignored with a tail.
    pub after_sequence: i64,
    /// The most lines to return: 0 means [`DEFAULT_LOG_PAGE_SIZE`]; capped at
    /// [`MAX_LOG_PAGE_SIZE`]. Ignored with a tail.
    pub page_size: u32,
    /// Only the last this many lines (after the attempt filter), capped at
    /// [`MAX_LOG_PAGE_SIZE`]; `None` or 0 means no tail.
    pub tail: Option<u32>,
}

/// A stored line as a resumed watch reads it: the line and the event it was made from.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredJobEvent {
    pub sequence: i64,
    pub time_ms: i64,
    pub attempt_number: i64,
    pub level: String,
    pub message: String,
    /// `NewLogLine::event`.
    pub event: Option<Vec<u8>>,
    /// `NewLogLine::stream`.
    pub stream: String,
}

/// One page of lines, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogPage {
    pub lines: Vec<LogLineRecord>,
    /// Whether lines after the last one returned exist now (never with a tail, which
    /// ends at the newest line).
    pub more: bool,
}

const LOG_COLUMNS: &str = "job_id, sequence, time_ms, attempt_number, level, message, stream";

/// The columns an append writes.
const APPEND_COLUMNS: &str =
    "job_id, sequence, time_ms, attempt_number, level, message, event, stream";

impl Store {
    /// Appends `lines` in ONE transaction and keeps the newest [`MAX_LOG_LINES_PER_JOB`]
    /// lines of each job they touch. See [`Store::append_log_lines_keeping`].
    pub async fn append_log_lines(&self, lines: &[NewLogLine]) -> Result<(), SchedulerError> {
        self.append_log_lines_keeping(lines, MAX_LOG_LINES_PER_JOB)
            .await
    }

    /// Appends `lines` in ONE transaction: each job's lines get the job's next sequences
    /// in the order given, and afterwards only the newest `keep_per_job` lines of each
    /// job remain. All or nothing: `NotFound` when a line names a job that does not exist,
    /// `InvalidArgument` (naming `lines[i].field`) for a level not in [`LOG_LEVELS`], a
    /// negative attempt number or a message over [`MAX_LOG_MESSAGE_BYTES`], or for a
    /// `keep_per_job` of 0.
    pub async fn append_log_lines_keeping(
        &self,
        lines: &[NewLogLine],
        keep_per_job: u64,
    ) -> Result<(), SchedulerError> {
        if keep_per_job == 0 {
            return Err(SchedulerError::invalid_argument(
                "keep_per_job",
                "must be at least 1",
            ));
        }
        let keep_per_job = i64::try_from(keep_per_job).unwrap_or(i64::MAX);
        for (index, line) in lines.iter().enumerate() {
            check_line(index, line)?;
        }
        // By job id, so that appenders always lock the jobs' sequence rows in the same
        // order and two appends never deadlock on PostgreSQL.
        let mut by_job: BTreeMap<&str, Vec<&NewLogLine>> = BTreeMap::new();
        for line in lines {
            by_job.entry(line.job_id.as_str()).or_default().push(line);
        }
        if by_job.is_empty() {
            return Ok(());
        }
        let result: Result<(), sqlx::Error> = async {
            with_write_tx!(self, tx => {
                // A constant number of statements per group, not two per job: each is a
                // round trip (to sqlx-sqlite's connection thread, or to PostgreSQL) made
                // while holding the write lock that submits need.
                let jobs: Vec<(&str, i64)> = by_job
                    .iter()
                    .map(|(job_id, job_lines)| (*job_id, job_lines.len() as i64))
                    .collect();
                let mut last_sequences: HashMap<String, i64> = HashMap::with_capacity(jobs.len());
                for chunk in jobs.chunks(INSERT_CHUNK_ROWS) {
                    let mut upsert = sqlx::QueryBuilder::new(
                        "INSERT INTO job_log_sequences (job_id, last_sequence) ",
                    );
                    upsert.push_values(chunk, |mut row, (job_id, count)| {
                        row.push_bind(job_id.to_string()).push_bind(*count);
                    });
                    upsert.push(
                        " ON CONFLICT (job_id) DO UPDATE SET \
                         last_sequence = job_log_sequences.last_sequence + excluded.last_sequence \
                         RETURNING job_id, last_sequence",
                    );
                    let rows: Vec<(String, i64)> =
                        upsert.build_query_as().fetch_all(&mut *tx).await?;
                    last_sequences.extend(rows);
                }
                let mut numbered: Vec<(&NewLogLine, i64)> = Vec::with_capacity(lines.len());
                for (job_id, job_lines) in &by_job {
                    let last_sequence = *last_sequences.get(*job_id).ok_or_else(|| {
                        sqlx::Error::Protocol(format!(
                            "the log sequence of job {job_id} was not returned"
                        ))
                    })?;
                    let first_sequence = last_sequence - job_lines.len() as i64 + 1;
                    numbered.extend(
                        job_lines
                            .iter()
                            .enumerate()
                            .map(|(offset, line)| (*line, first_sequence + offset as i64)),
                    );
                }
                for chunk in numbered.chunks(INSERT_CHUNK_ROWS) {
                    let mut insert = sqlx::QueryBuilder::new(format!(
                        "INSERT INTO job_log_lines ({APPEND_COLUMNS}) "
                    ));
                    insert.push_values(chunk, |mut row, (line, sequence)| {
                        row.push_bind(line.job_id.clone())
                            .push_bind(*sequence)
                            .push_bind(line.time_ms)
                            .push_bind(line.attempt_number)
                            .push_bind(line.level.clone())
                            .push_bind(line.message.clone())
                            .push_bind(line.event.clone())
                            .push_bind(line.stream.clone());
                    });
                    insert.build().execute(&mut *tx).await?;
                }
                for (job_id, _) in &jobs {
                    let last_sequence = last_sequences.get(*job_id).copied().unwrap_or(0);
                    if last_sequence > keep_per_job {
                        sqlx::query(
                            "DELETE FROM job_log_lines WHERE job_id = $1 AND sequence <= $2",
                        )
                        .bind(*job_id)
                        .bind(last_sequence - keep_per_job)
                        .execute(&mut *tx)
                        .await?;
                    }
                }
            });
            Ok(())
        }
        .await;
        match result {
            Ok(()) => Ok(()),
            Err(error) if is_foreign_key_violation(&error) => {
                let job_ids: Vec<&str> = by_job.keys().copied().collect();
                Err(if job_ids.len() == 1 {
                    SchedulerError::not_found("job", job_ids[0])
                } else {
                    SchedulerError::not_found("job", format!("(one of {})", job_ids.join(", ")))
                })
            }
            Err(error) => Err(error.into()),
        }
    }

    /// Reads lines of a job, oldest first: the page after `after_sequence`, or the tail.
    /// A job without lines, or one that does not exist, has an empty page (the caller
    /// checks that the job exists and may be seen).
    pub async fn read_log_lines(&self, query: &LogQuery) -> Result<LogPage, SchedulerError> {
        if query.after_sequence < 0 {
            return Err(SchedulerError::invalid_argument(
                "after_sequence",
                format!("must not be negative, got {}", query.after_sequence),
            ));
        }
        // 0 stands for "every attempt" in the SQL below; attempt 0 itself (the notes)
        // cannot be asked for alone.
        let attempt_filter = match query.attempt_number {
            Some(attempt) if attempt < 0 => {
                return Err(SchedulerError::invalid_argument(
                    "attempt_number",
                    format!("must not be negative, got {attempt}"),
                ));
            }
            Some(attempt) => attempt,
            None => 0,
        };
        if let Some(tail) = query.tail.filter(|tail| *tail > 0) {
            let tail = i64::from(tail.min(MAX_LOG_PAGE_SIZE));
            let sql = format!(
                "SELECT {LOG_COLUMNS} FROM job_log_lines \
                 WHERE job_id = $1 AND ($2 = 0 OR attempt_number = $2) \
                 ORDER BY sequence DESC LIMIT $3"
            );
            let mut lines: Vec<LogLineRecord> = with_pool!(self, pool => {
                sqlx::query_as(&sql)
                    .bind(&query.job_id)
                    .bind(attempt_filter)
                    .bind(tail)
                    .fetch_all(pool)
                    .await?
            });
            lines.reverse();
            return Ok(LogPage { lines, more: false });
        }
        let page_size = match query.page_size {
            0 => DEFAULT_LOG_PAGE_SIZE,
            size => size.min(MAX_LOG_PAGE_SIZE),
        } as usize;
        let sql = format!(
            "SELECT {LOG_COLUMNS} FROM job_log_lines \
             WHERE job_id = $1 AND sequence > $2 AND ($3 = 0 OR attempt_number = $3) \
             ORDER BY sequence LIMIT $4"
        );
        // One line more than the page tells whether another page exists.
        let mut lines: Vec<LogLineRecord> = with_pool!(self, pool => {
            sqlx::query_as(&sql)
                .bind(&query.job_id)
                .bind(query.after_sequence)
                .bind(attempt_filter)
                .bind(page_size as i64 + 1)
                .fetch_all(pool)
                .await?
        });
        let more = lines.len() > page_size;
        lines.truncate(page_size);
        Ok(LogPage { lines, more })
    }
}

impl Store {
    /// Up to `limit` stored lines of a job after `after_sequence`, oldest first, each with
    /// the event it was made from: what a resumed watch replays.
    pub async fn read_job_events(
        &self,
        job_id: &str,
        after_sequence: i64,
        limit: u32,
    ) -> Result<Vec<StoredJobEvent>, SchedulerError> {
        Ok(with_pool!(self, pool => {
            sqlx::query_as(
                "SELECT sequence, time_ms, attempt_number, level, message, event, stream \
                 FROM job_log_lines WHERE job_id = $1 AND sequence > $2 \
                 ORDER BY sequence LIMIT $3",
            )
            .bind(job_id)
            .bind(after_sequence)
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?
        }))
    }

    /// The sequence of the job's last stored line (0 before its first).
    pub async fn last_log_sequence(&self, job_id: &str) -> Result<i64, SchedulerError> {
        let last: Option<i64> = with_pool!(self, pool => {
            sqlx::query_scalar("SELECT last_sequence FROM job_log_sequences WHERE job_id = $1")
                .bind(job_id)
                .fetch_optional(pool)
                .await?
        });
        Ok(last.unwrap_or(0))
    }
}

fn check_line(index: usize, line: &NewLogLine) -> Result<(), SchedulerError> {
    if !LOG_LEVELS.contains(&line.level.as_str()) {
        return Err(SchedulerError::invalid_argument(
            format!("lines[{index}].level"),
            format!("{:?} is not one of {}", line.level, LOG_LEVELS.join(", ")),
        ));
    }
    if line.attempt_number < 0 {
        return Err(SchedulerError::invalid_argument(
            format!("lines[{index}].attempt_number"),
            format!("must not be negative, got {}", line.attempt_number),
        ));
    }
    if !line.stream.is_empty() && !LOG_STREAMS.contains(&line.stream.as_str()) {
        return Err(SchedulerError::invalid_argument(
            format!("lines[{index}].stream"),
            format!(
                "{:?} is not one of {} (or empty)",
                line.stream,
                LOG_STREAMS.join(", ")
            ),
        ));
    }
    if line.message.len() > MAX_LOG_MESSAGE_BYTES {
        return Err(SchedulerError::invalid_argument(
            format!("lines[{index}].message"),
            format!(
                "is {} bytes long; the limit is {MAX_LOG_MESSAGE_BYTES}",
                line.message.len()
            ),
        ));
    }
    Ok(())
}

/// How a [`LogBatcher`] groups lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogBatcherSettings {
    /// The longest a line waits for others before its group is written.
    pub flush_interval: Duration,
    /// A group is written as soon as it has this many lines.
    pub max_group: usize,
    /// Lines waiting to be written beyond this many are dropped (and counted), so a slow
    /// database never makes the scheduler wait on logs or grow without bound.
    pub capacity: usize,
    /// Lines of one job the store keeps.
    pub keep_per_job: u64,
}

impl Default for LogBatcherSettings {
    fn default() -> Self {
        LogBatcherSettings {
            flush_interval: Duration::from_millis(150),
            max_group: 2_000,
            capacity: 100_000,
            keep_per_job: MAX_LOG_LINES_PER_JOB,
        }
    }
}

enum LogCommand {
    Line(NewLogLine),
    /// Answered once every line sent before it has been written (or given up on).
    Flush(oneshot::Sender<()>),
}

#[derive(Debug, Default)]
struct LogCounters {
    lines_stored: AtomicU64,
    lines_dropped: AtomicU64,
}

/// Gathers log lines, which arrive one at a time from worker sessions and the
/// scheduler's decisions, into groups written with one [`Store::append_log_lines_keeping`]
/// each: a group is written when its first line has waited `flush_interval`, when it has
/// `max_group` lines, or when someone asks for a [`LogBatcher::flush`].
///
/// Log lines are best effort, unlike jobs: [`LogBatcher::append`] never waits, a line
/// sent when `capacity` lines are already waiting is dropped, and lines not yet written
/// when the process dies (at most `flush_interval` worth, ~150 ms by default) are lost.
/// A graceful shutdown flushes them. A group the database refuses is retried job by job,
/// so a line naming a job that does not exist loses only that job's lines.
///
/// Clones share the task, which ends after the last clone is dropped and every line
/// sent is written.
#[derive(Debug, Clone)]
pub struct LogBatcher {
    sender: mpsc::Sender<LogCommand>,
    counters: Arc<LogCounters>,
}

impl LogBatcher {
    /// Starts the batching task on the current tokio runtime with default settings.
    pub fn spawn(store: Store) -> LogBatcher {
        LogBatcher::spawn_with(store, LogBatcherSettings::default())
    }

    /// Starts the batching task on the current tokio runtime.
    pub fn spawn_with(store: Store, settings: LogBatcherSettings) -> LogBatcher {
        let (sender, receiver) = mpsc::channel(settings.capacity.max(1));
        let counters = Arc::new(LogCounters::default());
        tokio::spawn(run(store, receiver, settings, Arc::clone(&counters)));
        LogBatcher { sender, counters }
    }

    /// Queues a line to be written; never waits. A line that does not fit the queue is
    /// dropped and counted in [`LogBatcher::lines_dropped`].
    pub fn append(&self, line: NewLogLine) {
        if self.sender.try_send(LogCommand::Line(line)).is_err() {
            let dropped = self.counters.lines_dropped.fetch_add(1, Ordering::Relaxed) + 1;
            // Once, then at every power of two: a flood of drops must not flood the log.
            if dropped.is_power_of_two() {
                tracing::warn!(dropped, "log lines dropped: the log writer is behind");
            }
        }
    }

    /// Returns once every line appended before the call has been written (or dropped
    /// because the database refused it), so a reader that flushes first sees them.
    pub async fn flush(&self) {
        let (reply, written) = oneshot::channel();
        if self.sender.send(LogCommand::Flush(reply)).await.is_ok() {
            let _ = written.await;
        }
    }

    /// Lines written to the store so far.
    pub fn lines_stored(&self) -> u64 {
        self.counters.lines_stored.load(Ordering::Relaxed)
    }

    /// Lines given up on so far: the queue was full, or the database refused them.
    pub fn lines_dropped(&self) -> u64 {
        self.counters.lines_dropped.load(Ordering::Relaxed)
    }
}

async fn run(
    store: Store,
    mut receiver: mpsc::Receiver<LogCommand>,
    settings: LogBatcherSettings,
    counters: Arc<LogCounters>,
) {
    let max_group = settings.max_group.max(1);
    let mut commands = Vec::new();
    let mut lines = Vec::new();
    let mut flushes = Vec::new();
    while receiver.recv_many(&mut commands, max_group).await > 0 {
        let deadline = tokio::time::Instant::now() + settings.flush_interval;
        loop {
            for command in commands.drain(..) {
                match command {
                    LogCommand::Line(line) => lines.push(line),
                    LogCommand::Flush(reply) => flushes.push(reply),
                }
            }
            if !flushes.is_empty() || lines.len() >= max_group {
                break;
            }
            let more = receiver.recv_many(&mut commands, max_group - lines.len());
            match tokio::time::timeout_at(deadline, more).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        write_group(&store, &mut lines, settings.keep_per_job, &counters).await;
        for reply in flushes.drain(..) {
            let _ = reply.send(());
        }
    }
}

async fn write_group(
    store: &Store,
    lines: &mut Vec<NewLogLine>,
    keep_per_job: u64,
    counters: &LogCounters,
) {
    if lines.is_empty() {
        return;
    }
    let group = std::mem::take(lines);
    match store.append_log_lines_keeping(&group, keep_per_job).await {
        Ok(()) => {
            counters
                .lines_stored
                .fetch_add(group.len() as u64, Ordering::Relaxed);
        }
        Err(error) => {
            tracing::warn!(%error, lines = group.len(), "writing log lines failed; retrying job by job");
            let mut by_job: BTreeMap<String, Vec<NewLogLine>> = BTreeMap::new();
            for line in group {
                by_job.entry(line.job_id.clone()).or_default().push(line);
            }
            for (job_id, job_lines) in by_job {
                let count = job_lines.len() as u64;
                match store
                    .append_log_lines_keeping(&job_lines, keep_per_job)
                    .await
                {
                    Ok(()) => {
                        counters.lines_stored.fetch_add(count, Ordering::Relaxed);
                    }
                    Err(error) => {
                        counters.lines_dropped.fetch_add(count, Ordering::Relaxed);
                        tracing::warn!(job = %job_id, %error, lines = count, "log lines dropped");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{MAX_LOG_MESSAGE_BYTES, NewLogLine};

    #[test]
    fn lines_from_outside_are_normalized_for_the_store() {
        let line = NewLogLine::normalized("j", 5, 2, " WARNING ", "disk slow\r\n");
        assert_eq!(
            line,
            NewLogLine {
                job_id: "j".into(),
                time_ms: 5,
                attempt_number: 2,
                level: "warn".into(),
                message: "disk slow".into(),
                event: None,
                stream: String::new(),
            }
        );
        let marked = NewLogLine::normalized("j", 5, 2, "warn", "x");
        assert_eq!(marked.clone().from_stream("stderr").stream, "stderr");
        assert_eq!(marked.from_stream("/dev/tty").stream, "");
        assert_eq!(
            NewLogLine::normalized("j", 0, 1, "Error", "x").level,
            "error"
        );
        assert_eq!(
            NewLogLine::normalized("j", 0, 1, "trace", "x").level,
            "info"
        );
        assert_eq!(NewLogLine::normalized("j", 0, 1, "", "x").level, "info");
        // A long message is cut at a character boundary, within the limit, and marked.
        let long = "é".repeat(MAX_LOG_MESSAGE_BYTES);
        let cut = NewLogLine::normalized("j", 0, 1, "info", &long).message;
        assert!(cut.len() <= MAX_LOG_MESSAGE_BYTES, "{}", cut.len());
        assert!(cut.ends_with(" [cut]"));
        assert!(cut.trim_end_matches(" [cut]").chars().all(|c| c == 'é'));
        let exact = "a".repeat(MAX_LOG_MESSAGE_BYTES);
        assert_eq!(
            NewLogLine::normalized("j", 0, 1, "info", &exact).message,
            exact
        );
    }
}
