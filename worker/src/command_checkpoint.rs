//! A command job's reported checkpoints (`carve_core::command::checkpoint`): what a
//! `CARVE_CHECKPOINT step=N path=REL` line names in the job's directory is copied to
//! `{job}.recorded/attempt-{A}.step-{N}/REL`, beside the job's directory, before it is
//! reported; the job's next attempt resumes from that copy, mounted read-only.
//!
//! Why a copy: the program owns its directory and rewrites its checkpoint in place
//! (`torch.save` truncates the file it writes), so neither the name it reported nor a
//! hard link to it would still hold the step the scheduler recorded once it wrote the
//! next one, or once an attempt that lost its worker's lease wrote on. The copy is the
//! worker's: nothing of the tenant's writes there.
//!
//! The path is the tenant's, and the worker reads it as root: it is opened one component
//! at a time from the job's directory with `O_NOFOLLOW`, so a link anywhere on it (to
//! another tenant's files, to the worker's token) is refused, never followed; only
//! regular files and directories are copied, each checked by its type before it is
//! opened (a FIFO or a device is never opened) and again on the open descriptor. A file
//! that changed while it was copied is not recorded: the copy would be neither step.

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use carve_core::command::checkpoint::{
    CheckpointLine, MOST_PATH_COMPONENTS, parse_recorded_name, recorded_name,
};
use rustix::fs::{AtFlags, FileType, Mode, OFlags, Stat};

use crate::checkpoint_files::{CheckpointName, is_superseded};
use crate::image::remove_without_following;

/// The most files and directories one checkpoint may hold.
pub const MOST_CHECKPOINT_ENTRIES: usize = 100_000;

/// Where the recorded copies of the checkpoints written in `checkpoint_dir` go: beside
/// it, `{checkpoint_dir}.recorded`.
pub fn recorded_directory(checkpoint_dir: &Path) -> PathBuf {
    let mut name = checkpoint_dir
        .file_name()
        .map(OsStr::to_os_string)
        .unwrap_or_default();
    name.push(".recorded");
    checkpoint_dir.with_file_name(name)
}

/// Copies the checkpoint `line` names in `checkpoint_dir` to its recorded place under
/// `recorded_directory` (see the module docs); returns the copy's path, the location to
/// report. The error is the reason, for the job's log.
pub fn record_reported_checkpoint(
    checkpoint_dir: &Path,
    recorded_directory: &Path,
    attempt_number: u32,
    line: &CheckpointLine,
) -> Result<PathBuf, String> {
    let relative = line.relative_path();
    let failed = |what: &str, error: std::io::Error| format!("cannot {what} {relative}: {error}");
    std::fs::create_dir_all(recorded_directory)
        .map_err(|error| failed("make room to record", error))?;
    let name = recorded_name(attempt_number, line.step);
    let target = recorded_directory.join(&name);
    let partial = recorded_directory.join(format!("{name}.partial"));
    // Leftovers of an earlier try at the same step are the worker's own: replaced.
    for leftover in [&target, &partial] {
        remove_without_following(leftover)
            .map_err(|error| failed("replace an earlier copy of", error))?;
    }
    std::fs::create_dir(&partial).map_err(|error| failed("make room to record", error))?;
    let copied = copy_below(checkpoint_dir, &line.components, &partial);
    if let Err(reason) = copied {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(reason);
    }
    std::fs::rename(&partial, &target).map_err(|error| failed("record", error))?;
    Ok(line
        .components
        .iter()
        .fold(target, |path, component| path.join(component)))
}

/// Opens `components` below `checkpoint_dir` without following a link and copies what
/// the last one is to the same relative place under `destination`.
fn copy_below(
    checkpoint_dir: &Path,
    components: &[String],
    destination: &Path,
) -> Result<(), String> {
    let relative = components.join("/");
    let Some((last, directories)) = components.split_last() else {
        return Err("path= names no file".to_string());
    };
    let mut directory = rustix::fs::open(
        checkpoint_dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|error| format!("cannot open the job's directory: {error}"))?;
    let mut copy_to = destination.to_path_buf();
    for component in directories {
        directory = open_directory_at(&directory, component).map_err(|error| {
            format!("{relative}: {component} is not a directory of the job's own ({error})")
        })?;
        copy_to.push(component);
        std::fs::create_dir(&copy_to)
            .map_err(|error| format!("cannot record {relative}: {error}"))?;
    }
    let mut entries = 0;
    copy_entry(&directory, last, &copy_to.join(last), 1, &mut entries)
        .map_err(|reason| format!("{relative}: {reason}"))
}

