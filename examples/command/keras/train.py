#!/usr/bin/env python3
"""A Keras script reproducing a seed case, as a user would submit it to Carve as a
command job (`examples/command/keras-conv2d-1024px.toml`): one Conv2D(32) on 1024x1024x3
images at batch 32, the model of the TensorFlow reports that die with "OOM when allocating
tensor with shape[32,32,1024,1024]" on a small GPU (`examples/tf-conv2d-*.toml` are the
same model as Carve model jobs).

It trains with `model.fit` and a custom `train_step` that does gradient accumulation:
each step of the fit loop receives the global batch and runs it as --accumulation-steps
micro-batches of --batch-size, one after the other (each micro-batch's input waits for
the previous one's gradients, so their activations are never alive together), summing
the gradients before one optimizer step. --precision fp16|bf16 sets Keras' mixed
precision policy (mixed_float16 with loss scaling, or mixed_bfloat16); the logits stay
float32. --checkpoint-dir holds a tf.train.Checkpoint (model, optimizer, step) written
every --checkpoint-every steps and resumed from.

Like `examples/command/pytorch/train.py` it prints a `CARVE_PROGRESS step=.. total_steps=..
loss=.. samples_per_s=..` line per optimizer step and writes `<checkpoint-dir>/losses.csv`
(`step,loss,micro_batch,accumulation_steps,precision`). The data is synthetic and
seeded per step (a per-class pattern plus noise), so every optimizer step sees the same
samples whatever the micro-batch.

Works with tf.keras 2 and Keras 3 (TensorFlow backend). Runs on GPU machines.
"""

import argparse
import os
import sys
import time

import tensorflow as tf

keras = tf.keras

CLASSES = 10
LOSSES_FILE = "losses.csv"
POLICIES = {"fp32": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}


class AccumulatingConvNet(keras.Model):
    """Conv2D(32, 3x3, same) -> ReLU -> global average pooling -> Dense(10)."""

    def __init__(self, micro_batch, accumulation_steps, loss_scaling):
        super().__init__()
        self.conv = keras.layers.Conv2D(32, 3, padding="same")
        self.relu = keras.layers.ReLU()
        self.pool = keras.layers.GlobalAveragePooling2D()
        # float32 logits under a mixed policy, for a stable softmax.
        self.head = keras.layers.Dense(CLASSES, dtype="float32")
        self.micro_batch = micro_batch
        self.accumulation_steps = accumulation_steps
        self.loss_scaling = loss_scaling

    def call(self, images, training=False):
        return self.head(self.pool(self.relu(self.conv(images))))

    def _scaled(self, loss):
        if not self.loss_scaling:
            return loss
        if hasattr(self.optimizer, "scale_loss"):  # Keras 3
            return self.optimizer.scale_loss(loss)
        return self.optimizer.get_scaled_loss(loss)  # tf.keras 2

    def _unscaled(self, gradients):
        # Keras 3's LossScaleOptimizer unscales in apply_gradients; tf.keras 2's wants
        # unscaled gradients.
        if self.loss_scaling and hasattr(self.optimizer, "get_unscaled_gradients"):
            return self.optimizer.get_unscaled_gradients(gradients)
        return gradients

    def train_step(self, data):
        images, labels = data
        variables = self.trainable_variables
        summed = None
        total_loss = tf.constant(0.0, tf.float32)
        for part in range(self.accumulation_steps):
            start = part * self.micro_batch
            # The next micro-batch starts after this one's gradients exist: without the
            # dependency the graph may run every forward pass at once.
            after = [] if summed is None else [g for g in summed if g is not None]
            with tf.control_dependencies(after):
                x = tf.identity(images[start : start + self.micro_batch])
                y = tf.identity(labels[start : start + self.micro_batch])
            with tf.GradientTape() as tape:
                logits = self(x, training=True)
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
                )
                # The mean over the micro-batch over the accumulation steps: the summed
                # gradients are those of the mean over the global batch.
                loss = loss / self.accumulation_steps
                scaled = self._scaled(loss)
            gradients = self._unscaled(tape.gradient(scaled, variables))
            if summed is None:
                summed = list(gradients)
            else:
                summed = [a + g for a, g in zip(summed, gradients)]
            total_loss += loss
        self.optimizer.apply_gradients(zip(summed, variables))
        return {"loss": total_loss}


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


