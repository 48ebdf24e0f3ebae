//! `carve-guard-bench`: alloc+free pairs a second through the CUDA driver API straight into
//! the fake driver and with the guard (`libcarve_guard.so`) preloaded, in one run; the
//! added nanoseconds per allocation are judged against the target of under 1 µs. See
//! BENCHMARKS.md. The `child` subcommand is the measured process (run by the bench itself).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use carve_bench::guard_overhead::{
    GuardBenchSettings, library_next_to_binary, render_guard_report, run_child, run_guard_benchmark,
};
use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "carve-guard-bench",
    about = "Allocations per second through the guard against straight into the fake CUDA driver",
    args_conflicts_with_subcommands = true
)]
struct Arguments {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArguments,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The measured process: loads libcuda.so.1 from LD_LIBRARY_PATH and prints one JSON line.
    #[command(hide = true)]
    Child(MeasureArguments),
}

#[derive(Debug, Clone, Args)]
struct MeasureArguments {
    /// Bytes per allocation.
    #[arg(long = "bytes", default_value_t = 1 << 20)]
    allocation_bytes: u64,
    /// Alloc+free pairs per round.
    #[arg(long = "pairs", default_value_t = 200_000)]
    pairs_per_round: u64,
    /// Timed rounds (the median is reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// The guard's slice (CARVE_GUARD_LIMIT_BYTES); the check allocates past it.
    #[arg(long, default_value_t = 1 << 30)]
    limit_bytes: u64,
}

#[derive(Debug, Clone, Args)]
struct RunArguments {
    #[command(flatten)]
    measure: MeasureArguments,
    /// Children per side, run in turns (direct, guarded, direct, ...).
    #[arg(long, default_value_t = 3)]
    child_runs: usize,
    /// The fake driver; default: libcarve_fake_driver.so next to this binary (deps/ first).
    #[arg(long)]
    fake_driver_library: Option<PathBuf>,
    /// The guard; default: libcarve_guard.so next to this binary (deps/ first).
    #[arg(long)]
    guard_library: Option<PathBuf>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

impl MeasureArguments {
    fn settings(&self, child_runs: usize) -> Result<GuardBenchSettings> {
        if self.allocation_bytes == 0
            || self.pairs_per_round == 0
            || self.rounds == 0
            || child_runs == 0
        {
            bail!("--bytes, --pairs, --rounds and --child-runs must be positive");
        }
        Ok(GuardBenchSettings {
            allocation_bytes: self.allocation_bytes,
            pairs_per_round: self.pairs_per_round,
            rounds: self.rounds,
            limit_bytes: self.limit_bytes,
            child_runs,
        })
    }
}

fn library(flag: Option<PathBuf>, file_name: &str) -> Result<PathBuf> {
    let path = match flag {
        Some(path) => path,
        None => library_next_to_binary(file_name)?,
    };
    // LD_PRELOAD and the driver links need an absolute path.
    std::fs::canonicalize(&path).with_context(|| format!("{}", path.display()))
}

fn main() -> Result<()> {
    let arguments = Arguments::parse();
    if let Some(Command::Child(measure)) = arguments.command {
        let report = run_child(&measure.settings(1)?);
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    let run = arguments.run;
    let settings = run.measure.settings(run.child_runs)?;
    let fake_driver = library(run.fake_driver_library, "libcarve_fake_driver.so")?;
    let guard = library(run.guard_library, "libcarve_guard.so")?;
    if cfg!(debug_assertions) {
        eprintln!(
            "carve-guard-bench: a debug build; build with --release for figures worth keeping"
        );
    }
    let report = run_guard_benchmark(&settings, &fake_driver, &guard)?;
    if run.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render_guard_report(&report));
    }
    Ok(())
}
