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
#     weight difference relative to each tensor's largest magnitude;
#  4. the simulator's view of the same choice at cluster scale (`simulate --reduction`):
#     GPT-2 small data-parallel over W = 8 to 64 V100s, the all-reduce per step and the
#     samples/s by each way of summing (no MPI: seconds).
#
# Usage: bash bench/allreduce.sh
# Env:   PW (default target/release/pipewright), PARTS ("1 2 3 4"), RANKS ("2 4 8"), SIZES
#        (1MiB,4MiB,16MiB,64MiB,256MiB), REPEAT (5), STEP_MODELS ("gpt2-tiny:20:2
#        resnet18:6:2 gpt2-small:4:1": model:timed steps:replicas), ROUNDS (3), WARMUP
#        (3), DIFF_MODELS ("mlp
#        gpt2-tiny bert-tiny"), STEPS_DIFF (50), MODELS_DIR (../shared/corpus/models),
#        SIM_WIDTHS ("8 16 32 64"), OUT (target/bench/allreduce).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
PW="${PW:-$repo/target/release/pipewright}"
RANKS="${RANKS:-2 4 8}"
SIZES="${SIZES:-1MiB,4MiB,16MiB,64MiB,256MiB}"
REPEAT="${REPEAT:-5}"
PARTS="${PARTS:-1 2 3 4}"
SIM_WIDTHS="${SIM_WIDTHS:-8 16 32 64}"
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

if [[ " $PARTS " == *" 4 "* ]]; then
echo
echo "### The simulator's view at scale: GPT-2 small (124M, 512 tokens) data-parallel under 2BW on 8 x 8 V100-16GB, 25 Gbit/s between servers, fp16, global batch 512"
echo
echo "| replicas w | all-reduce ms per step, collective | fixed order | fixed / collective | samples/s, collective | fixed order |"
echo "|---|---|---|---|---|---|"
onnx="$OUT/gpt2-small-512.onnx"
[[ -f $onnx ]] || "$PW" synth gpt --preset gpt2-small --weights none --output "$onnx" >/dev/null
# The paper's cluster as a file, so that `plan --workers W --stages 1` fixes the width.
cat >"$OUT/paper.toml" <<'TOML'
workers_per_node = 8
memory_per_worker = "16GiB"
intra_bw = "150GB/s"
inter_bw = "25Gbit/s"
server_bw = "25Gbit/s"
peak_flops = "125T"
mem_bw = "900GB/s"
TOML
for w in $SIM_WIDTHS; do
    "$PW" plan "$onnx" --cluster "$OUT/paper.toml" --workers "$w" --stages 1 --schedule 2bw --batch 512 --precision fp16 --json >"$OUT/plan-w$w.json"
    for way in collective fixed-order; do
        "$PW" simulate "$OUT/plan-w$w.json" --reduction "$way" --batches 6 --json >"$OUT/sim-w$w-$way.json"
    done
    "$PY" - "$OUT/sim-w$w" "$w" <<'PYEOF'
import json, sys
base, w = sys.argv[1], sys.argv[2]
sim = {way: json.load(open(f"{base}-{way}.json"))["outcomes"][0]["simulation"] for way in ("collective", "fixed-order")}
ar = {way: s["stages"][0]["allreduce_s"] * 1e3 for way, s in sim.items()}
print(f"| {w} | {ar['collective']:.1f} | {ar['fixed-order']:.1f} | {ar['fixed-order'] / ar['collective']:.1f}x | {sim['collective']['samples_per_s']:.1f} | {sim['fixed-order']['samples_per_s']:.1f} |")
PYEOF
done
fi
