"""Tenant B's program in the hostile-tenant suite (worker/tests/hostile_tenant.rs): it
writes its weights to its checkpoint directory, says it is ready, waits until the test
says the attacker is done (a file `release` in its checkpoint directory, written by the
test on the host), and succeeds only if its weights are still its own.

Argument: its checkpoint directory ({checkpoint_dir}).
"""

import os
import sys
import time

checkpoints = sys.argv[1]
weights = os.path.join(checkpoints, "weights.txt")
with open(weights, "w") as file:
    file.write("weights of alice")
with open(os.path.join(checkpoints, "ready"), "w") as file:
    file.write(str(os.getpid()))
print("victim ready", flush=True)

deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(checkpoints, "release")):
    if time.monotonic() > deadline:
        print("never released", flush=True)
        sys.exit(2)
    time.sleep(0.1)

with open(weights) as file:
    now = file.read()
if now != "weights of alice":
    print(f"error: my weights were changed: {now!r}", file=sys.stderr, flush=True)
    sys.exit(1)
print("victim result: weights intact", flush=True)
