#!/usr/bin/env python3
"""Build examples/digits/digits.npz from the 8x8 digits data set scikit-learn ships.

Usage:
    pip download --no-deps scikit-learn -d /tmp/skl
    python3 examples/digits/make_npz.py /tmp/skl/scikit_learn-*.whl

The argument is either a scikit-learn wheel (the CSV is read from
sklearn/datasets/data/digits.csv.gz inside it) or that digits.csv.gz itself.
Needs numpy only. Writes `input` (f32 [1797, 64], pixels / 16, so in [0, 1]) and
`label` (i64 [1797], 0..9) with np.savez_compressed next to this script.
"""

import gzip
import io
import os
import sys
import zipfile

import numpy as np

MEMBER = "sklearn/datasets/data/digits.csv.gz"


def read_csv_gz(path):
    if path.endswith(".whl") or zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as whl:
            raw = whl.read(MEMBER)
    else:
        with open(path, "rb") as f:
            raw = f.read()
    text = gzip.decompress(raw).decode("ascii")
    return np.loadtxt(io.StringIO(text), delimiter=",", dtype=np.float64)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    data = read_csv_gz(sys.argv[1])
    assert data.shape == (1797, 65), data.shape
    pixels, labels = data[:, :64], data[:, 64]
    assert pixels.min() >= 0 and pixels.max() <= 16
    assert set(np.unique(labels).tolist()) == set(range(10))
    inp = (pixels / 16.0).astype("<f4")
    label = labels.astype("<i8")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.npz")
    np.savez_compressed(out, input=inp, label=label)
    print(f"wrote {out}: input {inp.dtype} {inp.shape}, label {label.dtype} {label.shape}")


if __name__ == "__main__":
    main()
