//! `carve logs JOB`: a job's stored log lines (attempt output and the scheduler's notes)
//! through `JobService.GetJobLogs`, page after page; with `--follow`, new lines as they
//! arrive until the job ends.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use carve_proto::v1;

use super::connection::{Connection, ConnectionOptions};
use super::failure::{ClientFailure, FailureKind};
use super::output::{is_terminal, timestamp_text};

/// How often `--follow` asks for new lines.
const FOLLOW_INTERVAL: Duration = Duration::from_millis(500);

/// The page size asked for: the server's cap.
const PAGE_SIZE: u32 = 10_000;

#[derive(Debug, clap::Args)]
pub struct LogsArguments {
    /// The job: its id, a unique prefix of it, or the job's name.
    job: String,
    /// Only this attempt's lines (which leaves out the scheduler's own notes).
    #[arg(long, value_name = "N")]
    attempt: Option<u32>,
    /// Only the last N lines.
    #[arg(long, value_name = "N")]
    tail: Option<u32>,
    /// Keep printing new lines until the job ends.
    #[arg(short, long)]
    follow: bool,
    #[command(flatten)]
    connection: ConnectionOptions,
}

fn print_line(line: &v1::JobLogLine) {
    let source = if line.attempt_number == 0 {
        "scheduler".to_string()
    } else {
        format!("attempt {}", line.attempt_number)
    };
    // A program's line says its stream (stdout, stderr); other lines their level.
    let kind = if line.stream.is_empty() {
        &line.level
    } else {
        &line.stream
    };
    println!(
        "{} {source} {kind}: {}",
        timestamp_text(line.time.as_ref()),
        line.message
    );
}

/// Asks for one page; UNIMPLEMENTED (a scheduler without log storage) says so plainly.
async fn fetch_page(
    connection: &Connection,
    request: v1::GetJobLogsRequest,
) -> Result<v1::GetJobLogsResponse> {
    let job_id = request.job_id.clone();
    connection
        .retrying(|connection| {
            let request = request.clone();
            async move { connection.jobs().get_job_logs(request).await }
        })
        .await
        .map_err(|status| {
            if status.code() == tonic::Code::Unimplemented {
                ClientFailure::new(
                    FailureKind::Other,
                    format!(
                        "the scheduler at {} does not serve job logs (GetJobLogs is not implemented there; upgrade it): {}",
                        connection.endpoint,
                        status.message()
                    ),
                )
                .into()
            } else {
                connection.failure(&status, &format!("cannot get the logs of job {job_id}"))
            }
        })
}

/// Prints every line after `after_sequence`, page by page; returns the last sequence.
async fn print_all_after(
    connection: &Connection,
    arguments: &LogsArguments,
    mut after_sequence: u64,
) -> Result<u64> {
    loop {
        let page = fetch_page(
            connection,
            v1::GetJobLogsRequest {
                job_id: arguments.job.clone(),
                attempt_number: arguments.attempt.unwrap_or(0),
                after_sequence,
                page_size: PAGE_SIZE,
                tail: 0,
            },
        )
        .await?;
        page.lines.iter().for_each(print_line);
        // A server that reports no progress must not loop forever on `more`.
        let advanced = page.last_sequence > after_sequence;
        after_sequence = after_sequence.max(page.last_sequence);
        if !page.more || !advanced {
            return Ok(after_sequence);
        }
    }
}

pub async fn logs(arguments: LogsArguments) -> Result<ExitCode> {
    if arguments.attempt == Some(0) {
        return Err(ClientFailure::new(
            FailureKind::InvalidArgument,
            "--attempt: attempts are numbered from 1",
        )
        .into());
    }
    let mut arguments = arguments;
    let connection = Connection::open(&arguments.connection).await?;
    // A prefix or a name is resolved once: a job submitted under the same name while
    // `--follow` runs does not make it ambiguous.
    arguments.job = connection.fetch_job(&arguments.job).await?.id;
    let mut last_sequence = match arguments.tail {
        Some(tail) if tail > 0 => {
            let page = fetch_page(
                &connection,
                v1::GetJobLogsRequest {
                    job_id: arguments.job.clone(),
                    attempt_number: arguments.attempt.unwrap_or(0),
                    after_sequence: 0,
                    page_size: 0,
                    tail,
                },
            )
            .await?;
            page.lines.iter().for_each(print_line);
            page.last_sequence
        }
        _ => print_all_after(&connection, &arguments, 0).await?,
    };
    if !arguments.follow {
        return Ok(ExitCode::SUCCESS);
    }
    loop {
        // The state is read before the lines, so once it says the job ended, the lines
        // read after it are all there will be.
        let ended = is_terminal(&connection.fetch_job(&arguments.job).await?);
        last_sequence = print_all_after(&connection, &arguments, last_sequence).await?;
        if ended {
            return Ok(ExitCode::SUCCESS);
        }
        tokio::time::sleep(FOLLOW_INTERVAL).await;
    }
}
