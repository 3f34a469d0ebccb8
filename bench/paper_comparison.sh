#!/usr/bin/env bash
# The PipeDream-2BW paper's setting (docs/paper-comparison.md): GPT 1.3B, 2.2B and 3.8B at
# sequence length 512, generated with shapes only (no weights written), on 8 servers of
# 8 V100-16GB (NVLink inside, 25 Gbit/s between), fp16 tensor cores with fp32 master
# weights, Adam, global batch 512, 1024 and 2048. For each model and batch the planner
# chooses (w, d, b, recompute) per scheme (and (t, groups, b) for tensor parallelism) and
# `pipewright simulate` replays it; the table is printed as Markdown, with the planner's
# prediction (for the pipeline schemes its own replay over 6 batches, the default BATCHES
# here) and its closed form. Then the same under the paper's own protocol (its section
# 5.2): every scheme with activation recomputation, at the depth and width of 2BW's plan
# (its planner's configuration "for all comparisons"), tensor parallelism split as many
# ways as that depth (16-way spans two servers), each scheme's microbatch its own best.
#
# Usage: bench/paper_comparison.sh [PIPEWRIGHT]   Env: EFFICIENCY (unset: each device's
#        per-kernel model of what it achieves; a number: that flat share instead), BATCHES (6),
#        WORK (a scratch folder; default a temporary one, removed at the end).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pw="${1:-$repo/target/release/pipewright}"
EFFICIENCY="${EFFICIENCY:-}"
BATCHES="${BATCHES:-6}"
work="${WORK:-$(mktemp -d)}"
[ -n "${WORK:-}" ] || trap 'rm -rf "$work"' EXIT
for m in 1.3b 2.2b 3.8b; do
    "$pw" synth gpt --preset "gpt-$m" --weights none -o "$work/gpt-$m.onnx" >/dev/null
done
# The paper's protocol (its section 5.2): every scheme at the configuration its planner
# recommended for 2BW (depth and width), with activation recomputation and the largest
# microbatch that fits; tensor parallelism split as many ways as that depth, as many
# groups as that width. Per scheme, the replay at the largest microbatch that fits.
protocol() { # model batch servers depth width out.json
    local model="$1" batch="$2" servers="$3" d="$4" w="$5" out="$6" b
    for b in 64 32 16 8 4 2 1; do
        "$pw" simulate "$model" --cluster V100-16GB --servers "$servers" --network 25gbit --precision fp16 \
            ${EFFICIENCY:+--efficiency "$EFFICIENCY"} --schedule 2bw,flush,gpipe,model-parallel,tensor-parallel \
            --recompute full --placement stage-major --stages "$d" --width "$w" --tensor-ways "$d" --microbatch "$b" \
            --batch "$batch" --batches "$BATCHES" --json > "$out.b$b"
    done
    python3 - "$out" <<'MERGE'
import json, sys
out = sys.argv[1]
runs = [json.load(open(f"{out}.b{b}")) for b in [64, 32, 16, 8, 4, 2, 1]]
merged = runs[0]
merged["outcomes"] = [next((r["outcomes"][k] for r in runs if r["outcomes"][k].get("simulation")), runs[-1]["outcomes"][k]) for k in range(len(runs[0]["outcomes"]))]
json.dump(merged, open(out, "w"))
MERGE
}
for m in 1.3b 2.2b 3.8b; do
    for batch in 512 1024 2048; do
        start=$(date +%s.%N)
        # The paper's placement: a stage's replicas on consecutive workers (its planner
        # charges the all-reduce NVLink when they fit in a server, the design's model).
        "$pw" simulate "$work/gpt-$m.onnx" --cluster V100-16GB --servers 8 --network 25gbit --precision fp16 \
            ${EFFICIENCY:+--efficiency "$EFFICIENCY"} --schedule 2bw,flush,model-parallel,data-parallel,tensor-parallel \
            --placement stage-major --batch "$batch" --batches "$BATCHES" --json > "$work/$m-$batch.json"
        # GPipe as the paper runs it (after Huang et al.): always recomputing, keeping only
        # each microbatch's stage input until its backward.
        "$pw" simulate "$work/gpt-$m.onnx" --cluster V100-16GB --servers 8 --network 25gbit --precision fp16 \
            ${EFFICIENCY:+--efficiency "$EFFICIENCY"} --schedule gpipe --recompute full \
            --placement stage-major --batch "$batch" --batches "$BATCHES" --json > "$work/$m-$batch-gpipe.json"
        # The planner free to number the workers replica-major as well.
        "$pw" simulate "$work/gpt-$m.onnx" --cluster V100-16GB --servers 8 --network 25gbit --precision fp16 \
            ${EFFICIENCY:+--efficiency "$EFFICIENCY"} --schedule 2bw,flush \
            --batch "$batch" --batches "$BATCHES" --json > "$work/$m-$batch-placed.json"
        "$pw" simulate "$work/gpt-$m.onnx" --cluster V100-16GB --servers 8 --network 25gbit --precision fp16 \
            ${EFFICIENCY:+--efficiency "$EFFICIENCY"} --schedule gpipe --recompute full \
            --batch "$batch" --batches "$BATCHES" --json > "$work/$m-$batch-placed-gpipe.json"
        end=$(date +%s.%N)
        echo "gpt-$m batch $batch: $(echo "$end - $start" | bc) s" >&2
    done
