#!/usr/bin/env bash
# The token-stream data path against in-memory arrays, and its memory over a file larger
# than the machine's memory:
#
#   - samples/s of gpt2-tiny (2 stages, 2BW, b = 4, m = 4) trained from a raw u16 token
#     file and from an .npz holding the same windows (input_ids and label arrays), both in
#     sequential order so both runs see the same samples (the final losses are printed to
#     show it), alternating ROUNDS times; the mean samples/s of steps 6 on;
#   - the peak resident memory of a run over a sparse token file 4x this machine's
#     available memory (a sparse file costs no disk), shuffled windows.
#
# Usage: bash bench/tokens.sh [BINARY]   (default target/release/pipewright)
# Env:   ROUNDS (3), STEPS (60), CORPUS (../shared/corpus/models)
set -euo pipefail
cd "$(dirname "$0")/.."

PW="${1:-target/release/pipewright}"
ROUNDS="${ROUNDS:-3}"
STEPS="${STEPS:-60}"
CORPUS="${CORPUS:-../shared/corpus/models}"
PY="${PIPEWRIGHT_PYTHON:-$(bash scripts/pyref.sh)}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$PW" compile "$CORPUS/gpt2-tiny.onnx" --stages 2 --schedule 2bw -o "$work/b" >/dev/null 2>"$work/compile.log" || { cat "$work/compile.log" >&2; exit 1; }
# 2,000 windows of 32 (+1) tokens below the vocabulary of 1,000, and the same windows as arrays.
"$PY" - "$work" <<'PYEOF'
import sys
import numpy as np
work, T, W = sys.argv[1], 32, 2000
ids = np.random.default_rng(0).integers(0, 1000, size=W * T + 1).astype("<u2")
ids.tofile(f"{work}/tokens.bin")
windows = np.stack([ids[k * T:k * T + T + 1] for k in range(W)]).astype(np.int64)
np.savez(f"{work}/windows.npz", input_ids=windows[:, :T], label=windows[:, 1:])
PYEOF

rate() { # rate DATA [extra...]: mean samples/s after step 5, and the final loss
    local data="$1"
    shift
    "$PW" train "$work/b" --data "$data" "$@" --steps "$STEPS" --microbatch 4 --microbatches 4 --optimizer adam --lr 1e-3 \
        --data-order sequential --metrics "$work/m.jsonl" --no-progress >/dev/null 2>&1
    "$PY" -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; s=[x["samples_per_s"] for x in r[5:]]; print(sum(s)/len(s), r[-1]["loss"])' "$work/m.jsonl"
}

tok=()
npz=()
for round in $(seq "$ROUNDS"); do
    read -r t tl < <(rate "$work/tokens.bin" --tokens u16)
    read -r n nl < <(rate "$work/windows.npz")
    tok+=("$t")
    npz+=("$n")
    echo "round $round of $ROUNDS: token stream $t samples/s (final loss $tl), .npz $n samples/s (final loss $nl)" >&2
done
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }
t="$(median "${tok[@]}")"
n="$(median "${npz[@]}")"
echo "| data | samples/s (median of $ROUNDS) | / .npz |"
echo "|---|---|---|"
printf '| .npz in memory | %.1f | 1.000 |\n' "$n"
printf '| u16 token stream | %.1f | %.3f |\n' "$t" "$(echo "$t / $n" | bc -l)"

avail_kib="$(awk '/MemAvailable/ {print $2}' /proc/meminfo)"
size=$((4 * avail_kib * 1024))
truncate -s "$size" "$work/huge.bin"
peak="$("$PW" train "$work/b" --data "$work/huge.bin" --tokens u16 --steps 20 --microbatch 4 --microbatches 4 --no-progress 2>/dev/null \
    | sed -n 's/^peak resident memory of this process: //p')"
echo
echo "sparse token file of $((size >> 30)) GiB (4x the $((avail_kib >> 20)) GiB available): peak resident memory $peak"
