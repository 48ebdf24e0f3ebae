"""Writes the Keras fixtures of `carve import keras` from the real `keras` package.

Run once, commit the output (the tests need no Python):

    pip install keras "jax[cpu]"
    KERAS_BACKEND=jax python cli/tests/keras/generate_fixtures.py

Each model is written as `model.to_json()` (`<name>.json`); `fixtures.json` records what
Keras itself says of it (`count_params()`, the Keras version), which the tests compare
with Carve's import. `tiny.keras` is a whole saved model, to test reading the zip.
"""

import json
import os

import keras
from keras import layers

HERE = os.path.dirname(os.path.abspath(__file__))


def sequential_cnn():
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            layers.Conv2D(16, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(2),
            layers.BatchNormalization(),
            layers.Dropout(0.25),
            layers.Conv2D(32, 3, use_bias=False),
            layers.Activation("tanh"),
            layers.AveragePooling2D(2),
            layers.Flatten(),
            layers.Dense(32, activation="gelu"),
            layers.Dense(10, activation="softmax"),
        ],
        name="sequential_cnn",
    )


def basic_block(x, filters, stride, name):
    shortcut = x
    y = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False, name=f"{name}_conv1")(x)
    y = layers.BatchNormalization(name=f"{name}_bn1")(y)
    y = layers.ReLU(name=f"{name}_relu1")(y)
    y = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv2")(y)
    y = layers.BatchNormalization(name=f"{name}_bn2")(y)
    if stride != 1 or x.shape[-1] != filters:
        shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False, name=f"{name}_shortcut")(x)
        shortcut = layers.BatchNormalization(name=f"{name}_shortcut_bn")(shortcut)
    y = layers.Add(name=f"{name}_add")([y, shortcut])
    return layers.ReLU(name=f"{name}_out")(y)


def resnet18_cifar():
    inputs = keras.Input((32, 32, 3), name="image")
    x = layers.Conv2D(64, 3, padding="same", use_bias=False, name="stem_conv")(inputs)
    x = layers.BatchNormalization(name="stem_bn")(x)
    x = layers.ReLU(name="stem_relu")(x)
    for stage, (filters, stride) in enumerate([(64, 1), (128, 2), (256, 2), (512, 2)]):
        x = basic_block(x, filters, stride, f"stage{stage + 1}_block1")
        x = basic_block(x, filters, 1, f"stage{stage + 1}_block2")
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(10, activation="softmax", name="classifier")(x)
    return keras.Model(inputs, outputs, name="resnet18_cifar")


def branches():
    """Every other mapped layer: concat of branches, depthwise with a multiplier, padding."""
    inputs = keras.Input((16, 16, 3))
    x = layers.ZeroPadding2D(((0, 1), (0, 1)))(inputs)
    x = layers.DepthwiseConv2D(3, strides=2, depth_multiplier=2)(x)
    x = layers.ReLU(max_value=6.0)(x)
    a = layers.Conv2D(8, 1, activation="sigmoid")(x)
    b = layers.Conv2D(8, 3, padding="same")(x)
    b = layers.LeakyReLU(negative_slope=0.1)(b)
    c = layers.MaxPooling2D(3, strides=1, padding="same")(x)
    x = layers.Concatenate()([a, b, c])
    x = layers.Activation("relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(5)(x)
    return keras.Model(inputs, outputs, name="branches")


def tf_seed(name, size, deep):
    model = [keras.Input((size, size, 3))]
    if deep:
        for filters, pool in [(256, False), (256, True), (512, False), (512, True), (1024, False), (1024, False)]:
            model += [layers.Conv2D(filters, 3, padding="same"), layers.BatchNormalization(), layers.ReLU()]
            if pool:
                model.append(layers.MaxPooling2D(2))
        model += [layers.GlobalAveragePooling2D(), layers.Dropout(0.5), layers.Dense(100, activation="softmax")]
    else:
        model += [layers.Conv2D(32, 3, padding="same", activation="relu"), layers.GlobalAveragePooling2D(), layers.Dense(10, activation="softmax")]
    return keras.Sequential(model, name=name)


def tiny():
    return keras.Sequential(
        [keras.Input((8, 8, 1)), layers.Conv2D(4, 3, activation="relu"), layers.Flatten(), layers.Dense(3)],
        name="tiny",
    )


MODELS = {
    "sequential_cnn": sequential_cnn,
    "resnet18_cifar": resnet18_cifar,
    "branches": branches,
    "resnet50": lambda: keras.applications.ResNet50(weights=None),
    "mobilenetv2": lambda: keras.applications.MobileNetV2(weights=None),
    "vgg16": lambda: keras.applications.VGG16(weights=None),
    "tf_conv2d_1024px": lambda: tf_seed("tf_conv2d_1024px", 1024, False),
    "tf_conv2d_128px": lambda: tf_seed("tf_conv2d_128px", 128, False),
    "tf_deep_cnn_128px": lambda: tf_seed("tf_deep_cnn_128px", 128, True),
}


def main():
    manifest = {"keras_version": keras.__version__, "backend": keras.backend.backend(), "models": {}}
    for name, build in MODELS.items():
        model = build()
        with open(os.path.join(HERE, f"{name}.json"), "w") as file:
            file.write(model.to_json())
        manifest["models"][name] = {"count_params": int(model.count_params()), "layers": len(model.layers)}
    model = tiny()
    model.save(os.path.join(HERE, "tiny.keras"))
    manifest["models"]["tiny"] = {"count_params": int(model.count_params()), "layers": len(model.layers), "file": "tiny.keras"}
    with open(os.path.join(HERE, "fixtures.json"), "w") as file:
        json.dump(manifest, file, indent=2, sort_keys=True)
        file.write("\n")


if __name__ == "__main__":
    main()