done
# The paper's protocol on its Figure 6 settings: GPT 2.2B 8-deep and 3.8B 16-deep on the
# 64 GPUs at batch 512 and 2048, and 2.2B 8-deep on one server at batch 64 and 256.
start=$(date +%s.%N)
for batch in 512 2048; do
    protocol "$work/gpt-2.2b.onnx" "$batch" 8 8 8 "$work/2.2b-$batch-protocol.json"
    protocol "$work/gpt-3.8b.onnx" "$batch" 8 16 4 "$work/3.8b-$batch-protocol.json"
done
for batch in 64 256; do
    protocol "$work/gpt-2.2b.onnx" "$batch" 1 8 1 "$work/2.2b-server-$batch-protocol.json"
done
echo "the paper's protocol: $(echo "$(date +%s.%N) - $start" | bc) s" >&2
# The paper's single-worker figure: its implementation trains a 355M-parameter GPT at
# about 45 Tflop/s on one V100 (mixed precision); GPT-2 medium's shape at 512 tokens.
"$pw" synth gpt --preset gpt2-medium --seq 512 --weights none -o "$work/gpt-355m.onnx" >/dev/null
"$pw" simulate "$work/gpt-355m.onnx" --cluster V100-16GB --servers 1 --gpus-per-server 1 --precision fp16 \
    ${EFFICIENCY:+--efficiency "$EFFICIENCY"} --schedule data-parallel --batch 32 --batches "$BATCHES" --json > "$work/355m.json"
python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]

def replays(name):
    """A run's report, GPipe's outcome (its own run, always recomputing) appended."""
    r = json.load(open(f"{work}/{name}.json"))
    r["outcomes"] += json.load(open(f"{work}/{name}-gpipe.json"))["outcomes"]
    return r

schemes = ["2bw", "flush", "gpipe", "model-parallel", "data-parallel", "tensor-parallel"]
print("| model | batch | " + " | ".join(schemes) + " | 2BW / Flush | 2BW / GPipe | 2BW / model-parallel | 2BW / tensor-parallel |")
print("|---|---|" + "---|" * (len(schemes) + 4))
for m in ["1.3b", "2.2b", "3.8b"]:
    for batch in [512, 1024, 2048]:
        r = replays(f"{m}-{batch}")
        by = {o["scheme"]: o for o in r["outcomes"]}
        cells, rate = [], {}
        for s in schemes:
            o = by.get(s)
            if not o or not o.get("simulation"):
                cells.append("does not fit" if o and "fits" in (o.get("why_not") or "") else "-")
                continue
            c, x = o["config"], o["simulation"]
            rate[s] = x["samples_per_s"]
            if s == "tensor-parallel":
                # w groups of t GPUs, each layer split over the t GPUs of a group.
                cells.append(f"{x['samples_per_s']:.1f} (t={o['t']} w={c['w']} b={c['b']} m={c['m']}; planner {o['planned_samples_per_s']:.1f})")
                continue
            # Stage-major, the default numbering, is left out of the JSON and the cell.
            placed = " replica-major" if c.get("placement") == "replica-major" else ""
            cells.append(f"{x['samples_per_s']:.1f} (w={c['w']} d={c['d']}{placed} b={c['b']} {c['recompute']}; planner {o['planned_samples_per_s']:.1f}, closed form {o.get('closed_form_samples_per_s') or 0:.1f})" if o["planned_samples_per_s"] else f"{x['samples_per_s']:.1f} (w={c['w']} d={c['d']} b={c['b']})")
        ratio = lambda a, b: f"{rate[a] / rate[b]:.2f}x" if a in rate and b in rate else "-"
        print(f"| GPT {m.upper()} | {batch} | " + " | ".join(cells) + f" | {ratio('2bw', 'flush')} | {ratio('2bw', 'gpipe')} | {ratio('2bw', 'model-parallel')} | {ratio('2bw', 'tensor-parallel')} |")

# The paper's claims (Narayanan et al., ICML 2021, sections 5.1 and 5.2; its figures'
# bars are not quoted), each against the same measure of the replays above.
def table_rates(runs):
    """(model, batch, scheme) -> samples/s over `runs`: (model, batch, report)."""
    out = {}
    for m, batch, r in runs:
        for o in r["outcomes"]:
            if o.get("simulation"):
                out[(m, batch, o["scheme"])] = o["simulation"]["samples_per_s"]
    return out
