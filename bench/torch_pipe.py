#!/usr/bin/env python3
"""torch.distributed.pipelining counterpart of a 2-stage pipewright job (bench/pipe_vs_torch.sh).

Started by `torchrun --nproc-per-node 2`: rank K runs BUILD/stageK.onnx (the stage ONNX files
`pipewright compile --stage-onnx` writes, so both sides cut the model at the same place) op
by op with eager torch ops (bench/torch_eager.py's OnnxModule, with pipewright's trainable
tensors) as a `PipelineStage`, over gloo, under the namesake of a pipewright schedule
(`--schedule`: flush is `Schedule1F1B`, 1F1B with a flush per step; gpipe `ScheduleGPipe`;
zb-h1 `ScheduleInterleavedZeroBubble` with one stage per rank, the zero-bubble schedule
that splits each backward into input and weight gradients; interleaved-V
`ScheduleInterleaved1F1B` with V stages per rank, rank K running stages K, K + ranks, ...
of a build of V x ranks stages; zb-v `ScheduleZBVZeroBubble` with stages K and 2 ranks - 1 - K
on rank K, the V placement, of a build of 2 x ranks stages), with the mean cross-entropy of the last stage's output
against seeded random labels, `torch.optim.SGD` (plain, lr), one intra-op thread per stage.
Each step is M microbatches of B samples. The last rank reports the median seconds per step
(the wall time between consecutive updates, as pipewright's metrics) after the warm-up.

Prints `torch-pipe model=NAME median_ms=X steps=S warmup=W microbatch=B microbatches=M`.
"""
import argparse
import os
import statistics
import sys
import time

import onnx
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_eager  # noqa: E402

torch_eager.OPS.setdefault("Identity", lambda x: x)


class ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous (gloo sends only
    contiguous tensors; ZB-V's input-gradient pass sends what autograd gives, which through
    a Split or Transpose is a view)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


class Stage(torch.nn.Module):
    def __init__(self, module, zb_v=False):
        super().__init__()
        self.module, self.zb_v = module, zb_v

    def forward(self, *xs):
        if self.zb_v:
            xs = tuple(ContiguousGrad.apply(x) if x.requires_grad else x for x in xs)
        # Sent tensors must be contiguous (pipewright sends contiguous bytes too). Under ZB-V
        # also copies: the schedule detaches a stage's output in place once sent, and where
        # that output is a value the last op saved for its backward (ReLU saves its result)
        # the later weight-gradient pass fails ("a saved tensor that has been detached
        # in-place").
        outs = [o.contiguous() for o in self.module(*xs)]
        if self.zb_v:
            outs = [o.clone() for o in outs]
        return tuple(outs) if len(outs) > 1 else outs[0]


def vocabulary(model):
    """The row count of the table the first Gather reads (token ids must stay below it)."""
    inits = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Gather" and n.input[0] in inits:
            return inits[n.input[0]].dims[0]
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--microbatch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--export-batch", type=int, default=2)
    ap.add_argument("--schedule", choices=["flush", "gpipe", "zb-h1", "interleaved-2", "interleaved-4", "zb-v"], default="flush")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    v = int(a.schedule.split("-")[1]) if a.schedule.startswith("interleaved-") else 2 if a.schedule == "zb-v" else 1
    # This rank's stages: K, K + ranks, ... (one unless interleaved); K and 2 ranks - 1 - K
    # under ZB-V.
    indices = [rank, 2 * world - 1 - rank] if a.schedule == "zb-v" else [rank + j * world for j in range(v)]
    last_rank = 0 if a.schedule == "zb-v" else world - 1
    models = [onnx.load(os.path.join(a.build, f"stage{k}.onnx")) for k in indices]
    modules = []
    for mdl in models:
        module = torch_eager.OnnxModule(mdl)
        torch_eager.match_pipewright(module, a.export_batch, a.microbatch)
        module.train(True)
        modules.append(module)
    stages = [PipelineStage(Stage(mod, a.schedule == "zb-v"), k, world * v, torch.device("cpu")) for k, mod in zip(indices, modules)]
    if a.schedule == "zb-v":
        # ZB-V puts stages p - 1 and p on one rank; the schedule's start-up exchange with
        # each neighbour stage then sends to this rank itself, which gloo refuses ("Pair
        # is not connected"). Leave those out: the schedule hands tensors between a rank's
        # own stages locally.
        for st in stages:
            init_ops = st._get_init_p2p_neighbors_ops
            st._get_init_p2p_neighbors_ops = lambda init_ops=init_ops: [op for op in init_ops() if op.group_peer != rank]
    last = models[-1].graph.output[0]
    per_sample = [d.dim_value for d in last.type.tensor_type.shape.dim][1:]

    def loss_fn(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    if a.schedule == "zb-h1":
        schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=a.microbatches, loss_fn=loss_fn)
    elif a.schedule == "zb-v":
        schedule = ScheduleZBVZeroBubble(stages, n_microbatches=a.microbatches, loss_fn=loss_fn)
    elif v > 1:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=a.microbatches, loss_fn=loss_fn)
    else:
        kind = {"flush": Schedule1F1B, "gpipe": ScheduleGPipe}[a.schedule]
        schedule = kind(stages[0], n_microbatches=a.microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for mod in modules for p in mod.parameters()], lr=a.lr)
    g = torch.Generator().manual_seed(0)
    n = a.microbatch * a.microbatches
    first = onnx.load(os.path.join(a.build, "stage0.onnx"))
    inits = {t.name for t in first.graph.initializer}
    spec = [i for i in first.graph.input if i.name not in inits][0]
    shape = [n] + [d.dim_value for d in spec.type.tensor_type.shape.dim][1:]
    if spec.type.tensor_type.elem_type == onnx.TensorProto.INT64:
        x = torch.randint(0, vocabulary(first) or 2, shape, generator=g)
    else:
        x = torch.randn(shape, generator=g)
    classes = per_sample[-1]
    y = torch.randint(0, classes, [n] + per_sample[:-1], generator=g)
    times, prev, loss = [], None, float("nan")
    for step in range(a.warmup + a.steps):
        if rank == 0 and rank == last_rank:
            # ZB-V: the first and the last stage on rank 0.
            losses = []
            schedule.step(x, target=y, losses=losses)
            loss = float(torch.stack(losses).mean())
        elif rank == 0:
            schedule.step(x)
        elif rank == last_rank:
            losses = []
            schedule.step(target=y, losses=losses)
            loss = float(torch.stack(losses).mean())
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = time.perf_counter()
        if prev is not None and step >= a.warmup:
            times.append(now - prev)
        prev = now
    if rank == last_rank:
        name = os.path.basename(os.path.normpath(a.build))
        print(f"{name}: last loss {loss:.4f}, torch {torch.__version__}, {len(times)} steps after {a.warmup} warm-up", flush=True)
        print(
            f"torch-pipe schedule={a.schedule} model={name} median_ms={statistics.median(times) * 1e3:.1f} steps={a.steps} warmup={a.warmup} microbatch={a.microbatch} microbatches={a.microbatches}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
