#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, as one script for a machine with an NVIDIA GPU and a CUDA
# PyTorch 2.11.0 (see ../shared/gpu.md): the binary built here runs against that
# PyTorch's torch/lib, with NO LD_PRELOAD (libtorch_cuda.so must come from pipewright's
# own dlopen). Usage: scripts/gpu-check.sh PIPEWRIGHT_BINARY MODELS_DIR OUT_DIR
# Not yet run on a GPU (written 2026-11-30 on a CPU-only machine).
set -u
BIN=$1 MODELS=$2 OUT=$3
TL=$(python3 -c "import torch,os; print(os.path.dirname(torch.__file__)+'/lib')")
export LD_LIBRARY_PATH=$TL
mkdir -p "$OUT"
run() { echo "== $*"; timeout 120 "$@" 2>&1 | tail -4; echo "rc=${PIPESTATUS[0]}"; }
run "$BIN" doctor
run "$BIN" run-forward "$MODELS/gpt2-tiny.onnx" --inputs "$MODELS/gpt2-tiny.inputs" --device cuda
"$BIN" compile "$MODELS/gpt2-tiny.onnx" --stages 2 -o "$OUT/g2" >/dev/null
for p in fp32 bf16 fp16; do
  run "$BIN" train "$OUT/g2" --steps 6 --microbatch 4 --microbatches 2 --optimizer adam --lr 0.001 \
    --no-progress --device cuda --precision $p --metrics "$OUT/g2-$p.jsonl"
done
# Two "devices" that are the one GPU, and a CPU + GPU split: losses as with --device cuda.
run "$BIN" train "$OUT/g2" --steps 6 --microbatch 4 --microbatches 2 --optimizer adam --lr 0.001 \
  --no-progress --devices cuda:0,cuda:0 --metrics "$OUT/g2-placed.jsonl"
run "$BIN" train "$OUT/g2" --steps 6 --microbatch 4 --microbatches 2 --optimizer adam --lr 0.001 \
  --no-progress --devices cpu,cuda:0 --metrics "$OUT/g2-split.jsonl"
for f in "$OUT"/g2-*.jsonl; do echo "$f: $(python3 -c "import json,sys; print([round(json.loads(l)['loss'],4) for l in open(sys.argv[1])])" "$f")"; done
