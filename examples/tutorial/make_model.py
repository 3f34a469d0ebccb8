"""Writes the tutorial's model (docs/tutorial.md): examples/tutorial/classifier.onnx, a
small PyTorch classifier of the 8x8 digits in examples/digits exported with torch.onnx,
plus two input folders:

- classifier.inputs/: input_0.pb (the first 8 digits) and output_0.pb, onnxruntime's
  output for them, to check that pipewright runs the export as onnxruntime does;
- sample/: input_0.pb only (the same 8 digits), to run a trained model on.

The model: 64 -> 64 -> 64 -> 10 (Linear, ReLU, Linear, ReLU, Linear), random weights from
seed 0, input `input` [batch, 64] float32 (the name of
the digits array, so the data file feeds it as it is), output `logits` [batch, 10], the batch axis
dynamic. Names are set in the export (`input_names`, `output_names`) so that the
tutorial's commands can name them.

Needs torch, onnx, onnxruntime, numpy. Run from the repository root:
    python3 examples/tutorial/make_model.py
"""
import os

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(os.path.dirname(here))
torch.manual_seed(0)

model = torch.nn.Sequential(
    torch.nn.Linear(64, 64), torch.nn.ReLU(),
    torch.nn.Linear(64, 64), torch.nn.ReLU(),
    torch.nn.Linear(64, 10),
).eval()

digits = np.load(os.path.join(root, "examples", "digits", "digits.npz"))
pixels = digits["input"][:8].astype(np.float32)

path = os.path.join(here, "classifier.onnx")
torch.onnx.export(
    model, (torch.from_numpy(pixels),), path,
    input_names=["input"], output_names=["logits"],
    dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
    opset_version=17, dynamo=False,  # the TorchScript exporter: no onnxscript needed
)
onnx.checker.check_model(onnx.load(path))

(logits,) = ort.InferenceSession(path).run(["logits"], {"input": pixels})
for folder, with_output in [("classifier.inputs", True), ("sample", False)]:
    d = os.path.join(here, folder)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "input_0.pb"), "wb") as f:
        f.write(numpy_helper.from_array(pixels, "input").SerializeToString())
    if with_output:
        with open(os.path.join(d, "output_0.pb"), "wb") as f:
            f.write(numpy_helper.from_array(logits, "logits").SerializeToString())
print(f"wrote {path} ({os.path.getsize(path)} bytes) and its input folders")
