//! The GPUs a worker offers: discovery (NVML is not built in yet, so only simulated
//! GPUs), `--sim-gpus` parsing, and the memory book that keeps the worker from admitting
//! more slices than a GPU can hold.

use std::collections::HashMap;

use carve_core::bytes::parse_byte_size;
use carve_proto::v1;

use crate::error::WorkerError;

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
}

impl WorkerGpu {
    /// The GPU as registration sends it: no slices yet.
    pub fn to_proto(&self, free_bytes: u64) -> v1::Gpu {
        v1::Gpu {
            uuid: self.uuid.clone(),
            index: self.index,
            model_name: if self.simulated {
                "simulated".into()
            } else {
                String::new()
            },
            total_bytes: self.total_bytes,
            context_bytes: self.context_bytes,
            free_bytes,
            simulated: self.simulated,
            slices: vec![],
            compute_capability: String::new(),
        }
    }
}

/// The GPUs to offer. There is no NVML binding in this build, so the worker says so
/// and offers only the simulated GPUs; without any it refuses to start.
pub fn discover_gpus(
    hostname: &str,
    simulated: &[SimulatedGpu],
    context_bytes: u64,
) -> Result<Vec<WorkerGpu>, WorkerError> {
    tracing::info!("no nvml in this build: offering only simulated gpus");
    if simulated.is_empty() {
        return Err(WorkerError::NoGpus(
            "nvml is not available; pass --sim-gpus (e.g. 2x16GiB) to simulate gpus".into(),
        ));
    }
    simulated
        .iter()
        .enumerate()
        .map(|(index, gpu)| {
            if context_bytes >= gpu.total_bytes {
                return Err(WorkerError::invalid_setting(
                    "--context-bytes",
                    format!(
                        "{context_bytes} bytes of context leave nothing of a {} byte gpu",
                        gpu.total_bytes
                    ),
                ));
            }
            Ok(WorkerGpu {
                uuid: format!("sim-{hostname}-{index}"),
                index: index as u32,
                total_bytes: gpu.total_bytes,
                context_bytes,
                simulated: true,
            })
        })
        .collect()
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
}
