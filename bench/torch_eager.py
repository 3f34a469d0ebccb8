#!/usr/bin/env python3
"""PyTorch-eager counterpart of `pipewright bench-step` (issue 3's fwd+bwd benchmark).

Runs MODEL.onnx as a torch.nn.Module executing the graph node by node with eager torch ops
(a minimal converter below: onnx2torch 1.5.15 has converters only up to about opset 17 and
fails on these opset-20 models: ReduceMean-18, Reshape-19 with allowzero=1, Split-18), feeds DIR/input_K.pb, and times `steps`
iterations of: forward (autograd on, eval mode), loss = sum over float outputs of
`output.sum()`, `loss.backward()`, zero the gradients in place. The trainable tensors
are pipewright's (`match_pipewright`): float initializers, except scalars (gpt2-tiny's
GELU exponent) and batch-baked masks, which pipewright keeps as constants.

Prints `torch-eager model=NAME median_ms=X mean_ms=Y threads=T`.
"""
import argparse
import glob
import os
import re
import statistics
import time

import onnx
import onnx.numpy_helper
import torch

import torch.nn.functional as F
from onnx import helper


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _pads2d(pads):
    b, e = pads[: len(pads) // 2], pads[len(pads) // 2 :]
    if list(b) != list(e):
        raise NotImplementedError(f"asymmetric pads {pads}")
    return list(b)


def _reshape(x, shape, allowzero):
    shape = shape.tolist()
    if not allowzero:
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return x.reshape(shape)


def _gemm(a, b, c=None, alpha=1.0, beta=1.0, transA=0, transB=0):
    a = a.t() if transA else a
    b = b.t() if transB else b
    y = a @ b
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c * beta if beta != 1.0 else c)
    return y


def _split(x, split=None, axis=0, num_outputs=None):
    if split is not None:
        return torch.split(x, split.tolist(), dim=axis)
    return torch.chunk(x, num_outputs, dim=axis)


def _conv(x, w, b=None, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), group=1, **_):
    return F.conv2d(x, w, b, stride=strides, padding=_pads2d(pads), dilation=dilations, groups=group)


def _maxpool(x, kernel_shape, strides=None, pads=(0, 0, 0, 0), dilations=(1, 1), ceil_mode=0, **_):
    return F.max_pool2d(x, kernel_shape, strides or kernel_shape, _pads2d(pads), dilations, bool(ceil_mode))


def _reduce_mean(x, axes=None, keepdims=1, **_):
    dims = list(range(x.dim())) if axes is None else axes.tolist()
    return x.mean(dim=dims, keepdim=bool(keepdims))


def _layer_norm(x, scale, bias=None, axis=-1, epsilon=1e-5, **_):
    axis = axis % x.dim()
    return F.layer_norm(x, x.shape[axis:], scale, bias, epsilon)


OPS = {
    "Conv": _conv,
    "Relu": lambda x: torch.relu(x),
    "MaxPool": _maxpool,
    "Add": lambda a, b: a + b,
    "Mul": lambda a, b: a * b,
    "MatMul": lambda a, b: a @ b,
    "Pow": lambda a, b: torch.pow(a, b),
    "Tanh": lambda x: torch.tanh(x),
    # pipewright's stage ONNX files write a fused GELU as opset 20's `Gelu` (bytes attribute).
    "Gelu": lambda x, approximate=b"none": F.gelu(x, approximate=approximate.decode() if isinstance(approximate, bytes) else approximate),
    "IsNaN": lambda x: torch.isnan(x),
    "Where": lambda c, a, b: torch.where(c, a, b),
    "ReduceMean": _reduce_mean,
    "Reshape": lambda x, s, allowzero=0: _reshape(x, s, allowzero),
    "Gemm": _gemm,
    "Gather": lambda x, i, axis=0: torch.index_select(x, axis, i.reshape(-1)).reshape(
        x.shape[:axis] + i.shape + x.shape[axis + 1 :]
    ),
    "LayerNormalization": _layer_norm,
    "Split": _split,
    "Transpose": lambda x, perm: x.permute(perm),
    "Softmax": lambda x, axis=-1: torch.softmax(x, axis),
}


