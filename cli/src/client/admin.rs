//! `carve admin`: tenants, their quotas and the bearer tokens, through the AdminService,
//! and removing a gone worker, through the ClusterService (admin tokens only).
//!
//! `carve admin tokens create` prints the new secret alone on stdout (details go to
//! stderr), so `TOKEN=$(carve admin tokens create ...)` captures exactly the secret; with
//! `-o json` the whole response, secret included, goes to stdout instead.

use std::process::ExitCode;

use anyhow::{Context, Result};
use carve_core::bytes::parse_byte_size;
use carve_proto::v1;

use super::connection::{Connection, ConnectionOptions};
use super::failure::{ClientFailure, FailureKind};
use super::output::{
    ListFormat, OutputFormat, bytes_text, date_text, print_message, print_table, print_wide_table,
    role_name, timestamp_text,
};

#[derive(Debug, clap::Args)]
pub struct AdminArguments {
    #[command(subcommand)]
    area: AdminArea,
    #[command(flatten)]
    connection: ConnectionOptions,
}

#[derive(Debug, clap::Subcommand)]
enum AdminArea {
    /// Tenants: groups of users whose jobs share a quota and see only each other.
    Tenants {
        #[command(subcommand)]
        action: TenantAction,
    },
    /// A tenant's quota.
    Quota {
        #[command(subcommand)]
        action: QuotaAction,
    },
    /// Bearer tokens.
    Tokens {
        #[command(subcommand)]
        action: TokenAction,
    },
    /// Workers the cluster should forget.
    Workers {
        #[command(subcommand)]
        action: WorkerAction,
    },
}

#[derive(Debug, clap::Subcommand)]
enum WorkerAction {
    /// Forgets a gone worker (a lost one, or one on a retired node): refused while it is
    /// connected or runs attempts. Its attempts stay in their jobs' history.
    Remove {
        /// The worker id (see `carve cluster`), or its node's name.
        worker: String,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
    },
}

/// A quota limit as typed: a number, or `none` for no limit.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Limit<T> {
    Unlimited,
    At(T),
}

impl<T> Limit<T> {
    fn into_option(self) -> Option<T> {
        match self {
            Limit::Unlimited => None,
            Limit::At(value) => Some(value),
        }
    }
}

fn is_unlimited(text: &str) -> bool {
    matches!(text.trim(), "none" | "unlimited")
}

fn parse_vram_limit(text: &str) -> Result<Limit<u64>, String> {
    if is_unlimited(text) {
        return Ok(Limit::Unlimited);
    }
    parse_byte_size(text)
        .map(Limit::At)
        .map_err(|error| format!("{error} (or `none` for no limit)"))
}

fn parse_count_limit(text: &str) -> Result<Limit<u32>, String> {
    if is_unlimited(text) {
        return Ok(Limit::Unlimited);
    }
    text.trim()
        .parse::<u32>()
        .map(Limit::At)
        .map_err(|_| format!("{text:?} is not a count (or `none` for no limit)"))
}

fn parse_weight(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(weight) if weight.is_finite() && weight > 0.0 => Ok(weight),
        _ => Err(format!("{text:?} is not a positive number")),
    }
}

/// `30d`, `12h`, `90m`, `3600s` (or plain seconds).
fn parse_time_to_live(text: &str) -> Result<prost_types::Duration, String> {
    let text = text.trim();
    let (number, unit_seconds) = match text.char_indices().last() {
        Some((index, 'd')) => (&text[..index], 86_400),
        Some((index, 'h')) => (&text[..index], 3600),
        Some((index, 'm')) => (&text[..index], 60),
        Some((index, 's')) => (&text[..index], 1),
        _ => (text, 1),
    };
    let seconds = number
        .parse::<i64>()
        .ok()
        .filter(|count| *count > 0)
        .and_then(|count| count.checked_mul(unit_seconds))
        .ok_or_else(|| format!("{text:?} is not a duration such as 30d, 12h, 90m or 3600s"))?;
    Ok(prost_types::Duration { seconds, nanos: 0 })
}

