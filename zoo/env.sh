#!/usr/bin/env bash
# The pinned Python environment that generates the model zoo (zoo/make_zoo.py): torch,
# torchvision, transformers, onnx, onnxscript and onnxruntime at the versions in
# zoo/requirements.txt, from PyPI (about 4 GB with torch's CUDA libraries; the zoo is
# exported on the CPU). Regenerating the zoo needs it (the committed zoo is what the
# tests use), and so does the CPU dry run of the GPU acceptance script
# (scripts/gpu_acceptance.py: GPT-2 from a transformers config, PyTorch eager's step),
# which scripts/test.sh runs.
#
# transformers is pinned at 4.52: from 4.53 on, its decoders build their attention masks
# with vmap, which the TorchScript exporter cannot export (`unordered_map::at`), and a
# zoo without TorchScript exports of today's LLMs would miss what their users bring.
#
# A venv cached under ${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}/zooenv
# (scripts/cached_venv.sh); the only line on stdout is the venv's python:
#     "$(bash zoo/env.sh)" zoo/make_zoo.py
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec bash "$here/../scripts/cached_venv.sh" zooenv 'import torch, torchvision, transformers, onnx, onnxscript, onnxruntime' -r "$here/requirements.txt"
