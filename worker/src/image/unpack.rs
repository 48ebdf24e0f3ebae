//! Unpacking an image's layers into one root filesystem, as a hostile tenant may have
//! written them.
//!
//! A layer is a tar stream (plain, gzip or zstd) of changes over the layers below it:
//! files, directories, symbolic and hard links, and whiteouts (`.wh.NAME` removes `NAME`
//! from the lower layers, `.wh..wh..opq` empties its directory of them). The tar is the
//! tenant's input, unpacked by the worker as root on the host, so:
//! - no entry lands outside the root: a `..` component is refused, and a symbolic link
//!   met on the way (one an earlier entry or layer made) is followed the way the
//!   container will see it, with the root as `/` and `..` stopping there
//!   ([`resolve_in_root`]), so `escape -> /etc` then `escape/passwd` writes the image's
//!   own `/etc/passwd`, never the host's;
//! - the last component of an entry is never followed: whatever was there is replaced;
//! - a hard link's target is resolved the same way and must be a file of the image;
//! - device nodes and FIFOs are skipped (a device node the image owns would open the
//!   host's device), setuid and setgid bits dropped (the files are the worker's, root's,
//!   on the host);
//! - a layer that unpacks to more than the cache may hold, or to more than
//!   [`MAX_ENTRIES_PER_LAYER`] entries, is refused (a small compressed bomb).
//!
//! Nothing else writes the root while it is unpacked (it is a staging directory of the
//! worker's, which no container mounts until it is complete), so checking a path and
//! then writing it races nothing.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{BufReader, Read};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// The most entries one layer may have.
pub const MAX_ENTRIES_PER_LAYER: u64 = 1_000_000;

/// How many symbolic links one path may go through, as Linux's own limit.
const MAX_LINK_HOPS: u32 = 40;

const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_MARKER: &str = ".wh..wh..opq";

/// Why a layer could not be unpacked: the image is at fault (`Refused`) or the worker's
/// disk (`Io`).
#[derive(Debug)]
pub enum UnpackError {
    Refused(String),
    Io(String, std::io::Error),
}

impl std::fmt::Display for UnpackError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UnpackError::Refused(reason) => formatter.write_str(reason),
            UnpackError::Io(context, error) => write!(formatter, "{context}: {error}"),
        }
    }
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> UnpackError {
    let context = context.into();
    move |error| UnpackError::Io(context, error)
}

/// A layer's compression, from its media type, or from its first bytes when the media
/// type does not say (Docker's `...rootfs.diff.tar.gzip`, or a registry's generic type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    pub fn of_layer(media_type: &str, path: &Path) -> Result<Compression, UnpackError> {
        if media_type.ends_with("+gzip") || media_type.ends_with(".tar.gzip") {
            return Ok(Compression::Gzip);
        }
        if media_type.ends_with("+zstd") {
            return Ok(Compression::Zstd);
        }
        let mut magic = [0_u8; 4];
        let mut file = File::open(path).map_err(io(format!("cannot open {}", path.display())))?;
        let read = file
            .read(&mut magic)
            .map_err(io(format!("cannot read {}", path.display())))?;
        Ok(match &magic[..read] {
            [0x1f, 0x8b, ..] => Compression::Gzip,
            [0x28, 0xb5, 0x2f, 0xfd] => Compression::Zstd,
            _ => Compression::None,
        })
    }
}

/// Opens a layer's tar stream, decompressed.
fn open_tar(path: &Path, compression: Compression) -> Result<Box<dyn Read>, UnpackError> {
    let file = BufReader::new(
        File::open(path).map_err(io(format!("cannot open layer {}", path.display())))?,
    );
    Ok(match compression {
        Compression::None => Box::new(file),
        Compression::Gzip => Box::new(flate2::read::GzDecoder::new(file)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::with_buffer(file)
                .map_err(io(format!("cannot read zstd layer {}", path.display())))?,
        ),
    })
}

