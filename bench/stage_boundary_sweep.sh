#!/usr/bin/env bash
# What cutting a model into more stages costs the runtime by itself (docs/simulator.md,
# calibration): the model compiled as 1, 2, 3 and 4 stages (GPipe, no recomputation,
# microbatch MICROBATCH) and trained one microbatch per step, so that no two stages are
# ever busy at once, with one libtorch thread per stage; ROUNDS rounds over the depths, each
# printing the milliseconds per step (between the starts of steps 50 and STEPS - 1 in the
# trace). With PIN="taskset -c 0" every thread shares one core.
#
# Usage: bench/stage_boundary_sweep.sh [MODEL] (default: gpt2-tiny)
# Env:   MICROBATCH (4), STEPS (200), ROUNDS (3), DEPTHS ("1 2 3 4"), PIN (none),
#        OUT (target/bench/boundary).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
model="${1:-gpt2-tiny}"
MICROBATCH="${MICROBATCH:-4}"
STEPS="${STEPS:-200}"
ROUNDS="${ROUNDS:-3}"
read -r -a depths <<<"${DEPTHS:-1 2 3 4}"
read -r -a pin <<<"${PIN:-}"
OUT="${OUT:-$repo/target/bench/boundary}"
MODELS_DIR="${MODELS_DIR:-$repo/../shared/corpus/models}"
pw="${PIPEWRIGHT:-${CARGO_TARGET_DIR:-$repo/target}/release/pipewright}"
onnx="$MODELS_DIR/$model.onnx"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$OUT"
for d in "${depths[@]}"; do
    "$pw" compile "$onnx" --stages "$d" --schedule gpipe --recompute none --microbatch "$MICROBATCH" --microbatches "$d" -o "$OUT/$model-d$d" >/dev/null 2>&1
done
for r in $(seq 1 "$ROUNDS"); do
    line="round $r:"
    for d in "${depths[@]}"; do
        "${pin[@]}" "$pw" train "$OUT/$model-d$d" --microbatches 1 --steps "$STEPS" --optimizer sgd --lr 0.0001 \
            --log-every 100000 --threads 1 --trace "$OUT/$model-d$d.trace.json" >/dev/null 2>&1
        ms="$(python3 - "$OUT/$model-d$d.trace.json" "$STEPS" <<'PY'
import json, sys
path, steps = sys.argv[1], int(sys.argv[2])
t = json.load(open(path))
events = [e for e in (t["traceEvents"] if isinstance(t, dict) else t) if e.get("ph") == "X"]
start = lambda s: min(e["ts"] for e in events if e["args"].get("step") == s)
print("%.2f" % ((start(steps - 1) - start(50)) / (steps - 51) / 1e3))
PY
)"
        line="$line d=$d $ms ms/step"
    done
    echo "$line"
done
