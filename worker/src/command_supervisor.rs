//! A command job's program under a lease that its worker renews and that something other
//! than the worker enforces: the supervisor, `carve-worker supervise ... -- PROGRAM...`
//! (the worker's own binary, one process per run of the program).
//!
//! An engine attempt process holds its worker's lease itself ([`crate::attempt_lease`]),
//! but a command job's program is the user's own and cannot be asked to. While its
//! worker is frozen (SIGSTOP) or stalled, nothing in the worker can stop it, and the
//! scheduler gives the job to another worker once the worker's lease runs out: two
//! attempts of the job would run at once, writing the same checkpoint directory. So the
//! worker starts every run of a command job's program through a supervisor, its own
//! child, which holds the deadline the worker counts ([`crate::leader_lease`]): the
//! milliseconds left at start (`--lease-ms`) and on its stdin (`lease-ms N` lines, as
//! engine attempts get) each time a leader hears the worker. At the deadline the
//! supervisor sends SIGTERM to the program (every process of its container through the
//! runtime, and the processes of its process group), so it can checkpoint, and SIGKILL
//! `--grace-ms` later, a quarter lease before the scheduler could place the job again.
//!
//! The program cannot renew or disable the lease: only the worker holds the write end of
//! the supervisor's stdin (the program's own stdin is /dev/null), and in a container the
//! program runs as its tenant's host uid in its own pid namespace, where the supervisor
//! (outside, as the worker's uid) can be neither seen, signalled nor traced; the
//! supervisor also makes itself non-dumpable, so a process of its own uid cannot ptrace
//! it. Without a container (`--insecure-no-sandbox`) the program has the worker's rights
//! and can kill its supervisor, as it can kill the worker.
//!
//! Everything else is as if the program were the worker's child: it shares the
//! supervisor's process group (which the worker's own stops signal; the supervisor
//! outlives a SIGTERM to the group to enforce the kill), its stdout and stderr are the
//! supervisor's, and the supervisor exits with its code, or 128 + the signal that ended
//! it ([`crate::sandbox::container_exit_status`] reads it back, as for `runc run`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use rustix::process::Signal;
use tokio::process::Command;
use tokio::sync::{mpsc, watch};

use crate::attempt_lease::parse_renewal;
use crate::sandbox::Container;

/// The hidden subcommand that runs the supervisor.
pub const SUPERVISE_SUBCOMMAND: &str = "supervise";

/// Variables the worker hands the program under this prefix, restored by the supervisor:
/// the dynamic loader's (`LD_PRELOAD`, with the guard) must act on the program, never on
/// the supervisor.
const HELD_VARIABLE_PREFIX: &str = "CARVE_SUPERVISED_";

/// The supervisor's exit code when it cannot start the program (as a shell's for a
/// command it cannot run).
const CANNOT_START_EXIT_CODE: u8 = 127;

/// The supervisor's flags, the same for `carve-worker supervise` and `carve supervise`.
#[derive(Debug, Clone, clap::Args)]
pub struct SuperviseArguments {
    /// Milliseconds left of the lease at start.
    #[arg(long)]
    pub lease_ms: u64,
    /// Milliseconds from SIGTERM to SIGKILL once the lease ran out.
    #[arg(long)]
    pub grace_ms: u64,
    /// The OCI runtime the program's container runs under (its processes are signalled
    /// through it); with `--container-root` and `--container`.
    #[arg(long, requires_all = ["container_root", "container"])]
    pub container_runtime: Option<PathBuf>,
    /// The runtime's state directory (`--root`).
    #[arg(long)]
    pub container_root: Option<PathBuf>,
    /// The container's name.
    #[arg(long)]
    pub container: Option<String>,
    /// The program and its arguments (`runc run ...` for a contained program).
    #[arg(last = true, required = true)]
    pub program: Vec<OsString>,
}

/// The worker's side: what every run of a command attempt's program is supervised with.
#[derive(Debug, Clone)]
pub struct Supervision {
    /// The supervisor's binary (the worker's attempt program: `carve-worker` or `carve`).
    pub program: PathBuf,
    /// The worker's stop deadline as it moves ([`crate::leader_lease::LeaderLease`]).
    pub deadlines: watch::Receiver<Option<Instant>>,
    /// SIGTERM to SIGKILL at the deadline ([`crate::leader_lease::stop_grace`]).
    pub grace: Duration,
}

