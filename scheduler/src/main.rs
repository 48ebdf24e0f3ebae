//! `carve-scheduler`: the scheduler binary. Its settings (flags, then environment
//! variables `CARVE_*`, then a TOML file `--config`, then defaults) are in `settings.rs`.

mod settings;

use anyhow::{Context, Result};
use carve_scheduler::server::run_announcing_readiness;
use carve_scheduler::store::{DATABASE_CHECK_TIMEOUT, check_database};
use clap::Parser;

use crate::settings::Arguments;

#[tokio::main]
async fn main() -> Result<()> {
    let arguments = Arguments::parse();
    carve_proto::logging::init_logging(arguments.log_format);
    let (listen, config) = arguments.settings()?.load()?;
    // A database that cannot be reached is reported now, naming its host, rather than
    // after "listening" when the first query gives up.
    check_database(&config.database_url, DATABASE_CHECK_TIMEOUT).await?;
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    // SIGINT and SIGTERM (what systemd, Docker and Kubernetes send) both drain cleanly.
    let shutdown = carve_proto::client::shutdown_signal();
    // The address line is for people and for scripts that started it on port 0; it is
    // printed once the scheduler is ready (its lock held, its store open), not at bind.
    run_announcing_readiness(config, listener, shutdown, |address| {
        if let Some(address) = address {
            eprintln!("carve-scheduler listening on {address}");
        }
    })
    .await?;
    Ok(())
}
