#!/usr/bin/env python3
"""PyTorch reference for Carve's cuda backend: trains an example's model (by default
examples/resnet-cifar.toml; graph models such as resnet18-cifar.toml too) with
torch.backends.cudnn.benchmark=True at the same batch size and precision and prints
samples/s, to compare with `cargo bench -p carve-engine` (the cuda rows) on the same GPU.

The model is the example's layers, with Keras' conventions that Carve follows:
TF "same" padding (a stride-2 3x3 convolution on an even input pads only bottom/right),
channels-last activations (Carve's NHWC: the same layout), batch norm momentum 0.99
(PyTorch 0.01) and epsilon 1e-3, the example's optimizer, synthetic inputs and labels.
The timed span is `--steps` steps between two synchronizes, after `--warmup` steps.

`--fp32-math default` leaves PyTorch's defaults (cuDNN may use TF32 for fp32
convolutions, matmuls may not); `--fp32-math strict` turns TF32 off for both, like
Carve's `CARVE_CUDA_TUNING=strict`.

`--compile MODE` times the model under `torch.compile(mode=MODE)` (inductor;
`reduce-overhead` adds CUDA graphs, the higher anchor), after `--warmup` steps that
include the compilation. `--rows fp32,fp16,bf16,strict --modes eager,compile` times
several rows in one process (one CUDA start-up, one import), each on a fresh model,
and prints each row also as a `RESULT {json}` line for engine/benches/gpu_table.py.

    python3 engine/benches/pytorch_reference.py --batch 128 --precision fp32 --steps 50
    python3 engine/benches/pytorch_reference.py --example examples/resnet18-cifar.toml \
        --batch 128 --rows fp32,fp16,bf16,strict --modes eager,compile --steps 30

Needs torch with CUDA; it only reads the example file (tomllib, Python 3.11+).
"""

import argparse
import json
import pathlib
import sys
import time
import tomllib

import torch
from torch import nn


