//! Starting a model job's attempt: its spec file, the engine's attempt process
//! (`carve-worker attempt ...`), its process record, and the task that watches it.

use std::path::PathBuf;

use carve_proto::v1;
use tokio::sync::mpsc;

use super::{
    RunningAttempt, StartedAttemptProcess, Worker, attempt_key, checkpoint_file_name, lock,
};
use crate::attempt_process::{AttemptLaunch, spawn_attempt_process, watch_attempt_process};
use crate::child_protocol::ConfigArgument;
use crate::error::WorkerError;
use crate::gpus::WorkerGpu;
use crate::leftover_processes::{record_for, write_record};

impl Worker {
    /// Writes the spec file, starts the process and a task that watches it.
    pub(super) async fn launch_model(
        &self,
        assignment: &v1::scheduler_message::Assignment,
        attempt: &v1::AttemptRef,
        config: &v1::RunConfig,
        gpu: &WorkerGpu,
    ) -> Result<(), WorkerError> {
        let directory = &self.config.checkpoint_directory;
        let spec_file = directory.join(format!(
            "{}.attempt-{}.spec.json",
            attempt.job_id, attempt.attempt_number
        ));
        tokio::fs::write(&spec_file, &assignment.spec_json)
            .await
            .map_err(|error| {
                WorkerError::io(format!("cannot write {}", spec_file.display()), error)
            })?;
        let config_json = serde_json::to_string(&ConfigArgument::from(config))
            .map_err(|error| WorkerError::AttemptProcess(format!("config: {error}")))?;
        let launch = AttemptLaunch {
            program: self.config.attempt_program.clone(),
            attempt: attempt.clone(),
            spec_file: spec_file.clone(),
            config_json,
            slice_bytes: assignment.slice_bytes,
            // Each attempt writes its own file: a stale attempt (one whose worker lost
            // its session) must never rewrite what the next attempt resumes from. The
            // scheduler keeps only the locations reported by the attempt holding the
            // lease, which is what promotes a file to "the job's checkpoint".
            checkpoint: directory.join(checkpoint_file_name(attempt)),
            resume: assignment
                .resume_from
                .as_ref()
                .filter(|checkpoint| !checkpoint.location.is_empty())
                .map(|checkpoint| PathBuf::from(&checkpoint.location)),
            // A simulated GPU's attempt trains on the cpu backend.
            cuda_gpu_uuid: (!gpu.simulated).then(|| gpu.uuid.clone()),
        };
        let child = spawn_attempt_process(&launch).await?;
        let process_id = child.id().unwrap_or(0);
        // Without a record a worker that crashes and comes back could not find this
        // process; the parent-death signal still covers it, so go on.
        let record_file = record_for(&attempt.job_id, attempt.attempt_number, process_id)
            .ok_or_else(|| {
                WorkerError::AttemptProcess(format!("process {process_id} ended at once"))
            })
            .and_then(|record| write_record(&self.process_records, &record))
            .inspect_err(|error| {
                tracing::warn!(job = %attempt.job_id, %error, "cannot record the attempt process");
            })
            .ok();
        tracing::info!(
            job = %attempt.job_id,
            attempt = attempt.attempt_number,
            gpu = %assignment.gpu_uuid,
            slice_bytes = assignment.slice_bytes,
            process_id,
            "attempt started"
        );
        let (control, control_receiver) = mpsc::unbounded_channel();
        lock(&self.shared).running.insert(
            attempt_key(attempt),
            RunningAttempt {
                attempt: attempt.clone(),
                control,
                gpu_uuid: assignment.gpu_uuid.clone(),
                process_id,
                slice_bytes: assignment.slice_bytes,
                guard_account: None,
            },
        );
        if let Some(observer) = &self.config.process_observer {
            let _ = observer.send(StartedAttemptProcess {
                job_id: attempt.job_id.clone(),
                attempt_number: attempt.attempt_number,
                process_id,
            });
        }
        let shared = self.shared.clone();
        let key = attempt_key(attempt);
        let gpu_uuid = assignment.gpu_uuid.clone();
        tokio::spawn(watch_attempt_process(
            child,
            attempt.clone(),
            self.reports.clone(),
            control_receiver,
            move || {
                let mut shared = lock(&shared);
                shared.running.remove(&key);
                shared.slices.release(&gpu_uuid, &key);
                // The spec file and the record were only for the process.
                let _ = std::fs::remove_file(&spec_file);
                if let Some(record_file) = &record_file {
                    let _ = std::fs::remove_file(record_file);
                }
            },
        ));
        Ok(())
    }
}
