//! `carve usage`: who used what over a period (issue 32's accounting, the scheduler's
//! GetUsage): per tenant and per user (the token that submitted the jobs), per GPU type:
//! jobs, attempts, GPU-hours, VRAM requested against VRAM used, OOM retries,
//! preemptions and queue-time percentiles. A user token sees its own tenant; an admin
//! sees every tenant, or one with --tenant.
//!
//! `-o json` prints the API's answer and `-o csv` one row per figure group, both with
//! the exact integers the scheduler counted (milliseconds, byte-milliseconds); the table
//! shows them in hours and GiB-hours for people.

use std::process::ExitCode;

use anyhow::Result;
use carve_core::spec::parse_duration;
use carve_proto::v1;

use super::connection::{Connection, ConnectionOptions};
use super::output::{print_message, table_lines, timestamp_text};

/// The period read when --since is not given.
const DEFAULT_PERIOD: &str = "30d";

#[derive(Debug, clap::Args)]
pub struct UsageArguments {
    /// Only this tenant's usage (admins; a user token sees its own tenant only).
    #[arg(long)]
    tenant: Option<String>,
    /// Only jobs submitted by this token: its id or its description.
    #[arg(long)]
    user: Option<String>,
    /// The period's start: a time ago (`7d`, `12h`, `90m`), a UTC date (`2026-11-01`)
    /// or time (`2026-11-01T08:00:00Z`, fractions of a second to the millisecond).
    #[arg(long, value_parser = parse_moment, default_value = DEFAULT_PERIOD)]
    since: Moment,
    /// The period's end (excluded), written as --since; now when not given.
    #[arg(long, value_parser = parse_moment)]
    until: Option<Moment>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = UsageFormat::Table)]
    output: UsageFormat,
    #[command(flatten)]
    connection: ConnectionOptions,
}

/// How `carve usage` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum UsageFormat {
    /// Per tenant, then per user, in hours and GiB-hours.
    Table,
    /// The API's answer (proto field names), exact integers.
    Json,
    /// One line per tenant and per user figure group, exact integers first.
    Csv,
}

/// A moment as the command line writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moment {
    /// Milliseconds since the Unix epoch.
    At(i64),
    /// This many milliseconds before now.
    Ago(i64),
}

impl Moment {
    fn milliseconds(self, now_ms: i64) -> i64 {
        match self {
            Moment::At(ms) => ms,
            Moment::Ago(ms) => now_ms.saturating_sub(ms),
        }
    }
}

/// Reads `7d`/`12h`/`90m` (ago), `now`, `2026-11-01` or `2026-11-01T08:00:00[.123]Z` (UTC).
pub fn parse_moment(text: &str) -> Result<Moment, String> {
    let text = text.trim();
    if text == "now" {
        return Ok(Moment::Ago(0));
    }
    if text.starts_with(|character: char| character.is_ascii_digit())
        && text.len() > 4
        && text.as_bytes()[4] == b'-'
    {
        return parse_utc(text).map(Moment::At);
    }
    let duration = parse_duration(text).map_err(|reason| {
        format!(
            "{text:?} {reason}, or a UTC date or time such as 2026-11-01 or 2026-11-01T08:00:00Z"
        )
    })?;
    Ok(Moment::Ago(
        i64::try_from(duration.as_millis()).map_err(|_| format!("{text:?} is too long ago"))?,
    ))
}

