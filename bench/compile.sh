#!/usr/bin/env bash
# `pipewright compile` end to end on resnet18 and gpt2-tiny (release build), with the time of
# each phase from --timings: the passes (import, plan, partition, recompute,
# weight-versioning, lower) and writing the stage modules and stage ONNX files. Median of
# RUNS runs per model and thread count; the thread counts (RAYON_NUM_THREADS: lowering and
# module writing run per stage in parallel) alternate run by run so both see the same
# machine.
#
# Usage: bench/compile.sh [MODEL ...]   Env: RUNS (5), STAGES (4), THREADS ("1 2"), MODELS_DIR.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
RUNS="${RUNS:-5}"
STAGES="${STAGES:-4}"
THREADS="${THREADS:-1 2}"
MODELS_DIR="${MODELS_DIR:-$repo/../shared/corpus/models}"
models=("$@")
[[ ${#models[@]} -gt 0 ]] || models=(resnet18 gpt2-tiny)
cargo build --release --locked >&2
pw="$repo/target/release/pipewright"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
printf '%-10s %7s %9s %9s %9s %9s %10s %9s\n' model threads total_ms import_ms plan_ms lower_ms modules_ms onnx_ms
for m in "${models[@]}"; do
    declare -A rows=()
    for ((r = 0; r < RUNS; r++)); do
        for t in $THREADS; do
            rm -rf "$out/build"
            start=$(date +%s%N)
            err=$(RAYON_NUM_THREADS=$t "$pw" compile "$MODELS_DIR/$m.onnx" --stages "$STAGES" --stage-onnx -o "$out/build" --timings 2>&1 >/dev/null)
            end=$(date +%s%N)
            total=$(( (end - start) / 1000 ))
            pick() { echo "$err" | awk -v k="$1" '$1 == k || $0 ~ k {print $(NF-1); exit}'; }
            rows[$t]+="$((total / 1000)).$(printf '%03d' $((total % 1000))) $(pick import) $(pick plan) $(pick lower) $(pick 'write stage modules') $(pick 'write stage ONNX')"$'\n'
        done
    done
    for t in $THREADS; do
        printf '%s' "${rows[$t]}" | sort -n | sed -n "$(( (RUNS + 1) / 2 ))p" |
            awk -v m="$m" -v t="$t" '{printf "%-10s %7s %9s %9s %9s %9s %10s %9s\n", m, t, $1, $2, $3, $4, $5, $6}'
    done
    unset rows
done
