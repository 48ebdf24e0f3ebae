#!/usr/bin/env python3
"""A PyTorch training script as a user would submit it to Carve as a command job
(`examples/command/pytorch-resnet.toml`): a ResNet-style CNN (residual basic blocks,
ResNet-18's layout) on synthetic CIFAR-sized data (32x32x3, 10 classes), seeded.

The knobs Carve turns are ordinary flags: --batch-size (the micro-batch),
--accumulation-steps (gradients of that many micro-batches per optimizer step),
--precision fp32|bf16|fp16 (autocast; fp16 also scales the loss with GradScaler),
--grad-checkpointing (torch.utils.checkpoint around every residual block) and
--checkpoint-dir (model, optimizer, scaler, step and RNG states saved there and resumed
from). When it runs out of memory it dies with PyTorch's own OutOfMemoryError, as any
script does; Carve reads that (or the guard's record) and retries it with a smaller
micro-batch and more accumulation steps, which keep the effective batch.

What it writes for people and checks:
- a `CARVE_PROGRESS step=.. total_steps=.. loss=.. samples_per_s=..` line per optimizer
  step on stdout (Carve turns these into progress reports);
- `<checkpoint-dir>/losses.csv`: `step,loss,micro_batch,accumulation_steps,precision`,
  one row per optimizer step (rows past the checkpoint it resumed from are dropped), so a
  run with accumulation can be compared with one without;
- a last line `train: done ... peak_reserved_bytes=N peak_allocated_bytes=N`.

Every optimizer step sees the same samples whatever the micro-batch: step s takes the
first global-batch indices of a permutation seeded by (seed, s), cut into micro-batches
in order. The default normalization is GroupNorm, which (unlike BatchNorm) does not mix
the samples of a micro-batch, so accumulation computes the same gradients as one big
batch up to float rounding; `--norm batch` is there for the classic ResNet.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as functional
from torch import nn
from torch.utils.checkpoint import checkpoint as checkpointed

CHECKPOINT_FILE = "checkpoint.pt"
LOSSES_FILE = "losses.csv"
CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def normalization(kind, channels):
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(min(32, channels // 4), channels)


class BasicBlock(nn.Module):
    """conv3x3-norm-relu-conv3x3-norm, plus the input (projected when the shape changes)."""

    def __init__(self, inputs, outputs, stride, norm):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.norm1 = normalization(norm, outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.norm2 = normalization(norm, outputs)
        self.shortcut = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), normalization(norm, outputs)
            )

    def forward(self, x):
        y = functional.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return functional.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width, blocks_per_stage, norm, recompute):
        super().__init__()
        self.recompute = recompute
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), normalization(norm, width), nn.ReLU()
        )
        blocks = []
        channels = width
        for stage in range(4):
            outputs = width * 2**stage
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(channels, outputs, stride, norm))
                channels = outputs
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(channels, CLASSES)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            if self.recompute and self.training:
                # Keeps only the block's input; its insides are recomputed in backward.
                x = checkpointed(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = functional.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


def synthetic_dataset(samples, seed):
    """Images = a per-class pattern + noise, so the loss has something to learn."""
    generator = torch.Generator().manual_seed(seed)
    templates = torch.randn((CLASSES, *IMAGE_SHAPE), generator=generator)
    labels = torch.randint(0, CLASSES, (samples,), generator=generator)
    noise = torch.randn((samples, *IMAGE_SHAPE), generator=generator)
    images = 0.5 * templates[labels] + noise
    return images, labels


def step_indices(step, samples, global_batch, seed):
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randperm(samples, generator=generator)[:global_batch]


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, required=True, help="the micro-batch")
    parser.add_argument("--accumulation-steps", type=int, default=1)
    parser.add_argument("--global-batch", type=int, help="checked: batch x accumulation")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps in all")
    parser.add_argument("--grad-checkpointing", action="store_true")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=8192, help="synthetic dataset size")
    parser.add_argument("--width", type=int, default=64, help="channels of the first stage")
    parser.add_argument("--blocks-per-stage", type=int, default=2)
    parser.add_argument("--norm", choices=["group", "batch"], default="group")
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    arguments = parser.parse_args(argv)
    global_batch = arguments.batch_size * arguments.accumulation_steps
    if arguments.global_batch is not None and arguments.global_batch != global_batch:
        parser.error(
            f"--batch-size {arguments.batch_size} x --accumulation-steps "
            f"{arguments.accumulation_steps} is not --global-batch {arguments.global_batch}"
        )
    if global_batch > arguments.samples:
        parser.error(f"the global batch {global_batch} is larger than --samples")
    return arguments


def gradient_scaler(device, enabled):
    """torch.amp.GradScaler (PyTorch 2.3 and later), else the older CUDA-only one."""
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device.type, enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled and device.type == "cuda")


def save_checkpoint(path, model, optimizer, scaler, step):
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    temporary = path + ".tmp"
    torch.save(state, temporary)
    os.replace(temporary, path)


def resume(path, model, optimizer, scaler):
    """The step the checkpoint at `path` was written at (0 without one)."""
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    return state["step"]


def open_losses(path, resumed_step):
    """losses.csv for appending, without the rows of steps after `resumed_step` (they
    are trained again)."""
    rows = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            rows = [
                line
                for line in file.read().splitlines()[1:]
                if line and int(line.split(",")[0]) <= resumed_step
            ]
    file = open(path, "w", encoding="utf-8")
    file.write("step,loss,micro_batch,accumulation_steps,precision\n")
    for row in rows:
        file.write(row + "\n")
    file.flush()
    return file


def train(arguments):
    torch.manual_seed(arguments.seed)
    device = torch.device(arguments.device)
    os.makedirs(arguments.checkpoint_dir, exist_ok=True)
    # On the host, as a data loader's would be: each micro-batch is copied over.
    images, labels = synthetic_dataset(arguments.samples, arguments.seed)
    model = ResNet(
        arguments.width, arguments.blocks_per_stage, arguments.norm, arguments.grad_checkpointing
    ).to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=arguments.learning_rate, momentum=0.9, weight_decay=5e-4
    )
    dtype = PRECISIONS[arguments.precision]
    scaler = gradient_scaler(device, enabled=arguments.precision == "fp16")
    checkpoint_path = os.path.join(arguments.checkpoint_dir, CHECKPOINT_FILE)
    first_step = resume(checkpoint_path, model, optimizer, scaler) + 1
    if first_step > 1:
        print(f"train: resumed from step {first_step - 1}", flush=True)
    losses = open_losses(os.path.join(arguments.checkpoint_dir, LOSSES_FILE), first_step - 1)
    micro, accumulation = arguments.batch_size, arguments.accumulation_steps
    global_batch = micro * accumulation
    model.train()
    for step in range(first_step, arguments.steps + 1):
        started = time.monotonic()
        indices = step_indices(step, arguments.samples, global_batch, arguments.seed)
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        for part in range(accumulation):
            chosen = indices[part * micro : (part + 1) * micro]
            x = images[chosen].to(device)
            y = labels[chosen].to(device)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                # The mean over the micro-batch, divided by the accumulation steps: the
                # summed gradients are those of the mean over the global batch.
                loss = functional.cross_entropy(model(x), y) / accumulation
            scaler.scale(loss).backward()
            step_loss += loss.detach().float()
        scaler.step(optimizer)
        scaler.update()
        loss_value = step_loss.item()  # also waits for the step to finish
        elapsed = max(time.monotonic() - started, 1e-9)
        losses.write(f"{step},{loss_value:.6f},{micro},{accumulation},{arguments.precision}\n")
        losses.flush()
        if step % arguments.checkpoint_every == 0 or step == arguments.steps:
            save_checkpoint(checkpoint_path, model, optimizer, scaler, step)
        print(
            f"CARVE_PROGRESS step={step} total_steps={arguments.steps} loss={loss_value:.4f} "
            f"samples_per_s={global_batch / elapsed:.1f}",
            flush=True,
        )
    losses.close()
    peaks = ""
    if device.type == "cuda":
        peaks = (
            f" peak_reserved_bytes={torch.cuda.max_memory_reserved(device)}"
            f" peak_allocated_bytes={torch.cuda.max_memory_allocated(device)}"
        )
    print(
        f"train: done step={arguments.steps} micro_batch={micro} "
        f"accumulation_steps={accumulation} precision={arguments.precision}{peaks}",
        flush=True,
    )


if __name__ == "__main__":
    train(parse_arguments(sys.argv[1:]))
