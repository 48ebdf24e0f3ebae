//! The GPUs a worker offers: real ones found through NVML (see `nvml`) and simulated
//! ones from `--sim-gpus`, the `--sim-gpus` parsing, and the memory book that keeps the
//! worker from admitting more slices than a GPU can hold.

use std::collections::HashMap;

use carve_core::bytes::parse_byte_size;
use carve_proto::v1;

use crate::error::WorkerError;
use crate::nvml::DiscoveredGpu;

/// A GPU the worker simulates: attempts run on the cpu backend with the same memory
/// bookkeeping, inside a capacity the operator chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimulatedGpu {
    pub total_bytes: u64,
}

/// Reads `--sim-gpus`: `COUNTxSIZE` (`2x16GiB`) or a comma-separated list of sizes
/// (`16GiB,8GiB`). Every GPU must be larger than 0 bytes; at least one GPU.
pub fn parse_simulated_gpus(text: &str) -> Result<Vec<SimulatedGpu>, WorkerError> {
    let invalid = |reason: String| WorkerError::invalid_setting("--sim-gpus", reason);
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(invalid(
            "must name at least one gpu, e.g. 2x16GiB or 16GiB,8GiB".into(),
        ));
    }
    let size = |text: &str| -> Result<u64, WorkerError> {
        if text.is_empty() {
            return Err(invalid(
                "a gpu size is missing (expected e.g. 2x16GiB)".into(),
            ));
        }
        match parse_byte_size(text) {
            Ok(0) => Err(invalid(format!(
                "`{text}`: a gpu must be larger than 0 bytes"
            ))),
            Ok(bytes) => Ok(bytes),
            Err(error) => Err(invalid(format!("`{text}`: {error}"))),
        }
    };
    // `2x16GiB`: a count, an `x`, a size. Sizes never contain `x`, so the split is safe.
    if let Some((count_text, size_text)) = trimmed.split_once(['x', 'X']) {
        let count: usize = count_text.trim().parse().map_err(|_| {
            invalid(format!(
                "`{count_text}` is not a gpu count (expected e.g. 2x16GiB)"
            ))
        })?;
        if count == 0 || count > 64 {
            return Err(invalid(format!(
                "the gpu count must be 1 to 64, not {count}"
            )));
        }
        let total_bytes = size(size_text.trim())?;
        return Ok(vec![SimulatedGpu { total_bytes }; count]);
    }
    trimmed
        .split(',')
        .map(|part| {
            let part = part.trim();
            if part.is_empty() {
                return Err(invalid("an empty entry in the list of sizes".into()));
            }
            Ok(SimulatedGpu {
                total_bytes: size(part)?,
            })
        })
        .collect()
}

/// One GPU as the worker keeps it.
#[derive(Debug, Clone)]
pub struct WorkerGpu {
    pub uuid: String,
    pub index: u32,
    pub total_bytes: u64,
    /// What one attempt process takes outside its slice (CUDA context and handles).
    pub context_bytes: u64,
    pub simulated: bool,
    /// NVML's product name; "simulated" for a simulated GPU.
    pub model_name: String,
    /// `major.minor` for a real GPU; empty for a simulated one.
    pub compute_capability: String,
    /// Whether MIG mode is on (real GPUs that support MIG); registration has no field
    /// for it yet, so the worker only logs it.
    pub mig_enabled: Option<bool>,
}

impl WorkerGpu {
    /// The GPU as registration sends it: no slices yet.
    pub fn to_proto(&self, free_bytes: u64) -> v1::Gpu {
        v1::Gpu {
            uuid: self.uuid.clone(),
            index: self.index,
            model_name: self.model_name.clone(),
            total_bytes: self.total_bytes,
            context_bytes: self.context_bytes,
            free_bytes,
            simulated: self.simulated,
            slices: vec![],
            compute_capability: self.compute_capability.clone(),
        }
    }
}

