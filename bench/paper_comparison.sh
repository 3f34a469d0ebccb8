#!/usr/bin/env bash
# The PipeDream-2BW paper's setting (docs/paper-comparison.md): GPT 1.3B, 2.2B and 3.8B at
# sequence length 512, generated with shapes only (no weights written), on 8 servers of
# 8 V100-16GB (NVLink inside, 25 Gbit/s between), fp16 tensor cores with fp32 master
# weights, Adam, global batch 512, 1024 and 2048. For each model and batch the planner
# chooses (w, d, b, recompute) per scheme (and (t, groups, b) for tensor parallelism) and
# `pipewright simulate` replays it; the table is printed as Markdown, with the planner's
# prediction (for the pipeline schemes its own replay over 6 batches, the default BATCHES
# here) and its closed form.
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
for m in 1.3b 2.2b 3.8b; do
    for batch in 512 1024 2048; do
        start=$(date +%s.%N)
        "$pw" simulate "$work/gpt-$m.onnx" --cluster V100-16GB --servers 8 --network 25gbit --precision fp16 \
            ${EFFICIENCY:+--efficiency "$EFFICIENCY"} --batch "$batch" --batches "$BATCHES" --json > "$work/$m-$batch.json"
        end=$(date +%s.%N)
        echo "gpt-$m batch $batch: $(echo "$end - $start" | bc) s" >&2
    done
done
python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
schemes = ["2bw", "flush", "gpipe", "model-parallel", "data-parallel", "tensor-parallel"]
print("| model | batch | " + " | ".join(schemes) + " | 2BW / Flush | 2BW / GPipe | 2BW / model-parallel | 2BW / tensor-parallel |")
print("|---|---|" + "---|" * (len(schemes) + 4))
for m in ["1.3b", "2.2b", "3.8b"]:
    for batch in [512, 1024, 2048]:
        r = json.load(open(f"{work}/{m}-{batch}.json"))
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
            cells.append(f"{x['samples_per_s']:.1f} (w={c['w']} d={c['d']} b={c['b']} {c['recompute']}; planner {o['planned_samples_per_s']:.1f}, closed form {o.get('closed_form_samples_per_s') or 0:.1f})" if o["planned_samples_per_s"] else f"{x['samples_per_s']:.1f} (w={c['w']} d={c['d']} b={c['b']})")
        ratio = lambda a, b: f"{rate[a] / rate[b]:.2f}x" if a in rate and b in rate else "-"
        print(f"| GPT {m.upper()} | {batch} | " + " | ".join(cells) + f" | {ratio('2bw', 'flush')} | {ratio('2bw', 'gpipe')} | {ratio('2bw', 'model-parallel')} | {ratio('2bw', 'tensor-parallel')} |")
PY
