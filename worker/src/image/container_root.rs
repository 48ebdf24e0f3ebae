//! An image as one container run's root filesystem.
//!
//! The cached image is shared by every attempt that uses it and must never change, yet a
//! container needs mount points in its root (`/proc`, `/tmp`, its job's directories at
//! their host paths, the guard, the GPU's device nodes and driver libraries). So each run
//! gets an overlay: the cached root as its read-only lower layer and a directory of its
//! own above it, mounted at `<image cache>/runs/<container>/root`, outside the bundle (a
//! removed bundle never deletes through a mounted root). The worker makes every mount
//! point in it before the runtime starts, as the container will resolve them (the
//! image's symbolic links followed with the root as `/`: `unpack::resolve_in_root`), so
//! neither it nor the runtime ever writes through the image's links onto the host. The
//! container sees the root read-only (`root.readonly`); the run's directory is
//! unmounted and removed when the run ends ([`ImageRunRoot`]'s drop), and a worker that
//! comes back after a crash removes what its previous life left
//! ([`remove_leftover_run_roots`]).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};

use oci_spec::runtime::Spec;

use super::unpack::{UnpackError, resolve_in_root};
use super::{CachedImageRecord, PulledImage};
use crate::error::WorkerError;

/// One run's root: the image under a directory of the run's own, mounted.
#[derive(Debug)]
pub struct ImageRunRoot {
    directory: PathBuf,
    root: PathBuf,
    record: CachedImageRecord,
    mounted: bool,
}

fn failed(context: String) -> impl FnOnce(std::io::Error) -> WorkerError {
    move |error| WorkerError::io(context, error)
}

