#!/usr/bin/env bash
# The engine's checks on a GPU machine, in one run, from binaries built on a machine
# without a GPU (GPU time is scarce; nothing is compiled there).
#
#   engine/benches/gpu_check.sh --build DIR             # here: binaries and wheels into DIR
#   engine/benches/gpu_check.sh --dry-run DIR [OUT]     # here or there: check and print
#   engine/benches/gpu_check.sh DIR [OUT]               # there: everything below, logs in OUT
#
# DIR (about 60 MiB: carry it, e.g. target/gpu-check) holds the cuda_backend and
# carve_engine test binaries (debug), the training bench (release), carve and
# libcarve_guard.so (release) and wheels/ (keras 3 and the pure-Python and optree wheels
# it needs, installed there only where missing). STEPS picks steps; the default, issue
# 33's run, is "suite guard jobs table nvml" and takes about 8 minutes on an H100:
# 1. `suite`: the cuda_backend suite (debug build: buffers that need not start at zero
#    are NaN-filled) in strict fp32, which on cuDNN 9 runs every convolution through the
#    graph API (`CARVE_CUDA_TUNING` words: engine/src/cuda/tuning.rs), again with
#    `graph-api` (fp16 and bf16 on the graph API too), and the kernel unit tests. `guard` (.ci/guard-gpu-check: the guard's frameworks, fail-closed, the
#    neighbour) and, when `table` is asked for, the torch.compile warm-up (its inductor
#    cache then serves the timed rows) run beside it: none of the three is timed.
# 2. `jobs`: one `carve dev --real-gpus` running two command jobs side by side:
#    examples/command/pytorch-resnet.toml as written (`vram = "auto"`: the real profile,
#    its fitted model against each attempt's measured peak) and the Keras seed case
#    (examples/command/keras-conv2d-1024px.toml) as Keras 3 on JAX
#    (keras/train_keras3.py, `KERAS_BACKEND=jax`): its OOM and retry.
# 3. `table`: Carve (the training bench's batch-128 rows: defaults, strict fp32 on the
#    graph API and on the legacy API, fp32 on the graph API) against eager PyTorch and
#    torch.compile (mode reduce-overhead: inductor and CUDA graphs) for resnet-cifar and
#    resnet18-cifar in fp32, fp16, bf16 and strict fp32; OUT/table.md is the table
#    (engine/benches/gpu_table.py), with peak == estimate per Carve row.
# 4. `nvml`: NVML's reading of one Carve bench process against its slice: the bytes the
#    engine holds outside the slice, against the 640 MiB --context-bytes default.
# The earlier steps stay: `bench`, `profile`, `ablation`, `pytorch` (see BENCHMARKS.md).
# GPU_CHECK_PYTHON names the Python with torch, GPU_CHECK_JAX_PYTHON the one with JAX
# (both are searched for otherwise). `--dry-run` runs nothing: it checks that every
# binary, file and command exists and prints each command with its time limit.
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ "${1:-}" = "--build" ]; then
  out="${2:?usage: engine/benches/gpu_check.sh --build DIR}"
  mkdir -p "$out/wheels"
  copy_executables() {
    python3 -c '
import json, sys
wanted = sys.argv[1:]
for line in sys.stdin:
    message = json.loads(line)
    target = message.get("target", {})
    if message.get("reason") == "compiler-artifact" and message.get("executable") and (
        target.get("name") in wanted or ("lib" in target.get("kind", []) and "lib" in wanted)
    ):
        print(message["executable"])' "$@" |
      while read -r binary; do
        name="$(basename "$binary" | sed 's/-[0-9a-f]*$//')"
        cp "$binary" "$out/$name" && strip "$out/$name"
      done
  }
  export CARGO_INCREMENTAL=0
  cargo test -p carve-engine --locked --no-run --message-format=json 2>/dev/null |
    copy_executables cuda_backend lib
  cargo bench -p carve-engine --locked --no-run --message-format=json 2>/dev/null |
    copy_executables training
  cargo build --release --locked -p carve-cli -p carve-guard &&
    cp target/release/carve target/release/libcarve_guard.so "$out/" &&
    strip "$out/carve" "$out/libcarve_guard.so"
  # Keras 3 for the JAX run: the wheel and what it imports that a JAX install may lack
  # (optree is compiled: one wheel per CPython the machine may have).
  pip download --no-deps -d "$out/wheels" keras namex absl-py rich markdown-it-py mdurl pygments
  for version in 311 312 313; do
    pip download --no-deps --only-binary=:all: --python-version "$version" \
      --platform manylinux_2_28_x86_64 -d "$out/wheels" optree
  done
  ls -l "$out" "$out/wheels"
  du -sh "$out"
  exit 0