class OnnxModule(torch.nn.Module):
    """Executes an ONNX graph node by node with eager torch ops; float initializers are
    parameters, the others (shapes, axes) constant buffers."""

    def __init__(self, model):
        super().__init__()
        g = model.graph
        self.params = torch.nn.ParameterDict()
        self.names = {}  # ONNX initializer name -> key in self.params / self.consts
        self.consts = {}
        for i, t in enumerate(g.initializer):
            a = torch.from_numpy(onnx.numpy_helper.to_array(t).copy())
            if a.is_floating_point():
                self.params[f"p{i}"] = torch.nn.Parameter(a)
                self.names[t.name] = ("p", f"p{i}")
            else:
                self.consts[t.name] = a
        inits = {t.name for t in g.initializer}
        self.inputs = [i.name for i in g.input if i.name not in inits]
        self.outputs = [o.name for o in g.output]
        self.nodes = []
        for n in g.node:
            if n.op_type not in OPS:
                raise NotImplementedError(f"op {n.op_type} (node {n.name})")
            attrs = _attrs(n)
            if n.op_type == "Gather" and "axis" not in attrs:
                attrs["axis"] = 0
            self.nodes.append((OPS[n.op_type], list(n.input), list(n.output), attrs))

    def forward(self, *xs):
        env = dict(self.consts)
        env.update({k: self.params[v] for k, (_, v) in self.names.items()})
        env.update(zip(self.inputs, xs))
        for fn, ins, outs, attrs in self.nodes:
            args = [env[i] if i else None for i in ins]
            while args and args[-1] is None:
                args.pop()
            r = fn(*args, **attrs)
            if isinstance(r, (tuple, list)):
                env.update(zip(outs, r))
            else:
                env[outs[0]] = r
        return [env[o] for o in self.outputs]


def read_inputs(d):
    files = sorted(glob.glob(os.path.join(d, "input_*.pb")), key=lambda p: int(re.findall(r"input_(\d+)\.pb$", p)[0]))
    out = []
    for p in files:
        t = onnx.TensorProto()
        with open(p, "rb") as f:
            t.ParseFromString(f.read())
        out.append((t.name, torch.from_numpy(onnx.numpy_helper.to_array(t).copy())))
    return out



def match_pipewright(module, export_batch, batch):
    """Makes constants of what pipewright does not train (scalars, batch-baked
    initializers); adapts the graph to `batch`."""
    for onnx_name, (_, key) in list(module.names.items()):
        p = module.params[key]
        if p.dim() == 0:
            # e.g. gpt2-tiny's GELU exponent (Pow(x, 3.0)): as a parameter its gradient,
            # x^3 * ln(x), is NaN for x < 0 and the first SGD step turns the model NaN.
            module.consts[onnx_name] = p.detach()
            del module.names[onnx_name]
            del module.params[key]
        elif p.dim() >= 3 and p.shape[0] == export_batch and export_batch > 1:
            t = p.detach()
            if batch != export_batch:
                if not all(torch.equal(t[0], t[i]) for i in range(1, t.shape[0])):
                    raise SystemExit(f"initializer {onnx_name}: batch-baked slices differ; cannot run at batch {batch}")
                t = t[:1]
            module.consts[onnx_name] = t
            del module.names[onnx_name]
            del module.params[key]
    if batch == export_batch:
        return

    def reshape(x, s, allowzero=0):
        s = s.tolist()
        if s and s[0] == export_batch:
            s[0] = batch
        elif s and -1 not in s and s[0] % export_batch == 0:
            s[0] = -1
        return _reshape(x, torch.tensor(s), allowzero)

    module.nodes = [(reshape if fn is OPS["Reshape"] else fn, i, o, a) for fn, i, o, a in module.nodes]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--train", action="store_true", help="train mode instead of eval mode")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    onnx_model = onnx.load(a.model)
    model = OnnxModule(onnx_model)
    model.train(a.train)
    graph_inputs0 = read_inputs(a.inputs)
    export_batch = graph_inputs0[0][1].shape[0] if graph_inputs0 and graph_inputs0[0][1].dim() > 0 else 1
    match_pipewright(model, export_batch, export_batch)
    params = list(model.parameters())
    trainable = len(params)

    graph_inputs = [i.name for i in onnx_model.graph.input if i.name not in {x.name for x in onnx_model.graph.initializer}]
    given = read_inputs(a.inputs)
    by_name = dict(given)
    feeds = [by_name[n] if n in by_name else given[k][1] for k, n in enumerate(graph_inputs)]

    def step():
        outs = model(*feeds)
        if isinstance(outs, torch.Tensor):
            outs = [outs]
        loss = sum(o.sum() for o in outs if o.is_floating_point())
        loss.backward()
        for p in params:
            if p.grad is not None:
                p.grad.zero_()

    for _ in range(a.warmup):
        step()
    ms = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    name = os.path.splitext(os.path.basename(a.model))[0]
    med, mean, threads = statistics.median(ms), statistics.fmean(ms), torch.get_num_threads()
    print(f"{name}: {trainable} trainable tensors, {len(ms)} steps after {a.warmup} warmup, torch {torch.__version__}")
    print(f"median {med:.3f} ms/step, mean {mean:.3f} ms/step, min {min(ms):.3f} ms, threads {threads}")
    print(f"torch-eager model={name} median_ms={med:.3f} mean_ms={mean:.3f} threads={threads}")


if __name__ == "__main__":
    main()