/// What unpacking one layer did, for the cache's size and the log.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UnpackSummary {
    /// Bytes of regular files written.
    pub file_bytes: u64,
    pub entries: u64,
    /// Device nodes and FIFOs left out.
    pub skipped_special_files: u64,
}

/// Applies the layer at `layer` (a verified blob) to `root`: its whiteouts first (they
/// remove what lower layers made), then its entries. `byte_budget` is how many bytes of
/// files it may still write.
pub fn apply_layer(
    root: &Path,
    layer: &Path,
    compression: Compression,
    byte_budget: u64,
) -> Result<UnpackSummary, UnpackError> {
    // Whiteouts apply to the layers below only, wherever they sit in the tar, so they are
    // collected and applied before any entry of this layer is written.
    let mut archive = tar::Archive::new(open_tar(layer, compression)?);
    let mut removals = Vec::new();
    for entry in archive
        .entries()
        .map_err(|error| refused_tar(layer, error))?
    {
        let entry = entry.map_err(|error| refused_tar(layer, error))?;
        let path = entry.path().map_err(|error| refused_tar(layer, error))?;
        let components = entry_components(&path)?;
        if let Some(name) = components.last().and_then(|name| name.to_str())
            && name.starts_with(WHITEOUT_PREFIX)
        {
            removals.push(components);
        }
    }
    for components in &removals {
        apply_whiteout(root, components)?;
    }

    let mut archive = tar::Archive::new(open_tar(layer, compression)?);
    let mut summary = UnpackSummary::default();
    for entry in archive
        .entries()
        .map_err(|error| refused_tar(layer, error))?
    {
        let mut entry = entry.map_err(|error| refused_tar(layer, error))?;
        summary.entries += 1;
        if summary.entries > MAX_ENTRIES_PER_LAYER {
            return Err(UnpackError::Refused(format!(
                "a layer has more than {MAX_ENTRIES_PER_LAYER} entries"
            )));
        }
        let path = entry
            .path()
            .map_err(|error| refused_tar(layer, error))?
            .into_owned();
        let components = entry_components(&path)?;
        let Some((name, parents)) = components.split_last() else {
            continue; // the root itself ("./")
        };
        if name
            .to_str()
            .is_some_and(|name| name.starts_with(WHITEOUT_PREFIX))
        {
            continue;
        }
        let kind = entry.header().entry_type();
        if matches!(
            kind,
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo
        ) {
            summary.skipped_special_files += 1;
            continue;
        }
        let parent = resolve_in_root(root, parents, true)?;
        let target = parent.join(name);
        let mode = entry.header().mode().unwrap_or(0o644) & 0o1777;
        match kind {
            tar::EntryType::Directory => {
                match std::fs::symlink_metadata(&target) {
                    Ok(existing) if existing.is_dir() => {}
                    Ok(_) => {
                        remove_entry(&target)?;
                        create_directory(&target)?;
                    }
                    Err(_) => create_directory(&target)?,
                }
                // Kept traversable by the worker whatever the image says, so later
                // entries and the cache's own walks can go through it.
                set_mode(&target, mode | 0o700)?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                remove_entry(&target)?;
                let size = entry.header().size().unwrap_or(0);
                if summary.file_bytes.saturating_add(size) > byte_budget {
                    return Err(UnpackError::Refused(format!(
                        "the image unpacks to more than {byte_budget} bytes, the most the \
                         worker's image cache can hold"
                    )));
                }
                // O_EXCL and O_NOFOLLOW: the name was just removed, so a link put there
                // is never followed.
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .custom_flags(libc_o_nofollow())
                    .mode(0o600)
                    .open(&target)
                    .map_err(io(format!("cannot create {}", target.display())))?;
                let copied = std::io::copy(&mut (&mut entry).take(size), &mut file)
                    .map_err(|error| refused_tar(layer, error))?;
                summary.file_bytes += copied;
                set_mode(&target, mode)?;
            }
            tar::EntryType::Symlink => {
                let Some(link) = entry
                    .link_name()
                    .map_err(|error| refused_tar(layer, error))?
                else {
                    return Err(UnpackError::Refused(format!(
                        "symbolic link {} has no target",
                        path.display()
                    )));
                };
                remove_entry(&target)?;
                // Kept as written: the container resolves it inside its own root, and
                // nothing of the worker's follows it.
                std::os::unix::fs::symlink(&link, &target)
                    .map_err(io(format!("cannot create {}", target.display())))?;
            }
            tar::EntryType::Link => {
                let Some(link) = entry
                    .link_name()
                    .map_err(|error| refused_tar(layer, error))?
                else {
                    return Err(UnpackError::Refused(format!(
                        "hard link {} has no target",
                        path.display()
                    )));
                };
                let link_components = entry_components(&link)?;
                let Some((link_name, link_parents)) = link_components.split_last() else {
                    return Err(UnpackError::Refused(format!(
                        "hard link {} names the root",
                        path.display()
                    )));
                };
                let missing = || {
                    UnpackError::Refused(format!(
                        "hard link {} names {}, which the image does not have",
                        path.display(),
                        link.display()
                    ))
                };
                let source = match resolve_in_root(root, link_parents, false) {
                    Ok(parent) => parent.join(link_name),
                    Err(UnpackError::Io(..)) => return Err(missing()),
                    Err(refused) => return Err(refused),
                };
                let metadata = std::fs::symlink_metadata(&source).map_err(|_| missing())?;
                if metadata.is_dir() {
                    return Err(UnpackError::Refused(format!(
                        "hard link {} names a directory",
                        path.display()
                    )));
                }
                if source == target {
                    continue;
                }
                remove_entry(&target)?;
                // linkat without AT_SYMLINK_FOLLOW: a symbolic link is linked as itself.
                std::fs::hard_link(&source, &target)
                    .map_err(io(format!("cannot link {}", target.display())))?;
            }
            // Pax and GNU headers are read by the tar crate itself; anything else carries
            // nothing a root filesystem needs.
            _ => {}
        }
    }
    Ok(summary)
}

