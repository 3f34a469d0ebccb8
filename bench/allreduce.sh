#!/usr/bin/env bash
# Gradient sums over MPI, side by side in one run:
#  1. one sum of each payload over W ranks (`pipewright bench-allreduce` under mpirun),
#     the fixed order (gathered to the first rank, added in the embedded executor's
#     order, sent back: `--deterministic-reduce`) against MPI's all-reduce (the default);
#  2. the step time of 2-stage pipelines under 2BW (with R replicas: 2 x R ranks) embedded,
#     over MPI in the fixed order and over MPI's all-reduce (per model the median over
#     ROUNDS rotated rounds of each run's median seconds per step after WARMUP; the
#     last step is left out too, as under 2BW an MPI run's last update ends early); the
#     GPT-2-small-shaped model (`synth gpt`, 128 tokens, tied embedding) is written here;
#  3. how far MPI's all-reduce moves training from the fixed order: 2 stages x 4 replicas
#     (8 ranks, where the order of additions differs), STEPS_DIFF steps, the largest
#     weight difference relative to each tensor's largest magnitude.
#
# Usage: bash bench/allreduce.sh
# Env:   PW (default target/release/pipewright), PARTS ("1 2 3"), RANKS ("2 4 8"), SIZES
#        (1MiB,4MiB,16MiB,64MiB,256MiB), REPEAT (5), STEP_MODELS ("gpt2-tiny:20:2
#        resnet18:6:2 gpt2-small:4:1": model:timed steps:replicas), ROUNDS (3), WARMUP
#        (3), DIFF_MODELS ("mlp
#        gpt2-tiny bert-tiny"), STEPS_DIFF (50), MODELS_DIR (../shared/corpus/models),
#        OUT (target/bench/allreduce).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
PW="${PW:-$repo/target/release/pipewright}"
RANKS="${RANKS:-2 4 8}"
SIZES="${SIZES:-1MiB,4MiB,16MiB,64MiB,256MiB}"
REPEAT="${REPEAT:-5}"
PARTS="${PARTS:-1 2 3}"
STEP_MODELS="${STEP_MODELS:-gpt2-tiny:20:2 resnet18:6:2 gpt2-small:4:1}"
ROUNDS="${ROUNDS:-3}"
WARMUP="${WARMUP:-3}"
DIFF_MODELS="${DIFF_MODELS:-mlp gpt2-tiny bert-tiny}"
STEPS_DIFF="${STEPS_DIFF:-50}"
MODELS_DIR="${MODELS_DIR:-$repo/../shared/corpus/models}"
OUT="${OUT:-$repo/target/bench/allreduce}"
PY="${PIPEWRIGHT_PYTHON:-$(bash scripts/pyref.sh)}"
mkdir -p "$OUT"
# The flags `pipewright launch` gives mpirun here (one place they live).
"$PW" compile "$MODELS_DIR/mlp.onnx" --stages 2 -o "$OUT/flags" >/dev/null
read -r -a flags <<<"$("$PW" launch "$OUT/flags" --dry-run | sed -E 's/^mpirun (.*) -np .*/\1/')"

if [[ " $PARTS " == *" 1 "* ]]; then
echo "### One sum over W ranks (median of $REPEAT, rank 0's wall time)"
echo
echo "| payload per rank | ranks | fixed order ms | MPI all-reduce ms | all-reduce / fixed | largest relative gap |"
echo "|---|---|---|---|---|---|"
for w in $RANKS; do
    mpirun "${flags[@]}" -np "$w" "$PW" bench-allreduce --sizes "$SIZES" --repeat "$REPEAT" 2>/dev/null | grep '^|'
done
fi

median_step() {
    "$PY" -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("%.4f" % statistics.median(r["seconds"] for r in rows[int(sys.argv[2]):-1]))' "$1" "$WARMUP"
}

