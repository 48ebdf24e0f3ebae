//! A run contained in its job's image instead of the host's system directories: the
//! bundle [`Sandbox::prepare`] writes, with its root moved onto the image
//! (`crate::image::container_root`). Everything else of the container (user namespace,
//! capabilities, seccomp, limits, the job's paths, the guard, the GPU's devices) is the
//! same as without an image, because it is the same bundle.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use oci_spec::runtime::Spec;

use super::bundle::{DEFAULT_PATH, SYSTEM_DIRECTORIES};
use super::{ContainerRequest, Sandbox};
use crate::error::WorkerError;
use crate::image::PulledImage;
use crate::image::container_root::ImageRunRoot;
use crate::sandbox::Container;

impl Sandbox {
    /// The node's image cache.
    pub fn images(&self) -> &crate::image::ImageCache {
        &self.images
    }

    /// As [`Sandbox::prepare`], with `image` as the container's read-only root, mounted
    /// under `runs_directory` (the image cache's). `library_directories`: where the host
    /// driver's libraries are bound (first on `LD_LIBRARY_PATH`). The returned root must
    /// outlive the container: drop it after [`Container::remove`].
    pub fn prepare_in_image(
        &self,
        request: &ContainerRequest,
        image: &PulledImage,
        runs_directory: &Path,
        library_directories: &[PathBuf],
    ) -> Result<(tokio::process::Command, Container, ImageRunRoot), WorkerError> {
        let (command, container) = self.prepare(request)?;
        let adapted = self.identity(&request.tenant).and_then(|identity| {
            let root =
                ImageRunRoot::mount(image, runs_directory, &request.name, identity.first_host_id)?;
            let config = self
                .bundle_directory
                .join(&request.name)
                .join("config.json");
            let mut spec = Spec::load(&config).map_err(|error| {
                WorkerError::AttemptProcess(format!("cannot read {}: {error}", config.display()))
            })?;
            root.adapt_spec(
                &mut spec,
                &SYSTEM_DIRECTORIES,
                DEFAULT_PATH,
                library_directories,
            )?;
            rewrite_config(&config, &spec)?;
            Ok(root)
        });
        match adapted {
            Ok(root) => Ok((command, container, root)),
            Err(error) => {
                container.remove();
                Err(error)
            }
        }
    }
}

/// Replaces the bundle's config, still the worker's alone (it holds the job's
/// environment).
fn rewrite_config(config: &Path, spec: &Spec) -> Result<(), WorkerError> {
    let text = serde_json::to_vec(spec)
        .map_err(|error| WorkerError::AttemptProcess(format!("the container's config: {error}")))?;
    std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(config)
        .and_then(|mut file| file.write_all(&text))
        .map_err(|error| WorkerError::io(format!("cannot write {}", config.display()), error))
}
