#!/usr/bin/env bash
# One training step, pipewright vs PyTorch eager: the model compiled into a single stage
# (`compile --stages 1 --schedule flush`: forward, backward, vanilla SGD update) and trained
# by `pipewright train` (one microbatch of BATCH per step), against bench/torch_train.py
# (the same ONNX graph run op by op as PyTorch calls, the same cross-entropy on the same
# output, torch.optim.SGD), on the same .npz data, batch, learning rate and intra-op
# thread count. pipewright's time per step is the metrics JSON `seconds` of each step after
# WARMUP (the wall time between consecutive updates); torch's is measured around each step.
# Each figure is the median over steps; the table gives the median over rounds.
#
# Usage: bench/train_eager.sh [MODEL ...]      (default: resnet18 gpt2-tiny)
# Env:   BATCH (2, the export batch of the shared models, as in bench/fwd_bwd.sh),
#        THREADS (2: OMP_NUM_THREADS/MKL_NUM_THREADS for pipewright — `train` has no thread
#        flag — and torch.set_num_threads for torch), STEPS (20 timed), WARMUP (3),
#        ROUNDS (3, alternating which side runs first), LR (1e-4), MODELS_DIR
#        (../shared/corpus/models), BENCH_VENV (${XDG_CACHE_HOME:-~/.cache}/pipewright/bench-venv,
#        torch + onnx + numpy; bench/fwd_bwd.sh sets it up), OUT (target/bench/train_eager).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
BATCH="${BATCH:-2}"
THREADS="${THREADS:-2}"
STEPS="${STEPS:-20}"
WARMUP="${WARMUP:-3}"
ROUNDS="${ROUNDS:-3}"
LR="${LR:-0.0001}"
MODELS_DIR="${MODELS_DIR:-$repo/../shared/corpus/models}"
cache="${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}"
py="${BENCH_VENV:-$cache/bench-venv}/bin/python"
OUT="${OUT:-$repo/target/bench/train_eager}"
models=("$@")
[[ ${#models[@]} -gt 0 ]] || models=(resnet18 gpt2-tiny)
log() { echo "train_eager.sh: $*" >&2; }

"$py" -c 'import torch, onnx, numpy' 2>/dev/null || { log "$py lacks torch/onnx/numpy (bench/fwd_bwd.sh sets the venv up)"; exit 1; }
log "cargo build --release"
cargo build --release >&2
pw="$repo/target/release/pipewright"
mkdir -p "$OUT"

field() { sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" <<<"$2"; }
median() { python3 -c 'import statistics,sys; print(f"{statistics.median(map(float, sys.argv[1:])):.3f}")' "$@"; }
# median ms of `seconds` over the metrics lines after WARMUP
pw_ms() { python3 -c '
import json, statistics, sys
s = [json.loads(l)["seconds"] for l in open(sys.argv[1]) if l.strip()][int(sys.argv[2]):]
print(f"{statistics.median(s) * 1e3:.3f} {statistics.fmean(s) * 1e3:.3f} {len(s)}")' "$1" "$2"; }

declare -A out_name
for m in "${models[@]}"; do
    "$py" bench/make_data.py "$MODELS_DIR/$m.onnx" -o "$OUT/$m.npz" --samples $((BATCH * 8)) >&2
    "$pw" compile "$MODELS_DIR/$m.onnx" --stages 1 --schedule flush -o "$OUT/$m-d1" >&2
    out_name[$m]="$("$py" -c 'import onnx,sys; print(onnx.load(sys.argv[1], load_external_data=False).graph.output[0].name)' "$MODELS_DIR/$m.onnx")"
done

export OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"
run_pw() { # run_pw MODEL ROUND
    local m=$1 r=$2
    "$pw" train "$OUT/$m-d1" --data "$OUT/$m.npz" --label label --loss cross-entropy --output "${out_name[$m]}" \
        --steps $((WARMUP + STEPS)) --microbatch "$BATCH" --microbatches 1 --optimizer sgd --lr "$LR" \
        --log-every 1000 --metrics "$OUT/$m-d1/m$r.jsonl" >&2
    read -r med mean n < <(pw_ms "$OUT/$m-d1/m$r.jsonl" "$WARMUP")
    echo "round $r: pipewright-train model=$m median_ms=$med mean_ms=$mean steps=$n threads=$THREADS batch=$BATCH"
    pw_res[$m]+=" $med"
}
run_torch() { # run_torch MODEL ROUND
    local m=$1 r=$2 line
    line="$("$py" bench/torch_train.py "$MODELS_DIR/$m.onnx" --data "$OUT/$m.npz" --batch "$BATCH" --output "${out_name[$m]}" \
        --steps "$STEPS" --warmup "$WARMUP" --threads "$THREADS" --lr "$LR" | grep '^torch-train ')"
    echo "round $r: $line"
    torch_res[$m]+=" $(field median_ms "$line")"
}

declare -A pw_res torch_res
for m in "${models[@]}"; do pw_res[$m]=""; torch_res[$m]=""; done
for r in $(seq 1 "$ROUNDS"); do
    for m in "${models[@]}"; do
        if ((r % 2)); then run_pw "$m" "$r"; run_torch "$m" "$r"; else run_torch "$m" "$r"; run_pw "$m" "$r"; fi
    done
done

{
    echo "training step (forward + cross-entropy + backward + SGD), CPU, batch $BATCH, threads $THREADS, $STEPS steps after $WARMUP warm-up, median over $ROUNDS alternating rounds of per-run medians"
    echo
    echo "| model | pipewright train | PyTorch eager | pipewright / PyTorch |"
    echo "|---|---|---|---|"
    for m in "${models[@]}"; do
        # shellcheck disable=SC2086
        a="$(median ${pw_res[$m]})"; b="$(median ${torch_res[$m]})"
        echo "| $m (batch $BATCH) | $a ms | $b ms | $(python3 -c "print(f'{$a/$b:.2f}x')") |"
    done
} | tee "$OUT/table.md"