fi

dry=0
if [ "${1:-}" = "--dry-run" ]; then
  dry=1
  shift
fi
binaries="${1:?usage: engine/benches/gpu_check.sh [--dry-run] DIR [OUT]}"
binaries="$(cd "$binaries" 2>/dev/null && pwd || echo "$binaries")"
out="${2:-${OUT:-/tmp/gpu-check}}"
steps="${STEPS:-suite guard jobs table nvml}"
repository="$PWD"
wants() { case " $steps " in *" $1 "*) return 0 ;; esac; return 1; }

# What the dry run found missing: in the carried files (an error) and on this machine
# where the GPU machine provides it (only said).
missing=()
gpu_machine=()
planned_seconds=0
need() { # need FILE...: carried or in the repository
  local file
  for file in "$@"; do [ -e "$file" ] || missing+=("$file"); done
}
need_here_or_there() { # need_here_or_there WHAT CHECK...: a tool of the GPU machine
  local what="$1"
  shift
  "$@" >/dev/null 2>&1 || gpu_machine+=("$what")
}

# A Python that imports MODULE: $2 if set, /opt/torch's, the PATH's, else any found.
find_python() {
  local module="$1" preset="${2:-}" candidate
  if [ -n "$preset" ]; then echo "$preset"; return; fi
  for candidate in /opt/torch/.venv/bin/python python3 python /usr/bin/python3 \
    $(find / -xdev -maxdepth 5 -path '*/bin/python3' -not -path '/proc/*' 2>/dev/null); do
    if "$candidate" -c "import $module" 2>/dev/null; then command -v "$candidate"; return; fi
  done
  echo ""
}
python="$(find_python torch "${GPU_CHECK_PYTHON:-}")"
jax_python="$(find_python jax "${GPU_CHECK_JAX_PYTHON:-}")"

# Everything ends by the deadline (GPU_CHECK_SECONDS after the start, default 560: one
# device command may run 600 s), each step within its own limit and what is left; the
# steps come in the order of what matters most. A dry run adds up the limits along the
# critical path instead (side-by-side steps count as the longest of them).
deadline_seconds="${GPU_CHECK_SECONDS:-560}"
# The untimed block (suite, guard, jobs, warm-up) ends by GPU_CHECK_UNTIMED_SECONDS, so
# the timed table always has its time.
untimed_seconds="${GPU_CHECK_UNTIMED_SECONDS:-250}"
phase_deadline=$untimed_seconds
side_by_side=0
block_longest=0

