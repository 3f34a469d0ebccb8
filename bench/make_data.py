#!/usr/bin/env python3
"""Writes a seeded random data set for MODEL.onnx as an .npz that both `pipewright train
--data FILE.npz --label label` and bench/torch_train.py read.

Usage: make_data.py MODEL.onnx -o OUT.npz [--samples N] [--seed S] [--int-high H] [--output NAME]

- one array per graph input (initializers excluded), named after it, shape
  [N, per-sample dims of the model's input]: floats standard normal (float32), integers
  uniform in [0, H) (H defaults to the class count below: the token ids of a language
  model whose output is over its vocabulary);
- `label`: int64 class labels uniform in [0, C), C = the last extent of output NAME
  (default: the first output), shape [N, the output's middle extents] — e.g. [N] for
  logits [N, C], [N, T] for per-token logits [N, T, C]. pipewright's `--data synthetic`
  only makes [N] labels (and all-zero token ids), which is why this exists.

Needs numpy and onnx (the bench venv).
"""
import argparse

import numpy as np
import onnx
from onnx import TensorProto


def dims(vi):
    return [d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--int-high", type=int)
    ap.add_argument("--output", help="the output the labels are for (default: the first)")
    a = ap.parse_args()

    g = onnx.load(a.model, load_external_data=False).graph
    inits = {t.name for t in g.initializer}
    out = next(o for o in g.output if a.output in (None, o.name))
    odims = dims(out)
    classes = odims[-1]
    if classes <= 0:
        raise SystemExit(f"output {out.name}: last extent {classes} is not fixed")
    rng = np.random.default_rng(a.seed)
    arrays = {}
    for i in g.input:
        if i.name in inits:
            continue
        per = dims(i)[1:]
        if any(d <= 0 for d in per):
            raise SystemExit(f"input {i.name}: per-sample shape {per} is not fixed")
        shape = [a.samples] + per
        et = i.type.tensor_type.elem_type
        if et == TensorProto.FLOAT:
            arrays[i.name] = rng.standard_normal(shape, dtype=np.float32)
        elif et in (TensorProto.INT64, TensorProto.INT32):
            dt = np.int64 if et == TensorProto.INT64 else np.int32
            arrays[i.name] = rng.integers(0, a.int_high or classes, size=shape, dtype=dt)
        else:
            raise SystemExit(f"input {i.name}: element type {et} not handled")
    arrays["label"] = rng.integers(0, classes, size=[a.samples] + odims[1:-1], dtype=np.int64)
    np.savez(a.out, **arrays)
    print(f"make_data: {a.out}: " + ", ".join(f"{k} {v.dtype}{list(v.shape)}" for k, v in arrays.items()))


if __name__ == "__main__":
    main()
