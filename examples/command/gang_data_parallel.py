#!/usr/bin/env python3
"""A stand-in for a data-parallel training script (issue 31: gangs): N ranks, one per
slice, train one small linear model together, as PyTorch DDP does through
torch.distributed's env:// start. Carve's tests run it as each member of a gang where a
real job would run torchrun.

- the gang: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment (or
  --rank {rank} --world-size {world_size} --master-addr {master_addr} --master-port
  {master_port}). Rank 0 listens on MASTER_ADDR:MASTER_PORT; every other rank connects
  (retrying while rank 0 is not up yet) and says which rank it is.
- the rendezvous deadline: CARVE_RENDEZVOUS_TIMEOUT_SECONDS (or --rendezvous-timeout;
  300 s by default). A rank that does not meet the whole gang in time exits 1 with a
  line naming what is missing ("gang rendezvous timed out after 5 s: rank 0 at
  127.0.0.1:29500 has ranks [0] of 2, missing [1]"), as torch's init_process_group
  raises at its timeout. The same deadline bounds every later exchange, so a member that
  dies mid-training ends the others ("rank 1 left the gang at step 4").
- the data: a deterministic data set of 4096 samples (y = w.x + b + noise, from a
  counter-based hash, no seed file); optimizer step s uses samples
  [(s-1) x global_batch, s x global_batch) modulo 4096, split into world_size equal
  shards, one per rank, each read in `accumulation_steps` micro-batches of `micro_batch`
  samples. micro_batch x accumulation_steps x world_size must equal global_batch, so an
  OOM retry at a smaller micro-batch with more accumulation trains on the same batches.
- the all-reduce, through rank 0: each rank sums its samples' gradients of the mean
  squared error EXACTLY (Python fractions: every float is a fraction of integers, so the
  sum does not depend on the order), sends the sum to rank 0, which adds the ranks' sums
  exactly, divides by global_batch, rounds once to floats and sends the mean gradient and
  loss back. Every rank applies the same update, so all ranks hold the same weights and
  report the same loss, bit for bit, whatever micro_batch, accumulation and world size
  the global batch was split into (a run of 1 rank gives the same numbers as 2).
- progress: every rank prints `CARVE_PROGRESS step=.. total_steps=.. loss=..
  samples_per_s=.. memory_in_use_bytes=.. memory_peak_bytes=..` (the gang's loss, the
  same on every rank; Carve shows rank 0's), and `gang rank R: step S loss L` lines.
- checkpoint (rank 0 only): `<checkpoint-dir>/gang_standin.json`, written atomically
  after every step; on start rank 0 reads it and sends the weights and the step to every
  rank, so members on other nodes need no shared file system. Its format, for tests:
      {"format": "carve-gang-standin-checkpoint/1", "global_batch": 32, "step": 5,
       "loss": 0.4, "weights": [..], "bias": 0.0,
       "optimizer_steps": [{"step": 1, "samples": 32, "micro_batch": 8,
                            "accumulation_steps": 2, "world_size": 2, "loss": 4.1}, ...],
       "runs": [{"run": 1, "resumed_from_step": 0, "world_size": 2, ...}]}
- device memory, as standin_train.py (beside this file) plays it: --fixed-mib once and
  --per-sample-mib x micro_batch per micro-batch, through libcuda.so.1 (the guard in
  front of it under Carve) or simulated against CARVE_SLICE_BYTES; a refused allocation
  prints PyTorch's OutOfMemoryError line and exits 1.

Python 3 standard library only.
"""

import argparse
import json
import os
import socket
import struct
import sys
import time
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import standin_train  # noqa: E402  (beside this file: its device memory and OOM wording)

CHECKPOINT_FILE = "gang_standin.json"
CHECKPOINT_FORMAT = "carve-gang-standin-checkpoint/1"
DATASET_SIZE = 4096
FEATURES = 4
TRUE_WEIGHTS = [0.5, -1.25, 2.0, 0.75]
TRUE_BIAS = 0.3
LEARNING_RATE = 0.05
MIB = 1 << 20


class GangFailure(Exception):
    """The gang could not meet or lost a member: the message says which and why."""


