//! The real GPUs of this node, through NVML (`nvml-wrapper`, which loads
//! `libnvidia-ml.so.1` at run time): discovery, and the per-process memory watch that
//! reports an attempt using more device memory than its slice.
//!
//! Every NVML call blocks (it talks to the driver). The functions here are plain
//! blocking functions; async code calls them through `tokio::task::spawn_blocking`
//! (see [`open_nvml`] and [`read_compute_processes`]). Without the library (no NVIDIA
//! driver on this node) opening NVML is an error, never a panic.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use carve_core::bytes::HumanBytes;
use carve_proto::v1;
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

/// The compute processes of each of `gpu_uuids`, read on a blocking thread. A GPU whose
/// processes cannot be read is left out (and logged): the watch is advisory.
pub async fn read_compute_processes(
    nvml: NvmlHandle,
    gpu_uuids: Vec<String>,
) -> HashMap<String, Vec<ProcessUsage>> {
    let read = tokio::task::spawn_blocking(move || {
        let mut readings = HashMap::new();
        for uuid in gpu_uuids {
            match nvml.compute_processes(&uuid) {
                Ok(processes) => {
                    readings.insert(uuid, processes);
                }
                Err(error) => tracing::warn!(%error, "cannot read per-process gpu memory"),
            }
        }
        readings
    })
    .await;
    read.unwrap_or_else(|error| {
        tracing::warn!(%error, "the per-process gpu memory reading stopped");
        HashMap::new()
    })
}

/// One process's device memory, as NVML reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUsage {
    pub process_id: u32,
    pub used_bytes: u64,
}

/// An attempt process the worker runs on a real GPU, with what it may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchedAttempt {
    pub attempt: v1::AttemptRef,
    pub gpu_uuid: String,
    pub process_id: u32,
    pub slice_bytes: u64,
    /// The GPU's context reservation: NVML counts the CUDA context in the process's
    /// usage, but placement reserves it outside the slice.
    pub context_bytes: u64,
}

impl WatchedAttempt {
    /// What the process may use before it is outside its slice: slice plus context.
    pub fn allowed_bytes(&self) -> u64 {
        self.slice_bytes.saturating_add(self.context_bytes)
    }
}

/// An attempt process seen using more device memory than its slice and context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceOverrun {
    pub attempt: v1::AttemptRef,
    pub process_id: u32,
    pub used_bytes: u64,
    pub slice_bytes: u64,
    pub context_bytes: u64,
}

impl SliceOverrun {
    /// The warning the scheduler gets, as the attempt's log line.
    pub fn message(&self) -> String {
        format!(
            "attempt {}/{} (pid {}) uses {} of device memory, its slice is {} (plus {} of context)",
            self.attempt.job_id,
            self.attempt.attempt_number,
            self.process_id,
            HumanBytes(self.used_bytes),
            HumanBytes(self.slice_bytes),
            HumanBytes(self.context_bytes),
        )
    }

    pub fn to_log_line(&self) -> v1::worker_message::LogLine {
        v1::worker_message::LogLine {
            attempt: Some(self.attempt.clone()),
            level: "warn".into(),
            message: self.message(),
        }
    }
}

/// `job/attempt`, the key of `reported`.
fn watched_key(attempt: &v1::AttemptRef) -> String {
    format!("{}/{}", attempt.job_id, attempt.attempt_number)
}

