//! Container Device Interface specs: what a GPU needs in a container, as the NVIDIA
//! container toolkit describes it for this host (`nvidia-ctk cdi generate` writes
//! `/etc/cdi/nvidia.yaml`), read instead of the built-in device list where one exists.
//!
//! A spec (JSON or YAML, `.json`, `.yaml`, `.yml`) of kind `nvidia.com/gpu` names its
//! devices by index (`0`, or `gpu0` under the toolkit's type-index strategy) and by uuid
//! (`GPU-...`); a device's edits and the spec's common ones together are the GPU's:
//! - `deviceNodes`: the only device nodes the container gets. Each must be a character
//!   device under `/dev` at the same path on the host (no `..`, not a link): a spec that
//!   names anything else (a host file as a "device", a node missing on this host, a node
//!   moved to another path) is refused as a whole, with the reason, and the caller falls
//!   back to the built-in list;
//! - `mounts`: host paths bound read-only at the same path (the driver's libraries and
//!   tools, usually under `/usr`, which containers see anyway); a mount to another
//!   path, or of a relative path, is left out with the reason;
//! - `env`: `NAME=VALUE` lines, for the program's environment;
//! - `hooks`: never run (they are programs run as root on the host as the container is
//!   made); listed among what was left out, with the reason. So are the edits Carve has
//!   no use for (`additionalGIDs`, `intelRdt`, a device node's own permissions).
//!
//! Specs are read from each directory in order; where two name the same GPU, the later
//! directory wins (the CDI rule: `/var/run/cdi`, written at run time, over `/etc/cdi`).
//! A file that cannot be read or parsed is skipped, and said.

use std::collections::BTreeMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use crate::error::WorkerError;

/// Where CDI specs are looked for unless the operator says otherwise (`--cdi-dir`), in
/// increasing priority.
pub const DEFAULT_CDI_DIRECTORIES: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

/// The kind of NVIDIA GPUs in a spec.
pub const NVIDIA_GPU_KIND: &str = "nvidia.com/gpu";

/// Larger spec files are not read (the toolkit's are a few KiB).
const LARGEST_SPEC_BYTES: u64 = 4 << 20;

/// What a GPU's container gets, from a CDI spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiGpu {
    /// The spec it came from.
    pub spec_file: PathBuf,
    /// The character devices to give the container, each at its host path.
    pub device_nodes: Vec<PathBuf>,
    /// Host paths to bind read-only at the same path.
    pub read_only_paths: Vec<PathBuf>,
    /// Environment variables, in the spec's order.
    pub environment: Vec<(String, String)>,
    /// What the spec asked for and Carve leaves out, each with why.
    pub left_out: Vec<String>,
}

/// The result of looking for a GPU in the CDI directories: the GPU's edits when a spec
/// names it, and every file skipped on the way with why.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CdiLookup {
    pub gpu: Option<CdiGpu>,
    pub skipped_files: Vec<String>,
}

/// Looks for the GPU of NVML index `index` and uuid `uuid` in the specs under
/// `directories` (in increasing priority). `Err` when the spec that names it is refused
/// (see the module's doc): the caller falls back to the built-in list and says why.
pub fn find_gpu(directories: &[PathBuf], index: u32, uuid: &str) -> Result<CdiLookup, WorkerError> {
    let mut lookup = CdiLookup::default();
    let mut found: Option<(PathBuf, Spec, Vec<usize>)> = None;
    for directory in directories {
        let Ok(entries) = std::fs::read_dir(directory) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries
            .flatten()
            .map(|entry| entry.path())
            .filter(|path| {
                path.extension()
                    .and_then(|extension| extension.to_str())
                    .is_some_and(|extension| ["json", "yaml", "yml"].contains(&extension))
            })
            .collect();
        files.sort();
        for file in files {
            let spec = match read_spec(&file) {
                Ok(spec) => spec,
                Err(reason) => {
                    lookup
                        .skipped_files
                        .push(format!("{}: {reason}", file.display()));
                    continue;
                }
            };
            if spec.kind != NVIDIA_GPU_KIND {
                continue;
            }
            let matching: Vec<usize> = spec
                .devices
                .iter()
                .enumerate()
                .filter(|(_, device)| names_gpu(&device.name, index, uuid))
                .map(|(position, _)| position)
                .collect();
            if !matching.is_empty() {
                found = Some((file, spec, matching));
            }
        }
    }
    if let Some((file, spec, matching)) = found {
        lookup.gpu = Some(gpu_edits(&file, &spec, &matching).map_err(|reason| {
            WorkerError::invalid_setting(
                format!("the CDI spec {} for gpu {index} ({uuid})", file.display()),
                format!("refused: {reason}"),
            )
        })?);
    }
    Ok(lookup)
}

/// Whether a spec's device name is the GPU: its index, `gpu{index}`, or its uuid. (A
/// device named `all` is every GPU, never one slice's.)
fn names_gpu(name: &str, index: u32, uuid: &str) -> bool {
    name == index.to_string() || name == format!("gpu{index}") || (!uuid.is_empty() && name == uuid)
}