# `run NAME SECONDS COMMAND...`: the command's output into OUT/NAME.log and, shortened,
# onto the screen; in a dry run, the command and its limit.
run() {
  local name="$1" seconds="$2"
  shift 2
  if [ "$dry" = 1 ]; then
    echo "would run [${seconds}s] $name: $*"
    if [ "$side_by_side" = 1 ]; then
      [ "$seconds" -gt "$block_longest" ] && block_longest=$seconds
    else
      planned_seconds=$((planned_seconds + seconds))
    fi
    local word
    for word in "$@"; do
      case "$word" in
        *=*) continue ;;
        env) continue ;;
        /*) need "$word" ;;
        *) command -v "$word" >/dev/null 2>&1 || need "$word" ;;
      esac
      break
    done
    return 0
  fi
  local left=$((phase_deadline - (SECONDS - started)))
  if [ "$left" -lt 15 ]; then
    echo "== $name: skipped, out of time (at $((SECONDS - started)) s of $phase_deadline)" |
      tee "$out/$name.log"
    return 124
  fi
  [ "$seconds" -gt "$left" ] && seconds=$left
  echo "== $name"
  timeout --kill-after=5 "$seconds" "$@" >"$out/$name.log" 2>&1
  local code=$?
  tail -n 40 "$out/$name.log"
  echo "== $name: exit $code"
  return "$code"
}

need "$binaries/cuda_backend" "$binaries/carve_engine" "$binaries/training" \
  "$binaries/carve" "$binaries/libcarve_guard.so" .ci/cuda-libraries.sh .ci/guard-gpu-check \
  .ci/guard_gpu_programs.py engine/benches/pytorch_reference.py engine/benches/gpu_table.py \
  engine/benches/gpu_jobs_report.py examples/resnet-cifar.toml examples/resnet18-cifar.toml \
  examples/command/pytorch-resnet.toml examples/command/pytorch/train.py \
  examples/command/keras-conv2d-1024px.toml examples/command/keras/train_keras3.py
ls "$binaries"/wheels/keras-3*.whl >/dev/null 2>&1 || missing+=("$binaries/wheels/keras-3*.whl")
ls "$binaries"/wheels/optree-*.whl >/dev/null 2>&1 || missing+=("$binaries/wheels/optree-*.whl")
for tool in timeout python3 nvidia-smi; do need_here_or_there "$tool" command -v "$tool"; done
[ -n "$python" ] || gpu_machine+=("a Python with torch (GPU_CHECK_PYTHON)")
[ -n "$jax_python" ] || gpu_machine+=("a Python with JAX (GPU_CHECK_JAX_PYTHON)")
python="${python:-python3}"
jax_python="${jax_python:-python3}"

if [ "$dry" = 0 ]; then
  mkdir -p "$out"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader |
    tee "$out/gpu.txt" || true
  . .ci/cuda-libraries.sh >"$out/libraries.txt" 2>&1
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  "$python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' || true
  export RUST_BACKTRACE=1
  # torch.compile's caches, shared by the warm-up and the timed rows.
  export TORCHINDUCTOR_CACHE_DIR="$out/inductor-cache" TRITON_CACHE_DIR="$out/triton-cache"
fi
started=$SECONDS

# `beside FUNCTION ARGUMENTS...`: FUNCTION in the background, its process id added to
# `background`; in a dry run in order, counted as one of the side-by-side steps.
background=()
beside() {
  if [ "$dry" = 1 ]; then
    local before=$planned_seconds
    "$@"
    local took=$((planned_seconds - before))
    planned_seconds=$before
    [ "$took" -gt "$block_longest" ] && block_longest=$took
  else
    "$@" &
    background+=($!)
  fi
}

# The command jobs: one `carve dev --real-gpus`, the PyTorch example as written (its
# `auto` profile) and the Keras seed case as Keras 3 on JAX, side by side.
command_jobs() {
  local keras_site="$out/keras-site"
  # Where runc is installed the jobs run contained, seeing the host's /usr and /etc but
  # not a Python (or its wheels) installed elsewhere: those are bound read-only.
  local visible
  visible="$(for candidate in "$python" "$jax_python"; do
    "$candidate" -c 'import os, sys; print(os.path.realpath(sys.prefix))' 2>/dev/null
  done | grep -v '^/usr' | sort -u | sed 's/.*/"&"/' | paste -sd, -)"
  local auto_arguments=(examples/command/pytorch-resnet.toml -q
    --set "command.argv[0]=$python"
    --set "command.argv[1]=$repository/examples/command/pytorch/train.py"
    --set command.steps=20 --set "command.read_only_paths=[${visible}]")
  local keras_arguments=(examples/command/keras-conv2d-1024px.toml -q
    --set "command.argv[0]=$jax_python"
    --set "command.argv[1]=$repository/examples/command/keras/train_keras3.py"
    --set command.env.KERAS_BACKEND=jax --set 'command.env.XLA_PYTHON_CLIENT_PREALLOCATE="false"'
    --set "command.env.PYTHONPATH=$keras_site" --set command.steps=6
    --set "command.read_only_paths=[${visible:+$visible,}\"$keras_site\"]")
  if [ "$dry" = 1 ]; then
    echo "would install into $keras_site what $jax_python lacks of" \
      "$binaries/wheels/{keras,optree,namex,absl_py,rich,markdown_it_py,mdurl,pygments}*.whl"
    run carve-dev 30 "$binaries/carve" dev --real-gpus --data-dir "$out/carve-dev"
    run submit-auto 30 "$binaries/carve" submit "${auto_arguments[@]}"
    run submit-keras 30 "$binaries/carve" submit "${keras_arguments[@]}"
    run watch-jobs 200 "$binaries/carve" watch JOB
    run report-auto 10 python3 engine/benches/gpu_jobs_report.py auto "$out/auto.json"
    run report-keras 10 python3 engine/benches/gpu_jobs_report.py keras "$out/keras.json"
    return 0
  fi
  mkdir -p "$keras_site"
  local wanted_wheels=() pair
  "$jax_python" -c 'import keras, sys; sys.exit(int(keras.__version__.split(".")[0]) < 3)' \
    2>/dev/null || wanted_wheels+=(keras)
  for pair in optree:optree namex:namex absl:absl-py rich:rich markdown_it:markdown-it-py \
    mdurl:mdurl pygments:pygments; do
    "$jax_python" -c "import ${pair%%:*}" 2>/dev/null || wanted_wheels+=("${pair##*:}")
  done
  if [ "${#wanted_wheels[@]}" -gt 0 ]; then
    echo "== keras: installing ${wanted_wheels[*]} into $keras_site"
    "$jax_python" -m pip install --quiet --no-index --no-deps --find-links "$binaries/wheels" \
      --target "$keras_site" "${wanted_wheels[@]}" >"$out/keras-install.log" 2>&1 ||
      echo "keras wheels did not install: $(tail -3 "$out/keras-install.log")"
  fi
  local cluster_log="$out/carve-dev.log" cluster
  "$binaries/carve" dev --real-gpus --data-dir "$out/carve-dev" >"$cluster_log" 2>&1 &
  cluster=$!
  for _ in $(seq 1 60); do grep -q '^  export CARVE_ENDPOINT' "$cluster_log" && break; sleep 1; done
  eval "$(grep '^  export CARVE_ENDPOINT' "$cluster_log")"
  local auto_job keras_job job watches=() pid
  auto_job="$(timeout 30 "$binaries/carve" submit "${auto_arguments[@]}" 2>"$out/submit-auto.err")"
  keras_job="$(timeout 30 "$binaries/carve" submit "${keras_arguments[@]}" 2>"$out/submit-keras.err")"
  echo "== jobs: auto ${auto_job:-refused: $(cat "$out/submit-auto.err")}," \
    "keras ${keras_job:-refused: $(cat "$out/submit-keras.err")}"
  for job in $auto_job $keras_job; do
    run "watch-$job" 200 "$binaries/carve" watch "$job" &
    watches+=($!)
  done
  for pid in "${watches[@]}"; do wait "$pid"; done
  [ -n "$auto_job" ] && timeout 30 "$binaries/carve" get "$auto_job" -o json >"$out/auto.json"
  [ -n "$keras_job" ] && timeout 30 "$binaries/carve" get "$keras_job" -o json >"$out/keras.json"
  for job in $auto_job $keras_job; do
    timeout 30 "$binaries/carve" logs "$job" >"$out/logs-$job.txt" 2>&1
  done
  kill -INT "$cluster" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$cluster" 2>/dev/null || break; sleep 1; done
  kill -KILL "$cluster" 2>/dev/null
  run report-auto 10 python3 engine/benches/gpu_jobs_report.py auto "$out/auto.json"
  run report-keras 10 python3 engine/benches/gpu_jobs_report.py keras "$out/keras.json"
}