/// The pure part of the usage watch: which attempts use more than their slice (plus
/// context) in `readings` (per GPU uuid). An attempt is reported the first time it is
/// over and again only when it reaches a new peak, so a steady overrun does not send a
/// warning every heartbeat; `reported` (by `job/attempt`) remembers the bytes last
/// reported and is updated here. Processes that are not attempts are ignored.
pub fn find_slice_overruns(
    attempts: &[WatchedAttempt],
    readings: &HashMap<String, Vec<ProcessUsage>>,
    reported: &mut HashMap<String, u64>,
) -> Vec<SliceOverrun> {
    let mut overruns = Vec::new();
    for watched in attempts {
        let Some(processes) = readings.get(&watched.gpu_uuid) else {
            continue;
        };
        let used_bytes: u64 = processes
            .iter()
            .filter(|process| process.process_id == watched.process_id)
            .map(|process| process.used_bytes)
            .sum();
        if used_bytes <= watched.allowed_bytes() {
            continue;
        }
        let key = watched_key(&watched.attempt);
        if reported.get(&key).is_some_and(|&last| used_bytes <= last) {
            continue;
        }
        reported.insert(key, used_bytes);
        overruns.push(SliceOverrun {
            attempt: watched.attempt.clone(),
            process_id: watched.process_id,
            used_bytes,
            slice_bytes: watched.slice_bytes,
            context_bytes: watched.context_bytes,
        });
    }
    overruns
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn watched(job: &str, gpu: &str, process_id: u32, slice_bytes: u64) -> WatchedAttempt {
        WatchedAttempt {
            attempt: v1::AttemptRef {
                job_id: job.into(),
                attempt_number: 2,
                ..Default::default()
            },
            gpu_uuid: gpu.into(),
            process_id,
            slice_bytes,
            context_bytes: 300 * MIB,
        }
    }

    fn usage(process_id: u32, used_bytes: u64) -> ProcessUsage {
        ProcessUsage {
            process_id,
            used_bytes,
        }
    }

    #[test]
    fn an_attempt_over_its_slice_and_context_is_reported_with_a_clear_message() {
        let attempts = [
            watched("job-a", "GPU-0", 100, 1024 * MIB),
            watched("job-b", "GPU-0", 200, 1024 * MIB),
        ];
        let readings = HashMap::from([(
            "GPU-0".to_string(),
            vec![
                // Within slice + context: fine.
                usage(100, 1324 * MIB),
                // One byte over.
                usage(200, 1324 * MIB + 1),
                // Not an attempt of this worker.
                usage(999, 70_000 * MIB),
            ],
        )]);
        let mut reported = HashMap::new();
        let overruns = find_slice_overruns(&attempts, &readings, &mut reported);
        assert_eq!(overruns.len(), 1, "{overruns:?}");
        assert_eq!(overruns[0].attempt.job_id, "job-b");
        assert_eq!(overruns[0].process_id, 200);
        let line = overruns[0].to_log_line();
        assert_eq!(line.level, "warn");
        assert!(
            line.message.starts_with(
                "attempt job-b/2 (pid 200) uses 1.29 GiB of device memory, its slice is 1 GiB"
            ),
            "{}",
            line.message
        );
    }

    #[test]
    fn a_steady_overrun_is_reported_once_and_a_new_peak_again() {
        let attempts = [watched("job-a", "GPU-0", 100, 1024 * MIB)];
        let reading = |used| HashMap::from([("GPU-0".to_string(), vec![usage(100, used)])]);
        let mut reported = HashMap::new();
        assert_eq!(
            find_slice_overruns(&attempts, &reading(2048 * MIB), &mut reported).len(),
            1
        );
        assert!(find_slice_overruns(&attempts, &reading(2048 * MIB), &mut reported).is_empty());
        assert!(find_slice_overruns(&attempts, &reading(1500 * MIB), &mut reported).is_empty());
        let again = find_slice_overruns(&attempts, &reading(3072 * MIB), &mut reported);
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].used_bytes, 3072 * MIB);
    }

    #[test]
    fn readings_of_other_gpus_or_missing_gpus_report_nothing() {
        // The same pid on another GPU is not this attempt's usage.
        let attempts = [watched("job-a", "GPU-0", 100, 1024 * MIB)];
        let readings = HashMap::from([("GPU-1".to_string(), vec![usage(100, 70_000 * MIB)])]);
        let mut reported = HashMap::new();
        assert!(find_slice_overruns(&attempts, &readings, &mut reported).is_empty());
        assert!(find_slice_overruns(&attempts, &HashMap::new(), &mut reported).is_empty());
        assert!(reported.is_empty());
    }

    #[test]
    fn several_entries_of_one_process_are_added_up() {
        // A process can appear more than once (e.g. once per MIG compute instance).
        let attempts = [watched("job-a", "GPU-0", 100, 1024 * MIB)];
        let readings = HashMap::from([(
            "GPU-0".to_string(),
            vec![usage(100, 700 * MIB), usage(100, 700 * MIB)],
        )]);
        let overruns = find_slice_overruns(&attempts, &readings, &mut HashMap::new());
        assert_eq!(overruns.len(), 1);
        assert_eq!(overruns[0].used_bytes, 1400 * MIB);
    }

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
