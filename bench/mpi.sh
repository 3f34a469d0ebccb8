#!/usr/bin/env bash
# WORKERS-worker pipelines (default 2) three ways, side by side in one run: the embedded executor
# (`pipewright train`: a thread per stage in one process), MPI (`pipewright launch`: a rank
# per stage; where a worker runs several stages, its ranks take turns) and
# torch.distributed.pipelining (bench/torch_pipe.py under `torchrun --nproc-per-node WORKERS`:
# gloo, the same stage cut through the build's stage ONNX files).
# Same model, microbatch, microbatches, plain SGD, one intra-op thread per stage;
# pipewright runs SCHEDULE (flush, gpipe, zb-h1, interleaved-V or zb-v; default flush) and
# torch its namesake (Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble with one
# stage per rank, ScheduleInterleaved1F1B with V stages per rank of a WORKERS x V-stage build,
# ScheduleZBVZeroBubble with 2 per rank in a V). Each round runs the three in a rotated
# order. Reports per model the median
# over rounds of each run's median seconds per step after WARMUP (the wall time between
# consecutive updates), and the ratios to the embedded executor.
#
# Usage: bench/mpi.sh [MODEL:MICROBATCH:STEPS ...]   (default: gpt2-tiny:2:30 resnet18:2:10)
# Env:   PW (the pipewright binary; default target/release/pipewright), ROUNDS (3),
#        WARMUP (3 steps dropped), M (4 microbatches per step), SCHEDULE (flush), WORKERS (2),
#        TORCH_PYTHON (a python with torch and onnx; default python3; TORCH=0 skips torch),
#        MODELS_DIR (../shared/corpus/models), OUT (target/bench/mpi).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
PW="${PW:-$repo/target/release/pipewright}"
ROUNDS="${ROUNDS:-3}"
WARMUP="${WARMUP:-3}"
M="${M:-4}"
SCHEDULE="${SCHEDULE:-flush}"
WORKERS="${WORKERS:-2}"
TORCH="${TORCH:-1}"
TORCH_PYTHON="${TORCH_PYTHON:-python3}"
MODELS_DIR="${MODELS_DIR:-$repo/../shared/corpus/models}"
OUT="${OUT:-$repo/target/bench/mpi}"
specs=("$@")
((${#specs[@]})) || specs=(gpt2-tiny:2:30 resnet18:2:10)
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
    # Stages per worker: V under interleaved-V.
    v=1
    [[ "$SCHEDULE" == interleaved-* ]] && v="${SCHEDULE#interleaved-}"
    [[ "$SCHEDULE" == zb-v ]] && v=2
    # Under ZB-V and ZB-H1 every side trains the build with exporter-merged initializers untied (one
    # copy per use): torch's zero-bubble schedules (2.11: ScheduleZBVZeroBubble and
    # ScheduleInterleavedZeroBubble) fail their weight-gradient pass
    # ("backward through the graph a second time") on a parameter that several nodes of one
    # stage read, as gpt2-tiny's merged LayerNorm weights are.
    untie=()
    [[ "$SCHEDULE" == zb-v || "$SCHEDULE" == zb-h1 ]] && untie=(--untie-merged)
    "$PW" compile "$MODELS_DIR/$model.onnx" --stages $((WORKERS * v)) --schedule "$SCHEDULE" --microbatch "$mb" --stage-onnx "${untie[@]}" -o "$build" >/dev/null
    opts=(--steps "$((steps + WARMUP))" --microbatch "$mb" --microbatches "$M" --optimizer sgd --lr 0.0001 --threads 1 --no-progress --log-every 1000000)
    sides=(train launch)
    ((TORCH)) && sides+=(torch)
    declare -A times=()
    for ((r = 0; r < ROUNDS; r++)); do
        for ((i = 0; i < ${#sides[@]}; i++)); do
            side="${sides[$(((i + r) % ${#sides[@]}))]}"
            m="$OUT/$model-$side-$r.jsonl"
            case $side in
                train) "$PW" train "$build" "${opts[@]}" --metrics "$m" >/dev/null 2>&1; t="$(median_step "$m")" ;;
                launch) "$PW" launch "$build" -- "${opts[@]}" --metrics "$m" >/dev/null 2>&1; t="$(median_step "$m")" ;;
                torch)
                    line="$(OMP_NUM_THREADS=1 "$TORCH_PYTHON" -m torch.distributed.run --nproc-per-node "$WORKERS" --master-port "$((29500 + RANDOM % 1000))" \
                        bench/torch_pipe.py "$build" --schedule "$SCHEDULE" --microbatch "$mb" --microbatches "$M" --steps "$steps" --warmup "$WARMUP" 2>"$OUT/$model-torch-$r.err" | grep '^torch-pipe' || true)"
                    if [[ -z "$line" ]]; then
                        # Reported, not fatal: the other sides' figures still stand.
                        echo "$model: torch.distributed.pipelining failed (round $r): $(grep -m1 -E '^\[rank[0-9]+\]: [A-Za-z]*Error' "$OUT/$model-torch-$r.err" || echo 'see '"$OUT/$model-torch-$r.err")"
                        t=nan
                    else
                        t="$(sed -E 's/.*median_ms=([0-9.]+).*/\1/' <<<"$line" | awk '{printf "%.4f", $1 / 1000}')"
                    fi ;;
            esac
            times[$side]+="$t "
        done
    done
    args=()
    for s in "${sides[@]}"; do args+=("$s" "${times[$s]}"); done
    python3 -c '
import statistics, sys
model, rest = sys.argv[1], sys.argv[2:]
names = {"train": "embedded", "launch": "MPI", "torch": "torch.distributed.pipelining"}
med = {}
for side, vals in zip(rest[::2], rest[1::2]):
    xs = [float(v) for v in vals.split() if v != "nan"]
    if not xs:
        print(f"{model}: {names[side]}: no run finished")
        continue
    med[side] = statistics.median(xs)
    print(f"{model}: {names[side]}: {med[side]*1000:.1f} ms/step (rounds {[round(x*1000, 1) for x in xs]})")
base = med["train"]
for side in med:
    if side != "train":
        print(f"{model}: {names[side]} / embedded = {med[side] / base:.2f}x")' \
        "$model" "${args[@]}"
    unset times
done
