//! Starting a command job's attempt from the worker's tables: which guard it runs under,
//! its directories, and keeping the running attempt's process (one per profile run) known
//! to the watchdog and recorded for a worker that comes back after a crash.

use std::path::{Path, PathBuf};
use std::time::Instant;

use carve_core::command::validate::ValidatedCommandJob;
use carve_core::plan::RunConfig;
use carve_proto::v1;
use carve_proto::v1::worker_message::Body;
use tokio::sync::mpsc;

use super::{
    RunningAttempt, Shared, StartedAttemptProcess, Worker, attempt_directory, attempt_key,
    container_name, job_directory, lock,
};
use crate::attempt_limits::MaxDuration;
use crate::command_attempt::{
    CommandAttemptLaunch, CommandProcesses, run_command_attempt, run_gang_member_attempt,
};
use crate::command_supervisor::Supervision;
use crate::error::WorkerError;
use crate::gang_member::{GangRefusal, member_checkpoint_directory, member_launch};
use crate::gpus::WorkerGpu;
use crate::leftover_processes::{record_for, write_record};
use crate::sandbox::{GpuDevices, gpu_devices};

impl Worker {
    /// Starts a command job's attempt: a task runs its program (or its profile runs)
    /// and reports; the slice is released when the last of them has exited.
    pub(super) fn launch_command(
        &self,
        assignment: &v1::scheduler_message::Assignment,
        attempt: &v1::AttemptRef,
        config: RunConfig,
        gpu: &WorkerGpu,
        job: ValidatedCommandJob,
        max_duration: Option<MaxDuration>,
    ) -> Result<(), WorkerError> {
        let guard_library = if gpu.simulated {
            self.simulated_guard_library.clone()
        } else {
            Some(self.guard_library.clone().ok_or_else(|| {
                WorkerError::Guard(
                    "a command job on a real gpu runs under the guard, and this worker has \
                     none: install libcarve_guard.so next to carve-worker or name it with \
                     --guard-library"
                        .to_string(),
                )
            })?)
        };
        // A gang's member (issue 31): its place in the gang, or the reason it cannot run
        // here (the master port taken on rank 0's node: interrupted, so the gang is
        // retried), reported as the attempt's end.
        let gang = match &assignment.gang {
            None => None,
            Some(gang) => match member_launch(gang, &self.gang_ports) {
                Ok(member) => Some(member),
                Err(refusal) => {
                    tracing::warn!(job = %attempt.job_id, rank = gang.rank, reason = %refusal.reason, "gang member refused");
                    lock(&self.shared)
                        .slices
                        .release(&gpu.uuid, &attempt_key(attempt));
                    let _ = self.reports.send(refused_member(attempt, refusal));
                    return Ok(());
                }
            },
        };
        let directory = &self.config.checkpoint_directory;
        // Rank 0 keeps the job's directory; the others have their own beside it.
        let checkpoint_dir = match &gang {
            Some(gang) => {
                member_checkpoint_directory(&job_directory(directory, attempt), gang.place.rank)
            }
            None => job_directory(directory, attempt),
        };
        let launch = CommandAttemptLaunch {
            attempt: attempt.clone(),
            job,
            config,
            slice_bytes: assignment.slice_bytes,
            gpu_uuid: gpu.uuid.clone(),
            guard_library,
            checkpoint_dir,
            attempt_directory: attempt_directory(directory, attempt),
            profile: assignment.profile,
            resume_from: assignment.resume_from.clone(),
            sandbox: self.sandbox.clone(),
            tenant: assignment.tenant.clone(),
            devices: if gpu.simulated {
                GpuDevices::default()
            } else {
                gpu_devices(&self.config.sandbox.cdi_directories, gpu.index, &gpu.uuid)
            },
            container_name: container_name(attempt),
            image: crate::command_attempt::AssignedImage::of_assignment(assignment),
            simulated_gpu_socket: self
                .simulated_gpu_ledgers
                .get(&gpu.uuid)
                .map(|ledger| ledger.socket().to_path_buf()),
            // Every run holds the worker's lease through a supervisor, so it stops at
            // the worker's deadline even while the worker is frozen.
            supervision: self.leader_lease.lease().map(|lease| Supervision {
                program: self.config.attempt_program.clone(),
                deadlines: self.leader_lease.watch_stop_deadline(),
                grace: crate::leader_lease::stop_grace(lease),
            }),
        };
        tracing::info!(
            job = %attempt.job_id,
            attempt = attempt.attempt_number,
            gpu = %gpu.uuid,
            slice_bytes = assignment.slice_bytes,
            profile = assignment.profile,
            under_guard = launch.guard_library.is_some(),
            "command attempt starting"
        );
        let key = attempt_key(attempt);
        let (control, control_receiver) = mpsc::unbounded_channel();
        lock(&self.shared).running.insert(
            key.clone(),
            RunningAttempt {
                attempt: attempt.clone(),
                control,
                gpu_uuid: gpu.uuid.clone(),
                // Set while one of its programs runs.
                process_id: 0,
                slice_bytes: assignment.slice_bytes,
                guard_account: None,
                container_processes: None,
                // A profile's runs count together, from here.
                started: Instant::now(),
                max_duration,
                directories: vec![
                    launch.checkpoint_dir.clone(),
                    launch.attempt_directory.clone(),
                ],
            },
        );
        let processes = WorkerCommandProcesses {
            shared: self.shared.clone(),
            key: key.clone(),
            attempt: attempt.clone(),
            process_records: self.process_records.clone(),
            observer: self.config.process_observer.clone(),
            record_file: None,
        };
        let shared = self.shared.clone();
        let gpu_uuid = gpu.uuid.clone();
        let gang_ports = self.gang_ports.clone();
        let gang_id = gang.as_ref().map(|gang| gang.gang_id.clone());
        let ended = move || {
            let mut shared = lock(&shared);
            shared.running.remove(&key);
            shared.slices.release(&gpu_uuid, &key);
            if let Some(gang_id) = gang_id {
                gang_ports.member_ended(&gang_id);
            }
        };
        let reports = self.reports.clone();
        match gang {
            Some(gang) => tokio::spawn(run_gang_member_attempt(
                launch,
                gang,
                reports,
                control_receiver,
                processes,
                ended,
            )),
            None => tokio::spawn(run_command_attempt(
                launch,
                reports,
                control_receiver,
                processes,
                ended,
            )),
        };
        Ok(())
    }
}