fn libc_o_nofollow() -> i32 {
    rustix::fs::OFlags::NOFOLLOW.bits() as i32
}

fn refused_tar(layer: &Path, error: std::io::Error) -> UnpackError {
    UnpackError::Refused(format!(
        "layer {} is not a readable tar: {error}",
        layer.file_name().unwrap_or_default().to_string_lossy()
    ))
}

/// An entry's path as its components: leading `/` and `.` dropped (tars write `./etc`
/// and `/etc` alike), `..` refused (no layer a build tool writes has one).
fn entry_components(path: &Path) -> Result<Vec<OsString>, UnpackError> {
    let mut components = Vec::new();
    for component in path.components() {
        match component {
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            Component::ParentDir => {
                return Err(UnpackError::Refused(format!(
                    "entry {} climbs out of the image's root with ..",
                    path.display()
                )));
            }
            Component::Normal(name) => components.push(name.to_os_string()),
        }
    }
    Ok(components)
}

/// The directory `components` name under `root`, as the container will resolve it:
/// symbolic links followed with `root` as `/`, `..` never above `root`; missing
/// directories created when `create` (else an error). Every path returned is inside
/// `root` and a real directory there.
pub fn resolve_in_root(
    root: &Path,
    components: &[OsString],
    create: bool,
) -> Result<PathBuf, UnpackError> {
    let mut resolved: Vec<OsString> = Vec::new();
    let mut pending: VecDeque<OsString> = components.iter().cloned().collect();
    let mut hops = 0;
    let here = |resolved: &[OsString]| {
        let mut path = root.to_path_buf();
        path.extend(resolved);
        path
    };
    while let Some(component) = pending.pop_front() {
        if component == OsStr::new(".") || component.is_empty() {
            continue;
        }
        if component == OsStr::new("..") {
            resolved.pop();
            continue;
        }
        let candidate = here(&resolved).join(&component);
        match std::fs::symlink_metadata(&candidate) {
            Ok(metadata) if metadata.file_type().is_symlink() => {
                hops += 1;
                if hops > MAX_LINK_HOPS {
                    return Err(UnpackError::Refused(format!(
                        "{} goes through more than {MAX_LINK_HOPS} symbolic links",
                        display_components(components)
                    )));
                }
                let link = std::fs::read_link(&candidate)
                    .map_err(io(format!("cannot read {}", candidate.display())))?;
                if link.is_absolute() {
                    resolved.clear();
                }
                let mut expanded: Vec<OsString> = link
                    .components()
                    .filter_map(|component| match component {
                        Component::Normal(name) => Some(name.to_os_string()),
                        Component::ParentDir => Some(OsString::from("..")),
                        _ => None,
                    })
                    .collect();
                expanded.extend(pending.drain(..));
                pending = expanded.into();
            }
            Ok(metadata) if metadata.is_dir() => resolved.push(component),
            Ok(_) => {
                return Err(UnpackError::Refused(format!(
                    "{} goes through {}, which is not a directory",
                    display_components(components),
                    candidate.strip_prefix(root).unwrap_or(&candidate).display()
                )));
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound && create => {
                create_directory(&candidate)?;
                set_mode(&candidate, 0o755)?;
                resolved.push(component);
            }
            Err(error) => {
                return Err(UnpackError::Io(
                    format!("cannot resolve {}", candidate.display()),
                    error,
                ));
            }
        }
    }
    Ok(here(&resolved))
}

fn display_components(components: &[OsString]) -> String {
    let mut path = PathBuf::from("/");
    path.extend(components);
    path.display().to_string()
}

/// A whiteout: `.wh..wh..opq` empties its directory, `.wh.NAME` removes `NAME`.
fn apply_whiteout(root: &Path, components: &[OsString]) -> Result<(), UnpackError> {
    let Some((name, parents)) = components.split_last() else {
        return Ok(());
    };
    let parent = match resolve_in_root(root, parents, false) {
        Ok(parent) => parent,
        // Nothing below to remove.
        Err(UnpackError::Io(_, error)) if error.kind() == std::io::ErrorKind::NotFound => {
            return Ok(());
        }
        Err(other) => return Err(other),
    };
    let name = name.to_string_lossy();
    if name == OPAQUE_MARKER {
        let entries = match std::fs::read_dir(&parent) {
            Ok(entries) => entries,
            Err(_) => return Ok(()),
        };
        for entry in entries {
            let entry = entry.map_err(io(format!("cannot list {}", parent.display())))?;
            remove_entry(&entry.path())?;
        }
        return Ok(());
    }
    let removed = &name[WHITEOUT_PREFIX.len()..];
    if removed.is_empty() || removed == "." || removed == ".." || removed.contains('/') {
        return Err(UnpackError::Refused(format!(
            "whiteout {} names no entry",
            display_components(components)
        )));
    }
    remove_entry(&parent.join(removed))
}

/// Removes whatever is at `path` without following it: a file, a link, or a directory
/// with everything in it (`remove_dir_all` does not follow links either); nothing there
/// is no error.
pub(crate) fn remove_without_following(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(metadata) if metadata.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(error),
    }
}

fn remove_entry(path: &Path) -> Result<(), UnpackError> {
    remove_without_following(path).map_err(io(format!("cannot remove {}", path.display())))
}

fn create_directory(path: &Path) -> Result<(), UnpackError> {
    std::fs::create_dir(path).map_err(io(format!("cannot create {}", path.display())))
}

fn set_mode(path: &Path, mode: u32) -> Result<(), UnpackError> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io(format!("cannot set the mode of {}", path.display())))
}

#[cfg(test)]
mod tests;
