//! `carve reset-model`: forgets the memory model Carve learned for a command job's
//! program (the caller's tenant's; models are per tenant), or every model of a tenant,
//! so the next `vram = "auto"` job of the command profiles again. `carve get` shows a
//! command job's model and what it rests on.

use std::process::ExitCode;

use anyhow::{Result, bail};
use carve_proto::v1;

use super::connection::{Connection, ConnectionOptions};

#[derive(Debug, clap::Args)]
pub struct ResetModelArguments {
    /// A command job (id, unique id prefix or name): the model of its command is
    /// forgotten (the job's tenant's).
    #[arg(
        value_name = "JOB",
        required_unless_present = "all",
        conflicts_with = "all"
    )]
    job: Option<String>,
    /// Forget every memory model of the tenant instead.
    #[arg(long)]
    all: bool,
    /// With --all: the tenant whose models are forgotten (admins; default: your own).
    #[arg(long, requires = "all")]
    tenant: Option<String>,
    #[command(flatten)]
    connection: ConnectionOptions,
}

/// Asks the scheduler to forget the models and says how many it forgot.
pub async fn reset_model(arguments: ResetModelArguments) -> Result<ExitCode> {
    let connection = Connection::open(&arguments.connection).await?;
    let request = v1::ResetMemoryModelsRequest {
        job_id: arguments.job.clone().unwrap_or_default(),
        all: arguments.all,
        tenant: arguments.tenant.clone().unwrap_or_default(),
    };
    if request.job_id.is_empty() && !request.all {
        bail!("name a job, or --all");
    }
    let what = match &arguments.job {
        Some(job) => format!("the memory model of job {job}'s command"),
        None => format!(
            "the memory models of tenant {}",
            arguments.tenant.as_deref().unwrap_or("(yours)")
        ),
    };
    let deleted = connection
        .jobs()
        .reset_memory_models(request)
        .await
        .map_err(|status| connection.failure(&status, &format!("cannot reset {what}")))?
        .into_inner()
        .deleted;
    match deleted {
        0 => println!("no memory model to forget: {what} was never learned"),
        1 => {
            println!("forgot 1 memory model ({what}); the next vram = \"auto\" job profiles again")
        }
        count => println!(
            "forgot {count} memory models ({what}); the next vram = \"auto\" job of each command profiles again"
        ),
    }
    Ok(ExitCode::SUCCESS)
}
