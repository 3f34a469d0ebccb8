#!/usr/bin/env bash
# The training fingerprint of every shared model: each compiled at d = 2 under each
# schedule and trained a few steps on seeded synthetic data; prints per run the losses of
# every step and a SHA-256 of the trained weights. Two pipewright binaries that print the
# same lines train bit for bit alike (use it before and after a refactoring):
#
#   bash bench/fingerprint.sh [PIPEWRIGHT] > before.txt   # default: target/release/pipewright
#   diff before.txt after.txt
set -euo pipefail
cd "$(dirname "$0")/.."

PW="${1:-target/release/pipewright}"
MODELS="${MODELS:-mlp gpt2-tiny bert-tiny vit-tiny mobilenet_v2 resnet18}"
SCHEDULES="${SCHEDULES:-2bw flush gpipe}"
STEPS="${STEPS:-3}"
CORPUS="${CORPUS:-../shared/corpus/models}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

for model in $MODELS; do
    for schedule in $SCHEDULES; do
        build="$work/$model-$schedule"
        "$PW" compile "$CORPUS/$model.onnx" --stages 2 --schedule "$schedule" -o "$build" >/dev/null 2>&1
        "$PW" train "$build" --steps "$STEPS" --microbatch 2 --microbatches 2 --seed 1 --lr 0.01 \
            --metrics "$build/metrics.jsonl" --no-progress --threads 1 >/dev/null 2>&1 \
            || { echo "$model $schedule: train failed"; continue; }
        losses="$(python3 -c 'import json,sys; print(" ".join(repr(json.loads(l)["loss"]) for l in open(sys.argv[1])))' "$build/metrics.jsonl")"
        weights="$(sha256sum "$build/weights.safetensors" | cut -c1-16)"
        echo "$model $schedule losses=[$losses] weights=$weights"
    done
done
