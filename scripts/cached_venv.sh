#!/usr/bin/env bash
# A Python venv cached under ${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}/NAME,
# made by `pip install` of the given arguments (binary wheels only). Idempotent: the venv
# is used only once its stamp says it is complete for exactly these arguments and
# requirement files (an interrupted or outdated set-up is redone). Progress goes to
# stderr; the only line on stdout is the venv's python.
#
#     bash scripts/cached_venv.sh NAME "import a, b" PIP_ARGUMENTS...
#
# NAME: the cache folder; the second argument: Python that must run in the finished venv.
# Used by scripts/pyref.sh (the tests' onnxruntime) and zoo/env.sh (the zoo's exporters).
set -euo pipefail

name="$1"
check="$2"
shift 2
log() { echo "$name: $*" >&2; }

# The stamp covers the arguments, with each `-r` requirements file by its contents, not
# its path: clones of the checkout elsewhere (CI's) share the venv.
words=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    if [[ "${args[i]}" == "-r" ]]; then
        words+=("-r" "$(sha256sum "${args[i + 1]}" | cut -c1-64)")
        i=$((i + 1))
    else
        words+=("${args[i]}")
    fi
done
key="${words[*]}"
cache="${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}"
venv="$cache/$name"
stamp="$venv/.complete-$(echo "$key" | sha256sum | cut -c1-16)"
if [[ -f "$stamp" ]]; then
    log "cached at $venv"
    echo "$venv/bin/python"
    exit 0
fi
mkdir -p "$cache"
rm -rf "$venv"
log "creating $venv ($*)"
python3 -m venv "$venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --only-binary=:all: "$@" >&2
"$venv/bin/python" -c "$check" >&2
touch "$stamp"
log "ready at $venv"
echo "$venv/bin/python"
