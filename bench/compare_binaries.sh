#!/usr/bin/env bash
# Two pipewright binaries side by side on the same benchmarks, alternating run by run so
# both see the same machine noise (for showing that a change keeps speed within noise):
#
#   - bench-step: forward + backward step time of resnet18 and gpt2-tiny through the op
#     layer (the shared models' sample inputs, 2 threads, STEPS timed after 3 warm-up);
#   - train: steady-state samples/s of the digits MLP in 2 stages under each schedule
#     (the main job's settings) and of gpt2-tiny in 2 stages under 2BW (b = 4, m = 4).
#
# Usage: bash bench/compare_binaries.sh BEFORE AFTER   (release binaries)
# Env:   ROUNDS (3), STEPS (20), CORPUS (../shared/corpus/models)
# Prints one Markdown table: the median over rounds of each binary, and AFTER / BEFORE
# (for times, below 1 is faster; for samples/s, above 1 is faster).
set -euo pipefail
cd "$(dirname "$0")/.."

A="${1:?usage: compare_binaries.sh BEFORE AFTER}"
B="${2:?usage: compare_binaries.sh BEFORE AFTER}"
ROUNDS="${ROUNDS:-3}"
STEPS="${STEPS:-20}"
CORPUS="${CORPUS:-../shared/corpus/models}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

median() { sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }

# bench-step's median ms/step.
step_ms() {
    "$1" bench-step "$CORPUS/$2.onnx" --inputs "$CORPUS/$2.inputs" --threads 2 --steps "$STEPS" --warmup 3 --train \
        | sed -n 's/.*median_ms=\([0-9.]*\).*/\1/p'
}

# The mean samples/s of a training run's steps after the first 5.
train_rate() {
    local bin="$1" build="$2" metrics="$work/m.jsonl"
    shift 2
    "$bin" train "$build" "$@" --metrics "$metrics" --no-progress >/dev/null 2>&1
    python3 -c 'import json,sys; r=[json.loads(l)["samples_per_s"] for l in open(sys.argv[1])][5:]; print(sum(r)/len(r))' "$metrics"
}

cases=("step resnet18" "step gpt2-tiny" "train mlp 2bw" "train mlp flush" "train mlp gpipe" "train gpt2-tiny 2bw")
for c in "${cases[@]}"; do
    read -r kind model schedule <<<"$c"
    if [[ $kind == train ]]; then
        for side in A B; do
            bin="${!side}"
            "$bin" compile "$CORPUS/$model.onnx" --stages 2 --schedule "$schedule" -o "$work/$side-$model-$schedule" >/dev/null 2>&1
        done
    fi
done

declare -A runs
for round in $(seq "$ROUNDS"); do
    for c in "${cases[@]}"; do
        read -r kind model schedule <<<"$c"
        for side in A B; do
            bin="${!side}"
            if [[ $kind == step ]]; then
                v="$(step_ms "$bin" "$model")"
            elif [[ $model == mlp ]]; then
                v="$(train_rate "$bin" "$work/$side-$model-$schedule" --data examples/digits/digits.npz --label label --output linear_3 \
                    --steps 200 --microbatch 16 --microbatches 4 --optimizer adam --lr 0.003)"
            else
                v="$(train_rate "$bin" "$work/$side-$model-$schedule" --steps 25 --microbatch 4 --microbatches 4 --lr 1e-4)"
            fi
            runs["$c|$side"]+="$v "
        done
    done
    echo "round $round of $ROUNDS done" >&2
done

echo "| benchmark | unit | before (median of $ROUNDS) | after | after / before |"
echo "|---|---|---|---|---|"
for c in "${cases[@]}"; do
    read -r kind model schedule <<<"$c"
    a="$(tr ' ' '\n' <<<"${runs["$c|A"]}" | grep . | median)"
    b="$(tr ' ' '\n' <<<"${runs["$c|B"]}" | grep . | median)"
    unit=$([[ $kind == step ]] && echo "ms/step" || echo "samples/s")
    printf '| %s | %s | %.2f | %.2f | %.3f |\n' "$c" "$unit" "$a" "$b" "$(echo "$b / $a" | bc -l)"
done
