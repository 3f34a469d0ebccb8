#!/usr/bin/env bash
# Obtain libtorch 2.11.0 for tch 0.24 and print the directory to use as LIBTORCH: a CPU-only
# view of PyPI's torch wheel by default, the CUDA view (the wheel's CUDA libraries and the NVIDIA
# wheels they load) on a machine with an NVIDIA driver or with PIPEWRIGHT_LIBTORCH_VARIANT=cuda.
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

# Which view: the CUDA one on a machine with an NVIDIA driver, the CPU one elsewhere;
# PIPEWRIGHT_LIBTORCH_VARIANT=cpu|cuda overrides the guess.
has_nvidia_driver() {
    [[ -e /proc/driver/nvidia/version ]] || nvidia-smi -L >/dev/null 2>&1
}
variant="${PIPEWRIGHT_LIBTORCH_VARIANT:-}"
if [[ -z "$variant" ]]; then
    if has_nvidia_driver; then variant=cuda; else variant=cpu; fi
fi
case "$variant" in
    cpu) suffix=cpu ;;
    cuda) suffix=cu130 ;;
    *) log "PIPEWRIGHT_LIBTORCH_VARIANT must be cpu or cuda, not '$variant'"; exit 2 ;;
esac

cache="${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}"
root="$cache/libtorch-$TORCH_VERSION-$suffix"
stamp="$root/.complete"
if [[ -f "$stamp" ]]; then
    log "cached libtorch $TORCH_VERSION ($variant view) at $root"
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
if [[ "$variant" == cuda ]]; then
    # The CUDA libraries the PyPI torch 2.11.0 wheel (built for CUDA 13.0) loads, pinned to
    # the versions its metadata resolves to (cuda-toolkit 13.0.2's extras, cuDNN, cuSPARSELt,
    # NCCL, NVSHMEM). About 1.9 GB of wheels.
    for spec in nvidia-cublas==13.1.0.3 nvidia-cuda-nvrtc==13.0.88 nvidia-cufft==12.0.0.61 \
        nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35 nvidia-cusolver==12.0.4.66 \
        nvidia-cusparse==12.6.3.3 nvidia-nvjitlink==13.0.88 nvidia-nvtx==13.0.85 \
        nvidia-cudnn-cu13==9.19.0.56 nvidia-cusparselt-cu13==0.8.0 nvidia-nccl-cu13==2.28.9 \
        nvidia-nvshmem-cu13==3.4.5; do
        name="${spec%%==*}"
        fetch "$spec" "${name//-/_}-${spec##*==}-*.whl"
    done
fi

tmp="$(mktemp -d "$cache/.assemble.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
log "unpacking wheels into $tmp"
for w in "$wheels"/torch-$TORCH_VERSION-*.whl; do
    python3 -m zipfile -e "$w" "$tmp/torch-wheel" >&2
done
mkdir -p "$tmp/out/lib"
if [[ "$variant" == cuda ]]; then
    # The CUDA view: all of torch/lib and every library of the pinned NVIDIA wheels in one
    # folder, so the binary's rpath finds them; only the driver (libcuda.so.1) comes from the
    # machine.
    for w in "$wheels"/nvidia_*.whl; do
        python3 -m zipfile -e "$w" "$tmp/nvidia" >&2
    done
    mv "$tmp"/torch-wheel/torch/lib/* "$tmp/out/lib/"
    find "$tmp/nvidia" -name '*.so*' -type f -exec mv {} "$tmp/out/lib/" \;
else
    for w in "$wheels"/nvidia_cuda_runtime-13.0.96*.whl "$wheels"/nvidia_cuda_cupti-13.0.85*.whl; do
        python3 -m zipfile -e "$w" "$tmp/nvidia" >&2
    done
    # The CPU view: every torch/lib file except the CUDA ones, plus cudart and cupti which
    # libtorch_cpu.so needs at load time even without a GPU.
    for f in "$tmp"/torch-wheel/torch/lib/*; do
        case "$(basename "$f")" in
            *cuda*|*nvrtc*|*nvshmem*) ;;
            *) mv "$f" "$tmp/out/lib/" ;;
        esac
    done
    find "$tmp/nvidia" -name 'libcudart.so.13*' -exec mv {} "$tmp/out/lib/" \;
    find "$tmp/nvidia" -name 'libcupti.so.13*' -exec mv {} "$tmp/out/lib/" \;
fi
mv "$tmp/torch-wheel/torch/include" "$tmp/out/include"
mkdir -p "$tmp/out/share"
touch "$tmp/out/.complete"
rm -rf "$root"
mv "$tmp/out" "$root"
log "libtorch $TORCH_VERSION ($variant view) ready at $root"
link_repo "$root"
echo "$root"
