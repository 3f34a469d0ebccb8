#!/usr/bin/env bash
# Issue 3's fwd+bwd benchmark: `pipewright bench-step` vs PyTorch eager (bench/torch_eager.py)
# on the same ONNX models, inputs, loss (sum of outputs) and intra-op thread count.
#
# Usage: bench/fwd_bwd.sh [MODEL ...]      (default: resnet18 gpt2-tiny)
# Env:   THREADS (2), STEPS (20), WARMUP (3), ROUNDS (3: each round runs pipewright then torch,
#        alternating, so both sides see the same machine noise), MODELS_DIR
#        (../shared/corpus/models), BENCH_VENV (${XDG_CACHE_HOME:-~/.cache}/pipewright/bench-venv).
#
# The venv lives outside the repository. torch 2.11.0 comes from the cached wheel that
# scripts/libtorch.sh fetched; that wheel is the CUDA build, whose libtorch_python.so links
# cuBLAS/cuDNN/NCCL..., so `import torch` needs the nvidia-* wheels even on CPU: pip installs
# them from the wheel's own requirements (about 3 GB, once).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
THREADS="${THREADS:-2}"
STEPS="${STEPS:-20}"
WARMUP="${WARMUP:-3}"
ROUNDS="${ROUNDS:-3}"
MODELS_DIR="${MODELS_DIR:-$repo/../shared/corpus/models}"
cache="${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}"
VENV="${BENCH_VENV:-$cache/bench-venv}"
models=("$@")
[[ ${#models[@]} -gt 0 ]] || models=(resnet18 gpt2-tiny)
log() { echo "fwd_bwd.sh: $*" >&2; }

# --- pipewright (release) ---
log "cargo build --release"
cargo build --release >&2
target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
pw="$target_dir/release/pipewright"

# --- torch venv (idempotent) ---
py="$VENV/bin/python"
if [[ -x "$py" ]] && "$py" -c 'import torch, onnx' 2>/dev/null; then
    log "venv $VENV ready (torch $("$py" -c 'import torch; print(torch.__version__)'))"
else
    [[ -x "$py" ]] || { log "creating venv $VENV"; python3 -m venv "$VENV"; }
    wheel="$(compgen -G "$cache/wheels/torch-2.11.0-*.whl" | head -n1 || true)"
    if [[ -n "$wheel" ]]; then
        log "installing $wheel (with its pip deps, nvidia-* included: the CUDA build needs them to import)"
        "$VENV/bin/pip" install --quiet "$wheel" >&2
    else
        log "no cached torch wheel under $cache/wheels: installing torch==2.11.0 from the index"
        "$VENV/bin/pip" install --quiet torch==2.11.0 >&2
    fi
    # bench/torch_eager.py converts the ONNX graph itself (onnx2torch 1.5.15 stops at about
    # opset 17; the corpus models are opset 20).
    log "installing onnx, numpy"
    "$VENV/bin/pip" install --quiet onnx numpy >&2
    "$py" -c 'import torch, onnx' >&2
fi

field() { # field KEY LINE
    sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" <<<"$2"
}
median() { python3 -c 'import statistics,sys; print(f"{statistics.median(map(float, sys.argv[1:])):.3f}")' "$@"; }

declare -A pw_ms torch_ms
for m in "${models[@]}"; do
    onnx_file="$MODELS_DIR/$m.onnx"
    inputs="$MODELS_DIR/$m.inputs"
    pw_ms[$m]=""
    torch_ms[$m]=""
    for r in $(seq 1 "$ROUNDS"); do
        line="$("$pw" bench-step "$onnx_file" --inputs "$inputs" --steps "$STEPS" --warmup "$WARMUP" --threads "$THREADS" | grep '^bench-step ')"
        echo "round $r: $line"
        pw_ms[$m]+=" $(field median_ms "$line")"
        line="$("$py" bench/torch_eager.py "$onnx_file" --inputs "$inputs" --steps "$STEPS" --warmup "$WARMUP" --threads "$THREADS" | grep '^torch-eager ')"
        echo "round $r: $line"
        torch_ms[$m]+=" $(field median_ms "$line")"
    done
done

echo
echo "fwd+bwd per step, CPU, threads=$THREADS, steps=$STEPS warmup=$WARMUP, median over $ROUNDS alternating rounds of per-run medians"
printf '%-12s %16s %16s %18s\n' model pipewright_ms torch_eager_ms pipewright/torch
for m in "${models[@]}"; do
    # shellcheck disable=SC2086
    a="$(median ${pw_ms[$m]})"; b="$(median ${torch_ms[$m]})"
    printf '%-12s %16s %16s %18s\n' "$m" "$a" "$b" "$(python3 -c "print(f'{$a/$b:.2f}x')")"
done
