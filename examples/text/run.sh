#!/usr/bin/env bash
# A small GPT-2-shaped language model trained on real English text, with the validation
# perplexity watched during the run and the loss curves drawn:
#
#   1. the text: the `fortunes` Debian package (installed here when missing), tokenised
#      to bytes by tokenize.py into train.bin and val.bin (u16 ids, 5% held out);
#   2. the model: `pipewright synth gpt` (4 layers, hidden 128, 4 heads, 64 tokens, a
#      vocabulary of 256 bytes);
#   3. two stages under PipeDream-2BW, AdamW with warm-up and cosine decay, evaluated on
#      EVAL_BATCHES validation microbatches every EVAL_EVERY steps;
#   4. `pipewright metrics-svg` draws the training and validation losses and the rate.
#
# Usage: bash examples/text/run.sh [OUT]   (default build/text)
# Env:   STEPS (1500), WARMUP (50), EVAL_EVERY (100), EVAL_BATCHES (40),
#        PW (target/release/pipewright)
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT="${1:-build/text}"
STEPS="${STEPS:-1500}"
WARMUP="${WARMUP:-50}"
EVAL_EVERY="${EVAL_EVERY:-100}"
EVAL_BATCHES="${EVAL_BATCHES:-40}"
PW="${PW:-target/release/pipewright}"

if [[ ! -d /usr/share/games/fortunes ]]; then
    sudo=""
    [[ $(id -u) -ne 0 ]] && sudo="sudo"
    echo "run.sh: installing the Debian package fortunes (the text)" >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq fortunes >&2
fi
mkdir -p "$OUT"
python3 examples/text/tokenize.py "$OUT"
"$PW" synth gpt --preset tiny --layers 4 --hidden 128 --heads 4 --seq 64 --vocab 256 -o "$OUT/gpt.onnx"
"$PW" compile "$OUT/gpt.onnx" --stages 2 --schedule 2bw -o "$OUT/build"
"$PW" train "$OUT/build" --data "$OUT/train.bin" --tokens u16 --steps "$STEPS" --microbatch 8 --microbatches 4 \
    --optimizer adamw --lr 3e-3 --weight-decay 0.01 --warmup "$WARMUP" --decay cosine --clip-norm 1.0 \
    --eval-data "$OUT/val.bin" --eval-every "$EVAL_EVERY" --eval-batches "$EVAL_BATCHES" \
    --log-every 100 --metrics "$OUT/metrics.jsonl"
"$PW" metrics-svg "$OUT/metrics.jsonl" -o "$OUT/curves.svg"