def synthetic_batches(first_step, last_step, global_batch, size, seed):
    """The global batch of every step from first_step to last_step: a per-class pattern
    plus noise, seeded by (seed, step)."""
    templates = tf.random.stateless_normal([CLASSES, size, size, 3], seed=[seed, -1])

    def batch(step):
        labels = tf.random.stateless_uniform(
            [global_batch], seed=[seed + 1, step], maxval=CLASSES, dtype=tf.int32
        )
        noise = tf.random.stateless_normal([global_batch, size, size, 3], seed=[seed, step])
        return 0.5 * tf.gather(templates, labels) + noise, labels

    steps = tf.data.Dataset.range(first_step, last_step + 1)
    return steps.map(batch).prefetch(1)


class Reporting(keras.callbacks.Callback):
    """CARVE_PROGRESS lines, losses.csv and the checkpoints, per optimizer step."""

    def __init__(self, arguments, manager, step, losses):
        super().__init__()
        self.arguments = arguments
        self.manager = manager
        self.step = step
        self.losses = losses
        self.started = time.monotonic()

    def on_train_batch_begin(self, batch, logs=None):
        self.started = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        arguments = self.arguments
        self.step.assign_add(1)
        step = int(self.step.numpy())
        loss = float(logs["loss"])
        global_batch = arguments.batch_size * arguments.accumulation_steps
        elapsed = max(time.monotonic() - self.started, 1e-9)
        self.losses.write(
            f"{step},{loss:.6f},{arguments.batch_size},{arguments.accumulation_steps},"
            f"{arguments.precision}\n"
        )
        self.losses.flush()
        if step % arguments.checkpoint_every == 0 or step == arguments.steps:
            self.manager.save(checkpoint_number=step)
        print(
            f"CARVE_PROGRESS step={step} total_steps={arguments.steps} loss={loss:.4f} "
            f"samples_per_s={global_batch / elapsed:.1f}",
            flush=True,
        )


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


def main(arguments):
    for gpu in tf.config.list_physical_devices("GPU"):
        # Allocate as needed instead of taking (the guard's) whole free memory up front.
        tf.config.experimental.set_memory_growth(gpu, True)
    keras.utils.set_random_seed(arguments.seed)
    keras.mixed_precision.set_global_policy(POLICIES[arguments.precision])
    os.makedirs(arguments.checkpoint_dir, exist_ok=True)
    loss_scaling = arguments.precision == "fp16"
    model = AccumulatingConvNet(arguments.batch_size, arguments.accumulation_steps, loss_scaling)
    model.build((None, arguments.image_size, arguments.image_size, 3))
    optimizer = keras.optimizers.Adam(learning_rate=arguments.learning_rate)
    if loss_scaling:
        optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
    try:
        # Creates the slot variables now, so a checkpoint restores them at once (Keras 3
        # and tf.keras 2.11+); older optimizers restore them when they are created.
        optimizer.build(model.trainable_variables)
    except (AttributeError, NotImplementedError, ValueError, TypeError):
        pass
    model.compile(optimizer=optimizer)

    step = tf.Variable(0, dtype=tf.int64, trainable=False)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
    manager = tf.train.CheckpointManager(checkpoint, arguments.checkpoint_dir, max_to_keep=2)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).expect_partial()
        print(f"train: resumed from step {int(step)}", flush=True)
    done = int(step)
    losses = open_losses(os.path.join(arguments.checkpoint_dir, LOSSES_FILE), done)
    if done < arguments.steps:
        global_batch = arguments.batch_size * arguments.accumulation_steps
        batches = synthetic_batches(
            done + 1, arguments.steps, global_batch, arguments.image_size, arguments.seed
        )
        model.fit(
            batches,
            epochs=1,
            steps_per_epoch=arguments.steps - done,
            callbacks=[Reporting(arguments, manager, step, losses)],
            verbose=0,
        )
    losses.close()
    print(
        f"train: done step={int(step)} micro_batch={arguments.batch_size} "
        f"accumulation_steps={arguments.accumulation_steps} precision={arguments.precision}",
        flush=True,
    )


if __name__ == "__main__":
    main(parse_arguments(sys.argv[1:]))
