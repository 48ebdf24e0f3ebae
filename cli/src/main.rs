//! `carve`: the command-line front end.
//!
//! Arguments are parsed and checked first (clap), then the real objects are built. Local
//! commands (estimate, run, dev) live in their own modules; the commands that talk to a
//! scheduler (submit, jobs, get, watch, logs, cancel, cluster, admin) in `client`, which
//! also chooses every exit code (`client::failure`).

mod attempt;
mod client;
mod dev;
mod elapsed;
mod estimate;
mod import_keras;
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
    /// Turns a model from another framework into a job file and prints its estimate
    /// (`carve import keras model.keras`).
    Import(import_keras::ImportArguments),
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
    /// Supervises a command job's program (started by the worker of `carve dev`).
    #[command(hide = true)]
    Supervise(carve_worker::command_supervisor::SuperviseArguments),
    #[command(flatten)]
    Client(client::ClientCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `carve dev` hosts a scheduler and a worker: a write to a closed pipe there is an
    // error to handle, not a reason to end the cluster. The attempt process keeps what
    // its worker expects.
    if !matches!(
        cli.command,
        Command::Dev(_) | Command::Attempt(_) | Command::Supervise(_)
    ) {
        end_quietly_on_closed_stdout();
    }
    let result = match cli.command {
        Command::Estimate(arguments) => estimate::run(arguments),
        Command::Import(arguments) => import_keras::run(arguments),
        Command::Run(arguments) => run::run(arguments),
        Command::Dev(arguments) => dev::run(arguments),
        Command::Sim(arguments) => sim::run(arguments),
        // The attempt process: stdout is its report channel, errors are handled inside.
        Command::Attempt(arguments) => return attempt::run(&arguments),
        // The supervisor exits as `carve-worker supervise` does: with its program's end.
        Command::Supervise(arguments) => {
            return carve_worker::command_supervisor::supervise_command(&arguments, "carve");
        }
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

/// Makes a write to a closed stdout or stderr pipe (`carve jobs -o json | head -1`) end
/// the process quietly, as it does for other Unix tools, instead of `println!` panicking
/// with "Broken pipe": one place for every command's output, rather than a check at each
/// print. A closed network connection raises SIGPIPE too (a plain-http client that a TLS
/// scheduler hangs up on): there the signal is ignored, as Rust's runtime would, so the
/// write fails with an error the command reports with its exit code.
#[allow(unsafe_code)]
fn end_quietly_on_closed_stdout() {
    // SAFETY: called first thing in main, before any other thread exists; the handler
    // only makes async-signal-safe calls and no handler of ours is replaced.
    unsafe {
        libc::signal(
            libc::SIGPIPE,
            end_if_an_output_pipe_is_closed as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

/// The SIGPIPE handler: dies of SIGPIPE, as without a handler, when stdout or stderr is a
/// pipe nobody reads any more (poll reports an error on it); returns otherwise.
#[allow(unsafe_code)]
extern "C" fn end_if_an_output_pipe_is_closed(_signal: libc::c_int) {
    let mut outputs = [1, 2].map(|fd| libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    });
    // SAFETY: poll, signal and raise are async-signal-safe; `outputs` is a valid array of
    // its stated length for the duration of the call.
    unsafe {
        let ready = libc::poll(outputs.as_mut_ptr(), outputs.len() as libc::nfds_t, 0);
        let closed = ready > 0
            && outputs
                .iter()
                .any(|output| output.revents & (libc::POLLERR | libc::POLLHUP) != 0);
        if closed {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            libc::raise(libc::SIGPIPE);
        }
    }
}