/// Copies the entry `name` of `directory` (a regular file or a directory, else refused)
/// to `target`; `depth` and `entries` bound a directory's tree.
fn copy_entry(
    directory: &OwnedFd,
    name: &str,
    target: &Path,
    depth: usize,
    entries: &mut usize,
) -> Result<(), String> {
    *entries += 1;
    if *entries > MOST_CHECKPOINT_ENTRIES {
        return Err(format!(
            "it holds more than {MOST_CHECKPOINT_ENTRIES} files and directories"
        ));
    }
    let seen = rustix::fs::statat(directory, name, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|error| format!("cannot read {name}: {error}"))?;
    match FileType::from_raw_mode(seen.st_mode) {
        FileType::RegularFile => copy_file_at(directory, name, &seen, target),
        FileType::Directory => {
            if depth > MOST_PATH_COMPONENTS {
                return Err(format!(
                    "it is nested more than {MOST_PATH_COMPONENTS} directories deep"
                ));
            }
            let inner = open_directory_at(directory, name)
                .map_err(|error| format!("cannot open {name}: {error}"))?;
            same_object(&seen, &inner, name)?;
            std::fs::create_dir(target)
                .map_err(|error| format!("cannot record {name}: {error}"))?;
            let listing = rustix::fs::Dir::read_from(&inner)
                .map_err(|error| format!("cannot list {name}: {error}"))?;
            for entry in listing {
                let entry = entry.map_err(|error| format!("cannot list {name}: {error}"))?;
                let entry_name = OsStr::from_bytes(entry.file_name().to_bytes());
                if entry_name == "." || entry_name == ".." {
                    continue;
                }
                let Some(entry_name) = entry_name.to_str() else {
                    return Err(format!("{name} holds a name that is not UTF-8"));
                };
                copy_entry(
                    &inner,
                    entry_name,
                    &target.join(entry_name),
                    depth + 1,
                    entries,
                )
                .map_err(|reason| format!("{name}/{reason}"))?;
            }
            Ok(())
        }
        FileType::Symlink => Err(format!(
            "{name} is a symbolic link, which is never followed: name the file itself"
        )),
        _ => Err(format!("{name} is neither a file nor a directory")),
    }
}

fn open_directory_at(directory: &OwnedFd, name: &str) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        directory,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// The open descriptor is the object `seen` described (not another swapped in since).
fn same_object(seen: &Stat, opened: &impl AsFd, name: &str) -> Result<Stat, String> {
    let now = rustix::fs::fstat(opened).map_err(|error| format!("cannot read {name}: {error}"))?;
    if now.st_dev != seen.st_dev || now.st_ino != seen.st_ino {
        return Err(format!("{name} was replaced while it was copied"));
    }
    Ok(now)
}

fn copy_file_at(directory: &OwnedFd, name: &str, seen: &Stat, target: &Path) -> Result<(), String> {
    let opened = rustix::fs::openat(
        directory,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|error| format!("cannot open {name}: {error}"))?;
    let before = same_object(seen, &opened, name)?;
    let mut source = File::from(opened);
    let mut copy =
        File::create_new(target).map_err(|error| format!("cannot record {name}: {error}"))?;
    std::io::copy(&mut source, &mut copy)
        .map_err(|error| format!("cannot copy {name}: {error}"))?;
    copy.set_permissions(std::fs::Permissions::from_mode(0o644))
        .and_then(|()| copy.sync_all())
        .map_err(|error| format!("cannot record {name}: {error}"))?;
    let after = same_object(seen, &source, name)?;
    let unchanged = (before.st_size, before.st_mtime, before.st_mtime_nsec)
        == (after.st_size, after.st_mtime, after.st_mtime_nsec);
    if !unchanged {
        return Err(format!(
            "{name} changed while it was copied, so the copy is neither step: write the \
             next checkpoint to a new name, or rename it into place"
        ));
    }
    Ok(())
}

/// The recorded copy an assignment's `resume_from` names, when it is one of
/// `recorded_directory`'s and is on this node: the path to give the program.
pub fn resume_checkpoint(recorded_directory: &Path, location: &str) -> Option<PathBuf> {
    let location = Path::new(location);
    let below = location.strip_prefix(recorded_directory).ok()?;
    let mut components = below.components();
    let copy = components.next()?.as_os_str().to_str()?;
    parse_recorded_name(copy)?;
    let plain = components.all(|component| matches!(component, std::path::Component::Normal(_)));
    (plain && std::fs::symlink_metadata(location).is_ok()).then(|| location.to_path_buf())
}

/// Deletes the recorded copies under `recorded_directory` that the copy holding
/// `recorded_location` supersedes (as [`is_superseded`] says of engine checkpoints:
/// older attempts' and this attempt's earlier steps), and unfinished copies of older
/// attempts; returns what it deleted. Nothing when the location is not such a copy.
pub fn delete_superseded_copies(
    recorded_directory: &Path,
    recorded_location: &Path,
) -> Vec<PathBuf> {
    let Some((attempt_number, step)) = recorded_location
        .strip_prefix(recorded_directory)
        .ok()
        .and_then(|below| below.components().next())
        .and_then(|copy| copy.as_os_str().to_str())
        .and_then(parse_recorded_name)
    else {
        return Vec::new();
    };
    let recorded = CheckpointName {
        attempt_number,
        step: Some(step),
    };
    let Ok(entries) = std::fs::read_dir(recorded_directory) else {
        return Vec::new();
    };
    let mut deleted = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let candidate = match name.strip_suffix(".partial") {
            // An unfinished copy: only an older attempt's is surely abandoned.
            Some(copy) => parse_recorded_name(copy).map(|(attempt, _)| CheckpointName {
                attempt_number: attempt,
                step: None,
            }),
            None => parse_recorded_name(name).map(|(attempt, step)| CheckpointName {
                attempt_number: attempt,
                step: Some(step),
            }),
        };
        if candidate.is_some_and(|candidate| is_superseded(candidate, recorded))
            && remove_without_following(&entry.path()).is_ok()
        {
            deleted.push(entry.path());
        }
    }
    deleted
}

#[cfg(test)]
mod tests;
