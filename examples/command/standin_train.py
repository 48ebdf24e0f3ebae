#!/usr/bin/env python3
"""A stand-in for a user's training script: Carve's CI and `carve dev --demo` run it as
the program of a command job, where a real job would run PyTorch, TensorFlow or JAX.

It trains nothing. It plays a training script's DEVICE MEMORY and its bookkeeping:

- memory: `fixed + per_sample x micro_batch` (the per-sample part x0.6 at bf16/fp16 and
  x0.5 with --recompute, the shares Carve's command memory model assumes), allocated
  through the CUDA driver API with ctypes (`libcuda.so.1`, found by the normal loader, so
  LD_LIBRARY_PATH and an LD_PRELOADed guard apply): the fixed part once (weights and
  optimizer state), the per-sample part for each micro-batch (activations, freed after its
  backward). From step --late-from-step on, each micro-batch also holds
  --late-extra-per-sample-mib per sample: memory a short profile cannot see, so a run
  admitted by the profile still runs out at run time.
- running out: a refused allocation (CUDA_ERROR_OUT_OF_MEMORY) prints PyTorch's wording
  on stderr ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ...") and
  exits 1, as an uncaught torch.OutOfMemoryError does.
- without a loadable libcuda (or with --device-memory simulated), the same bytes are
  accounted against CARVE_SLICE_BYTES (unlimited when unset) and fail the same way.
- gradient accumulation: micro_batch x accumulation_steps must equal global_batch; every
  optimizer step's sample count is recorded in the checkpoint.
- checkpoint: `<checkpoint-dir>/standin.json`, written after every optimizer step
  (atomically), read at start to resume at the next step. Its format, for tests:
      {"format": "carve-standin-checkpoint/1", "global_batch": 64, "step": 6,
       "loss": 0.93,
       "optimizer_steps": [{"step": 1, "samples": 64, "micro_batch": 64,
                            "accumulation_steps": 1, "precision": "fp32",
                            "recompute": false, "run": 1, "loss": 2.21}, ...],
       "runs": [{"run": 1, "pid": 4242, "resumed_from_step": 0, "micro_batch": 64,
                 "accumulation_steps": 1, "precision": "fp32", "recompute": false,
                 "memory": "cuda"}, ...]}
  "every optimizer step saw global_batch samples" is: `step` == the steps asked for,
  `optimizer_steps[i].step == i + 1`, and every `samples == global_batch`.
- other endings, for tests of how Carve classifies them: --catch-out-of-memory handles
  a refused late allocation (prints the same line, goes on, exits 0), --fail-at-step S
  raises an ordinary error at step S (a traceback, exit 1).
- progress: one `CARVE_PROGRESS step=.. total_steps=.. loss=.. samples_per_s=..
  memory_in_use_bytes=.. memory_peak_bytes=..` line per optimizer step on stdout (the
  memory from its own accounting, which Carve uses where the guard sees no CUDA call: a
  simulated GPU). The loss is made up (a decreasing function of the step
  alone, so a resumed run continues the same curve); it is a stand-in.

Python 3 standard library only.
"""

import argparse
import ctypes
import json
import math
import os
import sys
import time

MIB = 1 << 20
CHECKPOINT_FILE = "standin.json"
CHECKPOINT_FORMAT = "carve-standin-checkpoint/1"
HALF_PRECISION_PER_SAMPLE_SHARE = 0.6
RECOMPUTE_PER_SAMPLE_SHARE = 0.5
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


class OutOfMemory(Exception):
    """A refused allocation, with what PyTorch's message would say."""

    def __init__(self, requested, in_use, total, free):
        super().__init__("out of memory")
        self.requested = requested
        self.in_use = in_use
        self.total = total
        self.free = free


class CudaFailure(Exception):
    """A driver call that failed for another reason than memory."""


