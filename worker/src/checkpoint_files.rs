//! An engine job's checkpoint files in its directory: the name each checkpoint is
//! promoted to before its location is reported, and which files a recorded checkpoint
//! makes superseded.
//!
//! The trainer writes every checkpoint of an attempt to one working file,
//! `{job}.attempt-{N}.ckpt`, atomically (a new file renamed over the old). Reporting
//! that name would let the attempt change what the scheduler recorded: it rewrites the
//! file at its next checkpoint, and an attempt that runs on after its worker lost the
//! lease (stale) would rewrite what the job's next attempt resumes from. So before a
//! checkpoint is reported the attempt process hard-links the working file to
//! `{job}.attempt-{N}.step-{S}.ckpt` ([`promote`]): that name is written once and never
//! again (the trainer's next write replaces the working name's inode, not this one), so
//! the file the scheduler records is the file the next attempt loads, whatever runs on.
//!
//! Once the scheduler stored a checkpoint (its `CheckpointRecorded`), every older one
//! of the job is superseded — older attempts' files and this attempt's earlier steps —
//! and the worker deletes them ([`delete_superseded`]), so retries do not pile up
//! checkpoints against `--attempt-checkpoint-limit`. Only names of this shape for this
//! job are touched, in the job's own directory; links are removed, never followed.

use std::path::{Path, PathBuf};

/// A checkpoint file of a job, read from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointName {
    pub attempt_number: u32,
    /// `None` for an attempt's working file, the step for a promoted one.
    pub step: Option<u64>,
}

/// What `file_name` is among `job_id`'s checkpoint files, if it is one.
pub fn parse_checkpoint_name(job_id: &str, file_name: &str) -> Option<CheckpointName> {
    let rest = file_name
        .strip_prefix(job_id)?
        .strip_prefix(".attempt-")?
        .strip_suffix(".ckpt")?;
    let (attempt, step) = match rest.split_once(".step-") {
        Some((attempt, step)) => (attempt, Some(step)),
        None => (rest, None),
    };
    let number = |digits: &str| {
        (!digits.is_empty() && digits.bytes().all(|byte| byte.is_ascii_digit()))
            .then(|| digits.parse::<u64>().ok())
            .flatten()
    };
    Some(CheckpointName {
        attempt_number: u32::try_from(number(attempt)?).ok()?,
        step: match step {
            Some(step) => Some(number(step)?),
            None => None,
        },
    })
}

/// The promoted name of `working`'s checkpoint of `step`: `x.ckpt` -> `x.step-{step}.ckpt`.
pub fn promoted_path(working: &Path, step: u64) -> PathBuf {
    let name = working
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name.strip_suffix(".ckpt").unwrap_or(&name);
    working.with_file_name(format!("{stem}.step-{step}.ckpt"))
}

/// Gives the checkpoint of `step` in the working file `working` its own name, never
/// written again: a hard link (the same inode, no copy), or a copy renamed into place
/// where the file system has no hard links. Returns the promoted path.
pub fn promote(working: &Path, step: u64) -> std::io::Result<PathBuf> {
    let promoted = promoted_path(working, step);
    // A leftover of an earlier try at the same step (a process stopped between link
    // and report) is replaced, never appended to.
    match std::fs::remove_file(&promoted) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    if std::fs::hard_link(working, &promoted).is_err() {
        let partial = promoted.with_extension("ckpt.partial");
        std::fs::copy(working, &partial)?;
        std::fs::rename(&partial, &promoted)?;
    }
    Ok(promoted)
}

/// Whether `candidate` is superseded by the recorded checkpoint `recorded` (both of one
/// job): any file of an older attempt, and the recorded attempt's promoted files of
/// earlier steps. Never the recorded one, a later step, or an attempt's working file of
/// the recorded attempt or a later one (the trainer writes there).
pub fn is_superseded(candidate: CheckpointName, recorded: CheckpointName) -> bool {
    if candidate.attempt_number < recorded.attempt_number {
        return true;
    }
    candidate.attempt_number == recorded.attempt_number
        && match (candidate.step, recorded.step) {
            (Some(step), Some(recorded_step)) => step < recorded_step,
            _ => false,
        }
}

/// Deletes the checkpoint files of `job_id` in `job_directory` that `recorded_location`
/// (a checkpoint the scheduler stored for the job) supersedes; returns what it deleted.
/// Nothing is deleted when the recorded location is not one of the job's checkpoint
/// names (an unknown layout).
pub fn delete_superseded(
    job_directory: &Path,
    job_id: &str,
    recorded_location: &Path,
) -> Vec<PathBuf> {
    let Some(recorded) = recorded_location
        .file_name()
        .and_then(|name| name.to_str())
        .and_then(|name| parse_checkpoint_name(job_id, name))
    else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(job_directory) else {
        return Vec::new();
    };
    let mut deleted = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(candidate) = name
            .to_str()
            .and_then(|name| parse_checkpoint_name(job_id, name))
        else {
            continue;
        };
        // A plain file or a link (removed, not followed); never a directory.
        let is_file_or_link = entry
            .file_type()
            .is_ok_and(|kind| kind.is_file() || kind.is_symlink());
        if is_file_or_link
            && is_superseded(candidate, recorded)
            && std::fs::remove_file(entry.path()).is_ok()
        {
            deleted.push(entry.path());
        }
    }
    deleted
}

#[cfg(test)]
mod tests;