# 1. The untimed block, side by side (nothing in it is timed, so sharing the GPU changes
#    no result): the torch.compile warm-up, the guard's checks, the command jobs, and in
#    the foreground the suite.
side_by_side=1
if wants table; then
  for example in resnet-cifar resnet18-cifar; do
    beside run "pytorch-warmup-$example" 200 "$python" engine/benches/pytorch_reference.py \
      --example "examples/$example.toml" --batch 128 --rows fp32,fp16,bf16 --modes compile \
      --steps 1 --warmup 3
  done
fi
if wants guard; then
  export GUARD_CHECK_RESULTS="$out/guard" GUARD_CHECK_TIMEOUT=45
  beside run guard 200 .ci/guard-gpu-check "$binaries"
fi
if wants suite; then
  # Half precisions through the graph API too, for the day it becomes their default.
  beside run suite-graph-api 200 env CARVE_CUDA_TUNING=graph-api "$binaries/cuda_backend" \
    --test-threads=1
fi
side_by_side=0
if wants jobs; then
  beside command_jobs
fi
suite_block() {
  run suite 200 env CARVE_CUDA_TUNING= "$binaries/cuda_backend" --test-threads=1
  run kernels 30 "$binaries/carve_engine" --test-threads=1 cuda
}
if wants suite; then
  if [ "$dry" = 1 ]; then beside suite_block; else suite_block; fi
