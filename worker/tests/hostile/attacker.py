"""Tenant A's program in the hostile-tenant suite (worker/tests/hostile_tenant.rs): it
tries, one after the other, what a hostile tenant would do on a shared worker, and
prints one line per attack: `ATTACK <name> blocked <why>` or `ATTACK <name> SUCCEEDED
<what it got>`. The test asserts every attack is blocked in a container, and shows each
one succeeding with the sandbox off.

Arguments: the victim's checkpoint directory, the worker's checkpoint directory, the
worker's token file, the scheduler's port, and the directory for the program's own
checkpoints ({checkpoint_dir}).
"""

import os
import signal
import socket
import subprocess
import sys
import time

victim_checkpoints, worker_directory, token_file, scheduler_port, own_checkpoints = sys.argv[1:6]


def report(name, attack):
    try:
        got = attack()
    except Exception as error:  # every refusal is an exception of some kind
        print(f"ATTACK {name} blocked {type(error).__name__}: {error}", flush=True)
        return
    if got is None:
        print(f"ATTACK {name} blocked (nothing found)", flush=True)
    else:
        print(f"ATTACK {name} SUCCEEDED {str(got)[:200]!r}", flush=True)


def read_token_file():
    with open(token_file) as file:
        return file.read().strip()


def token_in_processes():
    # Another process's environment or command line (the worker's, say) holding a token.
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        for name in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as file:
                    text = file.read()
            except OSError:
                continue
            if b"CARVE_TOKEN" in text or b"--token" in text:
                return f"pid {pid} {name}"
    return None


def read_victim_checkpoint():
    with open(os.path.join(victim_checkpoints, "weights.txt")) as file:
        return file.read()


def overwrite_victim_checkpoint():
    with open(os.path.join(victim_checkpoints, "weights.txt"), "w") as file:
        file.write("weights changed by mallory")
    return "overwritten"


def list_worker_directory():
    # Its own job's directories show as the mount points they are; anything else there
    # (another job's, the worker's records) is the worker's to see.
    own_job = os.path.basename(own_checkpoints.rstrip("/"))
    others = [name for name in os.listdir(worker_directory) if not name.startswith(own_job)]
    return sorted(others) or None


def write_worker_directory():
    with open(os.path.join(worker_directory, "planted-by-mallory"), "w") as file:
        file.write("x")
    return "planted"


def victim_process():
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                if b"victim.py" in file.read():
                    return int(pid)
        except OSError:
            continue
    return None


def see_victim():
    return victim_process()


def read_victim_environment():
    pid = victim_process()
    if pid is None:
        return None
    with open(f"/proc/{pid}/environ", "rb") as file:
        text = file.read()
    return "secret read" if b"VICTIM_SECRET" in text else None


def signal_victim():
    pid = victim_process()
    if pid is None:
        return None
    os.kill(pid, 0)  # permission to signal it, without stopping it
    return f"may signal pid {pid}"


def reach_scheduler():
    with socket.create_connection(("127.0.0.1", int(scheduler_port)), timeout=2):
        return "connected"


def write_system_directory():
    with open("/usr/planted-by-mallory", "w") as file:
        file.write("x")
    os.remove("/usr/planted-by-mallory")
    return "wrote /usr"


def survive_the_attempt():
    # A process in a session of its own, outside the program's process group; the test
    # looks for it on the host after the job ended.
    subprocess.Popen(
        ["setsid", "python3", "-c", "import time; time.sleep(120)", "hostile-survivor"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    time.sleep(0.5)
    return None  # judged by the test on the host


def fork_bomb():
    children = []
    try:
        for _ in range(200):
            pid = os.fork()
            if pid == 0:
                time.sleep(20)
                os._exit(0)
            children.append(pid)
    except OSError as error:
        raise OSError(f"stopped after {len(children)} processes: {error}")
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return f"{len(children)} processes"


def host_memory():
    # In a child, so the cgroup's OOM killer takes the child and not this program.
    child = subprocess.run(
        ["python3", "-c", "b = bytearray(768 << 20); print(len(b))"],
        capture_output=True,
    )
    if child.returncode != 0:
        raise MemoryError(f"the child ended with {child.returncode}")
    return "held 768 MiB"


def fill_tmp():
    path = "/tmp/mallory-fill"
    try:
        with open(path, "wb") as file:
            for _ in range(256):
                file.write(bytes(1 << 20))
        return "wrote 256 MiB to /tmp"
    finally:
        if os.path.exists(path):
            os.remove(path)


for name, attack in [
    ("read_worker_token_file", read_token_file),
    ("token_in_other_processes", token_in_processes),
    ("read_victim_checkpoint", read_victim_checkpoint),
    ("overwrite_victim_checkpoint", overwrite_victim_checkpoint),
    ("list_worker_directory", list_worker_directory),
    ("write_worker_directory", write_worker_directory),
    ("see_victim_process", see_victim),
    ("read_victim_environment", read_victim_environment),
    ("signal_victim", signal_victim),
    ("reach_scheduler", reach_scheduler),
    ("write_system_directory", write_system_directory),
    ("survive_the_attempt", survive_the_attempt),
    ("fork_bomb", fork_bomb),
    ("host_memory", host_memory),
    ("fill_tmp", fill_tmp),
]:
    report(name, attack)

with open(os.path.join(own_checkpoints, "attacks-done"), "w") as file:
    file.write("done")
print("ATTACKS DONE", flush=True)
