//! Setting one run of a command job's program up: its directories, the guard's account,
//! its whole environment (nothing of the worker's), and its container when the worker
//! contains attempts (which host paths it sees, owned by whom).

use std::path::{Path, PathBuf};

use carve_core::command::checkpoint::{ENVIRONMENT_RESUME_FROM, ENVIRONMENT_RESUME_STEP};
use carve_core::command::render::{render_command, render_gang_member_command};
use tokio::process::Command;

use super::{CommandProcesses, ENVIRONMENT_SLICE_BYTES, RunPlan, Runner};
use crate::error::WorkerError;
use crate::guard_environment::AttemptGuard;
use crate::image::container_root::ImageRunRoot;
use crate::sandbox::{Container, ContainerRequest, HostPath, Sandbox, give_directory_to};
use crate::simulated_gpu_ledger::{ENV_SIMULATED_GPU_SOCKET, SIMULATED_GPU_DEVICE_PATH};

/// One run, ready to start.
pub(super) struct PreparedRun {
    pub(super) command: Command,
    /// The rendered argv, as the job's attempt records it.
    pub(super) argv: Vec<String>,
    pub(super) guard: Option<AttemptGuard>,
    pub(super) container: Option<Container>,
    /// The run's root in the job's image, mounted until this is dropped (after the
    /// container is removed).
    pub(super) image_root: Option<ImageRunRoot>,
    /// Whether `command` runs the program under its supervisor (which holds the lease).
    pub(super) supervised: bool,
}

