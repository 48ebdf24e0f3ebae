//! `carve`: the command-line front end.
//!
//! Arguments are parsed and checked first (clap), then the real objects are built. Local
//! commands (estimate, run, dev) live in their own modules; the commands that talk to a
//! scheduler (submit, jobs, get, watch, logs, cancel, cluster, admin) in `client`, which
//! also chooses every exit code (`client::failure`).

mod attempt;
mod client;
mod dev;
mod estimate;
mod run;
mod sim;
mod spec_input;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "carve",
    version,
    about = "Carve: GPU jobs admitted by their computed memory",
    after_long_help = client::failure::EXIT_CODES_HELP
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
    /// Replays a job trace on a simulated cluster under three policies (whole GPU per
    /// job, trust the declared memory, Carve) and compares utilisation, queueing, job
    /// completion times and out-of-memory errors; `carve sim generate` writes a trace.
    Sim(sim::SimArguments),
    /// Runs one attempt (started by the worker of `carve dev`, not by people).
    #[command(hide = true)]
    Attempt(carve_worker::attempt_child::AttemptArguments),
    #[command(flatten)]
    Client(client::ClientCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `carve dev` hosts a scheduler and a worker: a write to a closed pipe there is an
    // error to handle, not a reason to end the cluster. The attempt process keeps what
    // its worker expects.
    if !matches!(cli.command, Command::Dev(_) | Command::Attempt(_)) {
        end_quietly_on_closed_stdout();
    }
    let result = match cli.command {
        Command::Estimate(arguments) => estimate::run(arguments),
        Command::Run(arguments) => run::run(arguments),
        Command::Dev(arguments) => dev::run(arguments),
        Command::Sim(arguments) => sim::run(arguments),
        // The attempt process: stdout is its report channel, errors are handled inside.
        Command::Attempt(arguments) => return attempt::run(&arguments),
        Command::Client(command) => client::run(command, Cli::command),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            client::failure::exit_code_for_error(&error)
        }
    }
}

/// Gives SIGPIPE back its default action, which Rust's runtime sets to "ignore": then a
/// write to a closed pipe (`carve jobs -o json | head -1`) ends the process quietly, as
/// it does for other Unix tools, instead of `println!` panicking with "Broken pipe".
/// One place for every command's output, rather than a check at each print.
#[allow(unsafe_code)]
fn end_quietly_on_closed_stdout() {
    // SAFETY: called first thing in main, before any other thread exists; SIG_DFL is a
    // valid disposition for SIGPIPE and no handler of ours is replaced.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
