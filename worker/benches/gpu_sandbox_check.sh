#!/usr/bin/env bash
# Issue 26 on a real GPU: every attempt in its own container, checked with PyTorch.
# Four command jobs on `carve dev --real-gpus` (the real scheduler and worker, each
# attempt in its own runc container, the program under libcarve_guard.so), programs in
# worker/benches/gpu_sandbox_programs.py:
#   one-gpu          the container sees exactly one GPU (torch.cuda.device_count() == 1,
#                    one /dev/nvidiaN) -> the job SUCCEEDS;
#   past-slice       PyTorch allocating past a 2 GiB slice is refused by the guard with its
#                    own OutOfMemoryError, within the slice -> the job SUCCEEDS;
#   lift-account     the program rewrites the limit in its guard account and holds twice its
#                    slice -> the worker's watchdog (NVML by the container's cgroup) stops
#                    it: the job FAILS with "stopped by the worker ... more than its slice";
#   unguarded-child  a child without LD_PRELOAD holds 1 GiB -> the watchdog stops it: the
#                    job FAILS with "used the gpu without the guard".
# nvidia-smi's per-process memory is sampled meanwhile, as evidence of what the watchdog saw.
#
# Usage: worker/benches/gpu_sandbox_check.sh --build DIR   (here, without a GPU: the release
#            carve and guard, and runc's .deb for a machine without runc, into DIR)
#        worker/benches/gpu_sandbox_check.sh --dry-run [DIR]  (anywhere: checks the programs,
#            the job files and what DIR holds, prints the plan, runs nothing on a GPU)
#        worker/benches/gpu_sandbox_check.sh [DIR]  (on the GPU machine, as root; DIR
#            default target/release)
# About 2-4 minutes on a GPU: the jobs run side by side, each bounded by a timeout.
# Results stay in SANDBOX_CHECK_RESULTS (a temporary directory by default). Exit 0 when
# every verdict passes, 1 when one fails, 2 when the machine lacks what it needs.
set -uo pipefail
cd "$(dirname "$0")/../.."
repository="$PWD"
programs="$repository/worker/benches/gpu_sandbox_programs.py"
hold_seconds="${SANDBOX_CHECK_HOLD:-90}"
job_timeout="${SANDBOX_CHECK_JOB_TIMEOUT:-240}"

if [ "${1:-}" = "--build" ]; then
  out="${2:?usage: worker/benches/gpu_sandbox_check.sh --build DIR}"
  mkdir -p "$out"
  cargo build --release --locked -p carve-cli -p carve-guard &&
    cp target/release/carve target/release/libcarve_guard.so "$out/" &&
    strip "$out/carve" "$out/libcarve_guard.so" || exit 1
  # The GPU machine reaches no package archive: runc (and libseccomp, which it links)
  # travel as .debs, installed there only where runc is missing.
  (cd "$out" && apt-get download runc libseccomp2) || echo "WARNING: no runc .deb in $out"
  ls -l "$out"
  exit 0
fi

dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
  dry_run=1
  shift
fi
directory="$(cd "${1:-target/release}" 2>/dev/null && pwd)" || directory="${1:-target/release}"
carve="$directory/carve"
results="${SANDBOX_CHECK_RESULTS:-$(mktemp -d)}"
mkdir -p "$results/jobs"
# carve dev's data directory (bundles, job directories) lies under it: each container's
# root user (its tenant's host uid) must pass through it, which mktemp's 0700 refuses.
chmod 755 "$results"

# job_file NAME PROGRAM VRAM: a command job running one of the programs, with the Python
# that has PyTorch, in the programs' folder; its Python's prefix is bound read-only
# (a virtual environment or wheels outside /usr are invisible in a container otherwise).
job_file() {
  local name="$1" program="$2" vram="$3"
  local prefixes=""
  for prefix in "${python_prefixes[@]}"; do prefixes="$prefixes\"$prefix\", "; done
  cat >"$results/jobs/$name.toml" <<EOF
name = "sandbox-$name"

[command]
argv = ["$python", "gpu_sandbox_programs.py", "$program", "$hold_seconds"]
working_directory = "$repository/worker/benches"
read_only_paths = [${prefixes%, }]
global_batch = 1

[resources]
vram = "$vram"
max_duration = "10m"
EOF
}