class CudaMemory:
    """Device memory through the CUDA driver API (the guard in front of the driver when
    Carve runs the program)."""

    name = "cuda"

    def __init__(self, library):
        self.cuda = library
        self._declare()
        self._check("cuInit", self.cuda.cuInit(0))
        device = ctypes.c_int()
        self._check("cuDeviceGet", self.cuda.cuDeviceGet(ctypes.byref(device), 0))
        context = ctypes.c_void_p()
        self._check(
            "cuDevicePrimaryCtxRetain",
            self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
        )
        self._check("cuCtxSetCurrent", self.cuda.cuCtxSetCurrent(context))
        self.in_use = 0
        self.peak = 0
        self.sizes = {}

    def _declare(self):
        c_int, c_uint, c_size_t = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
        pointer, c_uint64 = ctypes.POINTER, ctypes.c_uint64
        signatures = {
            "cuInit": [c_uint],
            "cuDeviceGet": [pointer(c_int), c_int],
            "cuDevicePrimaryCtxRetain": [pointer(ctypes.c_void_p), c_int],
            "cuCtxSetCurrent": [ctypes.c_void_p],
            "cuMemAlloc_v2": [pointer(c_uint64), c_size_t],
            "cuMemFree_v2": [c_uint64],
            "cuMemGetInfo_v2": [pointer(c_size_t), pointer(c_size_t)],
        }
        for name, arguments in signatures.items():
            function = getattr(self.cuda, name)
            function.argtypes = arguments
            function.restype = c_int

    @staticmethod
    def _check(call, result):
        if result != CUDA_SUCCESS:
            raise CudaFailure(f"{call} failed with CUresult {result}")

    def memory_info(self):
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        result = self.cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        if result != CUDA_SUCCESS:
            return 0, 0
        return free.value, total.value

    def allocate(self, size):
        address = ctypes.c_uint64()
        result = self.cuda.cuMemAlloc_v2(ctypes.byref(address), size)
        if result == CUDA_ERROR_OUT_OF_MEMORY:
            free, total = self.memory_info()
            raise OutOfMemory(size, self.in_use, total, free)
        self._check("cuMemAlloc_v2", result)
        self.sizes[address.value] = size
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        return address.value

    def free(self, address):
        self._check("cuMemFree_v2", self.cuda.cuMemFree_v2(address))
        self.in_use -= self.sizes.pop(address)


class SimulatedMemory:
    """The same bytes, accounted against CARVE_SLICE_BYTES (no limit when unset)."""

    name = "simulated"

    def __init__(self, limit):
        self.limit = limit
        self.in_use = 0
        self.peak = 0
        self.sizes = {}
        self.next_address = 1

    def allocate(self, size):
        if self.limit is not None and self.in_use + size > self.limit:
            raise OutOfMemory(size, self.in_use, self.limit, self.limit - self.in_use)
        address = self.next_address
        self.next_address += 1
        self.sizes[address] = size
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        return address

    def free(self, address):
        self.in_use -= self.sizes.pop(address)


def open_memory(mode):
    """The CUDA driver when it loads (mode auto or cuda), else the simulation."""
    if mode in ("auto", "cuda"):
        try:
            library = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            if mode == "cuda":
                raise CudaFailure(f"cannot load libcuda.so.1: {error}") from error
        else:
            return CudaMemory(library)
    slice_bytes = os.environ.get("CARVE_SLICE_BYTES")
    limit = int(slice_bytes) if slice_bytes else None
    print(
        "standin: no CUDA driver; device memory is simulated against "
        + (f"CARVE_SLICE_BYTES={limit}" if limit is not None else "no limit"),
        flush=True,
    )
    return SimulatedMemory(limit)


def torch_size(size):
    """PyTorch's format_size: "0 bytes", "512.00 KiB", "64.00 MiB", "1.25 GiB"."""
    if size < 1024:
        return f"{size} bytes"
    if size < MIB:
        return f"{size / 1024:.2f} KiB"
    if size < 1 << 30:
        return f"{size / MIB:.2f} MiB"
    return f"{size / (1 << 30):.2f} GiB"


def torch_out_of_memory_line(error):
    return (
        "torch.OutOfMemoryError: CUDA out of memory. "
        f"Tried to allocate {torch_size(error.requested)}. "
        f"GPU 0 has a total capacity of {torch_size(error.total)} of which "
        f"{torch_size(error.free)} is free. Including non-PyTorch memory, this process "
        f"has {torch_size(error.in_use)} memory in use. Of the allocated memory "
        f"{torch_size(error.in_use)} is allocated by PyTorch, and 0 bytes is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def made_up_loss(step):
    return 0.1 + 2.2 * math.exp(-step / 25.0)


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
            "optimizer_steps": [],
            "runs": [],
        }
    if state.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"standin: {path} is not a stand-in checkpoint")
    if state["global_batch"] != global_batch:
        raise SystemExit(
            f"standin: {path} was written with global batch {state['global_batch']}, "
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


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--accumulation-steps", type=int, default=1)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps in all")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--fixed-mib", type=float, default=200.0)
    parser.add_argument("--per-sample-mib", type=float, default=12.0)
    parser.add_argument("--late-extra-per-sample-mib", type=float, default=0.0)
    parser.add_argument("--late-from-step", type=int, default=0)
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, help="sleep per step, for a demo to watch"
    )
    parser.add_argument(
        "--catch-out-of-memory",
        action="store_true",
        help="handle a refused late allocation and go on (exits 0)",
    )
    parser.add_argument(
        "--fail-at-step",
        type=int,
        default=0,
        help="raise an ordinary error after this step's micro-batches (exits 1, no OOM)",
    )
    parser.add_argument(
        "--device-memory",
        choices=["auto", "cuda", "simulated"],
        default="auto",
        help="auto: the CUDA driver when libcuda.so.1 loads, else simulated",
    )
    arguments = parser.parse_args(argv)
    if arguments.micro_batch * arguments.accumulation_steps != arguments.global_batch:
        parser.error(
            f"micro batch {arguments.micro_batch} x {arguments.accumulation_steps} "
            f"accumulation steps is not the global batch {arguments.global_batch}"
        )
    return arguments


