//! Starting a model job's attempt: its spec file, the engine's attempt process
//! (`carve-worker attempt ...`) in its container, its process record, and the task that
//! watches it.

use std::path::{Path, PathBuf};
use std::time::Instant;

use carve_core::spec::DataFiles;
use carve_core::validate::ValidatedJob;
use carve_proto::v1;
use tokio::sync::mpsc;

use super::{
    RunningAttempt, StartedAttemptProcess, Worker, attempt_directory, attempt_key,
    checkpoint_file_name, container_name, job_directory, lock,
};
use crate::attempt_lease::renew_attempt_lease;
use crate::attempt_limits::MaxDuration;
use crate::attempt_process::{AttemptLaunch, spawn_attempt_process, watch_attempt_process};
use crate::child_protocol::ConfigArgument;
use crate::error::WorkerError;
use crate::gpus::WorkerGpu;
use crate::leftover_processes::{record_for, write_record};
use crate::sandbox::{ContainerRequest, GpuDevices, HostPath, give_directory_to, gpu_devices};

impl Worker {
    /// Writes the spec file, starts the process and a task that watches it.
    pub(super) async fn launch_model(
        &self,
        assignment: &v1::scheduler_message::Assignment,
        attempt: &v1::AttemptRef,
        config: &v1::RunConfig,
        gpu: &WorkerGpu,
        job: &ValidatedJob,
        max_duration: Option<MaxDuration>,
    ) -> Result<(), WorkerError> {
        let directory = &self.config.checkpoint_directory;
        // The attempt's own directory holds its spec; the job's holds its checkpoints
        // (a container sees these two and nothing else of the checkpoint directory).
        let run_directory = attempt_directory(directory, attempt);
        let checkpoints = job_directory(directory, attempt);
        for path in [&run_directory, &checkpoints] {
            tokio::fs::create_dir_all(path).await.map_err(|error| {
                WorkerError::io(format!("cannot create {}", path.display()), error)
            })?;
        }
        let spec_file = run_directory.join("spec.json");
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
            checkpoint: checkpoints.join(checkpoint_file_name(attempt)),
            resume: assignment
                .resume_from
                .as_ref()
                .filter(|checkpoint| !checkpoint.location.is_empty())
                .map(|checkpoint| PathBuf::from(&checkpoint.location)),
            // A simulated GPU's attempt trains on the cpu backend.
            cuda_gpu_uuid: (!gpu.simulated).then(|| gpu.uuid.clone()),
            // It stops on its own at its worker's stop deadline unless the worker renews
            // it (a frozen worker cannot stop it).
            worker_lease: self.attempt_lease(),
        };
        let container = match &self.sandbox {
            Some(sandbox) => {
                give_directory_to(&checkpoints, sandbox.program_owner(&assignment.tenant)?)?;
                let mut host_paths = vec![
                    HostPath::read_only(&launch.program),
                    HostPath::read_only(&run_directory),
                    HostPath::writable(&checkpoints),
                ];
                // A checkpoint from before per-job directories, or from another layout.
                if let Some(resume) = &launch.resume
                    && !resume.starts_with(&checkpoints)
                    && resume.exists()
                {
                    host_paths.push(HostPath::read_only(resume));
                }
                // The job names its data files: each must be where the operator lets
                // jobs read (a bound file bypasses the permissions of its directories).
                for (field, path) in data_files(job) {
                    host_paths.push(HostPath::read_only(sandbox.job_path(field, path)?));
                }
                let devices = if gpu.simulated {
                    GpuDevices::default()
                } else {
                    gpu_devices(&self.config.sandbox.cdi_directories, gpu.index, &gpu.uuid)
                };
                host_paths.extend(devices.read_only_paths.iter().map(HostPath::read_only));
                Some((
                    sandbox.as_ref(),
                    ContainerRequest {
                        name: container_name(attempt),
                        tenant: assignment.tenant.clone(),
                        argv: Vec::new(),
                        environment: Vec::new(),
                        working_directory: run_directory.clone(),
                        host_paths,
                        devices: devices.nodes,
                        // A simulated GPU's engine attempt trains on the cpu backend.
                        simulated_gpu_socket: None,
                        // Validated at submit: a spec that does not read asks for nothing.
                        asked_limits: job.spec.resources.host_limits().unwrap_or_default(),
                    },
                ))
            }
            None => None,
        };
        let (mut child, container) = spawn_attempt_process(&launch, container).await?;
        if let Some(stdin) = child.stdin.take() {
            tokio::spawn(renew_attempt_lease(
                stdin,
                self.leader_lease.watch_stop_deadline(),
            ));
        }
        let container_processes = container
            .as_ref()
            .map(|container| container.processes_file().to_path_buf());
        // In a container the attempt process is the runtime's child, not the worker's.
        let process_id = match &container {
            Some(container) => container.program_process_id().await,
            None => None,
        }
        .or(child.id())
        .unwrap_or(0);
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
                container_processes,
                started: Instant::now(),
                max_duration,
                directories: vec![checkpoints.clone(), run_directory.clone()],
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
            container,
            attempt.clone(),
            self.reports.clone(),
            control_receiver,
            move || {
                let mut shared = lock(&shared);
                shared.running.remove(&key);
                shared.slices.release(&gpu_uuid, &key);
                // The spec file and the record were only for the process.
                let _ = std::fs::remove_dir_all(&run_directory);
                if let Some(record_file) = &record_file {
                    let _ = std::fs::remove_file(record_file);
                }
            },
        ));
        Ok(())
    }
}

impl Worker {
    /// The lease an engine attempt starts with: the time left until the worker's stop
    /// deadline and the grace after it; `None` before the worker knows its lease.
    fn attempt_lease(&self) -> Option<(std::time::Duration, std::time::Duration)> {
        let deadline = self.leader_lease.stop_deadline()?;
        let lease = self.leader_lease.lease()?;
        Some((
            deadline.saturating_duration_since(Instant::now()),
            crate::leader_lease::stop_grace(lease),
        ))
    }
}

/// The files a model job reads its data from, each with the field that names it
/// (absolute, as `carve submit` sends them).
fn data_files(job: &ValidatedJob) -> Vec<(&'static str, &Path)> {
    let data = &job.spec.data;
    [("data.train", &data.train), ("data.test", &data.test)]
        .into_iter()
        .filter_map(|(field, files)| Some((field, files.as_ref()?)))
        .flat_map(|(field, files): (&'static str, &DataFiles)| {
            [&files.images, &files.labels, &files.inputs, &files.targets]
                .into_iter()
                .flatten()
                .chain(files.files.iter())
                .map(move |path| (field, Path::new(path)))
        })
        .collect()
}