/// `YYYY-MM-DD`, then optionally `T` (or a space) `HH:MM[:SS[.fff]]`, then optionally `Z`.
fn parse_utc(text: &str) -> Result<i64, String> {
    let bad = || {
        format!(
            "{text:?} is not a UTC date or time; write 2026-11-01, 2026-11-01T08:00:00Z or \
             2026-11-01T08:00:00.250Z"
        )
    };
    let text_without_zone = text.strip_suffix('Z').unwrap_or(text);
    let (date, time) = match text_without_zone.split_once(['T', ' ']) {
        Some((date, time)) => (date, Some(time)),
        None => (text_without_zone, None),
    };
    let number = |part: &str, digits: usize| -> Result<i64, String> {
        if part.len() != digits || !part.bytes().all(|byte| byte.is_ascii_digit()) {
            return Err(bad());
        }
        part.parse::<i64>().map_err(|_| bad())
    };
    let mut date_parts = date.split('-');
    let (Some(year), Some(month), Some(day), None) = (
        date_parts.next(),
        date_parts.next(),
        date_parts.next(),
        date_parts.next(),
    ) else {
        return Err(bad());
    };
    let (year, month, day) = (number(year, 4)?, number(month, 2)?, number(day, 2)?);
    if !(1..=12).contains(&month) || !(1..=days_in_month(year, month)).contains(&day) {
        return Err(bad());
    }
    let mut milliseconds = days_from_civil(year, month, day) * 86_400_000;
    if let Some(time) = time {
        let (clock, fraction) = match time.split_once('.') {
            Some((clock, fraction)) => (clock, Some(fraction)),
            None => (time, None),
        };
        let mut clock_parts = clock.split(':');
        let hour = number(clock_parts.next().ok_or_else(bad)?, 2)?;
        let minute = number(clock_parts.next().ok_or_else(bad)?, 2)?;
        let second = clock_parts.next().map_or(Ok(0), |part| number(part, 2))?;
        if clock_parts.next().is_some() || hour > 23 || minute > 59 || second > 59 {
            return Err(bad());
        }
        milliseconds += (hour * 3600 + minute * 60 + second) * 1000;
        if let Some(fraction) = fraction {
            if fraction.is_empty()
                || fraction.len() > 3
                || !fraction.bytes().all(|byte| byte.is_ascii_digit())
            {
                return Err(bad());
            }
            let padded = format!("{fraction:0<3}");
            milliseconds += padded.parse::<i64>().map_err(|_| bad())?;
        }
    }
    Ok(milliseconds)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`, the inverse of the one `output.rs` prints dates with).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year.rem_euclid(400);
    let month_index = if month > 2 { month - 3 } else { month + 9 };
    let day_of_year = (153 * month_index + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

fn timestamp_of(milliseconds: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: milliseconds.div_euclid(1000),
        nanos: (milliseconds.rem_euclid(1000) * 1_000_000) as i32,
    }
}

pub async fn usage(arguments: UsageArguments) -> Result<ExitCode> {
    let connection = Connection::open(&arguments.connection).await?;
    let now_ms = super::output::now_seconds().saturating_mul(1000);
    let request = v1::GetUsageRequest {
        from: Some(timestamp_of(arguments.since.milliseconds(now_ms))),
        // Unset is the scheduler's now: one clock for the period and running attempts.
        to: arguments
            .until
            .map(|until| timestamp_of(until.milliseconds(now_ms))),
        tenant: arguments.tenant.unwrap_or_default(),
        user: arguments.user.unwrap_or_default(),
    };
    let answer = connection
        .retrying(|connection| {
            let request = request.clone();
            async move { connection.cluster().get_usage(request).await }
        })
        .await
        .map_err(|status| connection.failure(&status, "cannot read usage"))?;
    match arguments.output {
        UsageFormat::Json => {
            print_message(
                &answer,
                "carve.v1.GetUsageResponse",
                super::output::OutputFormat::Json,
            )?;
        }
        UsageFormat::Csv => print!("{}", csv_text(&answer)),
        UsageFormat::Table => print!("{}", table_text(&answer)),
    }
    Ok(ExitCode::SUCCESS)
}

/// The CSV columns, exact integers (and the tenant, user and GPU type) first.
const CSV_HEADER: [&str; 20] = [
    "scope",
    "tenant",
    "user_token_id",
    "user",
    "gpu_type",
    "jobs",
    "attempts",
    "gpu_milliseconds",
    "vram_requested_byte_milliseconds",
    "vram_used_byte_milliseconds",
    "vram_requested_measured_byte_milliseconds",
    "measured_attempts",
    "oom_retries",
    "preemptions",
    "queued_attempts",
    "queue_time_p50_ms",
    "queue_time_p90_ms",
    "queue_time_p99_ms",
    "gpu_hours",
    "vram_requested_gib_hours",
];

fn csv_text(answer: &v1::GetUsageResponse) -> String {
    let mut text = CSV_HEADER.join(",");
    text.push('\n');
    let rows = answer
        .tenants
        .iter()
        .map(|figures| ("tenant", figures))
        .chain(answer.users.iter().map(|figures| ("user", figures)));
    for (scope, figures) in rows {
        let cells = [
            scope.to_string(),
            csv_cell(&figures.tenant),
            csv_cell(&figures.user_token_id),
            csv_cell(&figures.user),
            csv_cell(&figures.gpu_type),
            figures.jobs.to_string(),
            figures.attempts.to_string(),
            figures.gpu_milliseconds.to_string(),
            figures.vram_requested_byte_milliseconds.clone(),
            figures.vram_used_byte_milliseconds.clone(),
            figures.vram_requested_measured_byte_milliseconds.clone(),
            figures.measured_attempts.to_string(),
            figures.oom_retries.to_string(),
            figures.preemptions.to_string(),
            figures.queued_attempts.to_string(),
            figures.queue_time_p50_ms.to_string(),
            figures.queue_time_p90_ms.to_string(),
            figures.queue_time_p99_ms.to_string(),
            format!("{:.6}", gpu_hours(figures.gpu_milliseconds)),
            format!(
                "{:.6}",
                gib_hours(&figures.vram_requested_byte_milliseconds)
            ),
        ];
        text.push_str(&cells.join(","));
        text.push('\n');
    }
    text
}

/// A CSV cell (RFC 4180): quoted when it holds a comma, a quote or a line break. A
/// cell a spreadsheet would run as a formula (`=`, `+`, `-`, `@` first: a token's
/// description is the tenant's own text) is quoted with a leading `'`.
fn csv_cell(text: &str) -> String {
    let text = if text.starts_with(['=', '+', '-', '@']) {
        format!("'{text}")
    } else {
        text.to_string()
    };
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text
    }
}

