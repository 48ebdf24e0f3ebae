//! A gang member's container on the node's network (issue 31): its members must reach
//! rank 0's master port, on this node across containers and on other nodes through the
//! node's address, which a network namespace of its own (loopback only) cannot. The
//! trade-off is written in `crate::gang_member`'s module docs: such a container reaches
//! what the node reaches, and what shares the node's network reaches its master port.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use oci_spec::runtime::{LinuxNamespaceType, Spec};

use super::Sandbox;
use super::bundle::bind;
use crate::error::WorkerError;

impl Sandbox {
    /// Moves the prepared container `name` (its bundle written by [`Sandbox::prepare`] or
    /// [`Sandbox::prepare_in_image`], not yet run) onto the node's network: no network
    /// namespace of its own, and the host's `/sys` bound read-only where a sysfs of its
    /// own was (sysfs can be mounted only by the owner of the network namespace), as
    /// `--sandbox-host-network` tenants get. Everything else of the container (user and
    /// pid namespaces, mounts, capabilities, seccomp, limits) stays.
    pub fn share_host_network(&self, name: &str) -> Result<(), WorkerError> {
        let config = self.bundle_directory.join(name).join("config.json");
        let mut spec = Spec::load(&config).map_err(|error| {
            WorkerError::AttemptProcess(format!("cannot read {}: {error}", config.display()))
        })?;
        share_host_network_in(&mut spec)?;
        write_config(&config, &spec)
    }
}

/// `spec` without its network namespace, with the host's `/sys` read-only.
pub(super) fn share_host_network_in(spec: &mut Spec) -> Result<(), WorkerError> {
    if let Some(linux) = spec.linux_mut()
        && let Some(namespaces) = linux.namespaces_mut()
    {
        namespaces.retain(|namespace| namespace.typ() != LinuxNamespaceType::Network);
    }
    let host_sys = bind("/sys", false)?;
    if let Some(mounts) = spec.mounts_mut() {
        for mount in mounts.iter_mut() {
            if mount.destination() == Path::new("/sys") {
                *mount = host_sys.clone();
            }
        }
    }
    Ok(())
}

/// Replaces the bundle's config, still the worker's alone (it holds the job's
/// environment).
fn write_config(config: &Path, spec: &Spec) -> Result<(), WorkerError> {
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
