//! `carve-sandbox-bench`: what a container adds to an attempt's start. It runs the same
//! short program (`/bin/true`, or `--program`) directly and in an attempt's container
//! (bundle written, `runc run`, removed), interleaved, and prints the medians, the time
//! added and the ratio. Needs runc and root, as a worker does.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use carve_worker::sandbox::{
    ContainerRequest, Sandbox, SandboxPolicy, SandboxSettings, container_exit_status,
};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(about = "Attempt start-up with and without the container, side by side")]
struct Arguments {
    /// Runs of each kind.
    #[arg(long, default_value_t = 30)]
    runs: usize,
    /// The program each run starts (argv, comma-separated).
    #[arg(long, default_value = "/bin/true", value_delimiter = ',')]
    program: Vec<String>,
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let arguments = Arguments::parse();
    let directory = tempfile::tempdir().context("a scratch directory")?;
    let settings = SandboxSettings {
        policy: SandboxPolicy::Required,
        ..SandboxSettings::default()
    };
    let sandbox =
        Sandbox::open(&settings, directory.path(), "bench")?.context("the sandbox is required")?;
    let mut direct = Vec::new();
    let mut contained = Vec::new();
    for run in 0..arguments.runs {
        let started = Instant::now();
        let status = tokio::process::Command::new(&arguments.program[0])
            .args(&arguments.program[1..])
            .env_clear()
            .status()
            .await?;
        direct.push(started.elapsed());
        if !status.success() {
            bail!("{:?} failed directly: {status}", arguments.program);
        }

        let started = Instant::now();
        let (mut command, container) = sandbox.prepare(&ContainerRequest {
            name: format!("bench-{run}"),
            tenant: "bench".into(),
            argv: arguments.program.clone(),
            environment: Vec::new(),
            working_directory: PathBuf::from("/tmp"),
            ..ContainerRequest::default()
        })?;
        let status = container_exit_status(command.status().await?, &[]);
        container.remove();
        contained.push(started.elapsed());
        if !status.success() {
            bail!("{:?} failed in its container: {status}", arguments.program);
        }
    }
    let direct = median(direct);
    let contained = median(contained);
    println!("program                {:?}", arguments.program);
    println!("runs of each           {}", arguments.runs);
    println!("direct (median)        {direct:?}");
    println!("in a container (median) {contained:?}");
    println!(
        "added per attempt      {:?} (target: under 150 ms)",
        contained.saturating_sub(direct)
    );
    println!(
        "ratio                  {:.1}x",
        contained.as_secs_f64() / direct.as_secs_f64()
    );
    Ok(())
}