fn gpu_hours(milliseconds: u64) -> f64 {
    milliseconds as f64 / 3_600_000.0
}

/// Byte-milliseconds (a decimal integer) in GiB-hours; 0 for text that is not one.
fn gib_hours(byte_milliseconds: &str) -> f64 {
    byte_milliseconds.parse::<u128>().unwrap_or(0) as f64 / (1u64 << 30) as f64 / 3_600_000.0
}

/// A wait as people read it: `850ms`, `12.3s`, `4m05s`, `2h10m`, `3d04h`.
fn wait_text(milliseconds: u64) -> String {
    let seconds = milliseconds / 1000;
    match milliseconds {
        0..1000 => format!("{milliseconds}ms"),
        1000..60_000 => format!("{:.1}s", milliseconds as f64 / 1000.0),
        60_000..3_600_000 => format!("{}m{:02}s", seconds / 60, seconds % 60),
        3_600_000..86_400_000 => format!("{}h{:02}m", seconds / 3600, seconds % 3600 / 60),
        _ => format!("{}d{:02}h", seconds / 86_400, seconds % 86_400 / 3600),
    }
}

const TABLE_HEADER: [&str; 11] = [
    "TENANT",
    "USER",
    "GPU TYPE",
    "JOBS",
    "ATTEMPTS",
    "GPU-H",
    "VRAM REQ GiB-H",
    "USED/REQ (MEASURED)",
    "OOM RETRIES",
    "PREEMPTED",
    "QUEUE P50/P90/P99",
];