def same_padding(size, kernel, stride):
    """TF's "same": total padding so that output = ceil(size / stride), extra at the end."""
    output = -(-size // stride)
    total = max((output - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class GraphModel(nn.Module):
    """The example's layers in order; a layer reads the previous one's output unless it
    names its `inputs` (Carve's graph models: `add` sums them, `concat` joins channels)."""

    def __init__(self, layers, names, inputs):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.names = names
        self.inputs = inputs

    def forward(self, x):
        outputs = {}
        previous = x
        for layer, name, sources in zip(self.layers, self.names, self.inputs):
            arguments = [outputs[source] for source in sources] if sources else [previous]
            previous = layer(*arguments)
            outputs[name] = previous
        return previous


class Add(nn.Module):
    def forward(self, *tensors):
        total = tensors[0]
        for tensor in tensors[1:]:
            total = total + tensor
        return total


class Concat(nn.Module):
    def forward(self, *tensors):
        return torch.cat(tensors, dim=1)


def build_model(spec):
    height, width, channels = spec["model"]["input_shape"]
    shapes = {}
    previous = (height, width, channels)
    layers, names, inputs = [], [], []
    for index, entry in enumerate(spec["model"]["layers"]):
        entry = dict(entry)
        name = entry.pop("name", f"layer{index}")
        sources = entry.pop("inputs", None)
        (kind, settings), = entry.items()
        height, width, channels = shapes[sources[0]] if sources else previous
        if kind == "conv2d":
            kernel = settings.get("kernel", 3)
            stride = settings.get("stride", 1)
            parts = []
            if settings.get("padding", "valid") == "same":
                top, bottom = same_padding(height, kernel, stride)
                left, right = same_padding(width, kernel, stride)
                if (top, left) == (bottom, right):
                    padding = (top, left)
                else:
                    parts.append(nn.ZeroPad2d((left, right, top, bottom)))
                    padding = 0
                height = -(-height // stride)
                width = -(-width // stride)
            else:
                padding = 0
                height = (height - kernel) // stride + 1
                width = (width - kernel) // stride + 1
            parts.append(
                nn.Conv2d(
                    channels,
                    settings["filters"],
                    kernel,
                    stride=stride,
                    padding=padding,
                    bias=settings.get("use_bias", True),
                )
            )
            layer = parts[0] if len(parts) == 1 else nn.Sequential(*parts)
            channels = settings["filters"]
        elif kind == "batch_norm":
            momentum = settings.get("momentum", 0.99)
            layer = nn.BatchNorm2d(channels, eps=settings.get("epsilon", 1e-3), momentum=1 - momentum)
        elif kind == "relu":
            layer = nn.ReLU()
        elif kind == "add":
            layer = Add()
        elif kind == "concat":
            layer = Concat()
            channels = sum(shapes[source][2] for source in sources)
        elif kind == "global_avg_pool":
            layer = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
            height = width = 1
        elif kind == "dense":
            layer = nn.Linear(channels * height * width, settings["units"])
            channels = settings["units"]
        else:
            sys.exit(f"layer {kind} is not part of the reference model")
        previous = (height, width, channels)
        shapes[name] = previous
        layers.append(layer)
        names.append(name)
        inputs.append(sources)
    return GraphModel(layers, names, inputs), spec["model"]["input_shape"], channels


def measure(spec, example, batch, precision, fp32_math, compile_mode, steps, warmup):
    """Trains a fresh model `steps` timed steps and returns the row as a dict."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = fp32_math != "strict"
    if compile_mode:
        torch._dynamo.reset()
    torch.cuda.reset_peak_memory_stats()
    optimizer_spec = spec["training"]["optimizer"]
    device = torch.device("cuda")
    model, (height, width, channels), classes = build_model(spec)
    model = model.to(device).to(memory_format=torch.channels_last)
    if "sgd" in optimizer_spec:
        sgd = optimizer_spec["sgd"]
        optimizer = torch.optim.SGD(
            model.parameters(),
            lr=sgd["learning_rate"],
            momentum=sgd.get("momentum", 0.0),
            nesterov=sgd.get("nesterov", False),
            weight_decay=sgd.get("weight_decay", 0.0),
        )
    else:
        (kind, adam), = optimizer_spec.items()
        optimizer = (torch.optim.AdamW if kind == "adamw" else torch.optim.Adam)(
            model.parameters(),
            lr=adam["learning_rate"],
            betas=(adam.get("beta1", 0.9), adam.get("beta2", 0.999)),
            eps=adam.get("epsilon", 1e-7),
            weight_decay=adam.get("weight_decay", 0.0),
        )
    forward = torch.compile(model, mode=compile_mode) if compile_mode else model
    autocast_type = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    inputs = torch.randn(batch, channels, height, width, device=device).to(
        memory_format=torch.channels_last
    )
    labels = torch.randint(0, classes, (batch,), device=device)
    loss_function = nn.CrossEntropyLoss()

    def step():
        if compile_mode:
            # CUDA graph trees: a new iteration begins, the last one's outputs are done.
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=autocast_type, enabled=autocast_type is not None):
            loss = loss_function(forward(inputs), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    warm_started = time.perf_counter()
    for _ in range(max(warmup, 5) if compile_mode else warmup):
        step()
    torch.cuda.synchronize()
    warmup_seconds = time.perf_counter() - warm_started
    started = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {
        "example": pathlib.Path(example).stem,
        "batch": batch,
        "precision": precision,
        "fp32_math": fp32_math,
        "mode": f"compile:{compile_mode}" if compile_mode else "eager",
        "samples_per_second": steps * batch / seconds,
        "warmup_seconds": warmup_seconds,
        "loss": loss.item(),
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
    }


def main():
    root = pathlib.Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default=str(root / "examples" / "resnet-cifar.toml"))
    parser.add_argument("--batch", type=int, default=None, help="defaults to the example's")
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default=None)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--fp32-math", choices=["default", "strict"], default="default")
    parser.add_argument(
        "--compile",
        default=None,
        metavar="MODE",
        help="torch.compile mode (default, reduce-overhead, max-autotune, ...)",
    )
    parser.add_argument(
        "--rows",
        default=None,
        help="comma-separated precisions, 'strict' for fp32 without TF32 (overrides "
        "--precision and --fp32-math)",
    )
    parser.add_argument(
        "--modes",
        default=None,
        help="comma-separated: eager, compile (with --compile's mode, reduce-overhead "
        "when not given)",
    )
    arguments = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit("skipped: CUDA not available to torch")
    spec = tomllib.loads(pathlib.Path(arguments.example).read_text())
    batch = arguments.batch or spec["training"]["batch_size"]
    default_precision = arguments.precision or spec["training"].get("precision", "fp32")
    torch.backends.cudnn.benchmark = True

    if arguments.rows:
        rows = []
        for row in arguments.rows.split(","):
            if row == "strict":
                rows.append(("fp32", "strict"))
            elif row in ("fp32", "fp16", "bf16"):
                rows.append((row, "default"))
            else:
                sys.exit(f"--rows: unknown row {row!r} (fp32, fp16, bf16, strict)")
    else:
        rows = [(default_precision, arguments.fp32_math)]
    if arguments.modes:
        modes = []
        for mode in arguments.modes.split(","):
            if mode == "eager":
                modes.append(None)
            elif mode == "compile":
                modes.append(arguments.compile or "reduce-overhead")
            else:
                sys.exit(f"--modes: unknown mode {mode!r} (eager, compile)")
    else:
        modes = [arguments.compile]

    failed = False
    for precision, fp32_math in rows:
        for compile_mode in modes:
            try:
                row = measure(
                    spec,
                    arguments.example,
                    batch,
                    precision,
                    fp32_math,
                    compile_mode,
                    arguments.steps,
                    arguments.warmup,
                )
            except Exception as error:  # one failed row must not hide the others
                failed = True
                print(
                    f"pytorch {pathlib.Path(arguments.example).stem} {precision} "
                    f"(fp32 math {fp32_math}) {compile_mode or 'eager'}: failed: {error!r}",
                    flush=True,
                )
                continue
            print(
                f"pytorch {row['torch']} {row['gpu']} {row['example']} batch {batch} "
                f"{precision} (fp32 math {fp32_math}) {row['mode']}: "
                f"{row['samples_per_second']:.1f} samples/s "
                f"(loss {row['loss']:.4f}, peak {row['peak_mib']:.0f} MiB, "
                f"warm-up {row['warmup_seconds']:.1f} s)",
                flush=True,
            )
            print("RESULT " + json.dumps(row), flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
