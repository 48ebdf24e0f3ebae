//! Records of the attempt processes a worker runs, one small file each, so that a worker
//! started again after a crash kills what its previous life left behind.
//!
//! The parent-death signal normally takes an attempt process down with its worker; the
//! records are for the rest (a process started by an older worker, a wrapper program
//! that does not `exec`, a setuid program, which drops the signal). A leftover keeps its
//! slice's GPU memory and writes checkpoints nobody will read, so at start the worker
//! SIGKILLs the process group of every recorded process that is still the process that
//! was recorded (same pid *and* same start time, which defeats pid reuse) and whose
//! recording worker is gone, then removes the records.
//!
//! Records live in `{checkpoint directory}/attempt-processes/{hostname}/`: pids only mean
//! something on their own host, and a checkpoint directory may be shared between nodes.

use std::path::{Path, PathBuf};

use rustix::process::Signal;
use serde::{Deserialize, Serialize};

use crate::attempt_process::signal_process_group;
use crate::error::WorkerError;

/// One attempt process as the worker that started it recorded it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptProcessRecord {
    pub job_id: String,
    pub attempt_number: u32,
    pub process_id: u32,
    /// The group the process leads; the worker signals the whole group.
    pub process_group: u32,
    /// The process's start time (clock ticks since boot, `/proc/PID/stat` field 22).
    pub start_time_ticks: u64,
    /// The worker process that started it, and that process's start time.
    pub worker_process_id: u32,
    pub worker_start_time_ticks: u64,
}

/// What [`kill_leftover_processes`] did with one record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeftoverOutcome {
    /// The process still ran and its group was sent SIGKILL.
    Killed(AttemptProcessRecord),
    /// The process had ended (or its pid now names another process): record removed.
    AlreadyGone(AttemptProcessRecord),
    /// The worker that recorded it still runs (another worker sharing the directory):
    /// left alone.
    OwnedByALiveWorker(AttemptProcessRecord),
    /// The file could not be read as a record: removed.
    Unreadable { file: PathBuf, reason: String },
}

/// The directory of this host's records.
pub fn record_directory(checkpoint_directory: &Path, hostname: &str) -> PathBuf {
    // The hostname becomes one path component, whatever it holds.
    let component: String = hostname
        .chars()
        .map(|character| {
            if character.is_ascii_alphanumeric() || matches!(character, '.' | '-' | '_') {
                character
            } else {
                '_'
            }
        })
        .collect();
    let component = match component.as_str() {
        "" | "." | ".." => "_".to_string(),
        _ => component,
    };
    checkpoint_directory
        .join("attempt-processes")
        .join(component)
}