fn read_spec(file: &Path) -> Result<Spec, String> {
    let metadata = std::fs::metadata(file).map_err(|error| error.to_string())?;
    if !metadata.is_file() {
        return Err("not a regular file".into());
    }
    if metadata.len() > LARGEST_SPEC_BYTES {
        return Err(format!(
            "{} bytes, more than the {LARGEST_SPEC_BYTES} a spec may have",
            metadata.len()
        ));
    }
    let text = std::fs::read_to_string(file).map_err(|error| error.to_string())?;
    parse_spec(&text)
}

/// Parses a spec's text, JSON or YAML (YAML reads JSON too).
pub fn parse_spec(text: &str) -> Result<Spec, String> {
    serde_norway::from_str(text).map_err(|error| format!("not a CDI spec: {error}"))
}

/// A CDI spec, as far as Carve reads it; fields it does not know are ignored.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    #[serde(default)]
    pub cdi_version: String,
    pub kind: String,
    #[serde(default)]
    pub devices: Vec<Device>,
    #[serde(default)]
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub name: String,
    #[serde(default)]
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default)]
    pub mounts: Vec<SpecMount>,
    #[serde(default)]
    pub hooks: Vec<serde_norway::Value>,
    #[serde(default, rename = "additionalGIDs")]
    pub additional_gids: Vec<serde_norway::Value>,
    #[serde(default)]
    pub intel_rdt: Option<serde_norway::Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    pub path: String,
    #[serde(default)]
    pub host_path: Option<String>,
    /// Type, numbers, mode and owner: Carve takes them from the host's node itself.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_norway::Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecMount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default)]
    pub options: Vec<String>,
}

/// A path that is absolute and has no `.` or `..` in it: what it says is where it is.
fn plain_absolute(path: &str) -> Option<PathBuf> {
    let path = Path::new(path);
    let plain = path.is_absolute()
        && path
            .components()
            .all(|component| matches!(component, Component::RootDir | Component::Normal(_)));
    plain.then(|| path.to_path_buf())
}

/// The GPU's edits: its devices' (`matching`) and the spec's common ones.
fn gpu_edits(file: &Path, spec: &Spec, matching: &[usize]) -> Result<CdiGpu, String> {
    let mut gpu = CdiGpu {
        spec_file: file.to_path_buf(),
        device_nodes: Vec::new(),
        read_only_paths: Vec::new(),
        environment: Vec::new(),
        left_out: Vec::new(),
    };
    let edits = matching
        .iter()
        .map(|&position| &spec.devices[position].container_edits)
        .chain([&spec.container_edits]);
    for edits in edits {
        for node in &edits.device_nodes {
            let path = device_node(node)?;
            if !gpu.device_nodes.contains(&path) {
                gpu.device_nodes.push(path);
            }
        }
        for mount in &edits.mounts {
            match (
                plain_absolute(&mount.host_path),
                plain_absolute(&mount.container_path),
            ) {
                (Some(host), Some(container)) if host == container => {
                    if !gpu.read_only_paths.contains(&host) {
                        gpu.read_only_paths.push(host);
                    }
                }
                _ => gpu.left_out.push(format!(
                    "the mount of {:?} at {:?}: containers see host paths at the same \
                     absolute path only",
                    mount.host_path, mount.container_path
                )),
            }
        }
        for line in &edits.env {
            match line.split_once('=') {
                Some((name, value)) if !name.is_empty() => {
                    gpu.environment.push((name.to_string(), value.to_string()));
                }
                _ => gpu
                    .left_out
                    .push(format!("the env entry {line:?}: not NAME=VALUE")),
            }
        }
        if !edits.hooks.is_empty() {
            gpu.left_out.push(format!(
                "{} hook(s): Carve never runs a spec's programs as root on the host; the \
                 host's libraries are bound as they are, so no ldcache update is needed",
                edits.hooks.len()
            ));
        }
        if !edits.additional_gids.is_empty() {
            gpu.left_out
                .push("additionalGIDs: the program runs as its tenant's own ids only".to_string());
        }
        if edits.intel_rdt.is_some() {
            gpu.left_out.push("intelRdt: not a GPU's".to_string());
        }
    }
    if gpu.device_nodes.is_empty() {
        return Err("it names no device node for the gpu".to_string());
    }
    Ok(gpu)
}

/// A spec's device node, checked: a character device under `/dev`, at the same path on
/// the host, itself and not a link to one.
fn device_node(node: &DeviceNode) -> Result<PathBuf, String> {
    let path = plain_absolute(&node.path)
        .filter(|path| path.starts_with("/dev") && path != Path::new("/dev"))
        .ok_or_else(|| {
            format!(
                "the device node {:?} is not a plain path under /dev",
                node.path
            )
        })?;
    if let Some(host_path) = &node.host_path
        && Path::new(host_path) != path
    {
        return Err(format!(
            "the device node {:?} comes from another host path ({host_path:?}); Carve \
             gives a container its nodes at their host paths only",
            node.path
        ));
    }
    let metadata = std::fs::symlink_metadata(&path).map_err(|error| {
        format!(
            "the device node {} is missing here: {error}",
            path.display()
        )
    })?;
    if !metadata.file_type().is_char_device() {
        return Err(format!(
            "{} is not a character device (a link, a file or a block device)",
            path.display()
        ));
    }
    Ok(path)
}

#[cfg(test)]
mod tests;