fn table_text(answer: &v1::GetUsageResponse) -> String {
    let mut text = format!(
        "usage from {} to {}\n",
        timestamp_text(answer.from.as_ref()),
        timestamp_text(answer.to.as_ref())
    );
    if answer.tenants.is_empty() {
        text.push_str("no attempt held a slice in this period\n");
        return text;
    }
    let row = |figures: &v1::UsageFigures, user: String| -> [String; 11] {
        let used = figures
            .vram_used_byte_milliseconds
            .parse::<u128>()
            .unwrap_or(0);
        let requested_measured = figures
            .vram_requested_measured_byte_milliseconds
            .parse::<u128>()
            .unwrap_or(0);
        let efficiency = if requested_measured == 0 {
            "-".to_string()
        } else {
            format!(
                "{:.0}% ({}/{})",
                used as f64 * 100.0 / requested_measured as f64,
                figures.measured_attempts,
                figures.attempts
            )
        };
        let queue = if figures.queued_attempts == 0 {
            "-".to_string()
        } else {
            format!(
                "{}/{}/{}",
                wait_text(figures.queue_time_p50_ms),
                wait_text(figures.queue_time_p90_ms),
                wait_text(figures.queue_time_p99_ms)
            )
        };
        [
            figures.tenant.clone(),
            user,
            figures.gpu_type.clone(),
            figures.jobs.to_string(),
            figures.attempts.to_string(),
            format!("{:.3}", gpu_hours(figures.gpu_milliseconds)),
            format!(
                "{:.3}",
                gib_hours(&figures.vram_requested_byte_milliseconds)
            ),
            efficiency,
            figures.oom_retries.to_string(),
            figures.preemptions.to_string(),
            queue,
        ]
    };
    let mut rows: Vec<[String; 11]> = answer
        .tenants
        .iter()
        .map(|figures| row(figures, "(all)".to_string()))
        .collect();
    rows.extend(answer.users.iter().map(|figures| {
        let user = if figures.user_token_id.is_empty() {
            "(unknown)".to_string()
        } else if figures.user.is_empty() {
            figures.user_token_id.clone()
        } else {
            format!("{} ({})", figures.user, figures.user_token_id)
        };
        row(figures, user)
    }));
    for line in table_lines(TABLE_HEADER, &rows, None) {
        text.push_str(&line);
        text.push('\n');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments_read_as_written() {
        assert_eq!(parse_moment("now"), Ok(Moment::Ago(0)));
        assert_eq!(parse_moment("7d"), Ok(Moment::Ago(7 * 86_400_000)));
        assert_eq!(parse_moment("1h30m"), Ok(Moment::Ago(5_400_000)));
        assert_eq!(parse_moment("1970-01-02"), Ok(Moment::At(86_400_000)));
        assert_eq!(
            parse_moment("2026-11-28T08:02:38Z"),
            Ok(Moment::At(1_795_852_958_000))
        );
        assert_eq!(
            parse_moment("2026-11-28 08:02:38.25Z"),
            Ok(Moment::At(1_795_852_958_250))
        );
        assert_eq!(
            parse_moment("2024-02-29"),
            Ok(Moment::At(1_709_164_800_000))
        );
        for bad in [
            "2023-02-29",
            "2026-13-01",
            "2026-11-28T24:00:00Z",
            "2026-11-28T08:00:00.1234Z",
            "yesterday",
            "7",
        ] {
            assert!(parse_moment(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn csv_cells_are_quoted_and_never_formulas() {
        assert_eq!(csv_cell("alice"), "alice");
        assert_eq!(csv_cell("a,b"), "\"a,b\"");
        assert_eq!(csv_cell("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_cell("=HYPERLINK(1)"), "'=HYPERLINK(1)");
        assert_eq!(csv_cell("-1,2"), "\"'-1,2\"");
    }

    #[test]
    fn waits_read_in_their_unit() {
        assert_eq!(wait_text(850), "850ms");
        assert_eq!(wait_text(12_300), "12.3s");
        assert_eq!(wait_text(245_000), "4m05s");
        assert_eq!(wait_text(7_800_000), "2h10m");
        assert_eq!(wait_text(273_600_000), "3d04h");
    }
}
