#!/usr/bin/env bash
# The simulator against real runs on this machine (docs/simulator.md, calibration): for
# gpt2-tiny and resnet18, d = 2 and 4, each schedule: profile the model (release build;
# per case, just before its runs), plan it for d stages with that profile (b = MICROBATCH,
# m = M, no recomputation, SGD), compile the plan, train STEPS steps with a trace, and
# replay the same plan for STEPS batches from the same profile. Prints one Markdown row per case: measured and simulated
# samples/s (the measured one over the steps after WARMUP, bench/pipeline_stats.py; the
# simulated one between the ends of the first and the last batch) and the mean bubble
# fraction over stages (whole run, as trace-svg computes it, on both sides); then the same
# replay with the run's own per-stage mean times (`simulate --stage-times`), which
# separates the schedule model from the cost inputs. Both replays run the stages as
# threads sharing the machine's cores (`simulate --host-cores HOST_CORES`), as the
# embedded executor's stage threads do; with --stage-times the trace's durations are
# converted back to full-speed work first (docs/simulator.md, sharing host cores).
#
# Usage: bench/calibrate_simulator.sh [MODEL:MICROBATCH:STEPS ...]
#        (default: gpt2-tiny:4:20 resnet18:2:8)
# Env:   ROUNDS (3 trainings per case; the median-rate one is reported), M (4), DEPTHS ("2 4"), SCHEDULES ("2bw flush gpipe"), WARMUP (2), THREADS (1 libtorch
#        thread per stage; the sharing model assumes 1), HOST_CORES (nproc), BENCH_VENV (/work/venv: numpy + onnx), OUT (target/bench/calibrate).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
M="${M:-4}"
ROUNDS="${ROUNDS:-3}"
WARMUP="${WARMUP:-2}"
THREADS="${THREADS:-1}"
HOST_CORES="${HOST_CORES:-$(nproc)}"
read -r -a depths <<<"${DEPTHS:-2 4}"
read -r -a schedules <<<"${SCHEDULES:-2bw flush gpipe}"
py="${BENCH_VENV:-/work/venv}/bin/python"
OUT="${OUT:-$repo/target/bench/calibrate}"
MODELS_DIR="${MODELS_DIR:-$repo/../shared/corpus/models}"
pw="${PIPEWRIGHT:-${CARGO_TARGET_DIR:-$repo/target}/release/pipewright}"
specs=("$@")
[[ ${#specs[@]} -gt 0 ]] || specs=(gpt2-tiny:4:20 resnet18:2:8)
mkdir -p "$OUT"
export OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"
echo "| model | d | schedule | measured samples/s | simulated (profile) | sim / measured | measured bubble | simulated bubble | simulated (run's stage times) | sim / measured | simulated bubble |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for spec in "${specs[@]}"; do
    IFS=: read -r model mb steps <<<"$spec"
    onnx="$MODELS_DIR/$model.onnx"
    out_name="$("$py" -c 'import onnx,sys; print(onnx.load(sys.argv[1], load_external_data=False).graph.output[0].name)' "$onnx")"
    "$py" bench/make_data.py "$onnx" -o "$OUT/$model.npz" --samples $((mb * M * 4)) >&2
    for d in "${depths[@]}"; do
        for s in "${schedules[@]}"; do
            dir="$OUT/$model-d$d-$s"
            mkdir -p "$dir"
            # Profiled per case, just before its runs: this machine's speed drifts between
            # minutes, and a profile from the start of the script would be compared with
            # runs up to minutes later.
            "$pw" profile "$onnx" --batch 1,2,4,8 -o "$dir/profile.json" >&2
            "$pw" plan "$onnx" --workers "$d" --stages "$d" --batch $((mb * M)) --microbatch "$mb" --schedule "$s" --recompute none \
                --optimizer sgd --profile "$dir/profile.json" --json > "$dir/plan.json" 2>/dev/null
            "$pw" compile "$onnx" --plan "$dir/plan.json" -o "$dir/build" >&2
            # ROUNDS runs; the one with the median rate stands for the case (this machine's
            # speed drifts by up to a quarter between runs minutes apart).
            for r in $(seq 1 "$ROUNDS"); do
                "$pw" train "$dir/build" --data "$OUT/$model.npz" --label label --loss cross-entropy --output "$out_name" \
                    --steps "$steps" --optimizer sgd --lr 0.0001 --log-every 1000 --metrics "$dir/m$r.jsonl" --trace "$dir/trace$r.json" >&2
                "$py" bench/pipeline_stats.py run --metrics "$dir/m$r.jsonl" --trace "$dir/trace$r.json" --warmup "$WARMUP" --label "$model d=$d $s" > "$dir/real$r.json"
            done
            median_round="$("$py" - "$dir" "$ROUNDS" <<'PY'
import json, sys
dir, n = sys.argv[1], int(sys.argv[2])
rates = sorted((json.load(open(f"{dir}/real{r}.json"))["samples_per_s"], r) for r in range(1, n + 1))
print(rates[len(rates) // 2][1])
PY
)"
            cp "$dir/real$median_round.json" "$dir/real.json"
            cp "$dir/trace$median_round.json" "$dir/trace.json"
            "$pw" simulate "$dir/plan.json" --profile "$dir/profile.json" --batches "$steps" --host-cores "$HOST_CORES" --json > "$dir/sim.json"
            "$pw" simulate "$dir/plan.json" --stage-times "$dir/trace.json" --batches "$steps" --host-cores "$HOST_CORES" --json > "$dir/sim-timed.json"
            "$py" - "$dir" "$model" "$d" "$s" <<'PY'
import json, sys
dir, model, d, s = sys.argv[1:]
real = json.load(open(f"{dir}/real.json"))
sim = json.load(open(f"{dir}/sim.json"))["outcomes"][0]["simulation"]
timed = json.load(open(f"{dir}/sim-timed.json"))["outcomes"][0]["simulation"]
rb = sum(st["bubble_whole_run"] for st in real["stages"]) / len(real["stages"])
r = real["samples_per_s"]
print(f"| {model} | {d} | {s} | {r:.1f} | {sim['samples_per_s']:.1f} | {sim['samples_per_s'] / r:.2f} | {rb:.3f} | {sim['bubble_fraction']:.3f} | {timed['samples_per_s']:.1f} | {timed['samples_per_s'] / r:.2f} | {timed['bubble_fraction']:.3f} |")
PY
        done
    done
done