impl Supervision {
    /// The command that runs `inner` under a supervisor; `clear_environment` says that
    /// `inner` was given its whole environment (`env_clear`), which the wrapper keeps.
    /// `None` while the worker knows no deadline yet (it has never registered, so it has
    /// no assignment either).
    pub fn wrap(
        &self,
        inner: &std::process::Command,
        clear_environment: bool,
        container: Option<&Container>,
    ) -> Option<Command> {
        let deadline = (*self.deadlines.borrow())?;
        let left = deadline.saturating_duration_since(Instant::now());
        let mut command = Command::new(&self.program);
        command
            .arg(SUPERVISE_SUBCOMMAND)
            .arg("--lease-ms")
            .arg(left.as_millis().to_string())
            .arg("--grace-ms")
            .arg(self.grace.as_millis().to_string());
        if let Some(container) = container {
            command
                .arg("--container-runtime")
                .arg(container.runtime())
                .arg("--container-root")
                .arg(container.state_directory())
                .arg("--container")
                .arg(container.name());
        }
        command
            .arg("--")
            .arg(inner.get_program())
            .args(inner.get_args());
        if clear_environment {
            command.env_clear();
        }
        for (name, value) in inner.get_envs() {
            let text = name.to_string_lossy();
            // A job's own variable under the prefix would be restored as a loader
            // variable it could have set directly anyway; it is dropped, so the
            // worker's (the guard's LD_PRELOAD) is the one restored.
            if text.starts_with(HELD_VARIABLE_PREFIX) {
                continue;
            }
            let name = if text.starts_with("LD_") {
                OsString::from(format!("{HELD_VARIABLE_PREFIX}{text}"))
            } else {
                name.to_os_string()
            };
            match value {
                Some(value) => command.env(name, value),
                None => command.env_remove(name),
            };
        }
        if let Some(directory) = inner.get_current_dir() {
            command.current_dir(directory);
        }
        Some(command)
    }

    /// Whether the worker's deadline has passed: a run that ends now ended because its
    /// supervisor stopped it (or would have), not by itself.
    pub fn lapsed(&self) -> bool {
        self.deadlines
            .borrow()
            .is_some_and(|deadline| Instant::now() >= deadline)
    }
}

/// The `supervise` subcommand: runs the program to its end under the lease and exits as
/// it did. Prefixes its own messages with `program` (the binary's name).
pub fn supervise_command(arguments: &SuperviseArguments, program: &str) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("{program} supervise: cannot start: {error}");
            return ExitCode::from(CANNOT_START_EXIT_CODE);
        }
    };
    let code = runtime.block_on(supervise(arguments, program));
    // Not a return: dropping the runtime would wait for the thread reading stdin.
    std::process::exit(i32::from(code))
}

/// What the supervisor does at the lease's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Held,
    /// SIGTERM sent; SIGKILL at the instant.
    Terminating(tokio::time::Instant),
    Killed,
}

async fn supervise(arguments: &SuperviseArguments, program: &str) -> u8 {
    // No process of the supervisor's uid may ptrace it (and read or rewrite its
    // deadline); another uid never could.
    if let Err(error) =
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    {
        eprintln!("{program} supervise: cannot make itself non-dumpable: {error}");
    }
    // The worker's own stops signal the whole process group: the program acts on them,
    // and the supervisor stays to enforce its deadline and pass the program's end on.
    use tokio::signal::unix::{SignalKind, signal};
    let caught = (|| {
        Ok::<_, std::io::Error>([
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
            signal(SignalKind::hangup())?,
        ])
    })();
    let mut signals = match caught {
        Ok(signals) => signals,
        Err(error) => {
            eprintln!("{program} supervise: cannot catch signals: {error}");
            return CANNOT_START_EXIT_CODE;
        }
    };
    let Some((name, rest)) = arguments.program.split_first() else {
        eprintln!("{program} supervise: no program to run");
        return CANNOT_START_EXIT_CODE;
    };
    let mut command = Command::new(name);
    command.args(rest).stdin(Stdio::null()).kill_on_drop(true);
    // The program dies with its supervisor, as it would with its worker.
    crate::attempt_process::die_with_this_process(&mut command);
    for (variable, value) in std::env::vars_os() {
        if let Some(held) = variable
            .to_str()
            .and_then(|text| text.strip_prefix(HELD_VARIABLE_PREFIX))
        {
            command.env_remove(&variable).env(held, value);
        }
    }
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(error) => {
            eprintln!("could not start {}: {error}", Path::new(name).display());
            return CANNOT_START_EXIT_CODE;
        }
    };
    let renewals = read_renewals();
    supervise_child(arguments, &mut child, renewals, &mut signals).await
}

/// Renewals from stdin, read on a thread of their own; the channel closes when stdin
/// does (the worker is gone or dropped it: the deadline then stays where it is).
fn read_renewals() -> mpsc::UnboundedReceiver<Duration> {
    let (sender, receiver) = mpsc::unbounded_channel();
    let _ = std::thread::Builder::new()
        .name("lease-renewals".into())
        .spawn(move || {
            use std::io::BufRead;
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { return };
                if let Some(left) = parse_renewal(&line)
                    && sender.send(left).is_err()
                {
                    return;
                }
            }
        });
    receiver
}