fi
for pid in "${background[@]}"; do wait "$pid" 2>/dev/null; done
[ "$block_longest" -gt "$untimed_seconds" ] && block_longest=$untimed_seconds
planned_seconds=$((planned_seconds + block_longest))
phase_deadline=$deadline_seconds

# 2. The timed table, with nothing else on the GPU: the issue's rows first, then the
#    engine's memory outside its slice, then the API comparison.
if wants table; then
  run carve-default 90 env CARVE_CUDA_TUNING= "$binaries/training" cuda resnet b128
  run carve-strict 45 env CARVE_CUDA_TUNING=strict "$binaries/training" cuda resnet b128 fp32
  for example in resnet-cifar resnet18-cifar; do
    run "pytorch-$example" 110 "$python" engine/benches/pytorch_reference.py \
      --example "examples/$example.toml" --batch 128 --rows fp32,fp16,bf16,strict \
      --modes eager,compile --steps 30
  done
fi

# 3. The engine's memory outside its slice, by NVML, with nothing else on the GPU.
if wants nvml; then
  if [ "$dry" = 1 ]; then
    echo "would poll: nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits every 0.2 s"
    run nvml-bench 40 "$binaries/training" cuda resnet18-cifar b128 fp32
  else
    (while true; do
      nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits
      sleep 0.2
    done) >"$out/nvml.txt" 2>/dev/null &
    poller=$!
    run nvml-bench 40 env CARVE_CUDA_TUNING= "$binaries/training" cuda resnet18-cifar b128 fp32
    kill "$poller" 2>/dev/null
  fi
  run nvml 10 python3 engine/benches/gpu_jobs_report.py nvml "$out/nvml.txt" "$out/nvml-bench.log"
fi

if wants table; then
  run carve-graph 40 env CARVE_CUDA_TUNING=graph-api "$binaries/training" cuda resnet b128 fp32
  run carve-strict-legacy 30 env CARVE_CUDA_TUNING=strict,legacy-api "$binaries/training" \
    cuda resnet b128 fp32
  # The table is written whatever time is left (it only reads the logs).
  phase_deadline=$((deadline_seconds + 30)) run table 10 python3 engine/benches/gpu_table.py "$out"
  [ "$dry" = 1 ] || cp "$out/table.log" "$out/table.md"
fi

# The earlier steps (BENCHMARKS.md's runs).
if wants bench; then
  run bench-fast 240 env CARVE_CUDA_TUNING= "$binaries/training" cuda
  run bench-first-wave 180 env CARVE_CUDA_TUNING=strict,zero-fill,heuristic-filter,legacy-batch-norm,no-graphs,no-workspace-headroom,legacy-api \
    "$binaries/training" cuda resnet-cifar
fi
if wants profile; then
  run bench-profile 120 env CARVE_CUDA_TUNING=profile "$binaries/training" cuda resnet
fi
if wants pytorch; then
  for example in resnet-cifar resnet18-cifar; do
    run "pytorch-eager-$example" 150 "$python" engine/benches/pytorch_reference.py \
      --example "examples/$example.toml" --batch 128 --rows fp32,fp16,bf16,strict --steps 30
  done
fi
if wants ablation; then
  for switch in ${ABLATION:-no-workspace-headroom strict zero-fill heuristic-filter legacy-batch-norm no-graphs graph-api}; do
    models=resnet-cifar
    [ "$switch" = no-workspace-headroom ] && models=resnet
    run "bench-without-$switch" 120 env CARVE_CUDA_TUNING="$switch" "$binaries/training" cuda "$models"
  done
fi

if [ "$dry" = 1 ]; then
  echo "steps: $steps; at most ${planned_seconds}s by the limits along the critical path" \
    "(side-by-side steps counted as the longest, the untimed block cut at ${untimed_seconds}s)," \
    "all cut at GPU_CHECK_SECONDS=$deadline_seconds"
  if [ "${#gpu_machine[@]}" -gt 0 ]; then
    echo "not on this machine (the GPU machine provides them): ${gpu_machine[*]}"
  fi
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "MISSING: $(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')"
    exit 1
  fi
  echo "every carried binary, file and wheel is there"
  exit 0
fi
echo "took $((SECONDS - started)) s; logs in $out"