/// The GPUs to offer: the real GPUs NVML found (`real`, empty without NVML) first, then
/// the simulated ones, numbered after them. Each attempt process on either kind is
/// charged `context_bytes` outside its slice. Without any GPU the worker refuses to start.
pub fn discover_gpus(
    hostname: &str,
    real: &[DiscoveredGpu],
    simulated: &[SimulatedGpu],
    context_bytes: u64,
) -> Result<Vec<WorkerGpu>, WorkerError> {
    if real.is_empty() && simulated.is_empty() {
        return Err(WorkerError::NoGpus(
            "nvml found no gpu and none are simulated; pass --sim-gpus (e.g. 2x16GiB) to \
             simulate gpus"
                .into(),
        ));
    }
    let leaves_room = |total_bytes: u64| {
        if context_bytes >= total_bytes {
            return Err(WorkerError::invalid_setting(
                "--context-bytes",
                format!(
                    "{context_bytes} bytes of context leave nothing of a {total_bytes} byte gpu"
                ),
            ));
        }
        Ok(())
    };
    let real_gpus = real.iter().map(|gpu| {
        leaves_room(gpu.total_bytes)?;
        Ok(WorkerGpu {
            uuid: gpu.uuid.clone(),
            index: gpu.index,
            total_bytes: gpu.total_bytes,
            context_bytes,
            simulated: false,
            model_name: gpu.model_name.clone(),
            compute_capability: gpu.compute_capability.clone(),
            mig_enabled: gpu.mig_enabled,
        })
    });
    let first_simulated_index = real.iter().map(|gpu| gpu.index + 1).max().unwrap_or(0);
    let simulated_gpus = simulated.iter().enumerate().map(|(position, gpu)| {
        leaves_room(gpu.total_bytes)?;
        let index = first_simulated_index + position as u32;
        Ok(WorkerGpu {
            uuid: format!("sim-{hostname}-{index}"),
            index,
            total_bytes: gpu.total_bytes,
            context_bytes,
            simulated: true,
            model_name: "simulated".into(),
            compute_capability: String::new(),
            mig_enabled: None,
        })
    });
    real_gpus.chain(simulated_gpus).collect()
}

/// Which slices run on which GPU: the worker's own check that it never admits more than
/// a GPU holds, whatever the scheduler says (its view may be stale after a reconnect).
#[derive(Debug, Default)]
pub struct SliceBook {
    /// Slice bytes in use per GPU uuid, by attempt (`job/attempt`).
    slices: HashMap<String, HashMap<String, u64>>,
}

impl SliceBook {
    /// What is left for new slices: total − context − running slices, as the scheduler
    /// computes it.
    pub fn free_bytes(&self, gpu: &WorkerGpu) -> u64 {
        let used: u64 = self
            .slices
            .get(&gpu.uuid)
            .map(|slices| slices.values().sum())
            .unwrap_or(0);
        gpu.total_bytes
            .saturating_sub(gpu.context_bytes)
            .saturating_sub(used)
    }

    /// Reserves a slice, or says why it does not fit.
    pub fn admit(
        &mut self,
        gpu: &WorkerGpu,
        attempt_key: &str,
        slice_bytes: u64,
    ) -> Result<(), String> {
        if slice_bytes == 0 {
            return Err("the assignment's slice is 0 bytes".into());
        }
        let free = self.free_bytes(gpu);
        if slice_bytes > free {
            return Err(format!(
                "the slice of {slice_bytes} bytes does not fit gpu {}: {free} bytes are free \
                 ({} total, {} context, the rest held by running slices)",
                gpu.uuid, gpu.total_bytes, gpu.context_bytes
            ));
        }
        self.slices
            .entry(gpu.uuid.clone())
            .or_default()
            .insert(attempt_key.to_string(), slice_bytes);
        Ok(())
    }