if [[ " $PARTS " == *" 2 "* ]]; then
echo
echo "### 2 stages under 2BW, median seconds per step (after $WARMUP; median of $ROUNDS rounds)"
echo
echo "| model | replicas | embedded | MPI, fixed order | MPI, all-reduce | fixed / embedded | all-reduce / embedded |"
echo "|---|---|---|---|---|---|---|"
for spec in $STEP_MODELS; do
    IFS=: read -r model steps replicas <<<"$spec"
    build="$OUT/$model-r$replicas"
    onnx="$MODELS_DIR/$model.onnx"
    if [[ ! -f $onnx && $model == gpt2-small ]]; then
        onnx="$OUT/gpt2-small.onnx"
        [[ -f $onnx ]] || "$PW" synth gpt --preset gpt2-small --seq 128 --output "$onnx" >/dev/null
    fi
    "$PW" compile "$onnx" --stages 2 --microbatch 2 -o "$build" >/dev/null 2>&1
    opts=(--steps "$((steps + WARMUP + 1))" --microbatch 2 --microbatches 4 --replicas "$replicas" --optimizer sgd --lr 0.0001 --threads 1 --no-progress --log-every 1000000)
    sides=(embedded fixed collective)
    declare -A times=()
    for ((r = 0; r < ROUNDS; r++)); do
        for ((i = 0; i < 3; i++)); do
            side="${sides[$(((i + r) % 3))]}"
            m="$OUT/$model-$side-$r.jsonl"
            case $side in
                embedded) "$PW" train "$build" "${opts[@]}" --metrics "$m" >/dev/null 2>&1 ;;
                fixed) "$PW" launch "$build" -- "${opts[@]}" --deterministic-reduce --metrics "$m" >/dev/null 2>&1 ;;
                collective) "$PW" launch "$build" -- "${opts[@]}" --metrics "$m" >/dev/null 2>&1 ;;
            esac
            times[$side]+="$(median_step "$m") "
        done
    done
    med() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
    e="$(med "${times[embedded]}")"; f="$(med "${times[fixed]}")"; c="$(med "${times[collective]}")"
    awk -v m="$model" -v w="$replicas" -v e="$e" -v f="$f" -v c="$c" 'BEGIN { printf "| %s | %s | %s | %s | %s | %.3f | %.3f |\n", m, w, e, f, c, f / e, c / e }'
    unset times
done
fi

if [[ " $PARTS " == *" 3 "* ]]; then
echo
echo "### MPI's all-reduce against the fixed order: 2 stages x 4 replicas, $STEPS_DIFF steps (adam)"
echo
echo "| model | largest weight difference (relative) | final loss, fixed order | final loss, all-reduce |"
echo "|---|---|---|---|"
for model in $DIFF_MODELS; do
    build="$OUT/diff-$model"
    "$PW" compile "$MODELS_DIR/$model.onnx" --stages 2 -o "$build" >/dev/null
    opts=(--steps "$STEPS_DIFF" --microbatch 2 --microbatches 2 --replicas 4 --optimizer adam --lr 1e-4 --seed 1 --threads 1 --no-progress --log-every 1000000)
    for way in fixed collective; do
        extra=()
        [[ $way == fixed ]] && extra=(--deterministic-reduce)
        "$PW" launch "$build" -- "${opts[@]}" "${extra[@]}" --metrics "$OUT/diff-$model-$way.jsonl" >/dev/null 2>&1
        mv "$build/weights.safetensors" "$OUT/diff-$model-$way.safetensors"
    done
    "$PY" - "$OUT/diff-$model" "$model" <<'PYEOF'
import json, struct, sys
import numpy as np

def load(path):
    # safetensors: an 8-byte header length, a JSON header, the data.
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    return {k: np.frombuffer(data[v["data_offsets"][0]:v["data_offsets"][1]], dtype=np.float32).astype(np.float64)
            for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32"}

base, model = sys.argv[1], sys.argv[2]
a, b = load(base + "-fixed.safetensors"), load(base + "-collective.safetensors")
gap = max(float(np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(a[k])), 1e-12)) for k in a if a[k].size)
last = lambda way: json.loads(open(f"{base}-{way}.jsonl").read().splitlines()[-1])["loss"]
print(f"| {model} | {gap:.1e} | {last('fixed'):.6f} | {last('collective'):.6f} |")
PYEOF
done
fi
