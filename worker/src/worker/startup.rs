//! What the worker does once when it starts, before its first session: finds the real
//! GPUs through NVML (or goes on with simulated ones alone), and kills the attempt
//! processes a previous run of this worker left behind, and serves each simulated GPU's
//! memory ledger.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use super::WorkerConfig;
use crate::error::WorkerError;
use crate::gpus::WorkerGpu;
use crate::leftover_processes::{LeftoverOutcome, kill_leftover_processes};
use crate::nvml::{DiscoveredGpu, NvmlHandle, open_nvml};
use crate::simulated_gpu_ledger::SimulatedGpuLedger;

/// SIGKILLs the attempt processes a previous run of this worker left running (see
/// [`crate::leftover_processes`]) before anything new starts: each holds its slice's
/// memory and writes checkpoints nobody reads.
pub(super) fn kill_leftovers_of_a_previous_life(process_records: &Path) {
    for outcome in kill_leftover_processes(process_records) {
        match outcome {
            LeftoverOutcome::Killed(record) => tracing::warn!(
                job = %record.job_id,
                attempt = record.attempt_number,
                process_id = record.process_id,
                "killed an attempt process left over from this worker's previous run"
            ),
            LeftoverOutcome::AlreadyGone(_) => {}
            LeftoverOutcome::OwnedByALiveWorker(record) => tracing::warn!(
                job = %record.job_id,
                process_id = record.process_id,
                worker_process_id = record.worker_process_id,
                directory = %process_records.display(),
                "another live worker records its attempts in this directory: left alone; \
                 give each worker its own --checkpoint-dir or --hostname"
            ),
            LeftoverOutcome::Unreadable { file, reason } => tracing::warn!(
                file = %file.display(),
                %reason,
                "an unreadable attempt process record: removed"
            ),
        }
    }
}

/// NVML and the real GPUs it sees, or why there are none. Without NVML the worker goes
/// on with the simulated GPUs alone (and refuses to start without those either).
pub(super) async fn find_real_gpus(
    config: &WorkerConfig,
) -> Result<(Option<NvmlHandle>, Vec<DiscoveredGpu>), WorkerError> {
    if !config.discover_real_gpus {
        return Ok((None, Vec::new()));
    }
    // "no nvml (<why>)" reads better without the error's own "nvml: " prefix.
    let why = |error: WorkerError| match error {
        WorkerError::Nvml(reason) => reason,
        other => other.to_string(),
    };
    match open_nvml().await {
        Ok((nvml, gpus)) => {
            for gpu in &gpus {
                tracing::info!(
                    index = gpu.index,
                    uuid = %gpu.uuid,
                    model = %gpu.model_name,
                    total_bytes = gpu.total_bytes,
                    free_bytes = gpu.free_bytes,
                    compute_capability = %gpu.compute_capability,
                    mig_enabled = ?gpu.mig_enabled,
                    "found a gpu"
                );
            }
            if gpus.is_empty() {
                tracing::info!("nvml found no gpu: offering only simulated gpus");
            }
            Ok((Some(nvml), gpus))
        }
        Err(error) if config.simulated_gpus.is_empty() => Err(WorkerError::NoGpus(format!(
            "no nvml ({}) and no simulated gpus; pass --sim-gpus (e.g. 2x16GiB) to \
             simulate gpus",
            why(error)
        ))),
        Err(error) => {
            tracing::info!("no nvml ({}): offering only simulated gpus", why(error));
            Ok((None, Vec::new()))
        }
    }
}

/// A ledger for each simulated GPU, at `{checkpoint_directory}/simulated-gpus/{uuid}.sock`
/// (the uuid names the node, so workers sharing a directory do not meet). A GPU whose
/// socket cannot be served (a path past the 107 bytes a unix socket allows) runs as
/// before, its memory the fake driver's own count and unwatched; the log says so.
pub(super) fn serve_simulated_gpus(
    gpus: &[WorkerGpu],
    checkpoint_directory: &Path,
) -> HashMap<String, Arc<SimulatedGpuLedger>> {
    let directory = checkpoint_directory.join("simulated-gpus");
    gpus.iter()
        .filter(|gpu| gpu.simulated)
        .filter_map(|gpu| {
            let socket = directory.join(format!("{}.sock", gpu.uuid));
            match SimulatedGpuLedger::bind(&socket, gpu.total_bytes) {
                Ok(ledger) => Some((gpu.uuid.clone(), Arc::new(ledger))),
                Err(error) => {
                    tracing::warn!(
                        gpu = %gpu.uuid,
                        %error,
                        "a simulated gpu without its ledger: the watchdog does not watch it"
                    );
                    None
                }
            }
        })
        .collect()
}