def per_sample_share(arguments):
    share = 1.0
    if arguments.precision != "fp32":
        share *= HALF_PRECISION_PER_SAMPLE_SHARE
    if arguments.recompute:
        share *= RECOMPUTE_PER_SAMPLE_SHARE
    return share


def allocate_late(memory, size, catch_out_of_memory):
    """The late per-sample memory; with --catch-out-of-memory a refusal is printed as a
    framework's warning would be and the step goes on without it (a program that
    handles its own OOM and exits 0 is not an OOM to Carve)."""
    try:
        return memory.allocate(size)
    except OutOfMemory as error:
        if not catch_out_of_memory:
            raise
        print(torch_out_of_memory_line(error), file=sys.stderr, flush=True)
        print("standin: caught the out-of-memory error; going on without it", file=sys.stderr)
        return None


def train(arguments):
    os.makedirs(arguments.checkpoint_dir, exist_ok=True)
    state = load_checkpoint(arguments.checkpoint_dir, arguments.global_batch)
    memory = open_memory(arguments.device_memory)
    share = per_sample_share(arguments)
    activation_bytes = int(arguments.per_sample_mib * MIB * share) * arguments.micro_batch
    late_bytes = int(arguments.late_extra_per_sample_mib * MIB * share) * arguments.micro_batch
    run = len(state["runs"]) + 1
    state["runs"].append(
        {
            "run": run,
            "pid": os.getpid(),
            "resumed_from_step": state["step"],
            "micro_batch": arguments.micro_batch,
            "accumulation_steps": arguments.accumulation_steps,
            "precision": arguments.precision,
            "recompute": arguments.recompute,
            "memory": memory.name,
        }
    )
    save_checkpoint(arguments.checkpoint_dir, state)
    if state["step"] > 0:
        print(f"standin: resumed from step {state['step']}", flush=True)
    memory.allocate(int(arguments.fixed_mib * MIB))  # weights and optimizer state
    for step in range(state["step"] + 1, arguments.steps + 1):
        started = time.monotonic()
        samples = 0
        for _ in range(arguments.accumulation_steps):
            activations = memory.allocate(activation_bytes)
            late = None
            if late_bytes and step >= arguments.late_from_step:
                late = allocate_late(memory, late_bytes, arguments.catch_out_of_memory)
            samples += arguments.micro_batch
            if late is not None:
                memory.free(late)
            memory.free(activations)
        assert samples == arguments.global_batch, (samples, arguments.global_batch)
        if step == arguments.fail_at_step:
            raise RuntimeError(f"a bug in the training script at step {step}")
        if arguments.step_seconds > 0:
            time.sleep(arguments.step_seconds)
        loss = made_up_loss(step)
        state["step"] = step
        state["loss"] = loss
        state["optimizer_steps"].append(
            {
                "step": step,
                "samples": samples,
                "micro_batch": arguments.micro_batch,
                "accumulation_steps": arguments.accumulation_steps,
                "precision": arguments.precision,
                "recompute": arguments.recompute,
                "run": run,
                "loss": loss,
            }
        )
        save_checkpoint(arguments.checkpoint_dir, state)
        elapsed = max(time.monotonic() - started, 1e-6)
        print(
            f"CARVE_PROGRESS step={step} total_steps={arguments.steps} loss={loss:.4f} "
            f"samples_per_s={samples / elapsed:.1f} "
            f"memory_in_use_bytes={memory.in_use} memory_peak_bytes={memory.peak}",
            flush=True,
        )
    print(
        f"standin: done at step {state['step']} of {arguments.steps}; "
        f"peak {memory.peak} bytes ({memory.name})",
        flush=True,
    )


def main(argv):
    arguments = parse_arguments(argv)
    try:
        train(arguments)
    except OutOfMemory as error:
        print(torch_out_of_memory_line(error), file=sys.stderr, flush=True)
        return 1
    except CudaFailure as error:
        print(f"standin: CUDA driver error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