#[derive(Debug, clap::Subcommand)]
enum TenantAction {
    /// Every tenant with its quota and what it uses now.
    List {
        /// Output format: `table` fits 100 columns, `wide` shows the creation time whole.
        #[arg(short = 'o', long, value_enum, default_value_t = ListFormat::Table)]
        output: ListFormat,
    },
    /// Creates a tenant (lowercase letters, digits and '-').
    Create {
        /// The tenant's name.
        name: String,
        /// Its weight in fair sharing (2 gets twice the share of 1).
        #[arg(long, value_parser = parse_weight)]
        weight: Option<f64>,
        /// The most VRAM its running attempts may hold (e.g. 32GiB); none by default.
        #[arg(long, value_parser = parse_vram_limit)]
        vram: Option<Limit<u64>>,
        /// The most attempts it may run at once; none by default.
        #[arg(long, value_parser = parse_count_limit)]
        max_running_jobs: Option<Limit<u32>>,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
    },
    /// Deletes a tenant with its quota and finished jobs, and revokes its user and worker
    /// tokens; refused while it has jobs that are not finished.
    Delete {
        /// The tenant's name.
        name: String,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
    },
}

#[derive(Debug, clap::Subcommand)]
enum QuotaAction {
    /// Changes a tenant's quota; limits not given keep their current values.
    Set {
        /// The tenant.
        tenant: String,
        /// The most VRAM its running attempts may hold (e.g. 32GiB), or `none`.
        #[arg(long, value_parser = parse_vram_limit)]
        vram: Option<Limit<u64>>,
        /// The most attempts it may run at once, or `none`.
        #[arg(long, value_parser = parse_count_limit)]
        max_running_jobs: Option<Limit<u32>>,
        /// Its weight in fair sharing.
        #[arg(long, value_parser = parse_weight)]
        weight: Option<f64>,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
    },
}

/// What a token may do, as `--role` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RoleArgument {
    /// Submits and manages its tenant's jobs.
    User,
    /// Everything, across tenants.
    Admin,
    /// Only the worker service.
    Worker,
}

impl From<RoleArgument> for v1::Role {
    fn from(role: RoleArgument) -> Self {
        match role {
            RoleArgument::User => v1::Role::User,
            RoleArgument::Admin => v1::Role::Admin,
            RoleArgument::Worker => v1::Role::Worker,
        }
    }
}

#[derive(Debug, clap::Subcommand)]
enum TokenAction {
    /// Tokens, without their secrets.
    List {
        /// Only this tenant's tokens.
        #[arg(long)]
        tenant: Option<String>,
        /// Also revoked and expired tokens.
        #[arg(long)]
        all: bool,
        /// Output format: `table` fits 100 columns (dates only, no creation or last use),
        /// `wide` shows every time whole.
        #[arg(short = 'o', long, value_enum, default_value_t = ListFormat::Table)]
        output: ListFormat,
    },
    /// Creates a token and prints its secret, this once, alone on stdout.
    Create {
        /// The tenant it acts for (user tokens).
        #[arg(long)]
        tenant: Option<String>,
        /// What it may do.
        #[arg(long, value_enum)]
        role: RoleArgument,
        /// What it is for, for people ("alice's laptop").
        #[arg(long)]
        name: Option<String>,
        /// How long it stays valid (30d, 12h, 90m, 3600s); until revoked by default.
        #[arg(long, value_parser = parse_time_to_live)]
        ttl: Option<prost_types::Duration>,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
    },
    /// Revokes a token: calls with it fail from now on.
    Revoke {
        /// The token id (see `carve admin tokens list`).
        id: String,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
    },
}