impl ImageRunRoot {
    /// Mounts `image` for the container `name` under `runs_directory`; the run's own
    /// layer belongs to `container_root_uid` (the container's root user's host id), as a
    /// bundle's root does.
    pub fn mount(
        image: &PulledImage,
        runs_directory: &Path,
        name: &str,
        container_root_uid: u32,
    ) -> Result<ImageRunRoot, WorkerError> {
        use std::os::unix::fs::PermissionsExt;
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(WorkerError::AttemptProcess(format!(
                "{name:?} cannot name a container's image root"
            )));
        }
        let directory = runs_directory.join(name);
        // A run of the same name is one a killed worker left behind.
        remove_run_root(&directory);
        let upper = directory.join("upper");
        let work = directory.join("work");
        let root = directory.join("root");
        for path in [&upper, &work, &root] {
            std::fs::create_dir_all(path)
                .map_err(failed(format!("cannot create {}", path.display())))?;
        }
        for path in [runs_directory, directory.as_path(), root.as_path()] {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o711))
                .map_err(failed(format!("cannot set up {}", path.display())))?;
        }
        std::fs::set_permissions(&upper, std::fs::Permissions::from_mode(0o755))
            .and_then(|()| {
                std::os::unix::fs::chown(&upper, Some(container_root_uid), Some(container_root_uid))
            })
            .map_err(failed(format!("cannot set up {}", upper.display())))?;
        let paths = [&image.rootfs, &upper, &work];
        if let Some(path) = paths.iter().find(|path| {
            let text = path.to_string_lossy();
            text.contains(',') || text.contains(':') || text.contains('\\')
        }) {
            return Err(WorkerError::AttemptProcess(format!(
                "{} cannot be an overlay directory (it has a comma, colon or backslash)",
                path.display()
            )));
        }
        let options = format!(
            "lowerdir={},upperdir={},workdir={}",
            image.rootfs.display(),
            upper.display(),
            work.display()
        );
        let options = std::ffi::CString::new(options).map_err(|_| {
            WorkerError::AttemptProcess("an overlay path holds a NUL byte".to_string())
        })?;
        rustix::mount::mount(
            "overlay",
            &root,
            "overlay",
            rustix::mount::MountFlags::NOSUID | rustix::mount::MountFlags::NODEV,
            options.as_c_str(),
        )
        .map_err(|error| {
            WorkerError::io(
                format!(
                    "cannot mount the image {} as {}'s root",
                    image.record.digest,
                    root.display()
                ),
                error.into(),
            )
        })?;
        Ok(ImageRunRoot {
            directory,
            root,
            record: image.record.clone(),
            mounted: true,
        })
    }

    /// Where the container's root is mounted.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Makes `spec` run in this root: its `root.path` is this root (read-only), the binds
    /// of the host's system directories (`host_system_directories`) are left out, every
    /// other mount's mount point is made in the run's own layer, and the image's `Env`
    /// is the base of the program's environment (the job's own variables and the
    /// worker's win; a `PATH` equal to `worker_default_path`, the worker's default, gives
    /// way to the image's). `library_directories` (where the host driver's libraries
    /// are bound) go first on `LD_LIBRARY_PATH`.
    pub fn adapt_spec(
        &self,
        spec: &mut Spec,
        host_system_directories: &[&str],
        worker_default_path: &str,
        library_directories: &[PathBuf],
    ) -> Result<(), WorkerError> {
        let mut root = spec.root().clone().unwrap_or_default();
        root.set_path(self.root.clone());
        root.set_readonly(Some(true));
        spec.set_root(Some(root));

        let mounts: Vec<_> = spec
            .mounts()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .filter(|mount| {
                let is_system_bind = mount.typ().as_deref() == Some("bind")
                    && mount.source().as_deref() == Some(mount.destination().as_path())
                    && host_system_directories
                        .iter()
                        .any(|directory| mount.destination() == Path::new(directory));
                !is_system_bind
            })
            .collect();
        for mount in &mounts {
            let is_file = mount.typ().as_deref() == Some("bind")
                && mount
                    .source()
                    .as_ref()
                    .and_then(|source| std::fs::metadata(source).ok())
                    .is_some_and(|metadata| !metadata.is_dir());
            self.make_mount_point(mount.destination(), is_file)?;
        }
        spec.set_mounts(Some(mounts));

        if let Some(mut process) = spec.process().clone() {
            let mut environment: BTreeMap<String, String> = BTreeMap::new();
            let split = |entry: &str| {
                entry
                    .split_once('=')
                    .map(|(name, value)| (name.to_string(), value.to_string()))
            };
            for (name, value) in self.record.env.iter().filter_map(|entry| split(entry)) {
                environment.insert(name, value);
            }
            let image_path = environment.get("PATH").cloned();
            for (name, value) in process
                .env()
                .clone()
                .unwrap_or_default()
                .iter()
                .filter_map(|entry| split(entry))
            {
                if name == "PATH" && value == worker_default_path && image_path.is_some() {
                    continue;
                }
                environment.insert(name, value);
            }
            if !library_directories.is_empty() {
                let mut directories: Vec<String> = library_directories
                    .iter()
                    .map(|directory| directory.to_string_lossy().into_owned())
                    .collect();
                if let Some(existing) = environment.get("LD_LIBRARY_PATH") {
                    directories.push(existing.clone());
                }
                environment.insert("LD_LIBRARY_PATH".to_string(), directories.join(":"));
            }
            process.set_env(Some(
                environment
                    .into_iter()
                    .map(|(name, value)| format!("{name}={value}"))
                    .collect(),
            ));
            spec.set_process(Some(process));
        }
        Ok(())
    }

    /// Makes `destination` exist in the root (a directory, or an empty file for a
    /// file's bind), resolved inside it.
    fn make_mount_point(&self, destination: &Path, is_file: bool) -> Result<(), WorkerError> {
        let components: Vec<OsString> = destination
            .components()
            .filter_map(|component| match component {
                Component::Normal(name) => Some(name.to_os_string()),
                _ => None,
            })
            .collect();
        let Some((name, parents)) = components.split_last() else {
            return Ok(());
        };
        let refused = |error: UnpackError| {
            WorkerError::AttemptProcess(format!(
                "cannot make the mount point {} in the image: {error}",
                destination.display()
            ))
        };
        let parent = resolve_in_root(&self.root, parents, true).map_err(refused)?;
        let target = parent.join(name);
        match std::fs::symlink_metadata(&target) {
            Ok(metadata) if metadata.file_type().is_symlink() => {
                // The image's link would be followed by the runtime; the mount point is
                // made where it leads, inside the root.
                let resolved = resolve_in_root(&self.root, &components, !is_file).map_err(refused);
                match resolved {
                    Ok(_) => Ok(()),
                    Err(_) if is_file => Ok(()),
                    Err(error) => Err(error),
                }
            }
            Ok(_) => Ok(()),
            Err(_) if is_file => std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&target)
                .map(drop)
                .map_err(failed(format!("cannot create {}", target.display()))),
            Err(_) => std::fs::create_dir(&target)
                .map_err(failed(format!("cannot create {}", target.display()))),
        }
    }
}

impl Drop for ImageRunRoot {
    fn drop(&mut self) {
        if self.mounted {
            remove_run_root(&self.directory);
        }
    }
}

/// Unmounts and removes one run's directory (nothing when it is not there).
fn remove_run_root(directory: &Path) {
    let root = directory.join("root");
    // Detached: a process still inside (it cannot be: the container is gone) would
    // otherwise keep it busy.
    let _ = rustix::mount::unmount(&root, rustix::mount::UnmountFlags::DETACH);
    let mounted_still = std::fs::read_to_string("/proc/self/mountinfo")
        .map(|table| table.contains(&format!(" {} ", root.display())))
        .unwrap_or(false);
    if mounted_still {
        // Never delete through a mounted root.
        tracing::warn!(root = %root.display(), "an image root is still mounted; left in place");
        return;
    }
    let _ = std::fs::remove_dir_all(directory);
}

/// Unmounts and removes every run root under `runs_directory`: what a worker killed
/// mid-run left.
pub fn remove_leftover_run_roots(runs_directory: &Path) {
    if let Ok(entries) = std::fs::read_dir(runs_directory) {
        for entry in entries.flatten() {
            remove_run_root(&entry.path());
        }
    }
}
