"""Runs an exported zoo model through onnxruntime at the entry's export batch and, where
the model's batch axis is dynamic, at three times it (the inputs repeated along the batch).

    python zoo/onnxruntime_batches.py MODEL.onnx ENTRY_FOLDER WORK_FOLDER

For each batch B it writes WORK_FOLDER/ortB/ with input_K.pb and what onnxruntime
computes (output_K.pb), for `pipewright run-forward --inputs` to match, and prints
`batch B FOLDER`. Needs onnx, onnxruntime and numpy (scripts/pyref.sh).
"""
import glob
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper


def main():
    model, entry, work = sys.argv[1:4]
    inputs = [onnx.load_tensor(p) for p in sorted(glob.glob(os.path.join(entry, "input_*.pb")))]
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    dims = [i.shape[0] if i.shape else None for i in session.get_inputs()]
    dynamic = all(isinstance(d, str) or d is None for d in dims)
    for repeat in (1, 3) if dynamic else (1,):
        feeds = {t.name: np.concatenate([numpy_helper.to_array(t)] * repeat, 0) for t in inputs}
        outputs = session.run(None, feeds)
        batch = next(iter(feeds.values())).shape[0]
        folder = os.path.join(work, f"ort{batch}")
        os.makedirs(folder, exist_ok=True)
        for k, t in enumerate(inputs):
            with open(os.path.join(folder, f"input_{k}.pb"), "wb") as f:
                f.write(numpy_helper.from_array(feeds[t.name], t.name).SerializeToString())
        for k, value in enumerate(outputs):
            with open(os.path.join(folder, f"output_{k}.pb"), "wb") as f:
                f.write(numpy_helper.from_array(np.asarray(value), f"output_{k}").SerializeToString())
        print(f"batch {batch} {folder}", flush=True)


if __name__ == "__main__":
    main()