rates = table_rates([(m, b, replays(f"{m}-{b}")) for m in ["1.3b", "2.2b", "3.8b"] for b in [512, 1024, 2048]])
# The paper's protocol, on its Figure 6 settings.
settings = [("2.2b", b, "GPT 2.2B, 64 GPUs") for b in [512, 2048]] + [("3.8b", b, "GPT 3.8B, 64 GPUs") for b in [512, 2048]]
settings += [("2.2b-server", b, "GPT 2.2B, one server of 8") for b in [64, 256]]
protocol_runs = {(m, b): json.load(open(f"{work}/{m}-{b}-protocol.json")) for m, b, _ in settings}
proto = table_rates([(m, b, r) for (m, b), r in protocol_runs.items()])

print()
print("| setting | batch | 2bw | flush | gpipe | model-parallel | tensor-parallel | 2BW / Flush | 2BW / GPipe | Flush / GPipe | 2BW / model-parallel | 2BW / tensor-parallel |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for key, batch, label in settings:
    by = {o["scheme"]: o for o in protocol_runs[(key, batch)]["outcomes"]}
    cells = []
    for s in ["2bw", "flush", "gpipe", "model-parallel", "tensor-parallel"]:
        o = by.get(s)
        if not o or not o.get("simulation"):
            cells.append("does not fit" if o and "fit" in (o.get("why_not") or "") else "-")
            continue
        c, x = o["config"], o["simulation"]
        shape = f"t={o['t']} w={c['w']} b={c['b']}" if s == "tensor-parallel" else f"w={c['w']} d={c['d']} b={c['b']}"
        cells.append(f"{x['samples_per_s']:.1f} ({shape})")
    r = lambda a, b: f"{proto[(key, batch, a)] / proto[(key, batch, b)]:.2f}x" if (key, batch, a) in proto and (key, batch, b) in proto else "-"
    print(f"| {label} | {batch} | " + " | ".join(cells) + f" | {r('2bw', 'flush')} | {r('2bw', 'gpipe')} | {r('flush', 'gpipe')} | {r('2bw', 'model-parallel')} | {r('2bw', 'tensor-parallel')} |")

def ratio(by, a, b, models, batches):
    vals = [by[(m, x, a)] / by[(m, x, b)] for m in models for x in batches if (m, x, a) in by and (m, x, b) in by]
    return max(vals) if vals else None
all_m, all_b = ["1.3b", "2.2b", "3.8b"], [512, 1024, 2048]
# The paper's throughput claims are about its Figure 6: GPT 2.2B and 3.8B.
fig6 = ["2.2b", "3.8b"]
one = json.load(open(f"{work}/355m.json"))["outcomes"][0]
tflops = 6 * 354_298_880 * 512 * one["simulation"]["samples_per_s"] / 1e12
# (claim, the paper's words, its figure, (schemes, models, batches)): each claim against
# the same measure of both sets of replays (the largest over the rows it covers).
claims = [
    ("2BW over PipeDream-Flush, batch 512 (most)", "up to 1.6x", 1.6, ("2bw", "flush", fig6, [512])),
    ("2BW over PipeDream-Flush, batch 2048 (most)", "15%: 1.15x", 1.15, ("2bw", "flush", fig6, [2048])),
    ("2BW over GPipe (most)", "up to 3.2x", 3.2, ("2bw", "gpipe", fig6, all_b)),
    ("PipeDream-Flush over GPipe, batch 512 (most)", "2.1x", 2.1, ("flush", "gpipe", fig6, [512])),
    ("PipeDream-Flush over GPipe, batch 2048 (most)", "3x", 3.0, ("flush", "gpipe", fig6, [2048])),
    ("2BW over inter-layer model parallelism, GPT 2.2B (most)", "up to 6.1x", 6.1, ("2bw", "model-parallel", ["2.2b"], all_b)),
    ("PipeDream-Flush over inter-layer model parallelism, GPT 2.2B, batch 512", "up to 4.1x", 4.1, ("flush", "model-parallel", ["2.2b"], [512])),
    ("PipeDream-Flush over inter-layer model parallelism, GPT 2.2B, batch 2048", "up to 5.3x", 5.3, ("flush", "model-parallel", ["2.2b"], [2048])),
    ("2BW over tensor model parallelism, GPT 3.8B on 64 GPUs (most)", "20x", 20.0, ("2bw", "tensor-parallel", ["3.8b"], all_b)),
    ("2BW over tensor model parallelism on one server of 8, GPT 2.2B (most)", "1.3x", 1.3, ("2bw", "tensor-parallel", ["2.2b-server"], [64, 256])),
]
def verdict(sim, paper):
    if sim is None:
        return "- | - | -"
    return f"{sim:.2f} | {sim / paper:.2f} | {'yes' if abs(sim / paper - 1) <= 0.2 else 'no'}"
print()
print("| claim | paper | each scheme its own search | / paper | within 20% | the paper's protocol | / paper | within 20% |")
print("|---|---|---|---|---|---|---|---|")
print(f"| one worker, 355M GPT (Tflop/s, 6 x parameters x tokens) | about 45 | {verdict(tflops, 45.0)} | {verdict(tflops, 45.0)} |")
for what, text, paper, (a, b, models, batches) in claims:
    print(f"| {what} | {text} | {verdict(ratio(rates, a, b, models, batches), paper)} | {verdict(ratio(proto, a, b, models, batches), paper)} |")
print()
print("| model | planner's depth (w x d) at batch 512, 2BW | paper's |")
print("|---|---|---|")
paper_depth = {"2.2b": "8-deep (w = 8, d = 8)", "3.8b": "16-deep (w = 4, d = 16)", "1.3b": "not stated"}
for m in all_m:
    c = next(o for o in json.load(open(f"{work}/{m}-512.json"))["outcomes"] if o["scheme"] == "2bw")["config"]
    placed = ", replica-major" if c.get("placement") == "replica-major" else ""
    print(f"| GPT {m.upper()} | w = {c['w']}, d = {c['d']}{placed} | {paper_depth[m]} |")
def gain_table(heading, by):
    """2BW's samples/s at batch 512 and 2048 per model, from `by[(model, batch, scheme)]`."""
    print()
    print(f"| model | {heading} | at 2048 | gain |")
    print("|---|---|---|---|")
    for m in all_m:
        a, b = by[(m, 512, "2bw")], by[(m, 2048, "2bw")]
        print(f"| GPT {m.upper()} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
gain_table("2BW samples/s at batch 512", rates)

# The same schemes with the planner choosing the placement too.
placed = {}
print()
print("| model | batch | 2bw | flush | gpipe | 2BW / Flush | 2BW / GPipe | 2BW against stage-major |")
print("|---|---|---|---|---|---|---|---|")
for m in all_m:
    for batch in all_b:
        by = {o["scheme"]: o for o in replays(f"{m}-{batch}-placed")["outcomes"]}
        cells = []
        for s in ["2bw", "flush", "gpipe"]:
            o = by[s]
            c, x = o["config"], o["simulation"]
            placed[(m, batch, s)] = x["samples_per_s"]
            cells.append(f"{x['samples_per_s']:.1f} (w={c['w']} d={c['d']} {c.get('placement', 'stage-major')} b={c['b']} {c['recompute']})")
        r = lambda a, b: placed[(m, batch, a)] / placed[(m, batch, b)]
        print(f"| GPT {m.upper()} | {batch} | " + " | ".join(cells) + f" | {r('2bw', 'flush'):.2f}x | {r('2bw', 'gpipe'):.2f}x | {placed[(m, batch, '2bw')] / rates[(m, batch, '2bw')]:.2f}x |")
gain_table("2BW samples/s at batch 512, placement chosen", placed)
PY

# Planning time: the whole `plan` command (process start, import, search, replay) for GPT
# 3.8B on the 64 GPUs at batch 512: 2BW with both placements weighed and with stage-major
# only, and every schedule (plan's default) with both placements; alternating, five runs
# each; the median wall time.
plan_wall() { # plan flags...
    local start end
    start=$(date +%s.%N)
    "$pw" plan "$work/gpt-3.8b.onnx" --cluster V100-16GB --servers 8 --network 25gbit --precision fp16 \
        --batch 512 "$@" >/dev/null
    end=$(date +%s.%N)
    echo "$end - $start" | bc
}
both=() staged=() every=()
for _ in 1 2 3 4 5; do
    both+=("$(plan_wall --schedule 2bw)")
    staged+=("$(plan_wall --schedule 2bw --placement stage-major)")
    every+=("$(plan_wall)")
done
median() { printf '%s\n' "$@" | sort -g | sed -n 3p; }
echo
echo "| planning GPT 3.8B, 64 V100s, batch 512 | median wall of 5 (s) | runs (s) |"
echo "|---|---|---|"
printf '| 2BW, both placements | %.2f | %s |\n' "$(median "${both[@]}")" "$(printf '%.2f ' "${both[@]}")"
printf '| 2BW, stage-major only | %.2f | %s |\n' "$(median "${staged[@]}")" "$(printf '%.2f ' "${staged[@]}")"
printf '| every schedule, both placements | %.2f | %s |\n' "$(median "${every[@]}")" "$(printf '%.2f ' "${every[@]}")"
