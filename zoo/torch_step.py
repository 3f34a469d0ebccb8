"""One SGD step of a zoo architecture in PyTorch: the reference `tests/torch_reference.rs`
holds pipewright's training to.

Builds ARCH as `zoo/make_zoo.py` does (same seed, so the same weights as its exports),
reads the entry's inputs (`input_K.pb`), takes the cross-entropy of the model's output
against fixed labels (`(7 * i + 3) % classes` over the output's leading axes, averaged
over all of them; written sample first where the output carries the batch further in),
takes one plain SGD step at LR, and writes to OUT:
  - `data.safetensors`: the inputs by name and `label`, for `pipewright train`;
  - `input_K.pb` and `output_0.pb`: the inputs and the output after the step, for
    `pipewright run-forward --inputs OUT`;
and prints the loss before the step.

The model is in eval mode, as exported, but for its BatchNorms: they take the step on the
batch's statistics and update their running ones, as pipewright trains them; the output
after the step is taken in eval mode throughout. Where the export has fewer
BatchNormalization nodes than the model has BatchNorms, the exporter fused the others into
the convolution before them (an eval-mode export; compile says so), and only those it kept
(their scale's initializer names the module) take the step so; a fused one stays in eval
mode with its scale frozen, as the fused graph trains it (the fused convolution's weight
trains as the convolution's: a fresh BatchNorm's scale and variance are ones).

    python zoo/torch_step.py ARCH ENTRY_FOLDER LR OUT
    python zoo/torch_step.py --serve

`--serve` takes one step per line of standard input, `ARCH<TAB>ENTRY_FOLDER<TAB>LR<TAB>OUT`,
and answers each with one line, `loss L` or `error: MESSAGE` (the traceback on standard
error): a test of many architectures then imports torch and transformers once instead of
once per architecture. Every step builds its model from the same seed, so a served step is
the step a process of its own takes.
"""
import os
import shutil
import sys
import traceback

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_zoo  # noqa: E402


def read_inputs(folder, names):
    arrays = []
    for k in range(len(names)):
        with open(os.path.join(folder, f"input_{k}.pb"), "rb") as f:
            t = numpy_helper.to_array(onnx.TensorProto.FromString(f.read()))
        arrays.append(t)
    return arrays


def training_batchnorms(model, entry):
    """The model's BatchNorms the export keeps as BatchNormalization nodes (every one, where
    it keeps as many); the scales of the others, fused by the exporter, are frozen."""
    everyone = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    graph = onnx.load(os.path.join(entry, "model.onnx"), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "BatchNormalization"]
    if len(nodes) >= len(everyone):
        return [m for _, m in everyone]
    kept = {n.input[1].rsplit(".", 1)[0] for n in nodes}
    for name, m in everyone:
        if name not in kept:
            m.weight.requires_grad_(False)
    return [m for name, m in everyone if name in kept]


def batch_axis(model, args):
    """The axis of the model's output that carries the batch: the one that doubles with its
    inputs (an eval-mode forward, which leaves every running statistic as it is)."""
    with torch.no_grad():
        once, twice = model(*args).shape, model(*[torch.cat([a, a]) for a in args]).shape
    return next((a for a, (x, y) in enumerate(zip(once, twice)) if y == 2 * x and x > 0), 0)


def step(arch, entry, lr, out):
    """Takes the step and writes OUT; returns the loss before the step."""
    model, inputs, _ = make_zoo.build(arch)
    names = list(inputs)
    arrays = read_inputs(entry, names)
    args = [torch.from_numpy(a) for a in arrays]
    axis = batch_axis(model, args)
    batchnorms = training_batchnorms(model, entry)
    for m in batchnorms:
        m.train()
    logits = model(*args)
    classes = logits.shape[-1]
    count = int(np.prod(logits.shape[:-1]))
    labels = torch.tensor([(7 * i + 3) % classes for i in range(count)], dtype=torch.int64).reshape(logits.shape[:-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(count, classes), labels.reshape(count))
    loss.backward()
    for m in batchnorms:
        m.eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
        after = model(*args)
    os.makedirs(out, exist_ok=True)
    tensors = {n: np.ascontiguousarray(a) for n, a in zip(names, arrays)}
    # `train --data` reads labels sample first.
    tensors["label"] = np.ascontiguousarray(labels.movedim(axis, 0).numpy())
    save_file(tensors, os.path.join(out, "data.safetensors"))
    for k in range(len(names)):
        shutil.copy(os.path.join(entry, f"input_{k}.pb"), os.path.join(out, f"input_{k}.pb"))
    with open(os.path.join(out, "output_0.pb"), "wb") as f:
        f.write(numpy_helper.from_array(after.numpy(), "output_0").SerializeToString())
    return loss.item()


def serve():
    for line in sys.stdin:
        try:
            arch, entry, lr, out = line.rstrip("\n").split("\t")
            print(f"loss {step(arch, entry, float(lr), out):.6f}", flush=True)
        except Exception as e:  # reported to the caller, which names the architecture
            traceback.print_exc()
            print(f"error: {type(e).__name__}: {e}".replace("\n", " "), flush=True)


def main():
    if sys.argv[1:] == ["--serve"]:
        serve()
        return
    arch, entry, lr, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    print(f"loss {step(arch, entry, lr, out):.6f}")


if __name__ == "__main__":
    main()
