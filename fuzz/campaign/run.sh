#!/usr/bin/env bash
# Runs one target of the campaign on the stable toolchain, without cargo-fuzz:
#   fuzz/campaign/run.sh TARGET SECONDS [libFuzzer options...]
# It builds the target with coverage instrumentation (what `cargo fuzz build -s none`
# does), copies the checked-in seeds into a working corpus (fuzz/campaign/work-corpus/,
# where libFuzzer adds what it finds), runs for SECONDS, and leaves crashes under
# fuzz/campaign/artifacts/TARGET/. The log is fuzz/campaign/logs/TARGET.log.
set -euo pipefail
target="${1:?usage: run.sh TARGET SECONDS [libFuzzer options...]}"
seconds="${2:?usage: run.sh TARGET SECONDS [libFuzzer options...]}"
shift 2
campaign="$(cd "$(dirname "$0")" && pwd)"
cd "$campaign"

# cargo-fuzz's flags for --sanitizer none: SanitizerCoverage on every crate (8-bit
# counters, the PC table, compare tracing for libFuzzer's value profile), `cfg(fuzzing)`,
# and debug assertions and overflow checks on, so arithmetic overflows are findings.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions \
-Coverflow-checks -Cforce-frame-pointers"
# With an explicit --target, RUSTFLAGS reach only the target's code, not build scripts
# and proc macros (which cannot link without libFuzzer's runtime).
host="$(rustc -vV | sed -n 's/^host: //p')"
cargo build --release --target "$host" --bin "$target"

mkdir -p "work-corpus/$target" "artifacts/$target" logs
cp -n ../corpus/"$target"/* "work-corpus/$target/" 2>/dev/null || true
dictionary=()
if [ -f "dictionaries/$target.dict" ]; then dictionary=("-dict=dictionaries/$target.dict"); fi
"./target/$host/release/$target" "work-corpus/$target" \
  -max_total_time="$seconds" -max_len=8192 -timeout=30 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="artifacts/$target/" "${dictionary[@]}" "$@" \
  2>&1 | tee "logs/$target.log"
