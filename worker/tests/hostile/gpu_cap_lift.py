"""A hostile tenant's program on a simulated GPU: it lifts its cap by rewriting the
limit in its own guard account (a file its attempt may write), then takes four times
its slice through the guard, and holds it. Only the worker's watchdog, reading the
device's memory from outside the program, can stop it.

argv: seconds to hold. Prints "ATTACK lift_the_account_limit SUCCEEDED" if it was let
hold the memory that long."""

import ctypes
import os
import sys
import time

cuda = ctypes.CDLL("libcuda.so.1")


def check(name, code):
    if code != 0:
        print(f"ATTACK lift_the_account_limit BLOCKED: {name} answered {code}", flush=True)
        sys.exit(0)


check("cuInit", cuda.cuInit(0))
# The account's header: magic (8 bytes), layout version and slot count (4 + 4), then the
# limit (8 bytes, native order), which every reservation reads.
with open(os.environ["CARVE_GUARD_ACCOUNT"], "r+b") as account:
    account.seek(16)
    account.write((1 << 40).to_bytes(8, sys.byteorder))
slice_bytes = int(os.environ["CARVE_GUARD_LIMIT_BYTES"])
pointer = ctypes.c_uint64()
step = 64 << 20
held = 0
while held < 4 * slice_bytes:
    check("cuMemAlloc_v2", cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(step)))
    held += step
print(f"holding {held >> 20} MiB on a slice of {slice_bytes >> 20} MiB", flush=True)
time.sleep(float(sys.argv[1]))
print("ATTACK lift_the_account_limit SUCCEEDED", flush=True)
