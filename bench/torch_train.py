#!/usr/bin/env python3
"""PyTorch-eager counterpart of a single-stage `pipewright train` step (bench/train_eager.sh).

Runs MODEL.onnx op by op with eager torch ops (bench/torch_eager.py's OnnxModule) and times
`steps` training steps after `warmup`: forward, mean cross-entropy of output NAME against
the labels (logits [N, ..., C] flattened to [-1, C], as pipewright does), `backward()`,
`torch.optim.SGD.step()` (plain SGD, lr, no momentum), gradients reset, and the loss read
as a Python float (pipewright reads it every step too). Batches are consecutive slices of
the .npz written by bench/make_data.py (the file `pipewright train --data` reads), all
converted to tensors before timing.

Trainable tensors match pipewright's (bench/torch_eager.py trains every float initializer):
floating-point initializers of rank >= 1, except those of rank >= 3 whose leading extent is
the export batch (attention masks the exporter
evaluated; pipewright keeps them as constants). At a batch other than the export batch,
such constants keep one slice (they must repeat one slice), and Reshape targets that name
the export batch are rewritten as pipewright's lowering does (leading extent = the batch,
or -1 where it is a multiple of it) — enough for the shared models.

Prints `torch-train model=NAME median_ms=X mean_ms=Y threads=T batch=B`.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import onnx  # noqa: E402

import torch_eager  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--data", required=True, help=".npz from bench/make_data.py (inputs by name, `label`)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--output", required=True, help="the output the cross-entropy applies to")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--export-batch", type=int, default=2)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    onnx_model = onnx.load(a.model)
    model = torch_eager.OnnxModule(onnx_model)
    torch_eager.match_pipewright(model, a.export_batch, a.batch)
    model.train(True)
    params = list(model.parameters())
    out_idx = model.outputs.index(a.output)
    opt = torch.optim.SGD(params, lr=a.lr)

    npz = np.load(a.data)
    n = npz["label"].shape[0]
    nb = n // a.batch
    if nb == 0:
        raise SystemExit(f"{a.data}: {n} samples, fewer than one batch of {a.batch}")
    batches = []
    for b in range(nb):
        sl = slice(b * a.batch, (b + 1) * a.batch)
        batches.append(([torch.from_numpy(np.ascontiguousarray(npz[name][sl])) for name in model.inputs],
                        torch.from_numpy(np.ascontiguousarray(npz["label"][sl]))))

    def step(k):
        xs, y = batches[k % nb]
        out = model(*xs)[out_idx]
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    last_loss = float("nan")
    for k in range(a.warmup):
        last_loss = step(k)
    ms = []
    for k in range(a.warmup, a.warmup + a.steps):
        t0 = time.perf_counter()
        last_loss = step(k)
        ms.append((time.perf_counter() - t0) * 1e3)
    name = os.path.splitext(os.path.basename(a.model))[0]
    med, mean, threads = statistics.median(ms), statistics.fmean(ms), torch.get_num_threads()
    if not np.isfinite(last_loss):
        raise SystemExit(f"{name}: the loss is {last_loss} after {a.warmup + a.steps} steps")
    print(f"{name}: last loss {last_loss:.4f}, {len(params)} trainable tensors, batch {a.batch}, {len(ms)} steps after {a.warmup} warm-up, torch {torch.__version__}")
    print(f"torch-train model={name} median_ms={med:.3f} mean_ms={mean:.3f} threads={threads} batch={a.batch}")


if __name__ == "__main__":
    main()
