//! `carve secret create|list|delete`: a tenant's secrets on the scheduler, today the
//! registry credentials a command job's `command.image_pull_secret` names. A value is
//! read from a file or from stdin (`--from-file -`), never from the command line (where
//! `ps` and shell history would show it), and never printed back: the scheduler answers
//! with names and times only.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use carve_proto::v1;

use super::connection::{Connection, ConnectionOptions};
use super::output::{ListFormat, print_message, print_table, timestamp_text};

/// The most bytes read from a secret's file (the scheduler takes 8 KiB).
const MAX_VALUE_BYTES: u64 = 64 * 1024;

#[derive(Debug, clap::Args)]
pub struct SecretArguments {
    #[command(subcommand)]
    command: SecretCommand,
}

#[derive(Debug, clap::Subcommand)]
enum SecretCommand {
    /// Stores a secret: a registry credential `username:password` (one line) read from
    /// a file, or from stdin with `--from-file -`; never from the command line.
    Create {
        /// Its name within the tenant (what `command.image_pull_secret` names).
        name: String,
        /// The file holding the value; `-` reads stdin.
        #[arg(long, value_name = "FILE")]
        from_file: PathBuf,
        /// Replace the value of an existing secret of that name.
        #[arg(long)]
        replace: bool,
        /// The tenant (admins; default: your own).
        #[arg(long)]
        tenant: Option<String>,
        #[command(flatten)]
        connection: ConnectionOptions,
    },
    /// Lists the tenant's secrets: names and times, never values.
    List {
        /// The tenant (admins; default: your own).
        #[arg(long)]
        tenant: Option<String>,
        #[arg(short = 'o', long, value_enum, default_value_t = ListFormat::Table)]
        output: ListFormat,
        #[command(flatten)]
        connection: ConnectionOptions,
    },
    /// Deletes a secret; jobs already admitted naming it fail their next attempt that
    /// needs it.
    Delete {
        /// The secret's name.
        name: String,
        /// The tenant (admins; default: your own).
        #[arg(long)]
        tenant: Option<String>,
        #[command(flatten)]
        connection: ConnectionOptions,
    },
}

/// A secret's value from `path` (`-`: stdin), bounded.
fn read_value(path: &PathBuf) -> Result<Vec<u8>> {
    let mut value = Vec::new();
    if path.as_os_str() == "-" {
        std::io::stdin()
            .take(MAX_VALUE_BYTES + 1)
            .read_to_end(&mut value)
            .context("cannot read the secret from stdin")?;
    } else {
        std::fs::File::open(path)
            .with_context(|| format!("cannot open {}", path.display()))?
            .take(MAX_VALUE_BYTES + 1)
            .read_to_end(&mut value)
            .with_context(|| format!("cannot read {}", path.display()))?;
    }
    if value.len() as u64 > MAX_VALUE_BYTES {
        bail!("the secret is longer than {MAX_VALUE_BYTES} bytes");
    }
    if value.is_empty() {
        bail!("the secret is empty");
    }
    Ok(value)
}

pub async fn secret(arguments: SecretArguments) -> Result<ExitCode> {
    match arguments.command {
        SecretCommand::Create {
            name,
            from_file,
            replace,
            tenant,
            connection,
        } => {
            let value = read_value(&from_file)?;
            let connection = Connection::open(&connection).await?;
            let created = connection
                .secrets()
                .create_secret(v1::CreateSecretRequest {
                    tenant: tenant.unwrap_or_default(),
                    name: name.clone(),
                    value,
                    replace,
                })
                .await
                .map_err(|status| {
                    connection.failure(&status, &format!("cannot create secret {name}"))
                })?
                .into_inner();
            let secret = created.secret.unwrap_or_default();
            println!(
                "secret {} {} for tenant {}",
                secret.name,
                if replace { "stored" } else { "created" },
                secret.tenant
            );
        }
        SecretCommand::List {
            tenant,
            output,
            connection,
        } => {
            let connection = Connection::open(&connection).await?;
            let listed = connection
                .secrets()
                .list_secrets(v1::ListSecretsRequest {
                    tenant: tenant.unwrap_or_default(),
                })
                .await
                .map_err(|status| connection.failure(&status, "cannot list secrets"))?
                .into_inner();
            match output.document() {
                Some(format) => print_message(&listed, "carve.v1.ListSecretsResponse", format)?,
                None => {
                    let rows: Vec<[String; 4]> = listed
                        .secrets
                        .iter()
                        .map(|secret| {
                            [
                                secret.name.clone(),
                                secret.tenant.clone(),
                                timestamp_text(secret.created_at.as_ref()),
                                timestamp_text(secret.updated_at.as_ref()),
                            ]
                        })
                        .collect();
                    print_table(["NAME", "TENANT", "CREATED", "UPDATED"], &rows);
                }
            }
        }
        SecretCommand::Delete {
            name,
            tenant,
            connection,
        } => {
            let connection = Connection::open(&connection).await?;
            connection
                .secrets()
                .delete_secret(v1::DeleteSecretRequest {
                    tenant: tenant.unwrap_or_default(),
                    name: name.clone(),
                })
                .await
                .map_err(|status| {
                    connection.failure(&status, &format!("cannot delete secret {name}"))
                })?;
            println!("secret {name} deleted");
        }
    }
    Ok(ExitCode::SUCCESS)
}
