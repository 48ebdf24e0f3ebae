"""A command job's program that tries to outlive its lease (worker/tests/command_supervisor.rs):
it ignores SIGTERM, then tries to kill, trace or renew through every process it can see
(its supervisor is the one that would stop it), and runs on printing `alive`. Each try
prints `TRY <what> <pid> blocked <why>` or `TRY <what> <pid> SUCCEEDED`.

Argument: its checkpoint directory, where the test writes the supervisor's host pid
(`supervisor-pid`), as if the program had guessed it.

It kills whatever it can see, so it refuses to run anywhere but as the first process of
its own pid namespace (a container): outside one, as root, that would be the host.
"""

import ctypes
import os
import signal
import sys
import time

if os.getpid() != 1:
    print("refusing to run outside a container of its own", flush=True)
    sys.exit(2)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
me = os.getpid()
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH = 16


def attempt(what, pid, action):
    try:
        action()
    except Exception as error:  # every refusal is an exception of some kind
        print(f"TRY {what} {pid} blocked {type(error).__name__}: {error}", flush=True)
        return
    print(f"TRY {what} {pid} SUCCEEDED", flush=True)


def ptrace(pid):
    if libc.ptrace(PTRACE_ATTACH, pid, None, None) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    libc.ptrace(17, pid, None, None)  # PTRACE_DETACH


def renew(pid):
    # A renewal line on the supervisor's stdin would move its deadline.
    with open(f"/proc/{pid}/fd/0", "w") as stdin:
        stdin.write("lease-ms 600000\n")


def trace_renew_kill(pid):
    """Tries every way at `pid`, killing last."""
    attempt("ptrace", pid, lambda: ptrace(pid))
    attempt("renew", pid, lambda: renew(pid))
    attempt("kill", pid, lambda: os.kill(pid, signal.SIGKILL))


pid_file = os.path.join(sys.argv[1], "supervisor-pid")
for _ in range(200):
    if os.path.exists(pid_file):
        break
    time.sleep(0.05)
supervisor = int(open(pid_file).read())
trace_renew_kill(supervisor)
visible = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
for pid in [os.getppid()] + visible:
    if pid not in (0, me):
        trace_renew_kill(pid)
print(f"TRIED {len(visible)} visible processes, parent {os.getppid()}", flush=True)
while True:
    print("alive", flush=True)
    time.sleep(0.1)
