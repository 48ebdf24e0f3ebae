"""A hostile tenant's program on a simulated GPU: it starts a child without the guard
(LD_PRELOAD removed), which takes device memory the guard never sees, and holds it.
The amount is within the slice: what gives it away is a process on the GPU with no
slot in the attempt's guard account, which only the worker's watchdog can see.

argv: seconds to hold. Prints "ATTACK unguarded_child SUCCEEDED" if the child was let
hold its memory that long."""

import os
import subprocess
import sys

CHILD = r"""
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0, "cuInit"
pointer = ctypes.c_uint64()
assert cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(64 << 20)) == 0, "alloc"
print("the unguarded child holds 64 MiB", flush=True)
time.sleep(float(sys.argv[1]))
"""

environment = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
child = subprocess.run([sys.executable, "-c", CHILD, sys.argv[1]], env=environment)
if child.returncode == 0:
    print("ATTACK unguarded_child SUCCEEDED", flush=True)
else:
    print(f"ATTACK unguarded_child BLOCKED: the child ended {child.returncode}", flush=True)
