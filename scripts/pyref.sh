#!/usr/bin/env bash
# A Python with onnxruntime, onnx and numpy, the outside reference some tests run exported
# models through (e.g. tests/train.rs `export_takes_any_batch_like_training_did`): a venv
# cached under ${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}/pyref with
# pinned versions. Idempotent: a venv is used only once its stamp file says it is complete
# (an interrupted set-up is redone). Progress goes to stderr; the only line on stdout is the
# venv's python, which scripts/test.sh passes to the tests as PIPEWRIGHT_PYTHON.
set -euo pipefail

log() { echo "pyref.sh: $*" >&2; }

pins=(onnxruntime==1.32.0 onnx==1.23.2 numpy==2.4.6)
cache="${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}"
venv="$cache/pyref"
stamp="$venv/.complete-${pins[*]// /-}"
stamp="${stamp// /_}"
if [[ -f "$stamp" ]]; then
    log "cached at $venv"
    echo "$venv/bin/python"
    exit 0
fi
mkdir -p "$cache"
rm -rf "$venv"
log "creating $venv with ${pins[*]}"
python3 -m venv "$venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --only-binary=:all: "${pins[@]}" >&2
"$venv/bin/python" -c 'import onnxruntime, onnx, numpy' >&2
touch "$stamp"
log "ready at $venv"
echo "$venv/bin/python"
