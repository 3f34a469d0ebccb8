#!/usr/bin/env bash
# The set-up and main-job command: installs prerequisites, builds pipewright in release
# mode, and runs the main job on an example model.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/prereqs.sh
# libtorch for the runtime (cached per user; links it as .libtorch for .cargo/config.toml).
bash scripts/libtorch.sh >/dev/null
cargo build --release --locked
model=../shared/corpus/models/gpt2-tiny.onnx
echo "== pipewright inspect $model" >&2
./target/release/pipewright inspect "$model"
