#!/usr/bin/env bash
# The optimizer step of two pipewright binaries side by side: for every shared model, each
# optimizer (SGD with momentum 0.9 and weight decay, Adam with L2 decay, AdamW) trains the
# model in 2 stages under 2BW for STEPS steps on its sample inputs, with the same seed,
# under both binaries; the final checkpoints' weights are compared, and each binary's
# optimizer time per step (the `optimizer` spans of `--trace`, summed over both stages)
# is reported. For showing that a new update path (the fused multi-tensor kernels) keeps
# the results within fp32 rounding and what it does to the update's cost.
#
# Usage: bash bench/optimizer.sh BEFORE AFTER   (release binaries)
# Env:   STEPS (50), MODELS (every .onnx in CORPUS), CORPUS (../shared/corpus/models)
# Prints one Markdown table: per model and optimizer, the largest absolute and relative
# weight difference after STEPS steps, and the median optimizer ms per step of each binary.
set -euo pipefail
cd "$(dirname "$0")/.."

A="${1:?usage: optimizer.sh BEFORE AFTER}"
B="${2:?usage: optimizer.sh BEFORE AFTER}"
STEPS="${STEPS:-50}"
CORPUS="${CORPUS:-../shared/corpus/models}"
MODELS="${MODELS:-$(cd "$CORPUS" && ls -- *.onnx | sed 's/\.onnx$//' | tr '\n' ' ')}"
PY="${PIPEWRIGHT_PYTHON:-$(bash scripts/pyref.sh)}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

declare -A optimizers=(
    [sgd]="--optimizer sgd --lr 1e-3 --momentum 0.9 --weight-decay 1e-4"
    [adam]="--optimizer adam --lr 1e-4 --weight-decay 1e-4"
    [adamw]="--optimizer adamw --lr 1e-4 --weight-decay 1e-2"
)

echo "| model | optimizer | largest abs. difference | largest rel. difference | before ms/step | after ms/step | after / before |"
echo "|---|---|---|---|---|---|---|"
for model in $MODELS; do
    for side in A B; do
        "${!side}" compile "$CORPUS/$model.onnx" --stages 2 --schedule 2bw -o "$work/$side-$model" >/dev/null 2>"$work/compile.log" \
            || { cat "$work/compile.log" >&2; exit 1; }
    done
    for opt in sgd adam adamw; do
        for side in A B; do
            rm -rf "$work/ck-$side"
            # shellcheck disable=SC2086
            "${!side}" train "$work/$side-$model" --steps "$STEPS" --microbatch 2 --microbatches 2 --seed 1 \
                ${optimizers[$opt]} --checkpoint-every "$STEPS" --checkpoint-dir "$work/ck-$side" \
                --trace "$work/trace-$side.json" --no-progress >/dev/null 2>&1
        done
        "$PY" - "$work" "$STEPS" "$model" "$opt" <<'PYEOF'
import glob, json, os, sys
import struct
import numpy as np

DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U8": np.uint8}

def load_file(path):
    # The safetensors layout: an 8-byte little-endian header length, a JSON header of
    # name -> dtype, shape, byte offsets, then the data.
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__" or t["dtype"] not in DTYPES:
            continue
        lo, hi = t["data_offsets"]
        out[name] = np.frombuffer(data[lo:hi], dtype=DTYPES[t["dtype"]]).reshape(t["shape"])
    return out

work, steps, model, opt = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

def weights(side):
    step = sorted(glob.glob(os.path.join(work, f"ck-{side}", "step-*")))[-1]
    out = {}
    for f in sorted(glob.glob(os.path.join(step, "stage*.safetensors"))):
        for k, v in load_file(f).items():
            if not k.startswith("opt."):
                out[os.path.basename(f) + "/" + k] = v.astype(np.float64)
    return out

def optimizer_ms(side):
    # Chrome trace events: each stage's `optimizer` spans, summed per step, median.
    events = json.load(open(os.path.join(work, f"trace-{side}.json")))
    events = events["traceEvents"] if isinstance(events, dict) else events
    per_step = {}
    for e in events:
        if e.get("ph") == "X" and e.get("name", "").startswith("optimizer"):
            step = e.get("args", {}).get("step", 0)
            per_step[step] = per_step.get(step, 0.0) + e["dur"] / 1e3
    v = sorted(per_step.values())
    return v[len(v) // 2] if v else float("nan")

a, b = weights("A"), weights("B")
if a.keys() != b.keys():
    sys.exit(f"{model} {opt}: the two runs saved different weights")
abs_gap = max(float(np.max(np.abs(a[k] - b[k]))) if a[k].size else 0.0 for k in a)
rel_gap = max(float(np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(a[k])), 1e-12)) if a[k].size else 0.0 for k in a)
ta, tb = optimizer_ms("A"), optimizer_ms("B")
print(f"| {model} | {opt} | {abs_gap:.2e} | {rel_gap:.2e} | {ta:.3f} | {tb:.3f} | {tb / ta:.2f} |")
PYEOF
    done
done
