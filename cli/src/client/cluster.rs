//! `carve cluster`: the workers and their GPUs, each GPU drawn as a bar of its memory
//! carved into the slices of the jobs that run on it, the CUDA context, and the free
//! space, and a drained worker's reason; `carve cluster drain WORKER [--reason TEXT]` and
//! `undrain WORKER` for operators.

use std::collections::HashMap;
use std::process::ExitCode;

use anyhow::{Context, Result};
use carve_proto::v1;

use super::connection::{Connection, ConnectionOptions};
use super::output::{
    ListFormat, OutputFormat, age_text, bytes_text, now_seconds, print_message, print_wide_table,
    timestamp_text, worker_state_name,
};

/// Characters of a GPU's memory bar between its brackets.
const BAR_WIDTH: usize = 64;

#[derive(Debug, clap::Args)]
pub struct ClusterArguments {
    #[command(subcommand)]
    action: Option<ClusterAction>,
    /// Output format: `table` draws the GPUs; `wide` first lists the workers in a table
    /// (id, host, state, version, GPUs, memory, slices, registered, last heartbeat).
    #[arg(short = 'o', long, value_enum, default_value_t = ListFormat::Table)]
    output: ListFormat,
    #[command(flatten)]
    connection: ConnectionOptions,
}

#[derive(Debug, clap::Subcommand)]
enum ClusterAction {
    /// Stops placing new attempts on a worker; its running attempts finish (admins).
    Drain {
        /// The worker id (see `carve cluster`), or its node's name.
        worker: String,
        /// Why: kept with the worker and shown by `carve cluster`.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Lets a drained worker take new attempts again (admins).
    Undrain {
        /// The worker id, or its node's name.
        worker: String,
    },
}

pub async fn cluster(arguments: ClusterArguments) -> Result<ExitCode> {
    let connection = Connection::open(&arguments.connection).await?;
    // Drain and undrain answer with one worker: a line, or the document.
    let change_format = arguments.output.document().unwrap_or(OutputFormat::Table);
    match arguments.action {
        None => show(&connection, arguments.output).await,
        Some(ClusterAction::Drain { worker, reason }) => {
            let drained = connection
                .cluster()
                .drain_worker(v1::DrainWorkerRequest {
                    worker_id: worker.clone(),
                    reason: reason.unwrap_or_default(),
                })
                .await
                .map_err(|status| connection.failure(&status, &format!("cannot drain {worker}")))?
                .into_inner()
                .worker
                .context("the scheduler answered a drain without the worker")?;
            print_worker_change(
                &drained,
                change_format,
                &format!("{}: it takes no new attempts", state_with_reason(&drained)),
            )
        }
        Some(ClusterAction::Undrain { worker }) => {
            let undrained = connection
                .cluster()
                .undrain_worker(v1::UndrainWorkerRequest {
                    worker_id: worker.clone(),
                })
                .await
                .map_err(|status| connection.failure(&status, &format!("cannot undrain {worker}")))?
                .into_inner()
                .worker
                .context("the scheduler answered an undrain without the worker")?;
            print_worker_change(&undrained, change_format, "ready: it takes new attempts")
        }
    }
}

fn print_worker_change(worker: &v1::Worker, output: OutputFormat, what: &str) -> Result<ExitCode> {
    if output == OutputFormat::Table {
        println!("worker {} ({}) is {what}", worker.id, worker.hostname);
    } else {
        print_message(worker, "carve.v1.Worker", output)?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn show(connection: &Connection, output: ListFormat) -> Result<ExitCode> {
    let workers = connection
        .retrying(|connection| async move {
            connection
                .cluster()
                .list_workers(v1::ListWorkersRequest { states: Vec::new() })
                .await
        })
        .await
        .map_err(|status| connection.failure(&status, "cannot list workers"))?;
    if let Some(format) = output.document() {
        print_message(&workers, "carve.v1.ListWorkersResponse", format)?;
        return Ok(ExitCode::SUCCESS);
    }
    if workers.workers.is_empty() {
        println!("no workers have registered");
        return Ok(ExitCode::SUCCESS);
    }
    let names = running_job_names(connection).await;
    let now = now_seconds();
    if output == ListFormat::Wide {
        print_workers_table(&workers.workers, now);
        println!();
    }
    for worker in &workers.workers {
        println!(
            "{} ({})  {}  version {}  last heartbeat {} ago",
            worker.hostname,
            worker.id,
            state_with_reason(worker),
            if worker.version.is_empty() {
                "-"
            } else {
                &worker.version
            },
            age_text(worker.last_heartbeat_at.as_ref(), now)
        );
        for gpu in &worker.gpus {
            for line in gpu_lines(gpu, &names) {
                println!("{line}");
            }
        }
        println!();
    }
    Ok(ExitCode::SUCCESS)
}

/// A worker's state, with the reason it was drained when one was given:
/// `draining (kernel upgrade)`.
fn state_with_reason(worker: &v1::Worker) -> String {
    let state = worker_state_name(worker.state);
    if worker.drain_reason.is_empty() {
        state
    } else {
        format!("{state} ({})", worker.drain_reason)
    }
}

/// The workers as rows, every cell whole (`carve cluster -o wide`).
fn print_workers_table(workers: &[v1::Worker], now: i64) {
    let rows: Vec<[String; 9]> = workers
        .iter()
        .map(|worker| {
            let total: u64 = worker.gpus.iter().map(|gpu| gpu.total_bytes).sum();
            let free: u64 = worker.gpus.iter().map(|gpu| gpu.free_bytes).sum();
            let slices: usize = worker.gpus.iter().map(|gpu| gpu.slices.len()).sum();
            [
                worker.id.clone(),
                worker.hostname.clone(),
                state_with_reason(worker),
                if worker.version.is_empty() {
                    "-".into()
                } else {
                    worker.version.clone()
                },
                worker.gpus.len().to_string(),
                format!("{} / {}", bytes_text(Some(free)), bytes_text(Some(total))),
                slices.to_string(),
                timestamp_text(worker.registered_at.as_ref()),
                format!("{} ago", age_text(worker.last_heartbeat_at.as_ref(), now)),
            ]
        })
        .collect();
    let header = [
        "ID",
        "HOSTNAME",
        "STATE",
        "VERSION",
        "GPUS",
        "FREE / TOTAL",
        "SLICES",
        "REGISTERED",
        "LAST HEARTBEAT",
    ];
    print_wide_table(header, &rows);
}

/// The names of the jobs the caller may see that hold slices now, by id. Names only
/// label the bars, so a caller who may not list jobs still gets the picture, with ids.
async fn running_job_names(connection: &Connection) -> HashMap<String, String> {
    let mut names = HashMap::new();
    let request = v1::ListJobsRequest {
        states: vec![v1::JobState::Placed as i32, v1::JobState::Running as i32],
        page_size: 1000,
        ..v1::ListJobsRequest::default()
    };
    if let Ok(response) = connection.jobs().list_jobs(request).await {
        for job in response.into_inner().jobs {
            names.insert(job.id, job.name);
        }
    }
    names
}

/// One part of a GPU's memory, as drawn.
struct Segment {
    bytes: u64,
    /// The text drawn inside the segment (cut to fit), or none for a fill.
    label: String,
    fill: char,
    /// The fewest characters it takes when it holds any bytes: a slice keeps room for
    /// its separator and its number, so even a tiny one can be found in the legend.
    min_width: usize,
}

/// Widths of `segments` on a bar of `width` characters for `total` bytes: proportional,
/// at least one character for any nonzero part, and the last (the free space) takes
/// what the rounding left.
fn segment_widths(segments: &[Segment], total: u64, width: usize) -> Vec<usize> {
    let mut widths: Vec<usize> = segments
        .iter()
        .map(|segment| {
            if segment.bytes == 0 || total == 0 {
                0
            } else {
                let share = (segment.bytes as f64 / total as f64 * width as f64).round() as usize;
                share.max(segment.min_width)
            }
        })
        .collect();
    if let Some((last, others)) = widths.split_last_mut() {
        let used: usize = others.iter().sum();
        *last = if segments.last().is_some_and(|segment| segment.bytes > 0) {
            width.saturating_sub(used).max(1)
        } else {
            width.saturating_sub(used)
        };
    }
    widths
}

/// The lines that show one GPU: a heading, its memory bar, and a legend.
fn gpu_lines(gpu: &v1::Gpu, names: &HashMap<String, String>) -> Vec<String> {
    let sliced: u64 = gpu.slices.iter().map(|slice| slice.bytes).sum();
    let free = gpu
        .total_bytes
        .saturating_sub(gpu.context_bytes)
        .saturating_sub(sliced);
    let mut lines = vec![format!(
        "  gpu {}  {}{}  {}  ({} free for slices)",
        gpu.index,
        gpu.model_name,
        if gpu.simulated && !gpu.model_name.to_lowercase().contains("simulated") {
            " (simulated)"
        } else {
            ""
        },
        bytes_text(Some(gpu.total_bytes)),
        bytes_text(Some(free)),
    )];
    let mut segments = vec![Segment {
        bytes: gpu.context_bytes,
        label: String::new(),
        fill: '#',
        min_width: 1,
    }];
    for (index, slice) in gpu.slices.iter().enumerate() {
        let name = names.get(&slice.job_id).unwrap_or(&slice.job_id);
        let number = (index + 1).to_string();
        segments.push(Segment {
            bytes: slice.bytes,
            min_width: 1 + number.len(),
            label: format!("{number}:{name}"),
            fill: '=',
        });
    }
    segments.push(Segment {
        bytes: free,
        label: String::new(),
        fill: '.',
        min_width: 1,
    });
    let widths = segment_widths(&segments, gpu.total_bytes, BAR_WIDTH);
    let mut bar = String::from("    [");
    for (position, (segment, width)) in segments.iter().zip(&widths).enumerate() {
        if *width == 0 {
            continue;
        }
        let is_slice = position > 0 && position + 1 < segments.len();
        // A slice starts with '|' so two neighbours stay apart.
        let (start, room) = if is_slice {
            ("|", width - 1)
        } else {
            ("", *width)
        };
        let label: String = segment.label.chars().take(room).collect();
        bar.push_str(start);
        bar.push_str(&label);
        bar.extend(std::iter::repeat_n(
            segment.fill,
            room - label.chars().count(),
        ));
    }
    bar.push(']');
    lines.push(bar);
    lines.push(format!(
        "     # context {}   . free {}   {}",
        bytes_text(Some(gpu.context_bytes)),
        bytes_text(Some(free)),
        gpu.uuid
    ));
    for (index, slice) in gpu.slices.iter().enumerate() {
        // The scheduler leaves out which job of another tenant holds a slice.
        if slice.job_id.is_empty() {
            lines.push(format!(
                "     {}: {}  (another tenant's job)",
                index + 1,
                bytes_text(Some(slice.bytes))
            ));
            continue;
        }
        let name = names
            .get(&slice.job_id)
            .map_or_else(String::new, |name| format!("{name} "));
        lines.push(format!(
            "     {}: {}  {name}({}, tenant {}, attempt {})",
            index + 1,
            bytes_text(Some(slice.bytes)),
            slice.job_id,
            slice.tenant,
            slice.attempt_number
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_gpu_bar_shows_context_slices_and_free_space_in_proportion() {
        let gpu = v1::Gpu {
            uuid: "SIM-0".into(),
            index: 0,
            model_name: "Simulated GPU".into(),
            total_bytes: 16 * GIB,
            context_bytes: GIB,
            simulated: true,
            slices: vec![
                v1::Slice {
                    bytes: 4 * GIB,
                    job_id: "job-a".into(),
                    tenant: "dev".into(),
                    attempt_number: 1,
                    ..v1::Slice::default()
                },
                v1::Slice {
                    bytes: 3 * GIB,
                    job_id: "job-b".into(),
                    tenant: "other".into(),
                    attempt_number: 2,
                    ..v1::Slice::default()
                },
                // Another tenant's, as a user sees it: only its size.
                v1::Slice {
                    bytes: GIB,
                    ..v1::Slice::default()
                },
            ],
            ..v1::Gpu::default()
        };
        let names = HashMap::from([("job-a".to_string(), "mnist-cnn".to_string())]);
        let lines = gpu_lines(&gpu, &names);
        assert!(lines[0].contains("7 GiB free"), "{lines:?}");
        let bar = &lines[1];
        let inside = bar.trim().trim_start_matches('[').trim_end_matches(']');
        assert_eq!(inside.chars().count(), BAR_WIDTH, "{bar}");
        // 1 of 16 GiB is context: 4 characters of 64.
        assert!(inside.starts_with("####|1:mnist-cnn"), "{bar}");
        assert_eq!(inside.chars().filter(|c| *c == '.').count(), 28, "{bar}");
        assert!(inside.contains("|2:job-b"), "{bar}");
        assert!(
            lines
                .iter()
                .any(|line| line.contains("2: 3 GiB  (job-b, tenant other, attempt 2)"))
        );
        assert!(
            lines
                .iter()
                .any(|line| line.contains("3: 1 GiB  (another tenant's job)")),
            "{lines:?}"
        );
    }

    #[test]
    fn tiny_parts_still_get_room_for_their_number() {
        let segments = [
            Segment {
                bytes: 1,
                label: String::new(),
                fill: '#',
                min_width: 1,
            },
            Segment {
                bytes: 1,
                label: "1:job".into(),
                fill: '=',
                min_width: 2,
            },
            Segment {
                bytes: 1000,
                label: String::new(),
                fill: '.',
                min_width: 1,
            },
        ];
        assert_eq!(segment_widths(&segments, 1002, 10), [1, 2, 7]);
    }
}