    pub fn release(&mut self, gpu_uuid: &str, attempt_key: &str) {
        if let Some(slices) = self.slices.get_mut(gpu_uuid) {
            slices.remove(attempt_key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_lists_parse() {
        assert_eq!(
            parse_simulated_gpus("2x16GiB").unwrap(),
            vec![
                SimulatedGpu {
                    total_bytes: 16 << 30
                };
                2
            ]
        );
        assert_eq!(
            parse_simulated_gpus("16GiB, 8GiB").unwrap(),
            vec![
                SimulatedGpu {
                    total_bytes: 16 << 30
                },
                SimulatedGpu {
                    total_bytes: 8 << 30
                }
            ]
        );
        assert_eq!(parse_simulated_gpus("1GiB").unwrap().len(), 1);
    }

    #[test]
    fn bad_input_is_refused_with_a_reason() {
        for (text, wanted) in [
            ("", "at least one gpu"),
            ("0x16GiB", "1 to 64"),
            ("ax16GiB", "not a gpu count"),
            ("2x", "size is missing"),
            ("2xlots", "not a number of bytes"),
            ("2x0", "larger than 0"),
            ("16GiB,,8GiB", "empty entry"),
            ("16 parsecs", "unknown unit"),
        ] {
            let error = parse_simulated_gpus(text).unwrap_err().to_string();
            assert!(error.contains(wanted), "{text:?}: {error}");
            assert!(error.starts_with("--sim-gpus"), "{error}");
        }
    }

    #[test]
    fn the_book_never_admits_more_than_the_gpu_holds() {
        let gpu = WorkerGpu {
            uuid: "sim-a-0".into(),
            index: 0,
            total_bytes: 1000,
            context_bytes: 100,
            simulated: true,
            model_name: "simulated".into(),
            compute_capability: String::new(),
            mig_enabled: None,
        };
        let mut book = SliceBook::default();
        book.admit(&gpu, "job-1", 500).unwrap();
        assert_eq!(book.free_bytes(&gpu), 400);
        let refused = book.admit(&gpu, "job-2", 401).unwrap_err();
        assert!(refused.contains("400 bytes are free"), "{refused}");
        book.admit(&gpu, "job-2", 400).unwrap();
        book.release(&gpu.uuid, "job-1");
        assert_eq!(book.free_bytes(&gpu), 500);
    }

    fn real_gpu(index: u32) -> DiscoveredGpu {
        DiscoveredGpu {
            index,
            uuid: format!("GPU-{index}"),
            model_name: "NVIDIA A100-SXM4-40GB".into(),
            total_bytes: 40 << 30,
            free_bytes: 39 << 30,
            compute_capability: "8.0".into(),
            mig_enabled: Some(false),
        }
    }

    #[test]
    fn real_and_simulated_gpus_are_offered_together() {
        let simulated = parse_simulated_gpus("16GiB").unwrap();
        let gpus =
            discover_gpus("node", &[real_gpu(0), real_gpu(1)], &simulated, 300 << 20).unwrap();
        assert_eq!(gpus.len(), 3);
        assert!(!gpus[0].simulated && !gpus[1].simulated && gpus[2].simulated);
        assert_eq!(gpus[1].uuid, "GPU-1");
        assert_eq!(gpus[2].uuid, "sim-node-2");
        assert_eq!(gpus[2].index, 2);
        let registered = gpus[0].to_proto(1);
        assert_eq!(registered.model_name, "NVIDIA A100-SXM4-40GB");
        assert_eq!(registered.compute_capability, "8.0");
        assert_eq!(registered.context_bytes, 300 << 20);
        assert!(!registered.simulated);
        assert_eq!(gpus[2].to_proto(1).model_name, "simulated");
    }

    #[test]
    fn no_gpus_at_all_is_a_clear_error() {
        let error = discover_gpus("node", &[], &[], 300 << 20)
            .unwrap_err()
            .to_string();
        assert!(error.contains("--sim-gpus"), "{error}");
    }
}
