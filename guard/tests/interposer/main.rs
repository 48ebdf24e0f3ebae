//! The guard's integration tests, without a GPU: `libcarve_guard.so` preloaded into a
//! test program that uses the fake driver (`libcarve_fake_driver.so` as `libcuda.so.1`).
//!
//! One binary, two roles (`harness = false`): started with `probe` it IS the program under
//! the guard (see `probe`), and otherwise it runs every case in `cases`, each starting
//! the probe as a child with the guard's environment and a timeout.
#![allow(unsafe_code)] // The probe calls the driver through C function pointers.

mod cases;
mod command_programs;
mod harness;
mod probe;

fn main() {
    let arguments: Vec<String> = std::env::args().skip(1).collect();
    if arguments.first().map(String::as_str) == Some("probe") {
        probe::run(&arguments[1..]);
        return;
    }
    let filter = arguments.iter().find(|argument| !argument.starts_with('-'));
    std::process::exit(cases::run_all(filter.map(String::as_str)));
}
