#!/usr/bin/env bash
# A Python with onnxruntime, onnx and numpy, the outside reference some tests run exported
# models through (e.g. tests/train.rs `export_takes_any_batch_like_training_did`): a venv
# cached under ${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}/pyref with
# pinned versions (scripts/cached_venv.sh). The only line on stdout is the venv's python,
# which scripts/test.sh passes to the tests as PIPEWRIGHT_PYTHON.
# ml_dtypes (onnx's dependency) is pinned to 0.6.0: 0.7.0 takes 0.8 s to import under
# numpy 2.4 (against 0.1 s), and the zoo test alone starts this Python once per entry.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec bash "$here/cached_venv.sh" pyref 'import onnxruntime, onnx, numpy' onnxruntime==1.32.0 onnx==1.23.2 numpy==2.4.6 ml_dtypes==0.6.0
