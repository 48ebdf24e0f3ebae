"""The programs `gpu_sandbox_check.sh` runs as command jobs in Carve's containers on a real
GPU. Each prints what it saw and exits 0 when its own check passed (the script also
judges the job's end from outside):

  one-gpu          PyTorch sees exactly one GPU, the slice's (by uuid), and the
                   container's /dev has exactly one /dev/nvidiaN;
  past-slice       PyTorch allocates 256 MiB tensors until it is refused: the guard must
                   refuse within the slice (+ one step), with PyTorch's OutOfMemoryError;
  lift-account     rewrites the limit in its own guard account, then takes twice its slice
                   and holds it: the worker's watchdog must stop the attempt;
  unguarded-child  starts a child without LD_PRELOAD that takes 1 GiB and holds it: the
                   watchdog must stop the attempt (a process on the GPU with no guard slot).

argv: the program's name, then seconds to hold (the last two)."""

import glob
import os
import subprocess
import sys
import time


def one_gpu():
    import torch

    count = torch.cuda.device_count()
    nodes = sorted(path for path in glob.glob("/dev/nvidia[0-9]*") if path[11:].isdigit())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    name = torch.cuda.get_device_name(0) if count else "-"
    print(f"ONE_GPU count={count} nodes={nodes} visible={visible} name={name}", flush=True)
    total = torch.cuda.get_device_properties(0).total_memory if count else 0
    print(f"ONE_GPU total_memory_mib={total >> 20} (the guard shows the slice)", flush=True)
    return 0 if count == 1 and len(nodes) == 1 else 1


def past_slice():
    import torch

    slice_bytes = int(os.environ["CARVE_GUARD_LIMIT_BYTES"])
    step = 256 << 20
    held = []
    try:
        while len(held) * step < 4 * slice_bytes:
            held.append(torch.empty(step, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as error:
        reached = len(held) * step
        print(f"PAST_SLICE refused at {reached >> 20} MiB of a {slice_bytes >> 20} MiB slice: "
              f"{str(error).splitlines()[0][:300]}", flush=True)
        return 0 if reached <= slice_bytes else 1
    print(f"PAST_SLICE never refused: held {(len(held) * step) >> 20} MiB", flush=True)
    return 1


def lift_account(hold_seconds):
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    with open(os.environ["CARVE_GUARD_ACCOUNT"], "r+b") as account:
        account.seek(16)  # the header's limit_bytes
        account.write((1 << 50).to_bytes(8, sys.byteorder))
    import torch

    slice_bytes = int(os.environ["CARVE_GUARD_LIMIT_BYTES"])
    held = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            for _ in range(2 * slice_bytes // (256 << 20))]
    print(f"LIFT holding {(len(held) * (256 << 20)) >> 20} MiB on a {slice_bytes >> 20} MiB slice",
          flush=True)
    time.sleep(hold_seconds)
    print("LIFT SUCCEEDED: nothing stopped it", flush=True)
    return 0


CHILD = """
import sys, time, torch
held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("UNGUARDED child holds 1 GiB", flush=True)
time.sleep(float(sys.argv[1]))
"""


def unguarded_child(hold_seconds):
    environment = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    child = subprocess.run([sys.executable, "-c", CHILD, str(hold_seconds)], env=environment)
    # Only a child that held its memory for the whole time got away with it; one ended by
    # a signal was stopped (on the H100 the watchdog's SIGTERM reached the child first, and
    # its parent lived to print this).
    if child.returncode == 0:
        print("UNGUARDED SUCCEEDED: the child held its memory, nothing stopped it", flush=True)
    else:
        print(f"UNGUARDED child stopped: it ended {child.returncode}", flush=True)
    return 0


if __name__ == "__main__":
    program = sys.argv[1]
    hold = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    programs = {
        "one-gpu": one_gpu,
        "past-slice": past_slice,
        "lift-account": lambda: lift_account(hold),
        "unguarded-child": lambda: unguarded_child(hold),
    }
    sys.exit(programs[program]())
