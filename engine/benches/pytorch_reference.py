#!/usr/bin/env python3
"""PyTorch reference for Carve's cuda backend: trains examples/resnet-cifar.toml's model
with torch.backends.cudnn.benchmark=True at the same batch size and precision and prints
samples/s, to compare with `cargo bench -p carve-engine` (the cuda rows) on the same GPU.

The model is the example's layer list, with Keras' conventions that Carve follows:
TF "same" padding (a stride-2 3x3 convolution on an even input pads only bottom/right),
channels-last activations, batch norm momentum 0.99 (PyTorch 0.01) and epsilon 1e-3,
SGD with Nesterov momentum 0.9 and weight decay 5e-4, synthetic inputs and labels.

    python3 engine/benches/pytorch_reference.py --batch 128 --precision fp32 --steps 50

Needs torch with CUDA; it only reads the example file (tomllib, Python 3.11+).
"""

import argparse
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


def build_model(spec):
    height, width, channels = spec["model"]["input_shape"]
    layers = []
    for entry in spec["model"]["layers"]:
        (kind, settings), = entry.items()
        if kind == "conv2d":
            kernel = settings.get("kernel", 3)
            stride = settings.get("stride", 1)
            if settings.get("padding", "valid") == "same":
                top, bottom = same_padding(height, kernel, stride)
                left, right = same_padding(width, kernel, stride)
                layers.append(nn.ZeroPad2d((left, right, top, bottom)))
                height = -(-height // stride)
                width = -(-width // stride)
            else:
                height = (height - kernel) // stride + 1
                width = (width - kernel) // stride + 1
            layers.append(
                nn.Conv2d(
                    channels,
                    settings["filters"],
                    kernel,
                    stride=stride,
                    bias=settings.get("use_bias", True),
                )
            )
            channels = settings["filters"]
        elif kind == "batch_norm":
            momentum = settings.get("momentum", 0.99)
            layers.append(
                nn.BatchNorm2d(channels, eps=settings.get("epsilon", 1e-3), momentum=1 - momentum)
            )
        elif kind == "relu":
            layers.append(nn.ReLU())
        elif kind == "global_avg_pool":
            layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
            height = width = 1
        elif kind == "dense":
            layers.append(nn.Linear(channels * height * width, settings["units"]))
            channels = settings["units"]
        else:
            sys.exit(f"layer {kind} is not part of the reference model")
    return nn.Sequential(*layers), spec["model"]["input_shape"], channels


def main():
    root = pathlib.Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default=str(root / "examples" / "resnet-cifar.toml"))
    parser.add_argument("--batch", type=int, default=None, help="defaults to the example's")
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default=None)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    arguments = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit("skipped: CUDA not available to torch")
    spec = tomllib.loads(pathlib.Path(arguments.example).read_text())
    batch = arguments.batch or spec["training"]["batch_size"]
    precision = arguments.precision or spec["training"].get("precision", "fp32")
    sgd = spec["training"]["optimizer"]["sgd"]

    torch.backends.cudnn.benchmark = True
    # Carve's fp32 runs without TF32, so the reference does too.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    model, (height, width, channels), classes = build_model(spec)
    model = model.to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=sgd["learning_rate"],
        momentum=sgd.get("momentum", 0.0),
        nesterov=sgd.get("nesterov", False),
        weight_decay=sgd.get("weight_decay", 0.0),
    )
    autocast_type = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    inputs = torch.randn(batch, channels, height, width, device=device).to(
        memory_format=torch.channels_last
    )
    labels = torch.randint(0, classes, (batch,), device=device)
    loss_function = nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=autocast_type, enabled=autocast_type is not None):
            loss = loss_function(model(inputs), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    for _ in range(arguments.warmup):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(arguments.steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    print(
        f"pytorch {torch.__version__} {torch.cuda.get_device_name()} "
        f"{pathlib.Path(arguments.example).stem} batch {batch} {precision}: "
        f"{arguments.steps * batch / seconds:.1f} samples/s "
        f"(loss {loss.item():.4f}, peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