def unit(*counters):
    """A deterministic number in [-1, 1) from integers (SplitMix64 of their mix)."""
    value = 0x9E3779B97F4A7C15
    for counter in counters:
        value = (value ^ (counter + 0x9E3779B97F4A7C15 + (value << 6) + (value >> 2))) & (
            (1 << 64) - 1
        )
        value = (value + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
        value ^= value >> 31
    return (value >> 11) / float(1 << 53) * 2.0 - 1.0


def sample(index):
    """Sample `index` of the data set: its features and its target."""
    features = [unit(index, feature) for feature in range(FEATURES)]
    target = sum(w * x for w, x in zip(TRUE_WEIGHTS, features)) + TRUE_BIAS
    return features, target + 0.05 * unit(index, 1000)


def sample_gradient(weights, bias, index):
    """The squared error of one sample and its gradient (weights then bias), as
    fractions: exact, so sums of them do not depend on their order."""
    features, target = sample(index)
    error = sum(w * x for w, x in zip(weights, features)) + bias - target
    error = Fraction(error)
    gradient = [2 * error * Fraction(x) for x in features] + [2 * error]
    return error * error, gradient


# --- messages: a 4-byte length, then JSON; fractions travel as [numerator, denominator]


def send(connection, message):
    data = json.dumps(message).encode()
    connection.sendall(struct.pack(">I", len(data)) + data)


def receive_exactly(connection, size, what):
    chunks = []
    while size:
        try:
            chunk = connection.recv(size)
        except socket.timeout as error:
            raise GangFailure(f"{what} did not answer in time") from error
        except OSError as error:
            raise GangFailure(f"{what}: {error}") from error
        if not chunk:
            raise GangFailure(f"{what} closed its connection")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def receive(connection, what):
    (size,) = struct.unpack(">I", receive_exactly(connection, 4, what))
    return json.loads(receive_exactly(connection, size, what))


def as_pair(value):
    return [value.numerator, value.denominator]


def as_fraction(pair):
    return Fraction(int(pair[0]), int(pair[1]))


# --- the rendezvous


def meet_as_master(arguments, deadline):
    """Rank 0: listen, accept every other rank before the deadline."""
    listener = socket.socket(socket.AF_INET6 if ":" in arguments.master_addr else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((arguments.master_addr, arguments.master_port))
    except OSError as error:
        raise GangFailure(
            f"rank 0 cannot listen on {arguments.master_addr}:{arguments.master_port}: {error}"
        ) from error
    listener.listen(arguments.world_size)
    peers = {}
    try:
        while len(peers) < arguments.world_size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(1, arguments.world_size) if r not in peers]
                raise GangFailure(
                    f"gang rendezvous timed out after {arguments.rendezvous_timeout:g} s: "
                    f"rank 0 at {arguments.master_addr}:{arguments.master_port} has ranks "
                    f"{[0] + sorted(peers)} of {arguments.world_size}, missing {missing}"
                )
            listener.settimeout(left)
            try:
                connection, _ = listener.accept()
            except socket.timeout:
                continue
            connection.settimeout(max(deadline - time.monotonic(), 0.1))
            try:
                hello = receive(connection, "a connecting rank")
            except GangFailure:
                connection.close()
                continue
            rank = hello.get("rank")
            if (
                hello.get("world_size") != arguments.world_size
                or not isinstance(rank, int)
                or not 0 < rank < arguments.world_size
                or rank in peers
            ):
                # Not a member of this gang (or a rank twice): not let in.
                connection.close()
                continue
            peers[rank] = connection
    finally:
        listener.close()
    for connection in peers.values():
        connection.settimeout(arguments.rendezvous_timeout)
    return [peers[rank] for rank in sorted(peers)]


def meet_as_member(arguments, deadline):
    """Any other rank: connect to rank 0 (it may not listen yet) before the deadline."""
    last_error = None
    while time.monotonic() < deadline:
        try:
            connection = socket.create_connection(
                (arguments.master_addr, arguments.master_port),
                timeout=max(min(deadline - time.monotonic(), 2.0), 0.1),
            )
        except OSError as error:
            last_error = error
            time.sleep(0.1)
            continue
        send(connection, {"rank": arguments.rank, "world_size": arguments.world_size})
        connection.settimeout(arguments.rendezvous_timeout)
        return connection
    raise GangFailure(
        f"gang rendezvous timed out after {arguments.rendezvous_timeout:g} s: rank "
        f"{arguments.rank} could not reach rank 0 at "
        f"{arguments.master_addr}:{arguments.master_port} ({last_error})"
    )


# --- checkpoint (rank 0)


def load_checkpoint(directory, global_batch):
    path = os.path.join(directory, CHECKPOINT_FILE)
    try:
        with open(path, encoding="utf-8") as file:
            state = json.load(file)
    except FileNotFoundError:
        return {
            "format": CHECKPOINT_FORMAT,
            "global_batch": global_batch,
            "step": 0,
            "loss": None,
            "weights": [0.0] * FEATURES,
            "bias": 0.0,
            "optimizer_steps": [],
            "runs": [],
        }
    if state.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"gang standin: {path} is not a gang stand-in checkpoint")
    if state["global_batch"] != global_batch:
        raise SystemExit(
            f"gang standin: {path} was written with global batch {state['global_batch']}, "
            f"not {global_batch}: resuming would change the training"
        )
    return state


