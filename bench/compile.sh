#!/usr/bin/env bash
# Issue 5's compile benchmark: `pipewright compile` end to end on resnet18 and gpt2-tiny
# (release build), with the time of each phase from --timings: import, the passes, lowering,
# and writing the stage modules and stage ONNX files. Median of RUNS runs per model.
#
# Usage: bench/compile.sh [MODEL ...]   Env: RUNS (5), STAGES (4), MODELS_DIR.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
RUNS="${RUNS:-5}"
STAGES="${STAGES:-4}"
MODELS_DIR="${MODELS_DIR:-$repo/../shared/corpus/models}"
models=("$@")
[[ ${#models[@]} -gt 0 ]] || models=(resnet18 gpt2-tiny)
cargo build --release --locked >&2
pw="$repo/target/release/pipewright"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
printf '%-10s %10s %10s %10s %10s %10s %10s\n' model total_ms import_ms passes_ms lower_ms modules_ms onnx_ms
for m in "${models[@]}"; do
    rows=()
    for ((r = 0; r < RUNS; r++)); do
        rm -rf "$out/build"
        start=$(date +%s%N)
        err=$("$pw" compile "$MODELS_DIR/$m.onnx" --stages "$STAGES" -o "$out/build" --timings 2>&1 >/dev/null)
        end=$(date +%s%N)
        total=$(( (end - start) / 1000 ))
        pick() { echo "$err" | awk -v k="$1" '$0 ~ k {print $(NF-1); exit}'; }
        rows+=("$((total / 1000)).$(printf '%03d' $((total % 1000))) $(pick 'importer') $(pick '^  total') $(pick 'lower stages') $(pick 'write stage modules') $(pick 'write stage ONNX')")
    done
    printf '%s\n' "${rows[@]}" | sort -n | sed -n "$(( (RUNS + 1) / 2 ))p" | awk -v m="$m" '{printf "%-10s %10s %10s %10s %10s %10s %10s\n", m, $1, $2, $3, $4, $5, $6}'
done