/// The end of a gang member that could not be launched.
fn refused_member(attempt: &v1::AttemptRef, refusal: GangRefusal) -> Body {
    Body::AttemptFinished(v1::worker_message::AttemptFinished {
        attempt: Some(attempt.clone()),
        outcome: refusal.outcome as i32,
        message: refusal.reason,
        ..Default::default()
    })
}

/// The worker's tables kept up to date with a command attempt's processes.
struct WorkerCommandProcesses {
    shared: Shared,
    key: String,
    attempt: v1::AttemptRef,
    process_records: PathBuf,
    observer: Option<mpsc::UnboundedSender<StartedAttemptProcess>>,
    record_file: Option<PathBuf>,
}

impl CommandProcesses for WorkerCommandProcesses {
    fn started(
        &mut self,
        process_id: u32,
        guard_account: Option<&Path>,
        container_processes: Option<&Path>,
    ) {
        if let Some(running) = lock(&self.shared).running.get_mut(&self.key) {
            running.process_id = process_id;
            running.guard_account = guard_account.map(Path::to_path_buf);
            running.container_processes = container_processes.map(Path::to_path_buf);
        }
        // Without a record a worker that crashes and comes back could not find this
        // process; the parent-death signal still covers it, so go on.
        self.record_file = record_for(&self.attempt.job_id, self.attempt.attempt_number, process_id)
            .ok_or_else(|| WorkerError::AttemptProcess(format!("process {process_id} ended at once")))
            .and_then(|record| write_record(&self.process_records, &record))
            .inspect_err(|error| {
                tracing::warn!(job = %self.attempt.job_id, %error, "cannot record the command's process");
            })
            .ok();
        if let Some(observer) = &self.observer {
            let _ = observer.send(StartedAttemptProcess {
                job_id: self.attempt.job_id.clone(),
                attempt_number: self.attempt.attempt_number,
                process_id,
            });
        }
    }

    fn exited(&mut self, _process_id: u32) {
        if let Some(running) = lock(&self.shared).running.get_mut(&self.key) {
            running.process_id = 0;
            running.guard_account = None;
            running.container_processes = None;
        }
        if let Some(record_file) = self.record_file.take() {
            let _ = std::fs::remove_file(record_file);
        }
    }
}