async fn supervise_child(
    arguments: &SuperviseArguments,
    child: &mut tokio::process::Child,
    mut renewals: mpsc::UnboundedReceiver<Duration>,
    signals: &mut [tokio::signal::unix::Signal; 3],
) -> u8 {
    let [terminate, interrupt, hangup] = signals;
    let grace = Duration::from_millis(arguments.grace_ms);
    let mut deadline = tokio::time::Instant::now() + Duration::from_millis(arguments.lease_ms);
    let mut phase = Phase::Held;
    let mut stdin_open = true;
    loop {
        let kill_at = match phase {
            Phase::Terminating(at) => Some(at),
            Phase::Held | Phase::Killed => None,
        };
        tokio::select! {
            status = child.wait() => {
                return match status {
                    Ok(status) => exit_code_of(status),
                    Err(error) => {
                        eprintln!("cannot wait for the program: {error}");
                        1
                    }
                };
            }
            renewal = renewals.recv(), if stdin_open => match renewal {
                // A stop once begun is carried through: the program has its SIGTERM.
                Some(left) if phase == Phase::Held => {
                    deadline = tokio::time::Instant::now() + left;
                }
                Some(_) => {}
                None => stdin_open = false,
            },
            _ = tokio::time::sleep_until(deadline), if phase == Phase::Held => {
                eprintln!(
                    "stopping: the worker did not renew this attempt's lease (no scheduler \
                     leader heard it for half its lease); SIGTERM now, SIGKILL in {grace:?}"
                );
                stop_program(arguments, Signal::TERM);
                phase = Phase::Terminating(tokio::time::Instant::now() + grace);
            }
            _ = crate::attempt_process::sleep_until_or_never(kill_at) => {
                eprintln!("stopping now: the lease ran out {grace:?} ago (SIGKILL)");
                stop_program(arguments, Signal::KILL);
                phase = Phase::Killed;
            }
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
            _ = hangup.recv() => {}
        }
    }
}

/// The supervisor's exit code for the program's status: its own code, or 128 + the
/// signal that ended it.
fn exit_code_of(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(1),
        (None, Some(signal)) => u8::try_from(128 + (signal & 0x7f)).unwrap_or(1),
        (None, None) => 1,
    }
}

/// `signal` to every process of the program: its container's through the runtime, then
/// every process of the supervisor's process group but the supervisor itself.
fn stop_program(arguments: &SuperviseArguments, signal: Signal) {
    if let (Some(runtime), Some(root), Some(name)) = (
        &arguments.container_runtime,
        &arguments.container_root,
        &arguments.container,
    ) {
        let name_of = if signal == Signal::KILL {
            "KILL"
        } else {
            "TERM"
        };
        match std::process::Command::new(runtime)
            .arg("--root")
            .arg(root)
            .args(["kill", "--all"])
            .arg(name)
            .arg(name_of)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .output()
        {
            Ok(output) if !output.status.success() => eprintln!(
                "cannot signal the container: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ),
            Ok(_) => {}
            Err(error) => eprintln!("cannot signal the container: {error}"),
        }
    }
    let me = rustix::process::getpid();
    for member in group_members(rustix::process::getpgrp()) {
        if member != me {
            let _ = rustix::process::kill_process(member, signal);
        }
    }
}

/// The processes of process group `group`, from `/proc`.
fn group_members(group: rustix::process::Pid) -> Vec<rustix::process::Pid> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|process_id| {
            std::fs::read_to_string(format!("/proc/{process_id}/stat"))
                .ok()
                .and_then(|stat| process_group_of_stat(&stat))
                == Some(group.as_raw_nonzero().get())
        })
        .filter_map(rustix::process::Pid::from_raw)
        .collect()
}

/// The process group field of a `/proc/<pid>/stat` line (the fifth; the command name
/// before it, in parentheses, may hold spaces and parentheses itself).
fn process_group_of_stat(stat: &str) -> Option<i32> {
    let (_, after_name) = stat.rsplit_once(')')?;
    after_name.split_whitespace().nth(2)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::{exit_code_of, process_group_of_stat};
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn the_group_is_read_past_a_command_name_with_spaces_and_parentheses() {
        assert_eq!(
            process_group_of_stat("412 (a b) c)) S 1 405 405 0 -1 4194560"),
            Some(405)
        );
        assert_eq!(process_group_of_stat("garbage"), None);
    }

    #[test]
    fn the_program_s_end_is_its_code_or_128_plus_its_signal() {
        assert_eq!(exit_code_of(std::process::ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code_of(std::process::ExitStatus::from_raw(9)), 137);
        assert_eq!(exit_code_of(std::process::ExitStatus::from_raw(15)), 143);
    }
}
