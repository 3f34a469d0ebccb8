#!/usr/bin/env bash
# The test command: installs what is missing, then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/prereqs.sh
# libtorch for the runtime (cached per user; links it as .libtorch for .cargo/config.toml).
bash scripts/libtorch.sh >/dev/null
# onnxruntime, the outside reference exported models are run through (cached venv).
PIPEWRIGHT_PYTHON="${PIPEWRIGHT_PYTHON:-$(bash scripts/pyref.sh)}"
export PIPEWRIGHT_PYTHON
# torch and transformers, for the CPU dry run of the GPU acceptance script (the zoo's
# pinned environment, cached per user).
PIPEWRIGHT_TORCH_PYTHON="${PIPEWRIGHT_TORCH_PYTHON:-$(bash zoo/env.sh)}"
export PIPEWRIGHT_TORCH_PYTHON
if [[ ! -d ../shared/corpus ]]; then
    echo "test.sh: the shared corpus is missing: expected it at $(cd .. && pwd)/shared/corpus" >&2
    exit 1
fi
# Compile-only commands must build without libtorch: libtorch's crates are not in their
# dependency tree, and they type-check without them (a check, not a build: the test build
# below compiles the same code with code generation).
without_torch="$(cargo tree --locked --no-default-features -p pipewright -e normal,build --prefix none)"
if grep -qE '^(tch|torch-sys) ' <<<"$without_torch"; then
    echo "test.sh: the build without the torch feature depends on libtorch's crates (cargo tree --no-default-features -p pipewright -i torch-sys)" >&2
    exit 1
fi
cargo check --locked --no-default-features -p pipewright
cargo test --workspace --locked 2>&1
