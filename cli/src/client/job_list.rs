//! `carve jobs`: the table of a tenant's jobs, each with the short id a person types
//! to name it (`carve get 3f9a`): the fewest last hex digits of its id, at least four,
//! that no other job listed ends with, starts with or is named. The scheduler takes
//! every reference within the caller's tenant and refuses one that names several jobs,
//! listing them, so a short id made unique among the jobs shown is safe to type even
//! when older jobs were left off the list.

use std::process::ExitCode;

use anyhow::Result;
use carve_proto::v1;

use super::attempt_results::{last_loss_text, last_results_text};
use super::connection::{Connection, ConnectionOptions};
use super::output::{
    ListFormat, age_text, bytes_text, config_text, job_state_name, now_seconds, print_message,
    print_table, print_wide_table, timestamp_text,
};

/// What every job id starts with; the rest is 32 hex digits, the first of them the time.
const JOB_ID_PREFIX: &str = "job-";

/// The fewest hex digits the scheduler tries as the end of an id.
const SHORTEST_SHORT_ID: usize = 4;

/// The job states, as `--state` spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum JobStateArgument {
    Queued,
    Placed,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl From<JobStateArgument> for v1::JobState {
    fn from(state: JobStateArgument) -> Self {
        match state {
            JobStateArgument::Queued => v1::JobState::Queued,
            JobStateArgument::Placed => v1::JobState::Placed,
            JobStateArgument::Running => v1::JobState::Running,
            JobStateArgument::Succeeded => v1::JobState::Succeeded,
            JobStateArgument::Failed => v1::JobState::Failed,
            JobStateArgument::Cancelled => v1::JobState::Cancelled,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct JobsArguments {
    /// Only jobs in these states (comma-separated or repeated).
    #[arg(long, value_enum, value_delimiter = ',')]
    state: Vec<JobStateArgument>,
    /// Only jobs whose name starts with this.
    #[arg(long, value_name = "PREFIX")]
    name_prefix: Option<String>,
    /// Only this tenant's jobs (admins; others may name only their own tenant).
    #[arg(long)]
    tenant: Option<String>,
    /// The most jobs to list, newest first; 0 lists every one.
    #[arg(long, default_value_t = 200)]
    limit: u32,
    /// Output format: `table` fits 100 columns, `wide` adds the priority, config,
    /// attempts and submit time and cuts nothing.
    #[arg(short = 'o', long, value_enum, default_value_t = ListFormat::Table)]
    output: ListFormat,
    #[command(flatten)]
    connection: ConnectionOptions,
}

pub async fn list(arguments: JobsArguments) -> Result<ExitCode> {
    let connection = Connection::open(&arguments.connection).await?;
    let states: Vec<i32> = arguments
        .state
        .iter()
        .map(|state| v1::JobState::from(*state) as i32)
        .collect();
    let mut jobs = Vec::new();
    let mut page_token = String::new();
    // A page may hold fewer jobs than asked (the scheduler also bounds a page in bytes,
    // so that it fits what this client decodes): the token, not the count, says whether
    // more are left.
    loop {
        let wanted = match arguments.limit {
            0 => 1000,
            limit => (limit as usize).saturating_sub(jobs.len()).min(1000) as u32,
        };
        let request = v1::ListJobsRequest {
            states: states.clone(),
            name_prefix: arguments.name_prefix.clone().unwrap_or_default(),
            tenant: arguments.tenant.clone().unwrap_or_default(),
            page_size: wanted,
            page_token: page_token.clone(),
        };
        let page = connection
            .retrying(|connection| {
                let request = request.clone();
                async move { connection.jobs().list_jobs(request).await }
            })
            .await
            .map_err(|status| connection.failure(&status, "cannot list jobs"))?;
        jobs.extend(page.jobs);
        page_token = page.next_page_token;
        let full = arguments.limit != 0 && jobs.len() >= arguments.limit as usize;
        if page_token.is_empty() || full {
            break;
        }
    }
    if arguments.limit != 0 {
        jobs.truncate(arguments.limit as usize);
    }
    if let Some(format) = arguments.output.document() {
        let list = v1::ListJobsResponse {
            jobs,
            next_page_token: String::new(),
        };
        return print_message(&list, "carve.v1.ListJobsResponse", format)
            .map(|()| ExitCode::SUCCESS);
    }
    if jobs.is_empty() {
        println!("no jobs");
        return Ok(ExitCode::SUCCESS);
    }
    let now = now_seconds();
    let short_ids = short_ids(&jobs);
    let rows: Vec<[String; 13]> = jobs
        .iter()
        .zip(short_ids)
        .map(|(job, short_id)| job_row_wide(job, short_id))
        .collect();
    let header = [
        "ID",
        "SHORT",
        "NAME",
        "TENANT",
        "STATE",
        "LOSS",
        "RESULTS",
        "PRIORITY",
        "CONFIG",
        "ESTIMATE / PEAK",
        "ATTEMPTS",
        "SUBMITTED",
        "WAITING / MESSAGE",
    ];
    if arguments.output == ListFormat::Wide {
        print_wide_table(header, &rows);
        return Ok(ExitCode::SUCCESS);
    }
    // The default table: the wide one's id, short id, name, state, loss and memory, the
    // age and the waiting reason, which fit 100 columns beside a whole id.
    let rows: Vec<[String; 8]> = jobs
        .iter()
        .zip(rows)
        .map(
            |(job, [id, short_id, name, _, state, loss, _, _, _, memory, _, _, _])| {
                [
                    id,
                    short_id,
                    name,
                    state,
                    loss,
                    memory,
                    age_text(job.created_at.as_ref(), now),
                    job.waiting_reason.clone(),
                ]
            },
        )
        .collect();
    print_table(
        [
            "ID",
            "SHORT",
            "NAME",
            "STATE",
            "LOSS",
            "ESTIMATE / PEAK",
            "AGE",
            "WAITING",
        ],
        &rows,
    );
    Ok(ExitCode::SUCCESS)
}

/// A job's row of `carve jobs -o wide`; the default table takes some of its cells.
fn job_row_wide(job: &v1::Job, short_id: String) -> [String; 13] {
    let peak = job
        .attempts
        .iter()
        .rev()
        .find_map(|attempt| attempt.measured_peak_bytes);
    let waiting_or_message = match (job.waiting_reason.is_empty(), job.message.is_empty()) {
        (false, _) | (true, true) => job.waiting_reason.clone(),
        (true, false) => job.message.clone(),
    };
    [
        job.id.clone(),
        short_id,
        job.name.clone(),
        job.tenant.clone(),
        job_state_name(job.state),
        last_loss_text(job),
        last_results_text(job),
        job.priority.to_string(),
        config_text(job.current_config.as_ref()),
        format!(
            "{} / {}",
            bytes_text(
                job.estimate
                    .as_ref()
                    .map(|estimate| estimate.required_bytes)
            ),
            bytes_text(peak)
        ),
        job.attempts.len().to_string(),
        timestamp_text(job.created_at.as_ref()),
        waiting_or_message,
    ]
}

/// Each job's short id (see the module docs), in order; a job whose id is not `job-` and
/// hex digits (none is) shows its whole id.
fn short_ids(jobs: &[v1::Job]) -> Vec<String> {
    let digits: Vec<Option<&str>> = jobs
        .iter()
        .map(|job| {
            job.id
                .strip_prefix(JOB_ID_PREFIX)
                .filter(|digits| digits.len() >= SHORTEST_SHORT_ID)
        })
        .collect();
    jobs.iter()
        .zip(&digits)
        .enumerate()
        .map(|(index, (job, own))| {
            let Some(own) = own else {
                return job.id.clone();
            };
            (SHORTEST_SHORT_ID..=own.len())
                .map(|length| &own[own.len() - length..])
                .find(|candidate| {
                    jobs.iter()
                        .zip(&digits)
                        .enumerate()
                        .all(|(other, (job, theirs))| {
                            other == index
                                || (job.name != *candidate
                                    && theirs.is_none_or(|theirs| {
                                        !theirs.ends_with(candidate)
                                            && !theirs.starts_with(candidate)
                                    }))
                        })
                })
                .map_or_else(|| job.id.clone(), str::to_string)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: &str, name: &str) -> v1::Job {
        v1::Job {
            id: id.into(),
            name: name.into(),
            ..v1::Job::default()
        }
    }

    #[test]
    fn a_short_id_is_the_fewest_last_digits_no_other_listed_job_could_mean() {
        let jobs = [
            job("job-019ac0de00007000800000000000a1b2", "train"),
            job("job-019ac0de00017000800000000000c3b2", "train"),
            job("job-019ac0de00027000800000000077c3b2", "c9d0"),
            job("job-019ac0de00037000800000000000c9d0", "eval"),
            job("job-019ac0de00047000800000000000019a", "eval"),
        ];
        assert_eq!(
            short_ids(&jobs),
            [
                // Four digits when they are unique.
                "a1b2", // Longer while another id ends the same way.
                "0c3b2", "7c3b2", // Longer while another job is named it.
                "0c9d0",
                // Longer while another id starts with it (the scheduler reads hex digits
                // as the start of an id too).
                "0019a",
            ]
        );
        // An id of another shape is shown whole.
        assert_eq!(short_ids(&[job("odd", "x")]), ["odd"]);
    }
}
