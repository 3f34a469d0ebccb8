#!/usr/bin/env bash
# Installs what a fresh Debian machine with only the Rust toolchain lacks for pipewright:
# Python 3 with pip (used to fetch the libtorch wheel from PyPI), a C++ compiler (for
# torch-sys), venv support (the tests' onnxruntime reference, scripts/pyref.sh), and Open MPI with its headers and libclang (the multi-process transport:
# the `mpi` crate binds Open MPI through bindgen; `mpirun` launches the workers), and the
# `fortunes` text of the language-model example (examples/text).
# Idempotent: installs nothing when everything is present.
set -euo pipefail

log() { echo "prereqs.sh: $*" >&2; }

# Debian package names of what is missing (a command, or an installed package).
has_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
need=()
command -v python3 >/dev/null 2>&1 || need+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
has_pkg libopenmpi-dev || need+=(libopenmpi-dev)
has_pkg libclang-dev || need+=(libclang-dev)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
# `python3 -m venv` (scripts/pyref.sh: onnxruntime, the tests' outside reference).
python3 -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
# The English text the language-model example trains on (examples/text).
[[ -d /usr/share/games/fortunes ]] || need+=(fortunes)

if ((${#need[@]} == 0)); then
    log "prerequisites present"
    exit 0
fi

sudo=""
if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { log "need root (or sudo) to install: ${need[*]}"; exit 1; }
    sudo="sudo"
fi
log "installing ${need[*]} with apt-get"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >&2
