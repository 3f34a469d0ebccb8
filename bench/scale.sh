#!/usr/bin/env bash
# Real sizes without downloads (release build, this machine): generated models only.
#
# 1. compile: a 100,800-node layered graph with long skips at several depths, and
#    GPT-2-small- and GPT-2-medium-shaped models (1024 tokens, weights inline as an exporter
#    writes them) at d = 4: wall time, each pass's time, peak RSS against the model file.
# 2. train: the GPT shapes at SEQ tokens (default 128), planned for d = 4 (b = 1, m = 4,
#    2BW, SGD, no recomputation), compiled from that plan and trained STEPS steps on
#    synthetic data: seconds per step, peak RSS, and each stage's peak live tensor bytes
#    beside the planner's prediction.
#
# Usage: bench/scale.sh [compile|train|all]   Env: SEQ (128), STEPS (3), DEPTHS ("1 4 16 64 256"),
#        WORK (a scratch folder; default a temporary one, removed at the end).
# Needs GNU time (/usr/bin/time) for peak RSS.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
what="${1:-all}"
SEQ="${SEQ:-128}"
STEPS="${STEPS:-3}"
DEPTHS="${DEPTHS:-1 4 16 64 256}"
[[ -x /usr/bin/time ]] || { echo "bench/scale.sh: needs GNU time at /usr/bin/time (apt-get install time)" >&2; exit 1; }
(cd "$repo" && cargo build --release --locked >&2)
pw="$repo/target/release/pipewright"
if [[ -n "${WORK:-}" ]]; then
    work="$WORK"
    mkdir -p "$work"
else
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
fi

# Runs a command under GNU time; prints its output, then "wall_s peak_kb" on the last line.
timed() {
    /usr/bin/time -f "%e %M" -o "$work/time.txt" "$@"
    cat "$work/time.txt"
}

# Bytes of the model file and, when there is one, its external data file.
model_bytes() {
    local files=("$1")
    if [[ -f "$1.data" ]]; then files+=("$1.data"); fi
    du -cb "${files[@]}" | tail -1 | cut -f1
}

compile_row() { # name model depth
    local name=$1 model=$2 d=$3
    rm -rf "$work/build"
    local out
    out=$(timed "$pw" compile "$model" --stages "$d" -o "$work/build" --timings 2>&1)
    local wall rss passes modules bytes
    read -r wall rss <<<"$(tail -1 <<<"$out")"
    pick() { awk -v k="$1" 'index($0, k) {print $(NF-1); exit}' <<<"$out"; }
    bytes=$(model_bytes "$model")
    printf '| %s | %s | %.2f | %s | %s | %s | %s | %.0f | %.2f |\n' "$name" "$d" "$wall" \
        "$(pick import)" "$(pick plan)" "$(pick partition)" "$(pick 'write stage modules')" \
        "$((rss / 1024))" "$(awk -v r="$rss" -v b="$bytes" 'BEGIN {print r * 1024 / b}')"
}

compile_bench() {
    "$pw" synth layered --nodes 100800 -o "$work/layered.onnx" >&2
    "$pw" synth gpt --preset gpt2-small --weights inline -o "$work/gpt2-small.onnx" >&2
    "$pw" synth gpt --preset gpt2-medium --weights inline -o "$work/gpt2-medium.onnx" >&2
    echo "| model | d | wall s | import ms | plan ms | partition ms | write modules ms | peak RSS MiB | RSS / model file |"
    echo "|---|---|---|---|---|---|---|---|---|"
    for d in $DEPTHS; do compile_row layered-100k "$work/layered.onnx" "$d"; done
    compile_row gpt2-small "$work/gpt2-small.onnx" 4
    compile_row gpt2-medium "$work/gpt2-medium.onnx" 4
    rm -f "$work"/*.onnx "$work"/*.onnx.data
}

train_row() { # preset
    local p=$1 model="$work/$1-$SEQ.onnx"
    "$pw" synth gpt --preset "$p" --seq "$SEQ" -o "$model" >&2
    local plan_args=(--stages 4 --microbatch 1 --batch 4 --workers 4 --memory 1TiB --optimizer sgd --recompute none --schedule 2bw)
    "$pw" plan "$model" "${plan_args[@]}" --json >"$work/plan.json"
    local predicted
    predicted=$("$pw" plan "$model" "${plan_args[@]}" | awk '/^stage [0-9]+:/ {for (i = 1; i <= NF; i++) if ($i == "memory") {v = $(i+1) " " $(i+2); sub(/,$/, "", v); printf "%s%s", sep, v; sep = " / "}}')
    rm -rf "$work/build"
    "$pw" compile "$model" --plan "$work/plan.json" -o "$work/build" >&2
    local out wall rss per_step measured
    out=$(timed "$pw" train "$work/build" --steps "$STEPS" --optimizer sgd --lr 0.01 --no-progress 2>&1)
    read -r wall rss <<<"$(tail -1 <<<"$out")"
    per_step=$(awk -v s="$STEPS" '/^trained/ {for (i = 1; i <= NF; i++) if ($i == "in") {t = $(i+1); sub(/s:$/, "", t); printf "%.2f", t / s}}' <<<"$out")
    measured=$(awk -F': ' '/^peak live tensor bytes per stage/ {gsub(/, /, " / ", $2); print $2}' <<<"$out")
    printf '| %s | %s | %s | %s | %.0f | %s | %s |\n' "$p" "$SEQ" "$STEPS" "$per_step" "$((rss / 1024))" "$measured" "$predicted"
    rm -rf "$work/build" "$model" "$model".data
}

train_bench() {
    echo "| model | tokens | steps | s/step | peak RSS MiB | peak live bytes per stage (measured) | planner's prediction |"
    echo "|---|---|---|---|---|---|---|"
    train_row gpt2-small
    train_row gpt2-medium
}

case "$what" in
compile) compile_bench ;;
train) train_bench ;;
all) compile_bench; echo; train_bench ;;
*) echo "usage: bench/scale.sh [compile|train|all]" >&2; exit 2 ;;
esac
