#!/usr/bin/env bash
# Pipeline schedules on the embedded executor: gpt2-tiny and resnet18 compiled for d = 2
# workers with each schedule (2bw, flush, gpipe, zb-h1: d stages; interleaved-v: d x v
# stages, v per worker; zb-v: 2d stages, 2 per worker in a V), trained on seeded random data, reporting per
# run the steady-state samples/s (metrics JSON lines, first WARMUP steps dropped), each
# worker's bubble fraction and time per microbatch (from the --trace), and the pipeline
# efficiency = samples/s / (samples per microbatch / the slowest worker's busy time per
# microbatch), and each run's rate against 2BW's (the median of per-round ratios).
# Definitions: bench/pipeline_stats.py.
#
# Usage: bench/schedules.sh [MODEL:MICROBATCH:STEPS ...]
#        (default: gpt2-tiny:4:40 resnet18:2:12)
# Env:   ROUNDS (3: each round runs every model x schedule once, the schedules back to back
#        in an order rotated by one each round, so they see the same machine noise and no
#        schedule always runs first; the table gives the median over rounds),
#        WARMUP (3 steps dropped), M (4 microbatches per step), STAGES (2: workers),
#        THREADS (1: libtorch intra-op threads per stage, through OMP_NUM_THREADS and
#        MKL_NUM_THREADS — `pipewright train` has no thread flag; 2 stage threads x 1 on the
#        2-core machine), LR (1e-4, plain SGD: small enough that no run diverges),
#        SCHEDULES ("2bw flush gpipe zb-h1 zb-h2 interleaved-2 zb-v"), MODELS_DIR (../shared/corpus/models),
#        CUTS_FROM (another pipewright binary, e.g. a release build of an earlier commit:
#        each schedule is also compiled by it and trained by this one, labelled "cuts from
#        CUTS_FROM", so two partitioners' cuts run side by side in the same rounds),
#        TRAINED_BY (another pipewright binary, e.g. a release build of an earlier commit:
#        each schedule's build, compiled by this one, is also trained by it, labelled
#        "trained by TRAINED_BY", so two runtimes run side by side in the same rounds),
#        PROFILE (1: also `pipewright profile` each model at its microbatch, outside the
#        rounds, and compile each schedule again from a plan cut by that profile, labelled
#        "cut by a measured profile", beside the cost model's cuts),
#        REFINE (1: with PROFILE=1, also train each schedule's profile-cut build for 8 steps
#        with a trace outside the rounds, `pipewright refine-profile` the profile by that
#        trace (its stages' measured shares of the pass) and compile the schedule again from
#        a plan cut by the refined profile, labelled "cut by a profile refined by its trace"),
#        BENCH_VENV (${XDG_CACHE_HOME:-~/.cache}/pipewright/bench-venv: numpy + onnx for
#        bench/make_data.py), OUT (target/bench/schedules: build folders, data, metrics,
#        traces, SVG timelines, runs.jsonl, table.md).
#
# Data: bench/make_data.py writes an .npz of random inputs (token ids uniform over the
# vocabulary for gpt2-tiny) and class labels shaped like the output without its class axis
# ([N, 32] for gpt2-tiny's per-token logits, [N] for resnet18); `--data synthetic` only
# makes [N] labels.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
ROUNDS="${ROUNDS:-3}"
WARMUP="${WARMUP:-3}"
M="${M:-4}"
STAGES="${STAGES:-2}"
THREADS="${THREADS:-1}"
LR="${LR:-0.0001}"
read -r -a schedules <<<"${SCHEDULES:-2bw flush gpipe zb-h1 zb-h2 interleaved-2 zb-v}"
CUTS_FROM="${CUTS_FROM:-}"
TRAINED_BY="${TRAINED_BY:-}"
PROFILE="${PROFILE:-0}"
REFINE="${REFINE:-0}"
[[ "$REFINE" != 1 ]] || PROFILE=1
# What each round runs: every schedule, and each again as `SCHEDULE@other` with CUTS_FROM,
# as `SCHEDULE@trained` with TRAINED_BY, as `SCHEDULE@profile` with PROFILE=1 and as `SCHEDULE@refined` with REFINE=1 (after
# `@profile`, whose build it refines by).
variants=()
for s in "${schedules[@]}"; do
    variants+=("$s")
    [[ -z "$CUTS_FROM" ]] || variants+=("$s@other")
    [[ -z "$TRAINED_BY" ]] || variants+=("$s@trained")
    [[ "$PROFILE" != 1 ]] || variants+=("$s@profile")
    [[ "$REFINE" != 1 ]] || variants+=("$s@refined")
done
MODELS_DIR="${MODELS_DIR:-$repo/../shared/corpus/models}"
cache="${PIPEWRIGHT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipewright}"
py="${BENCH_VENV:-$cache/bench-venv}/bin/python"
OUT="${OUT:-$repo/target/bench/schedules}"
specs=("$@")
[[ ${#specs[@]} -gt 0 ]] || specs=(gpt2-tiny:4:40 resnet18:2:12)
log() { echo "schedules.sh: $*" >&2; }
# Stages per worker: v for interleaved-v, else 1.
per_worker() { case "$1" in interleaved-*) echo "${1#interleaved-}" ;; zb-v) echo 2 ;; *) echo 1 ;; esac; }

