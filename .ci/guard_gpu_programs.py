"""Programs `.ci/guard-gpu-check` runs under the guard on a real GPU.

Each prints one JSON object on its last stdout line, so the check can judge it:

  torch-oom    allocate 256 MiB tensors until PyTorch raises; hold the memory while
               NVML is asked what this process uses (nvidia-smi, without the guard)
  torch-train  a seeded, deterministic MLP; prints its final loss (the neighbour check)
  tf-oom       TensorFlow allocating until it raises (only where TensorFlow is installed)
  jax-oom      JAX allocating until it raises (only where JAX is installed)
  judge DIR    reads every case's results under DIR and says what passed
"""

import json
import os
import subprocess
import sys
import time

CHUNK_BYTES = 256 << 20


def nvml_used_bytes_of_this_process():
    """What NVML says this process holds on the GPU, asked from a child without the guard."""
    environment = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    try:
        output = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, env=environment,
        ).stdout
    except Exception as error:  # the check reports a missing reading, not a crash
        return f"nvidia-smi failed: {error}"
    for line in output.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 2 and fields[0] == str(os.getpid()):
            return int(fields[1]) << 20
    return f"this pid not in nvidia-smi's list: {output!r}"


def torch_oom():
    import torch

    free_bytes, total_bytes = torch.cuda.mem_get_info()
    properties_total = torch.cuda.get_device_properties(0).total_memory
    held = []
    error_type, message = None, None
    try:
        while True:
            held.append(torch.empty(CHUNK_BYTES, dtype=torch.uint8, device="cuda"))
    except Exception as error:  # PyTorch raises torch.OutOfMemoryError here
        error_type, message = type(error).__name__, str(error)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    nvml_used = nvml_used_bytes_of_this_process()
    return {
        "error_type": error_type,
        "message": (message or "")[:600],
        "tensors": len(held),
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "mem_get_info": [free_bytes, total_bytes],
        "device_total_memory": properties_total,
        "nvml_used_bytes": nvml_used,
        "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }


def torch_train():
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)
    ).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator(device="cuda").manual_seed(11)
    loss = None
    started = time.time()
    for _ in range(3000):
        inputs = torch.randn(256, 1024, device="cuda", generator=generator)
        targets = torch.randint(0, 10, (256,), device="cuda", generator=generator)
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {"final_loss": float(loss.item()), "loss_hex": float(loss.item()).hex(),
            "seconds": round(time.time() - started, 2)}


