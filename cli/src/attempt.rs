//! `carve attempt ...` (hidden): the attempt process `carve dev`'s in-process worker
//! starts for every attempt. It forwards to the worker's own entry point,
//! [`carve_worker::attempt_child::run_attempt`], so it behaves exactly like
//! `carve-worker attempt ...` (exit codes 0 trained, 3 out of memory, 1 anything else).

use std::path::PathBuf;
use std::process::ExitCode;

use carve_worker::attempt_child::{AttemptArguments, run_attempt};

#[derive(Debug, clap::Args)]
pub struct AttemptCommandArguments {
    #[arg(long)]
    spec_file: PathBuf,
    #[arg(long)]
    config_json: String,
    #[arg(long)]
    slice_bytes: u64,
    #[arg(long)]
    checkpoint: PathBuf,
    #[arg(long)]
    resume: Option<PathBuf>,
}

/// Runs one attempt; stdout is the report channel to the worker, so nothing else is
/// printed there.
pub fn run(arguments: AttemptCommandArguments) -> ExitCode {
    let attempt = AttemptArguments {
        spec_file: arguments.spec_file,
        config_json: arguments.config_json,
        slice_bytes: arguments.slice_bytes,
        checkpoint: arguments.checkpoint,
        resume: arguments.resume,
    };
    match run_attempt(&attempt) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(error) => {
            eprintln!("carve attempt: {error}");
            ExitCode::FAILURE
        }
    }
}
