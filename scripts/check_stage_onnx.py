#!/usr/bin/env python3
"""Chains the stage ONNX files that `pipewright compile` wrote through onnxruntime and
compares the result with the model's stored reference outputs.

Usage: check_stage_onnx.py BUILD_DIR INPUTS_DIR
  BUILD_DIR   holds pipeline.toml and stageK.onnx (from `pipewright compile --stage-onnx`)
  INPUTS_DIR  holds input_K.pb / output_K.pb (e.g. ../shared/corpus/models/NAME.inputs)

Needs onnx and onnxruntime (pip). Exits non-zero on a mismatch (max abs error above 1e-4
of the output's largest magnitude).
"""
import sys
import tomllib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper


def load_tensors(folder: Path, prefix: str):
    files = sorted(folder.glob(f"{prefix}_*.pb"), key=lambda p: int(p.stem.split("_")[-1]))
    out = []
    for f in files:
        t = onnx.TensorProto()
        t.ParseFromString(f.read_bytes())
        out.append((t.name, numpy_helper.to_array(t)))
    return out


def main() -> int:
    build, inputs = Path(sys.argv[1]), Path(sys.argv[2])
    manifest = tomllib.loads((build / "pipeline.toml").read_text())
    values = dict(load_tensors(inputs, "input"))
    produced = {}
    for stage in manifest["stage"]:
        if "onnx" not in stage:
            print(f"{build}: stage {stage['index']} has no ONNX file: compile with --stage-onnx", file=sys.stderr)
            return 1
        sess = ort.InferenceSession(str(build / stage["onnx"]), providers=["CPUExecutionProvider"])
        feeds = {i.name: values[i.name] for i in sess.get_inputs()}
        names = [o.name for o in sess.get_outputs()]
        for name, value in zip(names, sess.run(names, feeds)):
            values[name] = value
            produced[name] = value
    worst = 0.0
    for name, expected in load_tensors(inputs, "output"):
        got = produced.get(name)
        if got is None:
            print(f"output {name!r} was not produced by any stage")
            return 1
        err = float(np.max(np.abs(got.astype(np.float64) - expected))) / max(float(np.max(np.abs(expected))), 1e-30)
        worst = max(worst, err)
        print(f"output {name!r}: max abs error / max |expected| = {err:.3e}")
    ok = worst <= 1e-4
    print("stage ONNX chain matches the reference" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
