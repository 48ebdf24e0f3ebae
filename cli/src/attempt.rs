//! `carve attempt ...` (hidden): the attempt process `carve dev`'s in-process worker
//! starts for every attempt. It forwards to the worker's own entry point,
//! [`carve_worker::attempt_child::attempt_command`], so it behaves exactly like
//! `carve-worker attempt ...` (exit codes 0 trained, 3 out of memory, 1 anything else).

use std::process::ExitCode;

use carve_worker::attempt_child::{AttemptArguments, attempt_command};

/// Runs one attempt; stdout is the report channel to the worker, so nothing else is
/// printed there.
pub fn run(arguments: &AttemptArguments) -> ExitCode {
    attempt_command(arguments, "carve")
}
