//! The real GPUs of this node, through NVML (`nvml-wrapper`, which loads
//! `libnvidia-ml.so.1` at run time): discovery, and each GPU's compute processes with
//! the device memory each uses (read by the watchdog, `watchdog.rs`).
//!
//! Every NVML call blocks (it talks to the driver). The functions here are plain
//! blocking functions; async code calls them through `tokio::task::spawn_blocking`
//! (see [`open_nvml`] and the watchdog's rounds). Without the library (no NVIDIA
//! driver on this node) opening NVML is an error, never a panic.

use std::fmt;
use std::sync::Arc;

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;

use crate::error::WorkerError;

/// One GPU as NVML describes it when the worker starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveredGpu {
    /// The CUDA device index on this node.
    pub index: u32,
    /// NVML's `GPU-...` uuid.
    pub uuid: String,
    /// The product name, e.g. "NVIDIA H100 80GB HBM3".
    pub model_name: String,
    pub total_bytes: u64,
    /// Unallocated device memory when it was discovered.
    pub free_bytes: u64,
    /// `major.minor`, e.g. "8.0"; empty when NVML cannot say.
    pub compute_capability: String,
    /// Whether MIG mode is on; `None` where the GPU does not support MIG.
    pub mig_enabled: Option<bool>,
}

/// An initialized NVML, shared by discovery and the usage watch. Cheap to clone.
#[derive(Clone)]
pub struct NvmlHandle {
    nvml: Arc<Nvml>,
}

impl fmt::Debug for NvmlHandle {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("NvmlHandle")
    }
}

fn nvml_error(what: &str, error: nvml_wrapper::error::NvmlError) -> WorkerError {
    WorkerError::Nvml(format!("{what}: {error}"))
}

impl NvmlHandle {
    /// Loads and initializes NVML. Blocking. Fails (never panics) when
    /// `libnvidia-ml.so.1` is missing: `nvml-wrapper` opens it with `libloading`, whose
    /// `dlopen` failure comes back as an error, and every symbol lookup is checked.
    pub fn open() -> Result<NvmlHandle, WorkerError> {
        let nvml = Nvml::init().map_err(|error| nvml_error("cannot initialize", error))?;
        Ok(NvmlHandle {
            nvml: Arc::new(nvml),
        })
    }

    /// Every GPU NVML sees. Blocking. Model, uuid, index and memory must be readable;
    /// compute capability and MIG mode are left empty where the GPU cannot say.
    pub fn discover(&self) -> Result<Vec<DiscoveredGpu>, WorkerError> {
        let count = self
            .nvml
            .device_count()
            .map_err(|error| nvml_error("cannot count gpus", error))?;
        (0..count)
            .map(|position| {
                let device = self
                    .nvml
                    .device_by_index(position)
                    .map_err(|error| nvml_error(&format!("gpu {position}"), error))?;
                let read =
                    |what: &str, error| nvml_error(&format!("gpu {position}: {what}"), error);
                let memory = device
                    .memory_info()
                    .map_err(|error| read("memory", error))?;
                let compute_capability = device
                    .cuda_compute_capability()
                    .map(|capability| format!("{}.{}", capability.major, capability.minor))
                    .unwrap_or_default();
                Ok(DiscoveredGpu {
                    index: device.index().map_err(|error| read("index", error))?,
                    uuid: device.uuid().map_err(|error| read("uuid", error))?,
                    model_name: device.name().map_err(|error| read("name", error))?,
                    total_bytes: memory.total,
                    free_bytes: memory.free,
                    compute_capability,
                    // NVML_DEVICE_MIG_ENABLE is 1; `NotSupported` on GPUs without MIG.
                    mig_enabled: device.mig_mode().ok().map(|mode| mode.current == 1),
                })
            })
            .collect()
    }

    /// The compute processes running on one GPU and the device memory each uses.
    /// Blocking. A process whose usage NVML cannot report is left out.
    pub fn compute_processes(&self, gpu_uuid: &str) -> Result<Vec<ProcessUsage>, WorkerError> {
        let device = self
            .nvml
            .device_by_uuid(gpu_uuid)
            .map_err(|error| nvml_error(&format!("gpu {gpu_uuid}"), error))?;
        let processes = device
            .running_compute_processes()
            .map_err(|error| nvml_error(&format!("gpu {gpu_uuid}: compute processes"), error))?;
        Ok(processes
            .into_iter()
            .filter_map(|process| match process.used_gpu_memory {
                UsedGpuMemory::Used(used_bytes) => Some(ProcessUsage {
                    process_id: process.pid,
                    used_bytes,
                }),
                UsedGpuMemory::Unavailable => None,
            })
            .collect())
    }
}

/// Opens NVML and discovers its GPUs. Blocking: async code uses [`open_nvml`].
pub fn discover_nvml_gpus() -> Result<Vec<DiscoveredGpu>, WorkerError> {
    NvmlHandle::open()?.discover()
}

/// [`NvmlHandle::open`] and [`NvmlHandle::discover`] on a blocking thread.
pub async fn open_nvml() -> Result<(NvmlHandle, Vec<DiscoveredGpu>), WorkerError> {
    tokio::task::spawn_blocking(|| {
        let handle = NvmlHandle::open()?;
        let gpus = handle.discover()?;
        Ok((handle, gpus))
    })
    .await
    .map_err(|error| WorkerError::Nvml(format!("nvml discovery stopped: {error}")))?
}

/// One process's device memory, as NVML reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUsage {
    pub process_id: u32,
    pub used_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the NVIDIA driver installs NVML's library (Debian/Ubuntu first).
    const NVML_LIBRARIES: [&str; 4] = [
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
        "/usr/lib64/libnvidia-ml.so.1",
        "/usr/lib/libnvidia-ml.so.1",
    ];

    fn nvml_is_installed() -> bool {
        NVML_LIBRARIES
            .iter()
            .any(|path| std::path::Path::new(path).exists())
    }

    #[test]
    fn discovery_without_nvml_is_an_error_not_a_panic() {
        let result = discover_nvml_gpus();
        if nvml_is_installed() {
            // A node with the driver: discovery works (it may find no GPU at all).
            let gpus = result.expect("nvml is installed, so discovery should work");
            for gpu in gpus {
                assert!(!gpu.uuid.is_empty());
                assert!(gpu.total_bytes > 0);
            }
        } else {
            let error = result.expect_err("there is no nvml library, so discovery must fail");
            assert!(matches!(error, WorkerError::Nvml(_)), "{error}");
            assert!(error.to_string().contains("nvml"), "{error}");
        }
    }

    #[tokio::test]
    async fn opening_nvml_from_async_code_without_the_library_is_an_error() {
        let result = open_nvml().await;
        if !nvml_is_installed() {
            assert!(result.is_err());
        }
    }
}
