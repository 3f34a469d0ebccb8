#!/usr/bin/env bash
# The MPI transport against the embedded executor: each model compiled into 2 stages (2BW)
# and trained with the same options by `pipewright train` (2 stage threads in one process)
# and by `pipewright launch` (2 MPI ranks, one stage each), side by side in one run: each
# round runs both, in alternating order. Reports per run the median seconds per step over
# the steps after WARMUP (metrics JSON lines), and per model the median over rounds and the
# ratio MPI / embedded. Both sides use one intra-op thread per stage.
#
# Usage: bench/mpi.sh [MODEL:MICROBATCH:STEPS ...]   (default: gpt2-tiny:4:30 resnet18:2:10)
# Env:   PW (the pipewright binary; default target/release/pipewright), ROUNDS (3),
#        WARMUP (3 steps dropped), M (4 microbatches per step), MODELS_DIR
#        (../shared/corpus/models), OUT (target/bench/mpi).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
PW="${PW:-$repo/target/release/pipewright}"
ROUNDS="${ROUNDS:-3}"
WARMUP="${WARMUP:-3}"
M="${M:-4}"
MODELS_DIR="${MODELS_DIR:-$repo/../shared/corpus/models}"
OUT="${OUT:-$repo/target/bench/mpi}"
specs=("$@")
((${#specs[@]})) || specs=(gpt2-tiny:4:30 resnet18:2:10)
mkdir -p "$OUT"

# Median seconds per step of a metrics file, the first WARMUP steps dropped.
median_step() {
    python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("%.4f" % statistics.median(r["seconds"] for r in rows[int(sys.argv[2]):]))' "$1" "$WARMUP"
}

for spec in "${specs[@]}"; do
    IFS=: read -r model mb steps <<<"$spec"
    build="$OUT/$model"
    "$PW" compile "$MODELS_DIR/$model.onnx" --stages 2 --schedule 2bw -o "$build" >/dev/null
    opts=(--steps "$steps" --microbatch "$mb" --microbatches "$M" --optimizer sgd --lr 0.0001 --threads 1 --no-progress --log-every 1000000)
    emb=() mpi=()
    for ((r = 0; r < ROUNDS; r++)); do
        order=(train launch)
        ((r % 2)) && order=(launch train)
        for side in "${order[@]}"; do
            m="$OUT/$model-$side-$r.jsonl"
            if [[ $side == train ]]; then
                "$PW" train "$build" "${opts[@]}" --metrics "$m" >/dev/null 2>&1
                emb+=("$(median_step "$m")")
            else
                "$PW" launch "$build" -- "${opts[@]}" --metrics "$m" >/dev/null 2>&1
                mpi+=("$(median_step "$m")")
            fi
        done
    done
    python3 -c '
import statistics, sys
model, emb, mpi = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
e, m = statistics.median(emb), statistics.median(mpi)
print(f"{model}: embedded {e*1000:.1f} ms/step, MPI {m*1000:.1f} ms/step, ratio {m/e:.2f}x; rounds embedded {[round(x*1000,1) for x in emb]} MPI {[round(x*1000,1) for x in mpi]}")' \
        "$model" "${emb[*]}" "${mpi[*]}"
done
