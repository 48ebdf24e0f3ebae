#!/usr/bin/env python3
"""The table of engine/benches/gpu_check.sh's `table` step, from its logs: Carve against
eager PyTorch and torch.compile for resnet-cifar and resnet18-cifar at batch 128 in fp32,
fp16, bf16 and strict fp32, samples/s and ratios, and whether peak == estimate on every
Carve row; then the convolution API rows (legacy against graph) that decide the default.

    python3 engine/benches/gpu_table.py OUT     # OUT: gpu_check.sh's log directory

Reads OUT/carve-*.log (the training bench's rows; the file name says the tuning) and
OUT/pytorch-*.log (pytorch_reference.py's `RESULT {json}` lines). Plain Python 3, no
torch: it runs wherever the logs are.
"""

import json
import pathlib
import re
import sys

MODELS = ["resnet-cifar", "resnet18-cifar"]
ROWS = [("fp32", "default"), ("fp16", "default"), ("bf16", "default"), ("fp32", "strict")]

# `resnet-cifar cuda 128 fp32 30 47786.1 1.21 GiB yes 2.3026 slice=1300234240`
CARVE_ROW = re.compile(
    r"^(?P<example>\S+)\s+cuda\s+(?P<batch>\d+)\s+(?P<precision>fp32|fp16|bf16)\s+\d+\s+"
    r"(?P<rate>[\d.]+|NaN|nan)\s+(?P<peak>\S+ \S+)\s+(?P<equal>yes|NO: \S+ \S+)"
)
CARVE_FAILED = re.compile(
    r"^(?P<example>\S+)\s+cuda\s+(?P<batch>\d+)\s+(?P<precision>fp32|fp16|bf16)\s+\d+\s+failed: (?P<why>.*)"
)


def carve_rows(path):
    """{(example, precision): (samples/s or None, peak == estimate text)} from a bench log."""
    rows = {}
    for line in path.read_text(errors="replace").splitlines():
        match = CARVE_ROW.match(line.strip())
        if match and match["batch"] == "128":
            rate = float(match["rate"])
            rows[(match["example"], match["precision"])] = (
                rate if rate == rate else None,
                "yes" if match["equal"] == "yes" else match["equal"],
            )
            continue
        match = CARVE_FAILED.match(line.strip())
        if match and match["batch"] == "128":
            rows[(match["example"], match["precision"])] = (None, "failed: " + match["why"][:60])
    return rows


def pytorch_rows(out):
    """{(example, precision, fp32 math, 'eager'|'compile'): samples/s}."""
    rows = {}
    for path in sorted(out.glob("pytorch-*.log")):
        # The warm-up runs (one step, to fill the inductor cache) print rows too; they
        # are not timings.
        if path.name.startswith("pytorch-warmup-"):
            continue
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("RESULT "):
                continue
            row = json.loads(line[len("RESULT "):])
            mode = "eager" if row["mode"] == "eager" else "compile"
            key = (row["example"], row["precision"], row["fp32_math"], mode)
            rows[key] = row["samples_per_second"]
    return rows


def number(value):
    return "" if value is None else f"{value:,.0f}"


def ratio(numerator, denominator):
    if numerator is None or not denominator:
        return ""
    return f"**{numerator / denominator:.2f}**"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = pathlib.Path(sys.argv[1])
    logs = {path.stem: carve_rows(path) for path in sorted(out.glob("carve-*.log"))}
    if not logs:
        sys.exit(f"no carve-*.log in {out}")
    default = logs.get("carve-default", {})
    strict = logs.get("carve-strict", {})
    pytorch = pytorch_rows(out)
    print("| model | precision | Carve | peak == estimate | PyTorch eager | torch.compile "
          "| Carve / eager | Carve / compile |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for model in MODELS:
        for precision, math in ROWS:
            carve_log = strict if math == "strict" else default
            rate, equal = carve_log.get((model, precision), (None, "missing"))
            eager = pytorch.get((model, precision, math, "eager"))
            compiled = pytorch.get((model, precision, math, "compile"))
            label = "fp32 strict" if math == "strict" else precision
            print(
                f"| {model} | {label} | {number(rate)} | {equal} | {number(eager)} | "
                f"{number(compiled)} | {ratio(rate, eager)} | {ratio(rate, compiled)} |"
            )
    print()
    print("Convolution API, Carve samples/s (legacy API / graph API; strict fp32's default "
          "is the graph API, the others' the legacy API):")
    print()
    print("| model | precision | legacy | graph | graph / legacy |")
    print("|---|---|---:|---:|---:|")
    pairs = [
        ("fp32", default, logs.get("carve-graph", {})),
        ("fp32 strict", logs.get("carve-strict-legacy", {}), strict),
    ]
    for model in MODELS:
        for label, legacy, graph in pairs:
            legacy_rate = legacy.get((model, "fp32"), (None, ""))[0]
            graph_rate = graph.get((model, "fp32"), (None, ""))[0]
            print(
                f"| {model} | {label} | {number(legacy_rate)} | {number(graph_rate)} | "
                f"{ratio(graph_rate, legacy_rate)} |"
            )
    unequal = [
        f"{name}: {example} {precision}: {equal}"
        for name, rows in logs.items()
        for (example, precision), (_, equal) in rows.items()
        if equal != "yes"
    ]
    print()
    print("peak == estimate on every Carve row" if not unequal else "NOT EQUAL OR FAILED: " + "; ".join(unequal))


if __name__ == "__main__":
    main()
