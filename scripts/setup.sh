#!/usr/bin/env bash
# The set-up and main-job command: installs prerequisites and libtorch, builds pipewright
# in release mode, and runs the main job on an example model.
#
# The main job today: import the example model, print its summary, run it through the
# runtime's op layer at twice its exported batch (compared with onnxruntime's outputs),
# and compile it into a two-stage 2BW pipeline under build/. (Training that pipeline is the
# open work of the runtime issue.)
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/prereqs.sh
bash scripts/libtorch.sh >/dev/null
cargo build --release --locked
models=../shared/corpus/models
name=gpt2-tiny
echo "== pipewright inspect $models/$name.onnx" >&2
./target/release/pipewright inspect "$models/$name.onnx"
echo "== pipewright run-forward $models/$name.onnx --tile-batch 2" >&2
./target/release/pipewright run-forward "$models/$name.onnx" --inputs "$models/$name.inputs" --tile-batch 2
echo "== pipewright compile $models/$name.onnx --stages 2 -o build/$name" >&2
./target/release/pipewright compile "$models/$name.onnx" --stages 2 --recompute full -o "build/$name"