pub async fn admin(arguments: AdminArguments) -> Result<ExitCode> {
    let connection = Connection::open(&arguments.connection).await?;
    match arguments.area {
        AdminArea::Tenants {
            action: TenantAction::List { output },
        } => {
            let tenants = list_tenants(&connection).await?;
            match output.document() {
                None => print_tenants(&tenants.tenants, output == ListFormat::Wide),
                Some(format) => print_message(&tenants, "carve.v1.ListTenantsResponse", format)?,
            }
        }
        AdminArea::Tenants {
            action:
                TenantAction::Create {
                    name,
                    weight,
                    vram,
                    max_running_jobs,
                    output,
                },
        } => {
            let quota = v1::Quota {
                vram_bytes: vram.and_then(Limit::into_option),
                max_running_jobs: max_running_jobs.and_then(Limit::into_option),
                fair_share_weight: weight.unwrap_or(0.0),
            };
            let tenant = connection
                .admin()
                .create_tenant(v1::CreateTenantRequest {
                    name: name.clone(),
                    quota: Some(quota),
                })
                .await
                .map_err(|status| {
                    connection.failure(&status, &format!("cannot create tenant {name}"))
                })?
                .into_inner()
                .tenant
                .context("the scheduler answered without the tenant")?;
            print_tenant_change(&tenant, output, "created")?;
        }
        AdminArea::Tenants {
            action: TenantAction::Delete { name, output },
        } => {
            let deleted = connection
                .admin()
                .delete_tenant(v1::DeleteTenantRequest { name: name.clone() })
                .await
                .map_err(|status| {
                    connection.failure(&status, &format!("cannot delete tenant {name}"))
                })?
                .into_inner();
            if output == OutputFormat::Table {
                println!(
                    "tenant {name} deleted: {} tokens revoked, {} finished jobs removed",
                    deleted.revoked_token_ids.len(),
                    deleted.deleted_jobs
                );
            } else {
                print_message(&deleted, "carve.v1.DeleteTenantResponse", output)?;
            }
        }
        AdminArea::Quota {
            action:
                QuotaAction::Set {
                    tenant,
                    vram,
                    max_running_jobs,
                    weight,
                    output,
                },
        } => {
            // SetQuota replaces the whole quota, so limits not given are read first.
            let current = list_tenants(&connection)
                .await?
                .tenants
                .into_iter()
                .find(|candidate| candidate.name == tenant)
                .ok_or_else(|| {
                    ClientFailure::new(FailureKind::NotFound, format!("tenant {tenant} not found"))
                })?;
            let mut quota = current.quota.unwrap_or_default();
            if let Some(vram) = vram {
                quota.vram_bytes = vram.into_option();
            }
            if let Some(count) = max_running_jobs {
                quota.max_running_jobs = count.into_option();
            }
            if let Some(weight) = weight {
                quota.fair_share_weight = weight;
            }
            let updated = connection
                .admin()
                .set_quota(v1::SetQuotaRequest {
                    tenant: tenant.clone(),
                    quota: Some(quota),
                })
                .await
                .map_err(|status| {
                    connection.failure(&status, &format!("cannot set the quota of {tenant}"))
                })?
                .into_inner()
                .tenant
                .context("the scheduler answered without the tenant")?;
            print_tenant_change(&updated, output, "updated")?;
        }
        AdminArea::Tokens { action } => tokens(&connection, action).await?,
        AdminArea::Workers {
            action: WorkerAction::Remove { worker, output },
        } => {
            let removed = connection
                .cluster()
                .remove_worker(v1::RemoveWorkerRequest {
                    worker_id: worker.clone(),
                })
                .await
                .map_err(|status| {
                    connection.failure(&status, &format!("cannot remove worker {worker}"))
                })?
                .into_inner()
                .worker
                .context("the scheduler answered without the worker")?;
            if output == OutputFormat::Table {
                println!("worker {} ({}) removed", removed.id, removed.hostname);
            } else {
                print_message(&removed, "carve.v1.Worker", output)?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn list_tenants(connection: &Connection) -> Result<v1::ListTenantsResponse> {
    connection
        .retrying(|connection| async move {
            connection
                .admin()
                .list_tenants(v1::ListTenantsRequest {})
                .await
        })
        .await
        .map_err(|status| connection.failure(&status, "cannot list tenants"))
}

fn quota_text(quota: Option<&v1::Quota>) -> [String; 3] {
    let quota = quota.cloned().unwrap_or_default();
    [
        quota
            .vram_bytes
            .map_or_else(|| "none".into(), |bytes| bytes_text(Some(bytes))),
        quota
            .max_running_jobs
            .map_or_else(|| "none".into(), |count| count.to_string()),
        if quota.fair_share_weight > 0.0 {
            quota.fair_share_weight.to_string()
        } else {
            "1".into()
        },
    ]
}

/// The tenants' table; `wide` shows when each was created to the second.
fn print_tenants(tenants: &[v1::Tenant], wide: bool) {
    if tenants.is_empty() {
        println!("no tenants");
        return;
    }
    let rows: Vec<[String; 7]> = tenants
        .iter()
        .map(|tenant| {
            let [vram, running, weight] = quota_text(tenant.quota.as_ref());
            [
                tenant.name.clone(),
                vram,
                running,
                weight,
                bytes_text(Some(tenant.vram_in_use_bytes)),
                format!(
                    "{} running, {} queued",
                    tenant.running_jobs, tenant.queued_jobs
                ),
                if wide {
                    timestamp_text(tenant.created_at.as_ref())
                } else {
                    date_text(tenant.created_at.as_ref())
                },
            ]
        })
        .collect();
    let header = [
        "NAME",
        "VRAM QUOTA",
        "RUNNING QUOTA",
        "WEIGHT",
        "VRAM IN USE",
        "JOBS",
        "CREATED",
    ];
    if wide {
        print_wide_table(header, &rows);
    } else {
        print_table(header, &rows);
    }
}

/// What a token's STATE cell says at `now_seconds`: `active`, `expired`, or `revoked`
/// with the revoke time as `time` writes it (when the scheduler kept one).
fn token_state(
    token: &v1::Token,
    now_seconds: i64,
    time: fn(Option<&prost_types::Timestamp>) -> String,
) -> String {
    if let Some(revoked_at) = &token.revoked_at {
        format!("revoked {}", time(Some(revoked_at)))
    } else if token
        .expires_at
        .as_ref()
        .is_some_and(|expires| expires.seconds <= now_seconds)
    {
        "expired".into()
    } else {
        "active".into()
    }
}

/// The tokens' table: the wide one with every time whole, the default one with dates and
/// without the creation time, which fit 100 columns beside a whole id.
fn print_tokens(tokens: &[v1::Token], wide: bool) {
    // Times to the second in the wide table, to the day in the default one.
    let time = if wide { timestamp_text } else { date_text };
    let now_seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs() as i64);
    let rows: Vec<[String; 8]> = tokens
        .iter()
        .map(|token| {
            [
                token.id.clone(),
                if token.tenant.is_empty() {
                    "-".to_string()
                } else {
                    token.tenant.clone()
                },
                role_name(token.role),
                token_state(token, now_seconds, time),
                time(token.created_at.as_ref()),
                time(token.expires_at.as_ref()),
                time(token.last_used_at.as_ref()),
                token.description.clone(),
            ]
        })
        .collect();
    let header = [
        "ID",
        "TENANT",
        "ROLE",
        "STATE",
        "CREATED",
        "EXPIRES",
        "LAST USED",
        "DESCRIPTION",
    ];
    if wide {
        print_wide_table(header, &rows);
        return;
    }
    let [id, tenant, role, state, _, expires, last_used, description] = header;
    let rows: Vec<[String; 7]> = rows
        .into_iter()
        .map(
            |[id, tenant, role, state, _, expires, last_used, description]| {
                [id, tenant, role, state, expires, last_used, description]
            },
        )
        .collect();
    print_table(
        [id, tenant, role, state, expires, last_used, description],
        &rows,
    );
}

fn print_tenant_change(tenant: &v1::Tenant, output: OutputFormat, what: &str) -> Result<()> {
    if output != OutputFormat::Table {
        return print_message(tenant, "carve.v1.Tenant", output);
    }
    let [vram, running, weight] = quota_text(tenant.quota.as_ref());
    println!(
        "tenant {} {what}: vram quota {vram}, running jobs quota {running}, weight {weight}",
        tenant.name
    );
    Ok(())
}

async fn tokens(connection: &Connection, action: TokenAction) -> Result<()> {
    let mut client = connection.admin();
    match action {
        TokenAction::List {
            tenant,
            all,
            output,
        } => {
            let tokens = client
                .list_tokens(v1::ListTokensRequest {
                    tenant: tenant.unwrap_or_default(),
                    include_inactive: all,
                })
                .await
                .map_err(|status| connection.failure(&status, "cannot list tokens"))?
                .into_inner();
            if let Some(format) = output.document() {
                return print_message(&tokens, "carve.v1.ListTokensResponse", format);
            }
            if tokens.tokens.is_empty() {
                println!("no tokens");
                return Ok(());
            }
            print_tokens(&tokens.tokens, output == ListFormat::Wide);
        }
        TokenAction::Create {
            tenant,
            role,
            name,
            ttl,
            output,
        } => {
            let created = client
                .create_token(v1::CreateTokenRequest {
                    tenant: tenant.unwrap_or_default(),
                    role: v1::Role::from(role) as i32,
                    description: name.unwrap_or_default(),
                    time_to_live: ttl,
                })
                .await
                .map_err(|status| connection.failure(&status, "cannot create a token"))?
                .into_inner();
            if output != OutputFormat::Table {
                return print_message(&created, "carve.v1.CreateTokenResponse", output);
            }
            if let Some(token) = &created.token {
                eprintln!(
                    "created token {} ({}{}); its secret, shown only this once:",
                    token.id,
                    role_name(token.role),
                    if token.tenant.is_empty() {
                        String::new()
                    } else {
                        format!(", tenant {}", token.tenant)
                    }
                );
            }
            println!("{}", created.secret);
        }
        TokenAction::Revoke { id, output } => {
            let revoked = client
                .revoke_token(v1::RevokeTokenRequest {
                    token_id: id.clone(),
                })
                .await
                .map_err(|status| connection.failure(&status, &format!("cannot revoke {id}")))?
                .into_inner()
                .token
                .context("the scheduler answered without the token")?;
            if output == OutputFormat::Table {
                // A scheduler older than the revoke time sends none: then no time, not "-".
                match revoked.revoked_at.as_ref() {
                    Some(time) => println!(
                        "token {} revoked at {}",
                        revoked.id,
                        timestamp_text(Some(time))
                    ),
                    None => println!("token {} revoked", revoked.id),
                }
            } else {
                print_message(&revoked, "carve.v1.Token", output)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_read_sizes_counts_and_none() {
        assert_eq!(parse_vram_limit("32GiB"), Ok(Limit::At(32 << 30)));
        assert_eq!(parse_vram_limit("none"), Ok(Limit::Unlimited));
        assert!(parse_vram_limit("lots").unwrap_err().contains("none"));
        assert_eq!(parse_count_limit("4"), Ok(Limit::At(4)));
        assert_eq!(parse_count_limit("unlimited"), Ok(Limit::Unlimited));
        assert!(parse_count_limit("-1").is_err());
        assert_eq!(parse_weight("2.5"), Ok(2.5));
        assert!(parse_weight("0").is_err());
        assert!(parse_weight("nan").is_err());
    }

    #[test]
    fn durations_read_their_unit() {
        assert_eq!(parse_time_to_live("30d").unwrap().seconds, 30 * 86_400);
        assert_eq!(parse_time_to_live("90m").unwrap().seconds, 5400);
        assert_eq!(parse_time_to_live("3600").unwrap().seconds, 3600);
        assert!(parse_time_to_live("0h").is_err());
        assert!(parse_time_to_live("soon").is_err());
    }
}
