#!/usr/bin/env bash
# The simulator against real runs on this machine (docs/simulator.md, calibration): for
# gpt2-tiny and resnet18, d = 2 and 4, each schedule: plan the model for d stages with a
# measured profile (b = MICROBATCH, m = M, no recomputation, SGD), compile the plan, train
# it ROUNDS times with a trace, and replay the same plan for STEPS batches from the
# profiles taken just before and just after those runs. Prints one Markdown row per case.
#
# Drift: this machine's speed moves by up to a third over tens of seconds, so one profile
# compared with runs made later measures the machine as much as the simulator. Per model
# the profiles and the runs alternate: profile P0, every run of d = 2, profile P1, every
# run of d = 4, profile P2; a case's runs are bracketed by the profile before and the one
# after them, and it is predicted from each (the mean of the two is the case's figure, as
# a drift that is linear over the bracket cancels in it). The runs of a depth go round
# the schedules (round 1 of each schedule, then round 2, ...), so that a slow spell hits
# one round of several schedules rather than every round of one; the run with the median
# rate stands for a case. The hypervisor's steal time (/proc/stat) over the runs and the
# profiles is printed beside each case: it names a disturbance from outside this machine.
#
# Columns: measured and simulated samples/s (the measured one over the steps after WARMUP,
# bench/pipeline_stats.py; the simulated one between the ends of the first and the last
# batch); the mean bubble fraction over stages (whole run, as trace-svg computes it, on
# both sides, the measured one with the lowest and highest of the case's rounds beside it,
# the spread a replay is judged against; and over the steps the measured rate counts,
# computed alike from the run's trace and the replays' traces by `pipeline_stats.py
# bubble`); then the replay with the
# run's own per-stage mean times
# (`simulate --stage-times`), which separates the schedule model from the cost inputs;
# and, where each stage has a core (d <= HOST_CORES), the whole-run bubble of the run's own
# compute events replayed in their order through the stages' dependencies alone
# (`pipeline_stats.py reorder`), with their measured durations, with each stage's mean
# per kind, and with its durations dealt at random (the mean of 50 replays): what the
# durations' spread adds to the bubble, which every replay of mean times leaves out
# (docs/simulator.md, the operations' spread).
# Both replays run the stages as threads sharing the machine's cores
# (`simulate --host-cores HOST_CORES`), as the embedded executor's stage threads do, on the
# host the profile measured (its crowding and its scheduler's turn); with --stage-times the
# trace's durations are converted back to full-speed work first (docs/simulator.md,
# stages sharing a host's CPU cores), and the profile before the runs describes the host.
#
# Usage: bench/calibrate_simulator.sh [MODEL:MICROBATCH:STEPS ...]
#        (default: gpt2-tiny:4:20 resnet18:2:8)
# Env:   ROUNDS (5), M (4), DEPTHS ("2 4"), SCHEDULES ("2bw flush gpipe"), WARMUP (2),
#        THREADS (1 libtorch thread per stage; the sharing model assumes 1), HOST_CORES
#        (the cores nproc counts, whatever OMP_NUM_THREADS says), BENCH_VENV (a Python
#        with numpy and onnx: scripts/pyref.sh's, by default), OUT (target/bench/calibrate).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
M="${M:-4}"
ROUNDS="${ROUNDS:-5}"
WARMUP="${WARMUP:-2}"
THREADS="${THREADS:-1}"
# nproc honours OMP_NUM_THREADS, which a shell set up for single-threaded runs exports:
# the replays would then put both stages on one core.
HOST_CORES="${HOST_CORES:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
read -r -a depths <<<"${DEPTHS:-2 4}"
read -r -a schedules <<<"${SCHEDULES:-2bw flush gpipe}"
py="${BENCH_VENV:-${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}/pyref}/bin/python"
[[ -x "$py" ]] || { echo "calibrate_simulator.sh: no Python at $py: run scripts/pyref.sh, or set BENCH_VENV" >&2; exit 1; }
OUT="${OUT:-$repo/target/bench/calibrate}"
MODELS_DIR="${MODELS_DIR:-$repo/../shared/corpus/models}"
pw="${PIPEWRIGHT:-${CARGO_TARGET_DIR:-$repo/target}/release/pipewright}"
specs=("$@")
[[ ${#specs[@]} -gt 0 ]] || specs=(gpt2-tiny:4:20 resnet18:2:8)
mkdir -p "$OUT"
export OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"

# The aggregate cpu line's steal and total jiffies.
cpu_jiffies() { awk '/^cpu /{t=0; for (i=2;i<=9;i++) t+=$i; print $9, t; exit}' /proc/stat; }
# Runs "$@" and appends its steal percentage to the file $STEAL_LOG.
with_steal() {
    local s0 t0 s1 t1
    read -r s0 t0 < <(cpu_jiffies)
    "$@"
    read -r s1 t1 < <(cpu_jiffies)
    awk -v s="$((s1 - s0))" -v t="$((t1 - t0))" 'BEGIN{printf "%.2f\n", (t > 0 ? 100 * s / t : 0)}' >>"$STEAL_LOG"
}
profile_to() { STEAL_LOG="$1.steal" with_steal "$pw" profile "$onnx" --batch 1,2,4,8 -o "$1" >&2; }

echo "| model | d | schedule | measured samples/s | simulated: profile before / after | sim / measured (mean of both) | before, after alone | measured bubble (rounds' range) | simulated bubble | simulated (run's stage times) | sim / measured | simulated bubble | bubble over the rate's steps: measured / profile / stage times | run's order alone: measured durations / means / dealt at random | steal % (max) |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for spec in "${specs[@]}"; do
    IFS=: read -r model mb steps <<<"$spec"
    onnx="$MODELS_DIR/$model.onnx"
    out_name="$("$py" -c 'import onnx,sys; print(onnx.load(sys.argv[1], load_external_data=False).graph.output[0].name)' "$onnx")"
    "$py" bench/make_data.py "$onnx" -o "$OUT/$model.npz" --samples $((mb * M * 4)) >&2
    before="$OUT/$model-p0.json"
    rm -f "$before.steal"
    profile_to "$before"
    for i in "${!depths[@]}"; do
        d="${depths[$i]}"
        for s in "${schedules[@]}"; do
            dir="$OUT/$model-d$d-$s"
            rm -rf "$dir" && mkdir -p "$dir"
            "$pw" plan "$onnx" --workers "$d" --stages "$d" --batch $((mb * M)) --microbatch "$mb" --schedule "$s" --recompute none \
                --optimizer sgd --profile "$before" --json > "$dir/plan.json" 2>/dev/null
            "$pw" compile "$onnx" --plan "$dir/plan.json" -o "$dir/build" >&2
        done
        for r in $(seq 1 "$ROUNDS"); do
            for s in "${schedules[@]}"; do
                dir="$OUT/$model-d$d-$s"
                STEAL_LOG="$dir/steal" with_steal "$pw" train "$dir/build" --data "$OUT/$model.npz" --label label --loss cross-entropy --output "$out_name" \
                    --steps "$steps" --optimizer sgd --lr 0.0001 --log-every 1000 --metrics "$dir/m$r.jsonl" --trace "$dir/trace$r.json" >&2
                "$py" bench/pipeline_stats.py run --metrics "$dir/m$r.jsonl" --trace "$dir/trace$r.json" --warmup "$WARMUP" --label "$model d=$d $s" > "$dir/real$r.json"
            done
        done
        after="$OUT/$model-p$((i + 1)).json"
        rm -f "$after.steal"
        profile_to "$after"
        for s in "${schedules[@]}"; do
            dir="$OUT/$model-d$d-$s"
            median_round="$("$py" - "$dir" "$ROUNDS" <<'PY'
import json, sys
dir, n = sys.argv[1], int(sys.argv[2])
rates = sorted((json.load(open(f"{dir}/real{r}.json"))["samples_per_s"], r) for r in range(1, n + 1))
print(rates[len(rates) // 2][1])
PY
)"
            cp "$dir/real$median_round.json" "$dir/real.json"
            cp "$dir/trace$median_round.json" "$dir/trace.json"
            cp "$before" "$dir/profile-before.json"
            cp "$after" "$dir/profile-after.json"
            cat "$before.steal" "$after.steal" "$dir/steal" > "$dir/steal-all"
            for p in before after; do
                "$pw" simulate "$dir/plan.json" --profile "$dir/profile-$p.json" --batches "$steps" --host-cores "$HOST_CORES" --json \
                    --trace "$dir/sim-$p.trace.json" > "$dir/sim-$p.json"
            done
            "$pw" simulate "$dir/plan.json" --stage-times "$dir/trace.json" --profile "$dir/profile-before.json" --batches "$steps" --host-cores "$HOST_CORES" --json \
                --trace "$dir/sim-timed.trace.json" > "$dir/sim-timed.json"
            for t in trace sim-before.trace sim-after.trace sim-timed.trace; do
                "$py" bench/pipeline_stats.py bubble --trace "$dir/$t.json" --warmup "$WARMUP"
            done > "$dir/steady-bubbles"
            if (( d <= HOST_CORES )); then
                for how in "" --means "--shuffle 50"; do
                    # shellcheck disable=SC2086 # an option and its value, or nothing
                    "$py" bench/pipeline_stats.py reorder --trace "$dir/trace.json" $how
                done > "$dir/order-bubbles"
            else
                rm -f "$dir/order-bubbles"
            fi
            "$py" - "$dir" "$model" "$d" "$s" "$ROUNDS" <<'PY'
import json, sys
dir, model, d, s, rounds = sys.argv[1:]
real_b, before_b, after_b, timed_b = (float(x) for x in open(f"{dir}/steady-bubbles").read().split())
real = json.load(open(f"{dir}/real.json"))
sim = lambda name: json.load(open(f"{dir}/{name}.json"))["outcomes"][0]["simulation"]
before, after, timed = sim("sim-before"), sim("sim-after"), sim("sim-timed")
bubble_of = lambda run: sum(st["bubble_whole_run"] for st in run["stages"]) / len(run["stages"])
rb = bubble_of(real)
each = [bubble_of(json.load(open(f"{dir}/real{r}.json"))) for r in range(1, int(rounds) + 1)]
r = real["samples_per_s"]
rate = (before["samples_per_s"] + after["samples_per_s"]) / 2
bubble = (before["bubble_fraction"] + after["bubble_fraction"]) / 2
steal = max(float(x) for x in open(f"{dir}/steal-all").read().split())
try:
    order = " / ".join(f"{float(x):.3f}" for x in open(f"{dir}/order-bubbles").read().split())
except FileNotFoundError:
    order = "-"
print(f"| {model} | {d} | {s} | {r:.1f} | {before['samples_per_s']:.1f} / {after['samples_per_s']:.1f} | {rate / r:.2f} | "
      f"{before['samples_per_s'] / r:.2f}, {after['samples_per_s'] / r:.2f} | {rb:.3f} ({min(each):.3f} to {max(each):.3f}) | {bubble:.3f} | "
      f"{timed['samples_per_s']:.1f} | {timed['samples_per_s'] / r:.2f} | {timed['bubble_fraction']:.3f} | "
      f"{real_b:.3f} / {(before_b + after_b) / 2:.3f} / {timed_b:.3f} | {order} | {steal:.1f} |")
PY
        done
        before="$after"
    done
done
