#!/usr/bin/env bash
# The cuda backend's speed and correctness checks on a GPU machine, in one run, from
# binaries built on a machine without a GPU (GPU time is scarce; nothing is compiled
# there).
#
#   engine/benches/gpu_check.sh --build DIR   # here: test and bench binaries into DIR
#   engine/benches/gpu_check.sh DIR [OUT]     # there: everything below, logs into OUT
#
# In order, each step under its own timeout so one hang cannot eat the machine's time:
# 1. the cuda_backend suite (debug build: buffers that need not start at zero are filled
#    with NaN, so a read before a write shows), with the fast switches and strict fp32;
# 2. `bench`: the training bench's cuda rows with every speed change on, then with the
#    first wave's behaviour
#    (`CARVE_CUDA_TUNING=strict,zero-fill,heuristic-filter,legacy-batch-norm,no-graphs,
#    no-workspace-headroom`);
#    `profile`: per-operation GPU and host times and the convolution algorithms chosen;
# 3. `pytorch`: PyTorch (engine/benches/pytorch_reference.py) on the same models, batches
#    and precisions, with its defaults and with strict fp32;
# 4. `ablation`: resnet-cifar with each change off alone (ABLATION lists them; the
#    workspace headroom, which is for ResNet-18's small stride-2 layers, with both models).
# STEPS selects some of them (default "suite bench profile ablation pytorch");
# GPU_CHECK_PYTHON names the Python that has torch.
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ "${1:-}" = "--build" ]; then
  out="${2:?usage: engine/benches/gpu_check.sh --build DIR}"
  mkdir -p "$out"
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
  cargo test -p carve-engine --locked --no-run --message-format=json 2>/dev/null |
    copy_executables cuda_backend lib
  cargo bench -p carve-engine --locked --no-run --message-format=json 2>/dev/null |
    copy_executables training
  ls -l "$out"
  exit 0
fi

binaries="${1:?usage: engine/benches/gpu_check.sh DIR [OUT]}"
out="${2:-${OUT:-/tmp/gpu-check}}"
mkdir -p "$out"
steps="${STEPS:-suite bench profile ablation pytorch}"
python="${GPU_CHECK_PYTHON:-$(ls /opt/torch/.venv/bin/python 2>/dev/null || echo python3)}"
export RUST_BACKTRACE=1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader |
  tee "$out/gpu.txt" || true
. .ci/cuda-libraries.sh > "$out/libraries.txt" 2>&1
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# `run NAME SECONDS COMMAND...`: the command's output into OUT/NAME.log and, shortened,
# onto the screen.
run() {
  local name="$1" seconds="$2"
  shift 2
  echo "== $name"
  timeout --kill-after=10 "$seconds" "$@" > "$out/$name.log" 2>&1
  local code=$?
  tail -n 60 "$out/$name.log"
  echo "== $name: exit $code"
}

case " $steps " in *" suite "*)
  run suite 240 "$binaries/cuda_backend" --test-threads=1
  run kernels 60 "$binaries/carve_engine" --test-threads=1 cuda
esac

case " $steps " in *" bench "*)
  run bench-fast 240 env CARVE_CUDA_TUNING= "$binaries/training" cuda
  run bench-first-wave 180 env CARVE_CUDA_TUNING=strict,zero-fill,heuristic-filter,legacy-batch-norm,no-graphs,no-workspace-headroom \
    "$binaries/training" cuda resnet-cifar
esac

case " $steps " in *" profile "*)
  run bench-profile 120 env CARVE_CUDA_TUNING=profile "$binaries/training" cuda resnet
esac

case " $steps " in *" pytorch "*)
  for example in resnet-cifar resnet18-cifar; do
    for precision in fp32 fp16 bf16; do
      run "pytorch-$example-$precision" 120 "$python" engine/benches/pytorch_reference.py \
        --example "examples/$example.toml" --batch 128 --precision "$precision" --steps 30
    done
    run "pytorch-$example-fp32-strict" 120 "$python" engine/benches/pytorch_reference.py \
      --example "examples/$example.toml" --batch 128 --precision fp32 --steps 30 --fp32-math strict
  done
esac

case " $steps " in *" ablation "*)
  for switch in ${ABLATION:-no-workspace-headroom strict zero-fill heuristic-filter legacy-batch-norm no-graphs}; do
    models=resnet-cifar
    [ "$switch" = no-workspace-headroom ] && models=resnet
    run "bench-without-$switch" 120 env CARVE_CUDA_TUNING="$switch" "$binaries/training" cuda "$models"
  done
esac
echo "logs in $out"