/// The start time of process `process_id` in clock ticks since boot, or `None` when
/// there is no such process (or it is a zombie: it has ended, only its exit status is
/// left to collect).
pub fn process_start_time(process_id: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{process_id}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces and ')': the
    // fields after it start after the last ')'.
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace();
    // Field 3 is the state; field 22, the start time, is 19 fields later.
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// Records an attempt process the worker just started; returns the record's file. The
/// file is written under a temporary name and renamed, so a crash never leaves half a
/// record.
pub fn write_record(
    directory: &Path,
    record: &AttemptProcessRecord,
) -> Result<PathBuf, WorkerError> {
    std::fs::create_dir_all(directory).map_err(|error| {
        WorkerError::io(format!("cannot create {}", directory.display()), error)
    })?;
    let name = format!("{}.attempt-{}.json", record.job_id, record.attempt_number);
    let file = directory.join(&name);
    let temporary = directory.join(format!(".{name}.tmp"));
    let text = serde_json::to_string(record)
        .map_err(|error| WorkerError::AttemptProcess(format!("a process record: {error}")))?;
    std::fs::write(&temporary, text)
        .and_then(|()| std::fs::rename(&temporary, &file))
        .map_err(|error| WorkerError::io(format!("cannot write {}", file.display()), error))?;
    Ok(file)
}

/// A record for a process this worker started just now.
pub fn record_for(
    job_id: &str,
    attempt_number: u32,
    process_id: u32,
) -> Option<AttemptProcessRecord> {
    let worker_process_id = std::process::id();
    Some(AttemptProcessRecord {
        job_id: job_id.to_string(),
        attempt_number,
        process_id,
        // The worker starts every attempt as the leader of its own group.
        process_group: process_id,
        start_time_ticks: process_start_time(process_id)?,
        worker_process_id,
        worker_start_time_ticks: process_start_time(worker_process_id)?,
    })
}

/// Kills every recorded process in `directory` that outlived its worker and removes the
/// records (see the module docs); returns what it did with each.
pub fn kill_leftover_processes(directory: &Path) -> Vec<LeftoverOutcome> {
    let Ok(entries) = std::fs::read_dir(directory) else {
        // No directory: nothing was ever recorded here.
        return Vec::new();
    };
    let mut outcomes = Vec::new();
    for entry in entries.flatten() {
        let file = entry.path();
        let is_record = file
            .extension()
            .is_some_and(|extension| extension == "json")
            && !entry.file_name().to_string_lossy().starts_with('.');
        if !is_record {
            if entry.file_name().to_string_lossy().ends_with(".tmp") {
                let _ = std::fs::remove_file(&file);
            }
            continue;
        }
        let record = std::fs::read_to_string(&file)
            .map_err(|error| error.to_string())
            .and_then(|text| {
                serde_json::from_str::<AttemptProcessRecord>(&text)
                    .map_err(|error| error.to_string())
            });
        let outcome = match record {
            Err(reason) => LeftoverOutcome::Unreadable {
                file: file.clone(),
                reason,
            },
            Ok(record) => settle_record(record),
        };
        if !matches!(outcome, LeftoverOutcome::OwnedByALiveWorker(_)) {
            let _ = std::fs::remove_file(&file);
        }
        outcomes.push(outcome);
    }
    outcomes
}

fn settle_record(record: AttemptProcessRecord) -> LeftoverOutcome {
    let this_process = std::process::id();
    // An earlier run of the worker inside this same process (tests restart it that way)
    // counts as a previous life; any other live recorder is a worker of its own.
    let recorder_alive = record.worker_process_id != this_process
        && process_start_time(record.worker_process_id) == Some(record.worker_start_time_ticks);
    if recorder_alive {
        return LeftoverOutcome::OwnedByALiveWorker(record);
    }
    let same_process = record.process_id > 1
        && record.process_id != this_process
        && process_start_time(record.process_id) == Some(record.start_time_ticks);
    if !same_process {
        return LeftoverOutcome::AlreadyGone(record);
    }
    if let Err(error) = signal_process_group(record.process_group, Signal::KILL) {
        tracing::warn!(
            process_group = record.process_group,
            %error,
            "cannot kill a leftover attempt's process group; killing the process alone"
        );
        if let Some(process) = i32::try_from(record.process_id)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(process, Signal::KILL);
        }
    }
    LeftoverOutcome::Killed(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::time::{Duration, Instant};

    fn sleeper() -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("600")
            .process_group(0)
            .spawn()
            .unwrap()
    }

    fn record_of(
        child: &std::process::Child,
        worker_start_time_ticks: u64,
    ) -> AttemptProcessRecord {
        AttemptProcessRecord {
            job_id: "job-1".into(),
            attempt_number: 2,
            process_id: child.id(),
            process_group: child.id(),
            start_time_ticks: process_start_time(child.id()).unwrap(),
            worker_process_id: std::process::id(),
            worker_start_time_ticks,
        }
    }

    /// Waits for the child's exit status, at most a few seconds.
    fn exit_signal(child: &mut std::process::Child) -> Option<i32> {
        use std::os::unix::process::ExitStatusExt;
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(status) = child.try_wait().unwrap() {
                return status.signal();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    #[test]
    fn the_start_time_is_read_past_a_command_name_with_spaces_and_parentheses() {
        let mine = process_start_time(std::process::id()).unwrap();
        assert!(mine > 0);
        assert_eq!(process_start_time(std::process::id()), Some(mine));
        assert_eq!(process_start_time(u32::MAX), None);
    }

    #[test]
    fn a_recorded_process_that_outlived_its_worker_is_killed_and_its_record_removed() {
        let directory = tempfile::tempdir().unwrap();
        let mut leftover = sleeper();
        // Recorded by this process in an earlier life: this process, another start time
        // would be a different worker, so use this process's own (a restart in-process).
        let record = record_of(&leftover, process_start_time(std::process::id()).unwrap());
        let file = write_record(directory.path(), &record).unwrap();
        assert!(file.is_file());
        let outcomes = kill_leftover_processes(directory.path());
        assert_eq!(outcomes, vec![LeftoverOutcome::Killed(record)]);
        assert_eq!(exit_signal(&mut leftover), Some(Signal::KILL.as_raw()));
        assert!(!file.exists());
    }

    #[test]
    fn a_reused_pid_is_not_killed() {
        let directory = tempfile::tempdir().unwrap();
        let mut unrelated = sleeper();
        let mut record = record_of(&unrelated, 0);
        // Same pid, another start time: the recorded process ended and the pid was
        // handed to this one.
        record.start_time_ticks += 1;
        let file = write_record(directory.path(), &record).unwrap();
        let outcomes = kill_leftover_processes(directory.path());
        assert_eq!(outcomes, vec![LeftoverOutcome::AlreadyGone(record)]);
        assert!(!file.exists());
        assert_eq!(unrelated.try_wait().unwrap(), None, "still running");
        unrelated.kill().unwrap();
        let _ = unrelated.wait();
    }

    #[test]
    fn a_process_of_another_live_worker_is_left_alone() {
        let directory = tempfile::tempdir().unwrap();
        let mut other_worker = sleeper();
        let mut attempt = sleeper();
        let mut record = record_of(&attempt, 0);
        record.worker_process_id = other_worker.id();
        record.worker_start_time_ticks = process_start_time(other_worker.id()).unwrap();
        let file = write_record(directory.path(), &record).unwrap();
        let outcomes = kill_leftover_processes(directory.path());
        assert_eq!(outcomes, vec![LeftoverOutcome::OwnedByALiveWorker(record)]);
        assert!(file.is_file());
        assert_eq!(attempt.try_wait().unwrap(), None, "still running");
        for child in [&mut other_worker, &mut attempt] {
            child.kill().unwrap();
            let _ = child.wait();
        }
    }

    #[test]
    fn an_unreadable_record_is_removed_and_reported() {
        let directory = tempfile::tempdir().unwrap();
        let file = directory.path().join("job.attempt-1.json");
        std::fs::write(&file, "{ not a record").unwrap();
        let outcomes = kill_leftover_processes(directory.path());
        assert!(
            matches!(&outcomes[..], [LeftoverOutcome::Unreadable { file: named, .. }] if *named == file),
            "{outcomes:?}"
        );
        assert!(!file.exists());
        assert!(kill_leftover_processes(&directory.path().join("missing")).is_empty());
    }

    #[test]
    fn a_hostname_is_one_safe_path_component() {
        let base = Path::new("/c");
        assert_eq!(
            record_directory(base, "node-1.example"),
            Path::new("/c/attempt-processes/node-1.example")
        );
        assert_eq!(
            record_directory(base, "../x/y"),
            Path::new("/c/attempt-processes/.._x_y")
        );
        assert_eq!(
            record_directory(base, ".."),
            Path::new("/c/attempt-processes/_")
        );
    }
}