impl<P: CommandProcesses> Runner<'_, P> {
    /// The directories, the guard's account and the command of one run, and its
    /// container when the worker contains its attempts.
    pub(super) fn prepare(&self, plan: &RunPlan) -> Result<PreparedRun, String> {
        let launch = self.launch;
        let directories = [
            &plan.checkpoint_dir,
            &launch.checkpoint_dir,
            &launch.attempt_directory,
        ];
        for directory in directories {
            std::fs::create_dir_all(directory)
                .map_err(|error| format!("cannot create {}: {error}", directory.display()))?;
        }
        let guard = launch
            .guard_library
            .as_deref()
            .map(|library| {
                AttemptGuard::prepare(
                    library,
                    &launch.attempt_directory,
                    launch.slice_bytes,
                    &launch.gpu_uuid,
                )
            })
            .transpose()
            .map_err(|error| error.to_string())?;
        let checkpoint_dir = plan.checkpoint_dir.to_string_lossy();
        let rendered = match self.gang {
            Some(gang) => render_gang_member_command(
                &launch.job,
                &plan.config,
                &checkpoint_dir,
                plan.max_steps,
                &gang.place,
            ),
            None => render_command(&launch.job, &plan.config, &checkpoint_dir, plan.max_steps),
        }
        .map_err(|error| format!("cannot render the command: {error}"))?;
        if rendered.argv.is_empty() {
            return Err("the command is empty".to_string());
        }
        let working_directory = rendered
            .working_directory
            .as_ref()
            .map_or_else(|| launch.attempt_directory.clone(), PathBuf::from);
        if !working_directory.is_dir() {
            return Err(format!(
                "could not start {}: its working directory {} does not exist",
                rendered.argv[0],
                working_directory.display()
            ));
        }
        // Nothing of the worker's own environment: only the job's (its `env` and the
        // `CARVE_*` values), then the guard's, which the job cannot override.
        let mut environment = match &guard {
            Some(guard) => guard.program_environment(&rendered.env),
            None => rendered.env.clone(),
        };
        environment.insert(
            ENVIRONMENT_SLICE_BYTES.to_string(),
            launch.slice_bytes.to_string(),
        );
        // The checkpoint the scheduler recorded, when this node holds its copy.
        if let Some(resume) = &plan.resume {
            environment.insert(
                ENVIRONMENT_RESUME_FROM.to_string(),
                resume.path.to_string_lossy().into_owned(),
            );
            environment.insert(ENVIRONMENT_RESUME_STEP.to_string(), resume.step.to_string());
        }
        // A gang member's rendezvous deadline and gang (RANK and the others are core's).
        environment.extend(self.gang.into_iter().flat_map(|gang| gang.environment()));
        // Python block-buffers stdout into a pipe: what a program printed would reach
        // the log after the traceback that followed it on stderr. Unless the job says
        // otherwise, its lines go out as they are printed.
        environment
            .entry("PYTHONUNBUFFERED".to_string())
            .or_insert_with(|| "1".to_string());
        // A simulated GPU's memory is its ledger: the fake driver finds it here outside a
        // container, at its device path inside one (where the job cannot move it).
        if let Some(socket) = &launch.simulated_gpu_socket {
            let seen_at = match launch.sandbox {
                Some(_) => PathBuf::from(SIMULATED_GPU_DEVICE_PATH),
                None => socket.clone(),
            };
            environment.insert(
                ENV_SIMULATED_GPU_SOCKET.to_string(),
                seen_at.to_string_lossy().into_owned(),
            );
        }
        let environment: Vec<(String, String)> = environment.into_iter().collect();
        let (command, container, image_root) = match &launch.sandbox {
            Some(sandbox) => {
                let (command, container, image_root) = self
                    .contain(
                        sandbox,
                        plan,
                        &rendered.argv,
                        environment,
                        &working_directory,
                        guard.as_ref(),
                    )
                    .map_err(|error| error.to_string())?;
                (command, Some(container), image_root)
            }
            None => {
                // Where the job sets no PATH, the worker's, so that `python3` means here
                // what it means to the person who started the worker.
                let mut command = Command::new(&rendered.argv[0]);
                command
                    .args(&rendered.argv[1..])
                    .current_dir(&working_directory)
                    .env_clear();
                if let Some(path) = std::env::var_os("PATH") {
                    command.env("PATH", path);
                }
                command.envs(environment);
                (command, None, None)
            }
        };
        // The lease is held outside the program and outside the worker: by a supervisor
        // between them (`command_supervisor.rs`).
        let supervised_command = launch.supervision.as_ref().and_then(|supervision| {
            supervision.wrap(command.as_std(), container.is_none(), container.as_ref())
        });
        let supervised = supervised_command.is_some();
        Ok(PreparedRun {
            command: supervised_command.unwrap_or(command),
            argv: rendered.argv,
            guard,
            container,
            image_root,
            supervised,
        })
    }

    /// The container of one run: the program sees the system directories, its working
    /// directory read-only (the attempt's own directory, read-write, when the spec names
    /// none), its checkpoint directory and its attempt's directory read-write (both
    /// given to its tenant's uid), the recorded checkpoint it resumes from and the guard
    /// read-only, and its GPU.
    fn contain(
        &self,
        sandbox: &Sandbox,
        plan: &RunPlan,
        argv: &[String],
        environment: Vec<(String, String)>,
        working_directory: &Path,
        guard: Option<&AttemptGuard>,
    ) -> Result<(Command, Container, Option<ImageRunRoot>), WorkerError> {
        let launch = self.launch;
        let owner = sandbox.program_owner(&launch.tenant)?;
        give_directory_to(&launch.checkpoint_dir, owner)?;
        give_directory_to(&launch.attempt_directory, owner)?;
        let mut host_paths = vec![
            HostPath::writable(&launch.checkpoint_dir),
            HostPath::writable(&launch.attempt_directory),
        ];
        // The attempt's own directory is its working directory when the spec names none.
        let working_directory = if working_directory == launch.attempt_directory {
            working_directory.to_path_buf()
        } else {
            let path = sandbox.job_path("command.working_directory", working_directory)?;
            host_paths.push(HostPath::read_only(&path));
            path
        };
        for (index, path) in launch.job.spec.command.read_only_paths.iter().enumerate() {
            let field = format!("command.read_only_paths[{index}]");
            host_paths.push(HostPath::read_only(
                sandbox.job_path(&field, Path::new(path))?,
            ));
        }
        if !plan.checkpoint_dir.starts_with(&launch.attempt_directory) {
            give_directory_to(&plan.checkpoint_dir, owner)?;
            host_paths.push(HostPath::writable(&plan.checkpoint_dir));
        }
        // The recorded checkpoints, read-only: the run cannot change what it resumes from.
        if let Some(resume) = &plan.resume {
            give_directory_to(&resume.recorded_directory, owner)?;
            host_paths.push(HostPath::read_only(&resume.recorded_directory));
        }
        if let Some(guard) = guard {
            host_paths.push(HostPath::read_only(guard.library()));
        }
        host_paths.extend(
            launch
                .devices
                .read_only_paths
                .iter()
                .map(HostPath::read_only),
        );
        let request = ContainerRequest {
            name: format!("{}-{}", launch.container_name, self.runs),
            tenant: launch.tenant.clone(),
            argv: argv.to_vec(),
            environment,
            working_directory,
            host_paths,
            devices: launch.devices.nodes.clone(),
            simulated_gpu_socket: launch.simulated_gpu_socket.clone(),
            // Validated at submit: a spec that does not read asks for nothing here.
            asked_limits: launch.job.spec.resources.host_limits().unwrap_or_default(),
        };
        let Some(image) = self.image else {
            let (command, container) = sandbox.prepare(&request)?;
            self.share_network_with_gang(sandbox, &container, &request.name)?;
            return Ok((command, container, None));
        };
        // The host driver's libraries (a CDI spec's mounts) are bound at their host
        // paths; their directories go first on LD_LIBRARY_PATH, as the image's own
        // library directories may not include them.
        let mut library_directories: Vec<PathBuf> = launch
            .devices
            .read_only_paths
            .iter()
            .filter(|path| path.to_string_lossy().contains(".so"))
            .filter_map(|path| path.parent().map(Path::to_path_buf))
            .collect();
        library_directories.dedup();
        let (command, container, root) = sandbox.prepare_in_image(
            &request,
            image,
            &sandbox.images().runs_directory(),
            &library_directories,
        )?;
        self.share_network_with_gang(sandbox, &container, &request.name)?;
        Ok((command, container, Some(root)))
    }

    /// A gang member's container goes onto the node's network, where its gang meets
    /// (the trade-off: `crate::gang_member`'s docs); a single process keeps its own.
    fn share_network_with_gang(
        &self,
        sandbox: &Sandbox,
        container: &Container,
        name: &str,
    ) -> Result<(), WorkerError> {
        if self.gang.is_none() {
            return Ok(());
        }
        sandbox
            .share_host_network(name)
            .inspect_err(|_| container.remove())
    }
}
