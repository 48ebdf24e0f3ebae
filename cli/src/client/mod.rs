//! The `carve` commands that talk to a scheduler over gRPC (submit, jobs, get, watch,
//! logs, cancel, cluster, admin, usage), and `carve completions`.
//!
//! One file per command group; the pieces they share are [`connection`] (the options,
//! the config file and the authenticated channel), [`output`] (tables, JSON and YAML,
//! and the words for states and sizes) and [`failure`] (the exit codes, chosen in one
//! place). `carve dev` uses the same connection and output helpers.

pub mod admin;
pub mod attempt_results;
pub mod cluster;
pub mod connection;
#[cfg(test)]
mod failover_tests;
pub mod failure;
pub mod job_list;
pub mod jobs;
pub mod logs;
pub mod memory_models;
pub mod output;
pub mod overrides;
pub mod secrets;
pub mod spec_errors;
pub mod usage;
pub mod watch;

use std::process::ExitCode;

use anyhow::{Context, Result};

/// The client commands, flattened into `carve`'s own list.
#[derive(Debug, clap::Subcommand)]
pub enum ClientCommand {
    /// Submits a job file to the scheduler and prints its id, state, estimate and
    /// configuration (and the shrink it got at admission, if any); --watch follows it.
    Submit(jobs::SubmitArguments),
    /// Lists jobs (the caller's tenant; every tenant for admins), newest first.
    Jobs(job_list::JobsArguments),
    /// Shows jobs (each by id, unique id prefix or name): its state and why it waits, its
    /// estimate, every attempt with its config, slice, measured peak and outcome,
    /// out-of-memory numbers and shrinks.
    Get(jobs::GetArguments),
    /// Follows a job to its end: progress, out-of-memory reports, shrinks; the exit code
    /// is 0 when it succeeded, 3 out of memory, 10 failed, 11 cancelled.
    Watch(watch::WatchArguments),
    /// Prints a job's log lines; --follow keeps printing until the job ends.
    Logs(logs::LogsArguments),
    /// Cancels jobs (each by id, unique id prefix or name).
    Cancel(jobs::CancelArguments),
    /// Forgets the memory model Carve learned for a command job's program (yours; models
    /// are per tenant), or with --all every model of a tenant: the next vram = "auto" job
    /// profiles again.
    ResetModel(memory_models::ResetModelArguments),
    /// Manages your tenant's secrets (registry credentials a job's
    /// command.image_pull_secret names): create from a file or stdin, list, delete.
    Secret(secrets::SecretArguments),
    /// Shows the workers and every GPU as a bar of its memory carved into slices;
    /// `drain` and `undrain` a worker (admins).
    Cluster(cluster::ClusterArguments),
    /// Manages tenants, quotas and tokens (admin token required).
    Admin(admin::AdminArguments),
    /// Who used what over a period: per tenant and per user (the submitting token), per
    /// GPU type: jobs, attempts, GPU-hours, VRAM requested vs used, OOM retries,
    /// preemptions, queue times (your tenant; every tenant for admins).
    Usage(usage::UsageArguments),
    /// Prints a shell completion script: `carve completions bash > /etc/bash_completion.d/carve`.
    Completions(CompletionsArguments),
}

#[derive(Debug, clap::Args)]
pub struct CompletionsArguments {
    /// The shell to complete for.
    shell: clap_complete::Shell,
}

/// Runs a client command. `cli` builds `carve`'s whole command line, which completions
/// describe.
pub fn run(command: ClientCommand, cli: impl FnOnce() -> clap::Command) -> Result<ExitCode> {
    if let ClientCommand::Completions(arguments) = &command {
        let mut command = cli();
        let name = command.get_name().to_string();
        clap_complete::generate(arguments.shell, &mut command, name, &mut std::io::stdout());
        return Ok(ExitCode::SUCCESS);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        match command {
            ClientCommand::Submit(arguments) => jobs::submit(arguments).await,
            ClientCommand::Jobs(arguments) => job_list::list(arguments).await,
            ClientCommand::Get(arguments) => jobs::get(arguments).await,
            ClientCommand::Watch(arguments) => watch::watch(arguments).await,
            ClientCommand::Logs(arguments) => logs::logs(arguments).await,
            ClientCommand::Cancel(arguments) => jobs::cancel(arguments).await,
            ClientCommand::ResetModel(arguments) => memory_models::reset_model(arguments).await,
            ClientCommand::Secret(arguments) => secrets::secret(arguments).await,
            ClientCommand::Cluster(arguments) => cluster::cluster(arguments).await,
            ClientCommand::Admin(arguments) => admin::admin(arguments).await,
            ClientCommand::Usage(arguments) => usage::usage(arguments).await,
            ClientCommand::Completions(_) => Ok(ExitCode::SUCCESS),
        }
    })
}
