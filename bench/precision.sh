#!/usr/bin/env bash
# Mixed precision against fp32 on the CPU (libtorch computes bf16 and fp16 there): each
# shared model compiled at d = 2 (2BW) and trained STEPS steps from the same seed and
# synthetic data in fp32, bf16 and fp16, and the largest gap between the loss curves,
# relative to the fp32 loss of the step, printed as one Markdown table. fp16 convolutions
# are about 50 times slower than fp32 on this CPU, so the convolutional models are not
# run in fp16 here (fp16 is for GPUs).
#
# Usage: bash bench/precision.sh [BINARY]      (default target/release/pipewright)
# Env:   STEPS (100), LR (1e-4: Adam at 1e-3 makes resnet18's fp32 loss itself jump from
#        8 to 33 by step 3), MODELS_DIR (../shared/corpus/models)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-target/release/pipewright}"
STEPS="${STEPS:-100}"
LR="${LR:-0.0001}"
MODELS_DIR="${MODELS_DIR:-../shared/corpus/models}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

train() { # build precision steps metrics
    "$BIN" train "$1" --steps "$3" --microbatch 4 --microbatches 2 --optimizer adam --lr "$LR" --seed 0 \
        --precision "$2" --no-progress --metrics "$4" >/dev/null 2>&1
}

gap() { # reference metrics, other metrics: the largest relative loss gap over their common steps
    python3 -c '
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
n = min(len(a), len(b))
print(f"{max(abs(x - y) / abs(x) for x, y in zip(a[:n], b[:n])):.2e} over {n} steps")' "$1" "$2"
}

echo "| model | bf16 vs fp32 | fp16 vs fp32 |"
echo "|---|---|---|"
for model in mlp resnet18 mobilenet_v2 bert-tiny gpt2-tiny vit-tiny; do
    build="$work/$model"
    "$BIN" compile "$MODELS_DIR/$model.onnx" --stages 2 -o "$build" >/dev/null 2>&1
    train "$build" fp32 "$STEPS" "$work/$model-fp32.jsonl"
    train "$build" bf16 "$STEPS" "$work/$model-bf16.jsonl"
    if [[ $model == resnet18 || $model == mobilenet_v2 ]]; then
        fp16="not run (fp16 convolutions on this CPU)"
    else
        train "$build" fp16 "$STEPS" "$work/$model-fp16.jsonl"
        fp16="$(gap "$work/$model-fp32.jsonl" "$work/$model-fp16.jsonl")"
    fi
    echo "| $model | $(gap "$work/$model-fp32.jsonl" "$work/$model-bf16.jsonl") | $fp16 |"
done
echo
echo "bench/precision.sh: d = 2 (2BW), microbatch 4 x 2, $STEPS Adam steps at lr $LR, seed 0, synthetic data; $("$BIN" --version 2>/dev/null || echo "$BIN")"
