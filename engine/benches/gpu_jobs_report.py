#!/usr/bin/env python3
"""Reports of engine/benches/gpu_check.sh's `jobs` and `nvml` steps, from their files.
Plain Python 3, no torch.

    python3 engine/benches/gpu_jobs_report.py auto JOB.json
        the `vram = "auto"` profile of the PyTorch command example: the fitted memory
        model (fixed + per sample of the micro-batch) against each attempt's measured
        peak, as an error in %, and the attempts (an OOM and its retry, if any);
    python3 engine/benches/gpu_jobs_report.py keras JOB.json
        the Keras example's attempts: the OOM, what the retry changed, the outcome;
    python3 engine/benches/gpu_jobs_report.py nvml NVML.txt BENCH.log
        NVML's largest per-process reading while one Carve bench row ran, less that row's
        slice: the bytes the engine holds outside its slice (context, handles, kernels,
        CUDA graphs), against the worker's 640 MiB `--context-bytes` default.
"""

import json
import re
import sys

MIB = 2**20
CONTEXT_ALLOWANCE_MIB = 640


def load(path):
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError) as error:
        sys.exit(f"FAIL: no job document at {path}: {error}")


def mib(value):
    return "?" if value is None else f"{value / MIB:,.0f} MiB"


def print_attempts(job):
    print(f"job {job.get('id')} state {job.get('state')}: {job.get('message', '')}")
    for attempt in job.get("attempts", []):
        config = attempt.get("config") or {}
        print(
            f"  attempt {attempt.get('number')}{' (profile)' if attempt.get('profile') else ''}: "
            f"{attempt.get('outcome')}; micro {config.get('micro_batch_size')} of "
            f"{config.get('batch_size')}, {config.get('precision')}, recompute "
            f"{config.get('recompute_segment_layers')}; slice {mib(attempt.get('slice_bytes'))}, "
            f"estimate {mib(attempt.get('estimate_bytes'))}, "
            f"measured peak {mib(attempt.get('measured_peak_bytes'))}"
        )
        for point in attempt.get("profile_points") or []:
            print(f"    profile point: {json.dumps(point)}")
        if attempt.get("chosen_because"):
            print(f"    chosen because: {attempt['chosen_because']}")
        if attempt.get("oom_detected_by"):
            print(f"    OOM detected by {attempt['oom_detected_by']}: {json.dumps(attempt.get('oom'))}")
        if attempt.get("failure_message"):
            print(f"    failure: {attempt['failure_message'][-400:]}")


def auto(path):
    job = load(path)
    print_attempts(job)
    model = job.get("memory_model") or {}
    if not model.get("measured"):
        print(f"FAIL: no measured memory model: {json.dumps(model)}")
        return 1
    fixed, per_sample = model["fixed_bytes"], model["per_sample_bytes"]
    print(f"fitted model: {mib(fixed)} + {mib(per_sample)} per sample ({model.get('basis', '')})")
    compared = 0
    for attempt in job.get("attempts", []):
        micro = (attempt.get("config") or {}).get("micro_batch_size")
        measured = attempt.get("measured_peak_bytes")
        if attempt.get("profile") or not micro or not measured:
            continue
        fitted = fixed + per_sample * micro
        compared += 1
        print(
            f"attempt {attempt.get('number')} micro {micro}: fitted {mib(fitted)}, measured "
            f"peak {mib(measured)}, error {100 * (fitted - measured) / measured:+.1f} %"
        )
    if not compared:
        print("FAIL: no training attempt with a measured peak to compare")
        return 1
    return 0 if job.get("state") == "JOB_STATE_SUCCEEDED" else 1


def keras(path):
    job = load(path)
    print_attempts(job)
    training = [a for a in job.get("attempts", []) if not a.get("profile")]
    ooms = [a for a in training if a.get("outcome") == "ATTEMPT_OUTCOME_OUT_OF_MEMORY"]
    succeeded = job.get("state") == "JOB_STATE_SUCCEEDED"
    print(
        f"{'PASS' if ooms and succeeded else 'CHECK'}: {len(training)} training attempts, "
        f"{len(ooms)} out of memory, job {job.get('state')}"
    )
    return 0 if succeeded else 1


def nvml(readings_path, bench_path):
    slices = [int(value) for value in re.findall(r"slice=(\d+)", open(bench_path).read())]
    readings = []
    for line in open(readings_path):
        parts = line.split(",")
        if len(parts) >= 2 and parts[1].strip().isdigit():
            readings.append(int(parts[1].strip()))
    if not slices or not readings:
        print(f"FAIL: no bench row ({len(slices)}) or no NVML reading ({len(readings)})")
        return 1
    used_mib, slice_mib = max(readings), max(slices) / MIB
    outside = used_mib - slice_mib
    print(
        f"NVML {used_mib} MiB at most for the bench process, slice {slice_mib:.0f} MiB: "
        f"{outside:.0f} MiB outside the slice against the {CONTEXT_ALLOWANCE_MIB} MiB "
        f"context allowance ({'within' if outside <= CONTEXT_ALLOWANCE_MIB else 'OVER'})"
    )
    return 0 if outside <= CONTEXT_ALLOWANCE_MIB else 1


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    kind = sys.argv[1]
    if kind == "auto":
        return auto(sys.argv[2])
    if kind == "keras":
        return keras(sys.argv[2])
    if kind == "nvml" and len(sys.argv) == 4:
        return nvml(sys.argv[2], sys.argv[3])
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main())
