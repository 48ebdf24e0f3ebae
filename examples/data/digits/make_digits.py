"""Writes the handwritten digits data set of `examples/digits-resnet.toml` as `.npy` files.

The source is the UCI "Optical Recognition of Handwritten Digits" test set as scikit-learn
ships it (`sklearn/datasets/data/digits.csv.gz`: 1797 rows of 64 pixels in 0..16, then the
label). Run once, commit the output (the tests need no Python and no NumPy):

    pip download scikit-learn==1.9.1 --no-deps -d /tmp/sklearn
    python3 examples/data/digits/make_digits.py /tmp/sklearn/scikit_learn-*.whl

The argument may also be the `digits.csv.gz` itself. Only the standard library is used.
The images are written as they are, uint8 in NHWC order, shape (N, 8, 8, 1), and the
labels as uint8, shape (N,): the engine's npy reader converts both. The first 1500 rows
are the training split and the last 297 the test split, in the file's order (the test
rows were never trained on).
"""

import csv
import gzip
import hashlib
import io
import os
import struct
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
MEMBER = "sklearn/datasets/data/digits.csv.gz"
# The bytes this directory's files were made from (scikit-learn 1.9.1); any other copy is
# refused so the committed files stay reproducible.
SOURCE_SHA256 = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"
ROWS = 1797
PIXELS = 64
TRAIN_ROWS = 1500


def read_source(path):
    if path.endswith(".whl") or zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as wheel:
            return wheel.read(MEMBER)
    with open(path, "rb") as source:
        return source.read()


def parse_rows(compressed):
    digest = hashlib.sha256(compressed).hexdigest()
    if digest != SOURCE_SHA256:
        sys.exit(f"digits.csv.gz has sha256 {digest}, expected {SOURCE_SHA256}")
    text = gzip.decompress(compressed).decode("ascii")
    rows = []
    for fields in csv.reader(io.StringIO(text)):
        values = [int(float(field)) for field in fields]
        assert len(values) == PIXELS + 1, fields
        pixels, label = values[:PIXELS], values[PIXELS]
        assert all(0 <= pixel <= 16 for pixel in pixels), fields
        assert 0 <= label <= 9, fields
        rows.append((pixels, label))
    assert len(rows) == ROWS, len(rows)
    return rows


def write_npy(path, shape, values):
    """A version 1.0 `.npy` file of uint8 `values`, as `numpy.save` writes it."""
    dimensions = ", ".join(str(size) for size in shape)
    if len(shape) == 1:
        dimensions += ","
    header = f"{{'descr': '|u1', 'fortran_order': False, 'shape': ({dimensions}), }}"
    # NumPy pads the header with spaces and a newline so the data starts 64-byte aligned.
    padding = -(10 + len(header) + 1) % 64
    header = (header + " " * padding + "\n").encode("ascii")
    with open(path, "wb") as output:
        output.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header)
        output.write(bytes(values))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rows = parse_rows(read_source(sys.argv[1]))
    for split, chosen in (("train", rows[:TRAIN_ROWS]), ("test", rows[TRAIN_ROWS:])):
        images = [pixel for pixels, _ in chosen for pixel in pixels]
        labels = [label for _, label in chosen]
        write_npy(os.path.join(HERE, f"{split}-images.npy"), (len(chosen), 8, 8, 1), images)
        write_npy(os.path.join(HERE, f"{split}-labels.npy"), (len(chosen),), labels)
        counts = [labels.count(digit) for digit in range(10)]
        print(f"{split}: {len(chosen)} samples, per class {counts}")


if __name__ == "__main__":
    main()