def tf_oom():
    import tensorflow as tf

    held, error_type, message = [], None, None
    try:
        with tf.device("/GPU:0"):
            while True:
                held.append(tf.zeros([CHUNK_BYTES // 4], dtype=tf.float32) + 1.0)
    except Exception as error:
        error_type, message = type(error).__name__, str(error)
    return {"error_type": error_type, "message": (message or "")[:600], "tensors": len(held),
            "nvml_used_bytes": nvml_used_bytes_of_this_process()}


def jax_oom():
    import jax.numpy as jnp

    held, error_type, message = [], None, None
    try:
        while True:
            held.append(jnp.ones([CHUNK_BYTES // 4], dtype=jnp.float32))
            held[-1].block_until_ready()
    except Exception as error:
        error_type, message = type(error).__name__, str(error)
    return {"error_type": error_type, "message": (message or "")[:600], "tensors": len(held),
            "nvml_used_bytes": nvml_used_bytes_of_this_process()}


GIB = 1 << 30
# NVML counts the CUDA context (and cuBLAS/cuDNN handles) in a process's usage; the
# guard cannot see it. A context on an H100/H200 is about 0.5 GiB.
CONTEXT_ALLOWANCE_BYTES = 1 * GIB


def read_case(directory):
    case = {"name": os.path.basename(directory)}
    def text(name):
        path = os.path.join(directory, name)
        return open(path).read() if os.path.exists(path) else ""
    case["exit"] = int(text("exit").strip() or -1)
    case["slice"] = int(text("slice").strip() or 0)
    case["stderr"] = text("stderr")
    lines = [line for line in text("stdout").splitlines() if line.startswith("{")]
    case["result"] = json.loads(lines[-1]) if lines else None
    case["record"] = [json.loads(line) for line in text("gpu-oom.jsonl").splitlines() if line.strip()]
    return case


def judge_oom(case, checks):
    result, record, slice_bytes = case["result"], case["record"], case["slice"]
    if result is None:
        checks.append((False, f"no result; exit {case['exit']}; stderr: {case['stderr'][-800:]}"))
        return
    checks.append((result["error_type"] in ("OutOfMemoryError", "ResourceExhaustedError", "XlaRuntimeError",
                                            "JaxRuntimeError"),
                   f"raised {result['error_type']}: {result['message'][:300]!r}"))
    # JAX (and TensorFlow's BFC allocator) size themselves from the free memory the guard
    # reports, so they may stop inside their own allocator before the guard refuses.
    sizes_itself = case["name"] in ("jax-oom", "tf-oom")
    checks.append((len(record) >= 1 or sizes_itself, f"{len(record)} OOM record line(s): {record[:2]}"))
    for line in record[:5]:
        checks.append((line["limit_bytes"] == slice_bytes
                       and line["in_use_bytes"] <= slice_bytes
                       and line["in_use_bytes"] + line["requested_bytes"] > slice_bytes
                       and line["peak_bytes"] <= slice_bytes,
                       f"record numbers consistent: {line['entry_point']} asked {line['requested_bytes']}, "
                       f"in use {line['in_use_bytes']}, limit {line['limit_bytes']}, peak {line['peak_bytes']}"))
    used = result["tensors"] * CHUNK_BYTES
    checks.append((used >= slice_bytes - 3 * CHUNK_BYTES,
                   f"held {used / GIB:.2f} GiB of tensors in a {slice_bytes / GIB:.2f} GiB slice"))
    if "mem_get_info" in result:
        checks.append((result["mem_get_info"][1] == slice_bytes,
                       f"torch.cuda.mem_get_info() = {result['mem_get_info']}, device total_memory = "
                       f"{result['device_total_memory']}"))
    nvml = result["nvml_used_bytes"]
    if isinstance(nvml, int):
        reserved = result.get("reserved_bytes", used)
        checks.append((nvml <= slice_bytes + CONTEXT_ALLOWANCE_BYTES,
                       f"NVML: process uses {nvml / GIB:.2f} GiB (slice {slice_bytes / GIB:.2f} GiB, framework "
                       f"reserved {reserved / GIB:.2f} GiB, so context etc. {(nvml - reserved) / 2**20:.0f} MiB)"))
    else:
        checks.append((False, f"NVML reading: {nvml}"))


def judge_training(case, cases, checks):
    alone = cases.get("train-unguarded", {}).get("result")
    result = case["result"]
    checks.append((result is not None and alone is not None and result["loss_hex"] == alone["loss_hex"],
                   f"final loss {result and result['final_loss']} vs unguarded alone "
                   f"{alone and alone['final_loss']} ({result and result['seconds']} s)"))


def judge(results_directory):
    cases = {name: read_case(os.path.join(results_directory, name))
             for name in sorted(os.listdir(results_directory))
             if os.path.isdir(os.path.join(results_directory, name))}
    failed = 0
    for name, case in cases.items():
        checks = []
        if name.startswith("train-"):
            judge_training(case, cases, checks)
        elif name.endswith("-oom"):
            judge_oom(case, checks)
        elif name == "fail-closed":
            refused = case["result"] is None or case["result"].get("error_type") is not None
            checks.append((refused and "carve-guard:" in case["stderr"],
                           f"refused without a limit; stderr: {case['stderr'].strip()[-300:]!r}"))
        for passed, what in checks:
            failed += not passed
            print(f"{'PASS' if passed else 'FAIL'} {name}: {what}")
    print(f"{failed} check(s) failed")
    return failed


if __name__ == "__main__" and sys.argv[1] == "judge":
    sys.exit(1 if judge(sys.argv[2]) else 0)


PROGRAMS = {"torch-oom": torch_oom, "torch-train": torch_train, "tf-oom": tf_oom, "jax-oom": jax_oom}

if __name__ == "__main__" and sys.argv[1] != "judge":
    print(json.dumps(PROGRAMS[sys.argv[1]]()), flush=True)