"$py" -c 'import numpy, onnx' 2>/dev/null || { log "$py lacks numpy/onnx (see bench/fwd_bwd.sh for the venv)"; exit 1; }
log "cargo build --release"
cargo build --release >&2
pw="$repo/target/release/pipewright"

mkdir -p "$OUT"
runs="$OUT/runs.jsonl"
: >"$runs"

# Compiles MODEL as variant VARIANT of SCHEDULE in STAGES stages at microbatch MB from a
# plan cut by PROFILE.
compile_planned() {
    local model="$1" s="$2" stages="$3" mb="$4" profile="$5" v="$6"
    "$pw" plan "$MODELS_DIR/$model.onnx" --workers "$STAGES" --stages "$stages" --schedule "$s" --recompute none \
        --microbatch "$mb" --batch $((mb * M)) --profile "$profile" --json >"$OUT/$model-$v.plan.json"
    "$pw" compile "$MODELS_DIR/$model.onnx" --plan "$OUT/$model-$v.plan.json" -o "$OUT/$model-$v" >&2
}

# Trains build DIR of MODEL at microbatch MB for STEPS steps on the model's data with
# pipewright binary BIN, with the rest of the arguments (metrics, trace) added.
train_run() {
    local bin="$1" dir="$2" model="$3" mb="$4" steps="$5"
    shift 5
    "$bin" train "$dir" --data "$OUT/$model.npz" --label label --loss cross-entropy --output "${out_name[$model]}" \
        --steps "$steps" --microbatch "$mb" --microbatches "$M" --optimizer sgd --lr "$LR" --log-every 1000 "$@" >&2
}

# Compile and make the data once per model (outside the timed rounds).
declare -A out_name
for spec in "${specs[@]}"; do
    IFS=: read -r model mb steps <<<"$spec"
    out_name[$model]="$("$py" -c 'import onnx,sys; print(onnx.load(sys.argv[1], load_external_data=False).graph.output[0].name)' "$MODELS_DIR/$model.onnx")"
    "$py" bench/make_data.py "$MODELS_DIR/$model.onnx" -o "$OUT/$model.npz" --samples $((mb * M * 4)) >&2
    [[ "$PROFILE" != 1 ]] || "$pw" profile "$MODELS_DIR/$model.onnx" --batch "$mb" -o "$OUT/$model.profile.json" >&2
    for v in "${variants[@]}"; do
        s="${v%@*}"
        stages=$((STAGES * $(per_worker "$s")))
        case "$v" in
            *@other) "$CUTS_FROM" compile "$MODELS_DIR/$model.onnx" --stages "$stages" --schedule "$s" -o "$OUT/$model-$v" >&2 ;;
            *@profile) compile_planned "$model" "$s" "$stages" "$mb" "$OUT/$model.profile.json" "$v" ;;
            *@refined)
                OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS" train_run "$pw" "$OUT/$model-$s@profile" "$model" "$mb" 8 --trace "$OUT/$model-$v.trace.json"
                "$pw" refine-profile "$OUT/$model.profile.json" --build "$OUT/$model-$s@profile" --trace "$OUT/$model-$v.trace.json" \
                    --batch "$mb" --warmup 2 -o "$OUT/$model-$v.profile.json"
                compile_planned "$model" "$s" "$stages" "$mb" "$OUT/$model-$v.profile.json" "$v" ;;
            *) "$pw" compile "$MODELS_DIR/$model.onnx" --stages "$stages" --schedule "$s" -o "$OUT/$model-$v" >&2 ;;
        esac
    done
done

export OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"
for r in $(seq 1 "$ROUNDS"); do
    for spec in "${specs[@]}"; do
        IFS=: read -r model mb steps <<<"$spec"
        n=${#variants[@]}
        for ((i = 0; i < n; i++)); do
            v="${variants[$(((i + r - 1) % n))]}"
            s="${v%@*}"
            label="$model, $s (microbatch $mb, m = $M)"
            case "$v" in
                *@other) label="$label, cuts from $CUTS_FROM" ;;
                *@trained) label="$label, trained by $TRAINED_BY" ;;
                *@profile) label="$label, cut by a measured profile" ;;
                *@refined) label="$label, cut by a profile refined by its trace" ;;
            esac
            dir="$OUT/$model-$v"
            log "round $r: $model, schedule $v, microbatch $mb x $M, $steps steps"
            bin="$pw"
            [[ "$v" != *@trained ]] || bin="$TRAINED_BY"
            train_run "$bin" "$dir" "$model" "$mb" "$steps" --metrics "$dir/m$r.jsonl" --trace "$dir/trace$r.json"
            "$pw" trace-svg "$dir/trace$r.json" -o "$dir/timeline$r.svg" 2>/dev/null | sed "s/^/round $r $model $s: trace-svg: /" >&2
            "$py" bench/pipeline_stats.py run --metrics "$dir/m$r.jsonl" --trace "$dir/trace$r.json" --warmup "$WARMUP" --workers "$STAGES" $([[ "$s" == zb-v ]] && echo --v-shape) \
                --label "$label" | tee -a "$runs" >&2
        done
    done
done

{
    echo "d = $STAGES workers, $THREADS intra-op thread(s) per worker (OMP_NUM_THREADS), SGD lr $LR, steps after $WARMUP warm-up, median over $ROUNDS round(s); $(getconf _NPROCESSORS_ONLN) CPUs"
    echo
    "$py" bench/pipeline_stats.py table "$runs"
} | tee "$OUT/table.md"
