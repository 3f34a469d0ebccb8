#!/usr/bin/env bash
# Obtain a CPU-usable libtorch 2.11.0 for tch 0.24 and print the directory to use as LIBTORCH.
#
# Idempotent: the wheels and the assembled directory are cached under
# ${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}, so a fresh clone reuses them.
# A user who sets LIBTORCH (their own libtorch) or LIBTORCH_USE_PYTORCH=1 (a PyTorch install)
# keeps that choice: this script then does nothing but echo it.
#
# Progress goes to stderr; the only line on stdout is the LIBTORCH directory.
#
# It also points the symlink `.libtorch` at the repository root at the assembled directory;
# `.cargo/config.toml` sets LIBTORCH to that link (unless the caller set LIBTORCH), so plain
# `cargo build` / `cargo test` find libtorch, and build scripts bake its resolved lib/ in as rpath.
set -euo pipefail

TORCH_VERSION=2.11.0
CUDART_SPEC='nvidia-cuda-runtime==13.0.96.*'
CUPTI_SPEC='nvidia-cuda-cupti==13.0.85.*'

log() { echo "libtorch.sh: $*" >&2; }

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
link_repo() { # link_repo DIR: point <repo>/.libtorch at DIR (replacing an old link only)
    local link="$repo_root/.libtorch"
    if [[ -e "$link" && ! -L "$link" ]]; then
        log "not linking: $link exists and is not a symlink"
        return 0
    fi
    ln -sfn "$1" "$link"
    log "linked $link -> $1"
}

if [[ -n "${LIBTORCH:-}" ]]; then
    log "using LIBTORCH=$LIBTORCH as set by the caller"
    echo "$LIBTORCH"
    exit 0
fi
if [[ "${LIBTORCH_USE_PYTORCH:-}" == "1" ]]; then
    log "LIBTORCH_USE_PYTORCH=1: torch-sys will use the Python torch install"
    echo ""
    exit 0
fi

cache="${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}"
root="$cache/libtorch-$TORCH_VERSION-cpu"
stamp="$root/.complete"
if [[ -f "$stamp" ]]; then
    log "cached libtorch $TORCH_VERSION at $root"
    link_repo "$root"
    echo "$root"
    exit 0
fi

mkdir -p "$cache/wheels"
wheels="$cache/wheels"
fetch() { # fetch SPEC GLOB: download a wheel unless one matching GLOB is cached
    local spec="$1" glob="$2"
    if compgen -G "$wheels/$glob" >/dev/null; then
        log "cached wheel for $spec"
    else
        log "downloading $spec (pip download)"
        python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$wheels" "$spec" >&2
    fi
}
fetch "torch==$TORCH_VERSION" "torch-$TORCH_VERSION-*.whl"
fetch "$CUDART_SPEC" "nvidia_cuda_runtime-13.0.96*.whl"
fetch "$CUPTI_SPEC" "nvidia_cuda_cupti-13.0.85*.whl"

tmp="$(mktemp -d "$cache/.assemble.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
log "unpacking wheels into $tmp"
for w in "$wheels"/torch-$TORCH_VERSION-*.whl; do
    python3 -m zipfile -e "$w" "$tmp/torch-wheel" >&2
done
for w in "$wheels"/nvidia_cuda_runtime-13.0.96*.whl "$wheels"/nvidia_cuda_cupti-13.0.85*.whl; do
    python3 -m zipfile -e "$w" "$tmp/nvidia" >&2
done

# The CPU view: every torch/lib file except the CUDA ones, plus cudart and cupti which
# libtorch_cpu.so needs at load time even without a GPU.
mkdir -p "$tmp/out/lib"
for f in "$tmp"/torch-wheel/torch/lib/*; do
    case "$(basename "$f")" in
        *cuda*|*nvrtc*|*nvshmem*) ;;
        *) mv "$f" "$tmp/out/lib/" ;;
    esac
done
find "$tmp/nvidia" -name 'libcudart.so.13*' -exec mv {} "$tmp/out/lib/" \;
find "$tmp/nvidia" -name 'libcupti.so.13*' -exec mv {} "$tmp/out/lib/" \;
mv "$tmp/torch-wheel/torch/include" "$tmp/out/include"
mkdir -p "$tmp/out/share"
touch "$tmp/out/.complete"
rm -rf "$root"
mv "$tmp/out" "$root"
log "libtorch $TORCH_VERSION (CPU view) ready at $root"
link_repo "$root"
echo "$root"