def save_checkpoint(directory, state):
    path = os.path.join(directory, CHECKPOINT_FILE)
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(state, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


# --- training


def local_gradient(arguments, memory, weights, bias, step, activation_bytes):
    """This rank's exact sums over its shard of step `step`'s global batch, read in
    micro-batches (each holding its activations while it runs)."""
    shard = arguments.micro_batch * arguments.accumulation_steps
    first = (step - 1) * arguments.global_batch + arguments.rank * shard
    loss_sum = Fraction(0)
    gradient_sum = [Fraction(0)] * (FEATURES + 1)
    for micro in range(arguments.accumulation_steps):
        activations = memory.allocate(activation_bytes)
        for offset in range(arguments.micro_batch):
            index = (first + micro * arguments.micro_batch + offset) % DATASET_SIZE
            loss, gradient = sample_gradient(weights, bias, index)
            loss_sum += loss
            gradient_sum = [total + part for total, part in zip(gradient_sum, gradient)]
        memory.free(activations)
    return loss_sum, gradient_sum


def all_reduce_mean(arguments, peers, loss_sum, gradient_sum, step):
    """The global batch's mean loss and gradient, through rank 0, rounded once."""
    if arguments.rank != 0:
        (connection,) = peers
        send(connection, {"step": step, "loss": as_pair(loss_sum),
                          "gradient": [as_pair(part) for part in gradient_sum]})
        reply = receive(connection, f"rank 0 (step {step})")
        return reply["loss"], reply["gradient"]
    total_loss, total_gradient = loss_sum, list(gradient_sum)
    for rank, connection in enumerate(peers, start=1):
        try:
            message = receive(connection, f"rank {rank}")
        except GangFailure as error:
            raise GangFailure(f"rank {rank} left the gang at step {step}: {error}") from error
        total_loss += as_fraction(message["loss"])
        total_gradient = [
            total + as_fraction(part) for total, part in zip(total_gradient, message["gradient"])
        ]
    loss = float(total_loss / arguments.global_batch)
    gradient = [float(part / arguments.global_batch) for part in total_gradient]
    for connection in peers:
        send(connection, {"loss": loss, "gradient": gradient})
    return loss, gradient


def train(arguments):
    deadline = time.monotonic() + arguments.rendezvous_timeout
    if arguments.rank == 0:
        peers = meet_as_master(arguments, deadline)
        os.makedirs(arguments.checkpoint_dir, exist_ok=True)
        state = load_checkpoint(arguments.checkpoint_dir, arguments.global_batch)
        start = {"step": state["step"], "weights": state["weights"], "bias": state["bias"]}
        for connection in peers:
            send(connection, start)
    else:
        peers = [meet_as_member(arguments, deadline)]
        start = receive(peers[0], "rank 0 (the start)")
        state = None
    print(
        f"gang rank {arguments.rank}: the gang of {arguments.world_size} met; "
        f"starting at step {start['step'] + 1}",
        flush=True,
    )
    weights, bias = list(start["weights"]), start["bias"]
    memory = standin_train.open_memory(arguments.device_memory)
    activation_bytes = int(arguments.per_sample_mib * MIB) * arguments.micro_batch
    if state is not None:
        state["runs"].append(
            {
                "run": len(state["runs"]) + 1,
                "resumed_from_step": state["step"],
                "world_size": arguments.world_size,
                "micro_batch": arguments.micro_batch,
                "accumulation_steps": arguments.accumulation_steps,
                "memory": memory.name,
            }
        )
        save_checkpoint(arguments.checkpoint_dir, state)
    memory.allocate(int(arguments.fixed_mib * MIB))  # weights and optimizer state
    for step in range(start["step"] + 1, arguments.steps + 1):
        started = time.monotonic()
        loss_sum, gradient_sum = local_gradient(
            arguments, memory, weights, bias, step, activation_bytes
        )
        if step == arguments.fail_at_step:
            raise RuntimeError(f"a bug in rank {arguments.rank}'s script at step {step}")
        loss, gradient = all_reduce_mean(arguments, peers, loss_sum, gradient_sum, step)
        weights = [w - LEARNING_RATE * g for w, g in zip(weights, gradient[:FEATURES])]
        bias = bias - LEARNING_RATE * gradient[FEATURES]
        if state is not None:
            state.update(step=step, loss=loss, weights=weights, bias=bias)
            state["optimizer_steps"].append(
                {
                    "step": step,
                    "samples": arguments.global_batch,
                    "micro_batch": arguments.micro_batch,
                    "accumulation_steps": arguments.accumulation_steps,
                    "world_size": arguments.world_size,
                    "loss": loss,
                }
            )
            save_checkpoint(arguments.checkpoint_dir, state)
        if arguments.step_seconds > 0:
            time.sleep(arguments.step_seconds)
        elapsed = max(time.monotonic() - started, 1e-6)
        print(f"gang rank {arguments.rank}: step {step} loss {loss!r}", flush=True)
        print(
            f"CARVE_PROGRESS step={step} total_steps={arguments.steps} loss={loss!r} "
            f"samples_per_s={arguments.global_batch / elapsed:.1f} "
            f"memory_in_use_bytes={memory.in_use} memory_peak_bytes={memory.peak}",
            flush=True,
        )
    for connection in peers:
        connection.close()
    print(f"gang rank {arguments.rank}: done at step {arguments.steps}", flush=True)


def environment_default(name, convert, fallback=None):
    value = os.environ.get(name)
    return convert(value) if value not in (None, "") else fallback


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=environment_default("RANK", int))
    parser.add_argument(
        "--world-size", type=int, default=environment_default("WORLD_SIZE", int)
    )
    parser.add_argument("--master-addr", default=environment_default("MASTER_ADDR", str))
    parser.add_argument(
        "--master-port", type=int, default=environment_default("MASTER_PORT", int)
    )
    parser.add_argument(
        "--rendezvous-timeout",
        type=float,
        default=environment_default("CARVE_RENDEZVOUS_TIMEOUT_SECONDS", float, 300.0),
        help="seconds to meet the whole gang (and for each later exchange)",
    )
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--accumulation-steps", type=int, default=1)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps in all")
    parser.add_argument("--fixed-mib", type=float, default=16.0)
    parser.add_argument("--per-sample-mib", type=float, default=1.0)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--fail-at-step", type=int, default=0)
    parser.add_argument(
        "--device-memory", choices=["auto", "cuda", "simulated"], default="auto"
    )
    arguments = parser.parse_args(argv)
    for name in ("rank", "world_size", "master_addr", "master_port"):
        if getattr(arguments, name) is None:
            parser.error(f"--{name.replace('_', '-')} (or {name.upper()}) is needed")
    if not 0 <= arguments.rank < arguments.world_size:
        parser.error(f"rank {arguments.rank} is not below world size {arguments.world_size}")
    per_step = arguments.micro_batch * arguments.accumulation_steps * arguments.world_size
    if per_step != arguments.global_batch:
        parser.error(
            f"micro batch {arguments.micro_batch} x {arguments.accumulation_steps} "
            f"accumulation steps x {arguments.world_size} ranks is not the global batch "
            f"{arguments.global_batch}"
        )
    return arguments


def main(argv):
    arguments = parse_arguments(argv)
    try:
        train(arguments)
    except GangFailure as error:
        print(f"gang standin: rank {arguments.rank}: {error}", file=sys.stderr, flush=True)
        return 1
    except standin_train.OutOfMemory as error:
        print(standin_train.torch_out_of_memory_line(error), file=sys.stderr, flush=True)
        return 1
    except standin_train.CudaFailure as error:
        print(f"gang standin: CUDA driver error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
