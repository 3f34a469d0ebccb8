#!/usr/bin/env bash
# What fusing a dynamo export's attention is worth on this CPU: a GPT-2 (HF transformers,
# seeded, no download) exported by torch.onnx's dynamo exporter at a fixed batch, whose
# attention scale is a one-element initializer (docs/ir.md, "Attention scales that are
# initializers"), compiled into one stage twice from the same file: by default (the
# attention fused, run as libtorch's scaled dot-product attention) and with
# `--train-attention-scales` (spelled out as exported: the product, softmax and product,
# the scale trained). Both builds train the same seeded data, alternately, ROUNDS times;
# the table gives samples/s (metrics after WARMUP steps) per round and the median.
#
# Usage: bench/attention_fusion.sh [PIPEWRIGHT]
# Env:   ROUNDS (5), STEPS (10), WARMUP (2), BATCH (2: the export's and the training's
#        microbatch), SEQ (512), LAYERS (4), WIDTH (256), HEADS (4), VOCAB (2000),
#        THREADS (2: libtorch intra-op threads, `train --threads`),
#        TORCH_PYTHON (a Python with torch and transformers: zoo/env.sh's venv by default),
#        BENCH_VENV (numpy + onnx for bench/make_data.py), OUT (target/bench/attention).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
pw="${1:-$repo/target/release/pipewright}"
ROUNDS="${ROUNDS:-5}" STEPS="${STEPS:-10}" WARMUP="${WARMUP:-2}" BATCH="${BATCH:-2}" SEQ="${SEQ:-512}"
LAYERS="${LAYERS:-4}" WIDTH="${WIDTH:-256}" HEADS="${HEADS:-4}" VOCAB="${VOCAB:-2000}" THREADS="${THREADS:-2}"
cache="${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}"
TORCH_PYTHON="${TORCH_PYTHON:-$cache/zooenv/bin/python}"
BENCH_PYTHON="${BENCH_VENV:-$cache/bench-venv}/bin/python"
OUT="${OUT:-$repo/target/bench/attention}"
[[ -x "$pw" ]] || { echo "attention_fusion.sh: no pipewright at $pw (cargo build --release)" >&2; exit 1; }
[[ -x "$TORCH_PYTHON" ]] || { echo "attention_fusion.sh: no Python with torch at $TORCH_PYTHON (bash zoo/env.sh, or set TORCH_PYTHON)" >&2; exit 1; }
rm -rf "$OUT"
mkdir -p "$OUT"

"$TORCH_PYTHON" - "$OUT/gpt2.onnx" "$BATCH" "$SEQ" "$LAYERS" "$WIDTH" "$HEADS" "$VOCAB" <<'PY'
import sys, warnings
import torch, transformers
path, batch, seq, layers, width, heads, vocab = sys.argv[1], *map(int, sys.argv[2:])
torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads)
model = transformers.GPT2LMHeadModel(config).eval()

class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).logits

ids = torch.randint(0, vocab, (batch, seq))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.onnx.export(Logits(model), (ids,), path, dynamo=True, input_names=["input_ids"], output_names=["output"])
PY
"$BENCH_PYTHON" bench/make_data.py "$OUT/gpt2.onnx" -o "$OUT/data.npz" --samples $((BATCH * STEPS)) >/dev/null
"$pw" compile "$OUT/gpt2.onnx" --stages 1 -o "$OUT/fused" 2>"$OUT/fused.notes" >/dev/null
"$pw" compile "$OUT/gpt2.onnx" --stages 1 --train-attention-scales -o "$OUT/spelled" 2>"$OUT/spelled.notes" >/dev/null
count() { "$pw" inspect "$OUT/$1/stage0.pwm" | grep -c "$2" || true; }
echo "fused build: $(count fused 'Attention') Attention nodes, $(count fused 'Softmax') Softmax; spelled-out build: $(count spelled 'Attention') Attention, $(count spelled 'Softmax') Softmax" >&2

rate() { # build round -> samples/s over the steps after WARMUP
    "$pw" train "$OUT/$1" --data "$OUT/data.npz" --label label --loss cross-entropy --output output \
        --steps "$STEPS" --microbatch "$BATCH" --microbatches 1 --optimizer sgd --lr 0.0001 --threads "$THREADS" \
        --no-progress --metrics "$OUT/$1/m$2.jsonl" >/dev/null 2>&1
    python3 -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[2]):]
print(f\"{sum(r['samples'] for r in rows) / sum(r['seconds'] for r in rows):.2f}\")" "$OUT/$1/m$2.jsonl" "$WARMUP"
}
declare -A rates
for r in $(seq 1 "$ROUNDS"); do
    # Alternate which build goes first, so neither always meets the machine first.
    order=(fused spelled)
    (( r % 2 == 0 )) && order=(spelled fused)
    for b in "${order[@]}"; do rates[$b]+="$(rate "$b" "$r") "; done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
f=$(echo "${rates[fused]}" | median) s=$(echo "${rates[spelled]}" | median)
echo "GPT-2 ($LAYERS layers of $WIDTH, $HEADS heads, $SEQ tokens, vocabulary $VOCAB), dynamo export at batch $BATCH, one stage, $THREADS threads, SGD; samples/s after $WARMUP of $STEPS steps, median of $ROUNDS rounds"
echo
echo "| build | samples/s | rounds | against spelled out |"
echo "|---|---|---|---|"
echo "| attention fused (default) | $f | ${rates[fused]}| $(python3 -c "print(f'{$f / $s:.2f}x')") |"
echo "| spelled out (--train-attention-scales) | $s | ${rates[spelled]}| 1.00x |"
