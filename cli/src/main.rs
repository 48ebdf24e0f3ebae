//! `carve`: the command-line front end.
//!
//! Arguments are parsed and checked first (clap), then the real objects are built. For now
//! it estimates and trains jobs locally; the gRPC commands (submit, jobs, watch, ...)
//! arrive with the scheduler.

mod attempt;
mod dev;
mod estimate;
mod run;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "carve",
    version,
    about = "Carve: GPU jobs admitted by their computed memory"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Computes the GPU memory one training step of a job needs, with breakdowns; with
    /// --slice, what would run inside a slice of that size.
    Estimate(estimate::EstimateArguments),
    /// Trains a job locally inside a slice (the same code a worker's attempt runs) and
    /// prints its final metrics; an out-of-memory ends it with the numbers (exit code 3).
    Run(run::RunArguments),
    /// Starts a local cluster in this process: a scheduler (SQLite) and a worker with
    /// simulated GPUs; prints the endpoint and a token and runs until Ctrl-C. With
    /// --demo it submits the examples, watches them to the end, prints a summary and stops.
    Dev(dev::DevArguments),
    /// Runs one attempt (started by the worker of `carve dev`, not by people).
    #[command(hide = true)]
    Attempt(attempt::AttemptCommandArguments),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Estimate(arguments) => estimate::run(arguments),
        Command::Run(arguments) => run::run(arguments),
        Command::Dev(arguments) => dev::run(arguments),
        // The attempt process: stdout is its report channel, errors are handled inside.
        Command::Attempt(arguments) => return attempt::run(arguments),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(1)
        }
    }
}
