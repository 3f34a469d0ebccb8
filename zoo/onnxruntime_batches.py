"""Runs an exported zoo model through onnxruntime at the entry's export batch and, where
the model's batch axis is dynamic, at three times it (the inputs repeated along the batch).

    python zoo/onnxruntime_batches.py MODEL.onnx ENTRY_FOLDER WORK_FOLDER [BATCH_AXIS]
    python zoo/onnxruntime_batches.py --serve

BATCH_AXIS (0 by default) is the axis of the outputs that carries the batch (a stack of
layers' outputs carries it on the second). `--serve` reads one request per line on stdin,
the three paths and the axis separated by tabs, and
answers each with the lines below and then `end ok` or `end error MESSAGE`, so that
tests/zoo.rs starts Python and imports onnxruntime once per job rather than per entry.

For each batch B it writes WORK_FOLDER/ortB/ with input_K.pb and what onnxruntime
computes (output_K.pb), for `pipewright run-forward --inputs` to match, and prints
`batch B FOLDER`. At three times the export batch each output that carries the batch
must also be the output at the export batch repeated three times, within 1e-3 of its
largest magnitude: at the export batch the batch-following shapes export wrote give the
values the exporter's fixed ones did, and at any other batch they must not move values
between samples (weights trained by pipewright, so not the entry's own outputs). A
mismatch is printed on stderr and the script exits 1. Last it writes the entry's own
inputs and outputs (onnxruntime on the model as exported) repeated three times, for
`run-forward` of that source model at three times its export batch, and prints `source B
FOLDER`. Needs onnx, onnxruntime and numpy (scripts/pyref.sh).
"""
import glob
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper


class Mismatch(Exception):
    """An output at three times the export batch that is not its value repeated."""


def main():
    if sys.argv[1:] == ["--serve"]:
        serve()
        return
    try:
        check(*sys.argv[1:5], emit=lambda line: print(line, flush=True))
    except Mismatch as e:
        sys.exit(str(e))


def serve():
    """Requests from stdin, one per line: `MODEL<TAB>ENTRY<TAB>WORK<TAB>BATCH_AXIS`."""
    for request in sys.stdin:
        try:
            check(*request.rstrip("\n").split("\t"), emit=print)
            print("end ok", flush=True)
        except Exception as e:  # a model onnxruntime refuses fails its entry, not the rest
            message = " ".join((str(e) if isinstance(e, Mismatch) else f"{type(e).__name__}: {e}").split())
            print(f"end error {message}", flush=True)


def check(model, entry, work, batch_axis="0", *, emit):
    """Writes the folders for one exported model, `emit`ting a line for each."""
    axis = int(batch_axis)
    inputs = [onnx.load_tensor(p) for p in sorted(glob.glob(os.path.join(entry, "input_*.pb")))]
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    dims = [i.shape[0] if i.shape else None for i in session.get_inputs()]
    dynamic = all(isinstance(d, str) or d is None for d in dims)
    at_export_batch = None
    for repeat in (1, 3) if dynamic else (1,):
        feeds = {t.name: np.concatenate([numpy_helper.to_array(t)] * repeat, 0) for t in inputs}
        outputs = session.run(None, feeds)
        if repeat == 1:
            at_export_batch = outputs
        else:
            check_samples(outputs, at_export_batch, repeat, axis)
        batch = next(iter(feeds.values())).shape[0]
        folder = os.path.join(work, f"ort{batch}")
        write_tensors(folder, [(t.name, feeds[t.name]) for t in inputs], [(f"output_{k}", v) for k, v in enumerate(outputs)])
        emit(f"batch {batch} {folder}")
    # The entry's inputs and onnxruntime's outputs for them (on the model as the exporter
    # wrote it) repeated three times, for `run-forward` of that source model.
    tripled = lambda t, a: (t.name, np.concatenate([numpy_helper.to_array(t)] * 3, along(numpy_helper.to_array(t), a)))
    expected = [onnx.load_tensor(p) for p in sorted(glob.glob(os.path.join(entry, "output_*.pb")))]
    folder = os.path.join(work, "source3x")
    sources = [tripled(t, 0) for t in inputs]
    write_tensors(folder, sources, [tripled(t, axis) for t in expected])
    emit(f"source {sources[0][1].shape[0]} {folder}")


def write_tensors(folder, inputs, outputs):
    """`(name, array)` pairs as FOLDER/input_K.pb and FOLDER/output_K.pb."""
    os.makedirs(folder, exist_ok=True)
    for kind, tensors in (("input", inputs), ("output", outputs)):
        for k, (name, value) in enumerate(tensors):
            with open(os.path.join(folder, f"{kind}_{k}.pb"), "wb") as f:
                f.write(numpy_helper.from_array(np.asarray(value), name).SerializeToString())


def along(array, axis):
    """`axis` where `array` has it, else its first (an output of lower rank)."""
    return axis if axis < array.ndim else 0


def check_samples(outputs, expected, repeat, axis):
    """Each output carrying the batch (on `axis`) against the one at the export batch
    repeated."""
    for k, (got, want) in enumerate(zip(outputs, expected)):
        got, want = np.asarray(got), np.asarray(want)
        if want.ndim == 0 or not np.issubdtype(want.dtype, np.floating):
            continue
        a = along(want, axis)
        if got.shape != want.shape[:a] + (want.shape[a] * repeat,) + want.shape[a + 1:]:
            continue
        tiled = np.concatenate([want] * repeat, a).astype(np.float64)
        scale = float(np.max(np.abs(tiled))) if tiled.size else 0.0
        diff = float(np.max(np.abs(got.astype(np.float64) - tiled))) if tiled.size else 0.0
        if diff > 1e-3 * scale:
            raise Mismatch(f"output {k} at batch {got.shape[a]} (the inputs repeated {repeat} times) is not its value at the "
                           f"export batch repeated: it differs by up to {diff:.3e} where the values reach {scale:.3e}")


if __name__ == "__main__":
    main()
