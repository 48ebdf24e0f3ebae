#!/usr/bin/env python3
"""The Keras seed case of `keras/train.py` (Conv2D(32) on 1024x1024x3 images at batch 32)
written against Keras 3 alone, so it runs on any Keras backend: `KERAS_BACKEND=jax`
where JAX is installed and TensorFlow is not. Same command line, progress lines and
losses.csv as `keras/train.py`, so `examples/command/keras-conv2d-1024px.toml` runs it
with `--set command.argv[1]=keras/train_keras3.py --set command.env.KERAS_BACKEND=jax`
(engine/benches/gpu_check.sh's `keras` step does).

Gradient accumulation is Keras 3's own (`gradient_accumulation_steps` on the optimizer):
each micro-batch is one `train_on_batch`, and the optimizer applies the summed
gradients every --accumulation-steps of them, so an optimizer step sees the same
samples whatever the micro-batch. --precision fp16|bf16 sets the mixed policy (fp16 with
Keras' loss scaling). Checkpoints are the weights and the step in an `.npz` file (plain
SGD keeps no optimizer state), so no h5py is needed. The data is synthetic and seeded
per step with numpy.
"""

import argparse
import os
import sys
import time

import numpy as np

import keras

CLASSES = 10
LOSSES_FILE = "losses.csv"
CHECKPOINT_FILE = "checkpoint.npz"
POLICIES = {"fp32": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, required=True, help="the micro-batch")
    parser.add_argument("--accumulation-steps", type=int, default=1)
    parser.add_argument("--global-batch", type=int, help="checked: batch x accumulation")
    parser.add_argument("--precision", choices=sorted(POLICIES), default="fp32")
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps in all")
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--image-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning-rate", type=float, default=0.001)
    arguments = parser.parse_args(argv)
    global_batch = arguments.batch_size * arguments.accumulation_steps
    if arguments.global_batch is not None and arguments.global_batch != global_batch:
        parser.error(
            f"--batch-size {arguments.batch_size} x --accumulation-steps "
            f"{arguments.accumulation_steps} is not --global-batch {arguments.global_batch}"
        )
    return arguments


def model_for(arguments):
    keras.mixed_precision.set_global_policy(POLICIES[arguments.precision])
    size = arguments.image_size
    model = keras.Sequential(
        [
            keras.Input((size, size, 3)),
            keras.layers.Conv2D(32, 3, padding="same"),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(),
            # float32 logits under a mixed policy, for a stable softmax.
            keras.layers.Dense(CLASSES, dtype="float32"),
        ]
    )
    optimizer = keras.optimizers.SGD(
        learning_rate=arguments.learning_rate,
        gradient_accumulation_steps=(
            arguments.accumulation_steps if arguments.accumulation_steps > 1 else None
        ),
    )
    if arguments.precision == "fp16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def global_batch_of(step, arguments, templates):
    """Step `step`'s global batch: a per-class pattern plus noise, seeded by (seed, step)."""
    generator = np.random.default_rng([arguments.seed, step])
    global_batch = arguments.batch_size * arguments.accumulation_steps
    labels = generator.integers(0, CLASSES, global_batch).astype("int32")
    noise = generator.standard_normal(templates.shape[1:], dtype=np.float32)
    images = 0.5 * templates[labels] + noise
    return images.astype(np.float32), labels


def main(arguments):
    keras.utils.set_random_seed(arguments.seed)
    os.makedirs(arguments.checkpoint_dir, exist_ok=True)
    model = model_for(arguments)
    checkpoint = os.path.join(arguments.checkpoint_dir, CHECKPOINT_FILE)
    step = 0
    if os.path.exists(checkpoint):
        saved = np.load(checkpoint)
        step = int(saved["step"])
        model.set_weights([saved[f"w{index}"] for index in range(len(model.weights))])
        print(f"resumed at step {step} from {checkpoint}", flush=True)
    losses = open_losses(os.path.join(arguments.checkpoint_dir, LOSSES_FILE), step)
    size = arguments.image_size
    templates = np.random.default_rng([arguments.seed, 1 << 31]).standard_normal(
        (CLASSES, size, size, 3), dtype=np.float32
    )
    print(
        f"keras {keras.__version__} backend {keras.backend.backend()}, micro-batch "
        f"{arguments.batch_size} x {arguments.accumulation_steps}, {arguments.precision}",
        flush=True,
    )
    while step < arguments.steps:
        started = time.monotonic()
        images, labels = global_batch_of(step + 1, arguments, templates)
        total = 0.0
        for part in range(arguments.accumulation_steps):
            start = part * arguments.batch_size
            end = start + arguments.batch_size
            loss = model.train_on_batch(images[start:end], labels[start:end])
            total += float(np.asarray(loss).reshape(-1)[0]) / arguments.accumulation_steps
        step += 1
        elapsed = max(time.monotonic() - started, 1e-9)
        losses.write(
            f"{step},{total:.6f},{arguments.batch_size},{arguments.accumulation_steps},"
            f"{arguments.precision}\n"
        )
        losses.flush()
        if step % arguments.checkpoint_every == 0 or step == arguments.steps:
            weights = {f"w{index}": value for index, value in enumerate(model.get_weights())}
            partial = checkpoint + ".partial.npz"
            np.savez(partial, step=step, **weights)
            os.replace(partial, checkpoint)
        print(
            f"CARVE_PROGRESS step={step} total_steps={arguments.steps} loss={total:.4f} "
            f"samples_per_s={len(labels) / elapsed:.1f}",
            flush=True,
        )
    return 0


def open_losses(path, resumed_step):
    """losses.csv for appending, without the rows after `resumed_step`."""
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


if __name__ == "__main__":
    sys.exit(main(parse_arguments(sys.argv[1:])))