# The Python with PyTorch: the PATH's, else any on the machine (dry run: any Python).
python=""
for candidate in /opt/torch/.venv/bin/python python3 python /usr/bin/python3 \
  $(find / -xdev -maxdepth 5 -path '*/bin/python3' -not -path '/proc/*' 2>/dev/null); do
  if "$candidate" -c 'import torch' 2>/dev/null; then python="$(command -v "$candidate")"; break; fi
done
if [ -z "$python" ] && [ "$dry_run" = 1 ]; then python="$(command -v python3)"; fi
if [ -z "$python" ]; then echo "no Python with PyTorch on this machine"; exit 2; fi
# The interpreter itself, not a shim (pyenv's are shell scripts outside its prefix), and
# not resolved past a virtual environment's link (its packages are found from there).
python="$("$python" -c 'import sys; print(sys.executable)')"
mapfile -t python_prefixes < <("$python" -c '
import os, sys
for prefix in sorted({os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}):
    if not prefix.startswith("/usr"):
        print(prefix)')

job_file one-gpu one-gpu 2GiB
job_file past-slice past-slice 2GiB
job_file lift-account lift-account 2GiB
job_file unguarded-child unguarded-child 2GiB
jobs=(one-gpu past-slice lift-account unguarded-child)

if [ "$dry_run" = 1 ]; then
  status=0
  bash -n "$0" || status=1
  # compile() rather than py_compile: nothing written next to the programs.
  "$python" -c 'import sys; compile(open(sys.argv[1]).read(), sys.argv[1], "exec")' "$programs" &&
    echo "ok: the programs compile" || status=1
  for job in "${jobs[@]}"; do
    "$python" -c 'import sys, tomllib; tomllib.load(open(sys.argv[1], "rb"))' "$results/jobs/$job.toml" 2>/dev/null ||
      "$python" -c 'import sys; sys.exit(0 if sys.version_info < (3, 11) else 1)' ||
      { echo "FAIL: $job.toml is not TOML"; status=1; }
  done
  echo "ok: job files in $results/jobs:"; cat "$results/jobs/past-slice.toml"
  for file in "$carve" "$directory/libcarve_guard.so"; do
    [ -f "$file" ] && echo "ok: $file" || echo "missing here (build with --build DIR): $file"
  done
  if command -v runc >/dev/null; then echo "ok: $(runc --version | head -1)"
  else ls "$directory"/runc_*.deb >/dev/null 2>&1 && echo "ok: runc .deb in $directory" ||
    echo "missing: runc and its .deb (--build DIR downloads it)"; fi
  echo "plan: $carve dev --real-gpus --data-dir $results/carve-data; submit ${jobs[*]}; watch each" \
    "(timeout ${job_timeout}s); judge: one-gpu and past-slice SUCCEEDED, lift-account and" \
    "unguarded-child FAILED, stopped by the worker's watchdog"
  exit "$status"
fi

[ "$(id -u)" = 0 ] || { echo "run as root: containers with a user namespace per tenant need it"; exit 2; }
for file in "$carve" "$directory/libcarve_guard.so"; do
  if [ ! -f "$file" ]; then echo "missing $file (build with: --build DIR)"; exit 2; fi
done
if ! command -v runc >/dev/null; then
  echo "no runc: installing the carried .debs"
  dpkg -i "$directory"/libseccomp2_*.deb "$directory"/runc_*.deb >"$results/dpkg.log" 2>&1 ||
    { tail -5 "$results/dpkg.log"; }
  command -v runc >/dev/null || { echo "no runc, and it could not be installed"; exit 2; }
fi
runc --version | head -1
nvidia-smi --query-gpu=name,driver_version,memory.total,uuid --format=csv,noheader || exit 2
"$python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
echo "python prefixes bound read-only: ${python_prefixes[*]:-none (under /usr)}"
started=$SECONDS

data_dir="$results/carve-data"
cluster_log="$results/carve-dev.log"
"$carve" dev --real-gpus --data-dir "$data_dir" >"$cluster_log" 2>&1 &
cluster=$!
monitor=""
stop_all() {
  [ -n "$monitor" ] && kill "$monitor" 2>/dev/null
  if kill -0 "$cluster" 2>/dev/null; then
    kill -INT "$cluster"
    for _ in $(seq 1 30); do kill -0 "$cluster" 2>/dev/null || break; sleep 1; done
    kill -KILL "$cluster" 2>/dev/null
  fi
}
trap stop_all EXIT
for _ in $(seq 1 60); do grep -q '^  export CARVE_ENDPOINT' "$cluster_log" && break; sleep 1; done
if ! grep -q '^  export CARVE_ENDPOINT' "$cluster_log"; then
  echo "FAIL: carve dev did not start within 60 s:"; tail -20 "$cluster_log"; exit 1
fi
eval "$(grep '^  export CARVE_ENDPOINT' "$cluster_log")"
if grep -q "NOT contained" "$cluster_log"; then
  echo "FAIL: carve dev runs attempts uncontained:"; grep -m3 "contain" "$cluster_log"; exit 1
fi

timeout $((job_timeout + 60)) bash -c '
  while true; do
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
      sed "s/^/$(date +%s) /"
    sleep 0.5
  done' >"$results/nvml.txt" 2>/dev/null &
monitor=$!

declare -A job_ids
for job in "${jobs[@]}"; do
  job_ids[$job]="$("$carve" submit "$results/jobs/$job.toml" -q 2>"$results/$job.submit.err")"
  if [ -z "${job_ids[$job]}" ]; then echo "FAIL: $job was refused:"; cat "$results/$job.submit.err"; exit 1; fi
  echo "submitted $job: ${job_ids[$job]}"
done
for job in "${jobs[@]}"; do
  timeout --kill-after=10 "$job_timeout" "$carve" watch "${job_ids[$job]}" >"$results/$job.watch" 2>&1
  code=$?
  if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
    echo "$job did not end within ${job_timeout} s: cancelling it"
    timeout 20 "$carve" cancel "${job_ids[$job]}" >/dev/null 2>&1
  fi
  timeout 30 "$carve" get "${job_ids[$job]}" -o json >"$results/$job.json" 2>"$results/$job.get.err"
  timeout 30 "$carve" logs "${job_ids[$job]}" >"$results/$job.logs" 2>&1
done
kill "$monitor" 2>/dev/null
monitor=""
echo "== the jobs took $((SECONDS - started)) s"

"$python" - "$results" "${jobs[@]}" <<'EOF'
import json, os, sys

results, jobs = sys.argv[1], sys.argv[2:]
expected = {
    "one-gpu": ("SUCCEEDED", "ONE_GPU count=1"),
    "past-slice": ("SUCCEEDED", "PAST_SLICE refused at"),
    "lift-account": ("FAILED", "more than its slice"),
    "unguarded-child": ("FAILED", "used the gpu without the guard"),
}
failed = 0
for job in jobs:
    try:
        record = json.load(open(os.path.join(results, f"{job}.json")))
    except (OSError, ValueError) as error:
        print(f"FAIL {job}: no job record ({error})")
        failed += 1
        continue
    state = str(record.get("state", "")).upper()
    logs = open(os.path.join(results, f"{job}.logs"), errors="replace").read()
    attempts = record.get("attempts", [])
    failure = " ".join(str(a.get("failure_message", a.get("failureMessage", ""))) for a in attempts)
    want_state, want_text = expected[job]
    ok = want_state in state and (want_text in logs or want_text in failure)
    if want_state == "FAILED":
        ok = ok and "stopped by the worker" in failure and "SUCCEEDED:" not in logs
    print(f"{'PASS' if ok else 'FAIL'} {job}: {state}; "
          f"{[line for line in logs.splitlines() if any(k in line for k in ('ONE_GPU', 'PAST_SLICE', 'LIFT', 'UNGUARDED'))][:3]}"
          f" {failure[:300]}")
    failed += not ok
samples = [line.split() for line in open(os.path.join(results, "nvml.txt")) if line.strip()]
peak = max((int(parts[-1]) for parts in samples if parts[-1].isdigit()), default=0)
print(f"nvidia-smi: {len(samples)} samples, the largest process held {peak} MiB")
sys.exit(1 if failed else 0)
EOF
verdict=$?
echo "results in $results"
exit "$verdict"
