#!/usr/bin/env bash
# The set-up and main-job command: installs prerequisites and libtorch, builds pipewright
# in release mode, and runs the main job: compile an example model into a two-stage
# PipeDream-2BW pipeline and train it on the embedded executor.
#
# The example: the shared 4-layer MLP (../shared/corpus/models/mlp.onnx, 64 -> 10) on the
# 8x8 handwritten digits that scikit-learn ships (examples/digits/digits.npz, 1,797
# samples). The loss falls from about 2.3 to under 0.1 in a few seconds on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/prereqs.sh
bash scripts/libtorch.sh >/dev/null
cargo build --release --locked
pw=./target/release/pipewright
model=../shared/corpus/models/mlp.onnx
echo "== pipewright compile $model --stages 2 --schedule 2bw -o build/digits" >&2
"$pw" compile "$model" --stages 2 --schedule 2bw -o build/digits
echo "== pipewright train build/digits --data examples/digits/digits.npz" >&2
"$pw" train build/digits --data examples/digits/digits.npz --label label --output linear_3 \
    --steps 300 --microbatch 16 --microbatches 4 --optimizer adam --lr 0.003 --log-every 50 \
    --metrics build/digits/metrics.jsonl
