#!/usr/bin/env python3
"""Steady-state figures of one `pipewright train` run, from its --metrics JSON lines and its
--trace (Chrome trace JSON), and a markdown table over several runs. Stdlib only.

Usage:
  pipeline_stats.py run --metrics M.jsonl --trace T.json --warmup W [--label TEXT] [--workers P [--v-shape]]
      prints one JSON object (see below) on stdout; with --workers P (interleaved 1F1B,
      where worker k runs stages k, k + P, ...; with --v-shape ZB-V, where it runs stages k
      and 2P - 1 - k), the per-stage figures are per worker
  pipeline_stats.py table FILE.jsonl
      FILE holds one `run` object per line (several rounds of the same label allowed);
      prints a markdown table, one row per label, the median over its rounds
  pipeline_stats.py bubble --trace T.json --warmup W
      prints the mean over stages of bubble_k (steady), from the trace alone: a real
      run's, or a replay's (`pipewright simulate --trace`), so that both are measured alike
  pipeline_stats.py reorder --trace T.json [--means | --shuffle N]
      replays a real run's compute events in the order each stage ran them, through the
      stages' dependencies alone (a forward after the previous stage's forward of its
      microbatch, a backward after the next stage's backward, a tied-weight allreduce after
      every stage's last backward of the step), with their measured durations (or each
      stage's mean per kind with --means) and nothing between them: no sends, waits or
      untraced work. Prints the whole-run bubble: what the durations and the order alone
      leave, against the run's own (`run`'s bubble_whole_run). With --shuffle N, each
      stage's measured durations of each kind are dealt to its operations in a random
      order (seeds 0 to N-1) and the mean bubble of the N replays is printed: the spread
      alone, as independent draws, without the order the run happened to have

Definitions (steps 1..S of the metrics = batches 0..S-1 of the trace; the first W are
warm-up and dropped):
- samples_per_s: sum of `samples` / sum of `seconds` over metrics steps W+1..S
  (`seconds` is the wall time between consecutive weight updates reported by the last stage).
- busy: forward + backward (+ backward-weight, a split backward's weight gradient) +
  recompute + optimizer durations (send/recv are waiting).
- "stage" below is a worker under --workers: its stages' events together.
- per stage, time per microbatch t_k = busy of the events of batches W..S-1 / number of
  microbatches that stage ran forward in those batches.
- ideal_samples_per_s = samples per microbatch / max_k t_k (the slowest stage's rate, the
  most a pipeline of these stages can sustain); efficiency = samples_per_s / ideal.
- against 2BW (table): the median over rounds of a run's samples_per_s over the 2BW run of
  the same model, microbatches and binary in the same round (the k-th run of a label is
  round k's), so both saw the same machine; with the lowest and highest round's ratio,
  the machine's noise.
- bubble_k (steady): 1 - busy of stage k inside the window / window length, the window
  running from the end of the last stage's update of batch W-1 to the end of its update
  of batch S-1 (the interval the steady samples/s is measured over); busy intervals are
  clipped to the window.
- bubble_k (whole run): 1 - busy / span of the whole trace, what `pipewright trace-svg` prints.
"""
import argparse
import json
import random
import statistics
import sys

BUSY = {"forward", "backward", "backward-weight", "recompute", "optimizer"}


def step_of(e):
    return (e.get("args") or {}).get("step")


def read_events(trace_path):
    ev = json.load(open(trace_path))
    if isinstance(ev, dict):
        ev = ev["traceEvents"]
    return [e for e in ev if e.get("ph") == "X"]


def steady_window(ev, warmup, steps):
    """The steady window on the trace clock (µs): from the end of the last stage's update of
    batch warmup-1 to the end of its update of batch steps-1."""
    last = max(e["tid"] for e in ev)
    opt_end = {step_of(e): e["ts"] + e["dur"] for e in ev if e["tid"] == last and e["name"] == "optimizer"}
    w0 = opt_end[warmup - 1] if warmup > 0 else min(e["ts"] for e in ev)
    return w0, opt_end[steps - 1]


def steady_bubble(ev, w0, w1, stage):
    clipped = sum(max(0.0, min(e["ts"] + e["dur"], w1) - max(e["ts"], w0)) for e in ev if e["tid"] == stage and e["name"] in BUSY)
    return 1.0 - clipped / (w1 - w0)


def mean_steady_bubble(trace_path, warmup):
    ev = read_events(trace_path)
    steps = 1 + max(step_of(e) for e in ev if e["name"] == "optimizer")
    if steps <= warmup:
        sys.exit(f"{trace_path}: {steps} steps, not more than the {warmup} warm-up steps")
    w0, w1 = steady_window(ev, warmup, steps)
    stages = sorted({e["tid"] for e in ev})
    return sum(steady_bubble(ev, w0, w1, k) for k in stages) / len(stages)


def run_stats(metrics_path, trace_path, warmup, label, workers=None, v_shape=False):
    steps = [json.loads(l) for l in open(metrics_path) if l.strip()]
    S = len(steps)
    if S <= warmup:
        sys.exit(f"{metrics_path}: {S} steps, not more than the {warmup} warm-up steps")
    steady = steps[warmup:]
    samples = sum(s["samples"] for s in steady)
    seconds = sum(s["seconds"] for s in steady)

    ev = read_events(trace_path)
    stages = sorted({e["tid"] for e in ev})
    mb_of = lambda e: (e.get("args") or {}).get("microbatch")
    w0, w1 = steady_window(ev, warmup, S)
    t0 = min(e["ts"] for e in ev)
    t1 = max(e["ts"] + e["dur"] for e in ev)

    # microbatches per batch and samples per microbatch
    fw0 = [e for e in ev if e["tid"] == stages[0] and e["name"] == "forward" and step_of(e) == 0]
    m = len(fw0)
    per_mb = steps[-1]["samples"] / m
    if workers:
        # Interleaved: a worker's stages share it; its row is theirs together.
        for e in ev:
            k = e["tid"]
            e["tid"] = (2 * workers - 1 - k if k >= workers else k) if v_shape else k % workers
        stages = sorted({e["tid"] for e in ev})

    out = {"label": label, "steps": S, "warmup": warmup, "m": m, "samples_per_microbatch": per_mb,
           "samples_per_s": samples / seconds, "trace_window_s": (w1 - w0) / 1e6,
           "trace_samples_per_s": samples / ((w1 - w0) / 1e6), "stages": []}
    slowest = 0.0
    for k in stages:
        mine = [e for e in ev if e["tid"] == k]
        busy_steady = sum(e["dur"] for e in mine if e["name"] in BUSY and step_of(e) is not None and step_of(e) >= warmup)
        mbs = {mb_of(e) for e in mine if e["name"] == "forward" and step_of(e) is not None and step_of(e) >= warmup}
        t_mb = busy_steady / len(mbs) / 1e6
        slowest = max(slowest, t_mb)
        busy_all = sum(e["dur"] for e in mine if e["name"] in BUSY)
        kinds = {}
        for e in mine:
            if step_of(e) is not None and step_of(e) >= warmup:
                kinds[e["name"]] = kinds.get(e["name"], 0.0) + e["dur"] / len(mbs) / 1e3
        out["stages"].append({
            "stage": k,
            "microbatches": len(mbs),
            "ms_per_microbatch": t_mb * 1e3,
            "ms_per_microbatch_by_kind": {n: round(v, 3) for n, v in sorted(kinds.items())},
            "bubble_steady": steady_bubble(ev, w0, w1, k),
            "bubble_whole_run": 1.0 - busy_all / (t1 - t0),
        })
    out["ideal_samples_per_s"] = per_mb / slowest
    out["efficiency"] = out["samples_per_s"] / out["ideal_samples_per_s"]
    return out


def stage_orders(ev):
    """The stages, and each stage's compute and allreduce events in the order it ran them."""
    stages = sorted({e["tid"] for e in ev})
    kept = BUSY | {"allreduce"}
    return stages, {k: sorted((e for e in ev if e["tid"] == k and e["name"] in kept), key=lambda e: e["ts"]) for k in stages}


def replay_in_order(order, stages, dur_of):
    """The whole-run bubble of each stage's events in `order` replayed in that order
    through the stages' dependencies alone, an event at position p of stage k lasting
    dur_of(k, p, e) (an allreduce waits for the other stages' last backward, no time)."""
    mb_of = lambda e: (e.get("args") or {}).get("microbatch")
    # A step's gradients are complete after its last backward, or its last weight gradient
    # under a schedule that splits the backward.
    last_backward = {(k, step_of(e)): id(e) for k in stages for e in order[k] if e["name"] in ("backward", "backward-weight")}
    done, clock, busy, pos = {}, {k: 0.0 for k in stages}, {k: 0.0 for k in stages}, {k: 0 for k in stages}
    progress = True
    while progress:
        progress = False
        for i, k in enumerate(stages):
            while pos[k] < len(order[k]):
                e = order[k][pos[k]]
                name = e["name"]
                if name == "forward" and i > 0:
                    needs = [(stages[i - 1], "forward", mb_of(e))]
                elif name == "backward" and i + 1 < len(stages):
                    needs = [(stages[i + 1], "backward", mb_of(e))]
                elif name == "allreduce":
                    needs = [(x, "last backward", step_of(e)) for x in stages if x != k]
                else:
                    needs = []
                if any(n not in done for n in needs):
                    break
                start = max([clock[k]] + [done[n] for n in needs])
                dur = 0.0 if name == "allreduce" else dur_of(k, pos[k], e)
                clock[k] = start + dur
                busy[k] += dur
                done[(k, name, mb_of(e) if name in ("forward", "backward", "backward-weight", "recompute") else step_of(e))] = clock[k]
                if name in ("backward", "backward-weight") and last_backward[(k, step_of(e))] == id(e):
                    done[(k, "last backward", step_of(e))] = clock[k]
                pos[k] += 1
                progress = True
    if any(pos[k] < len(order[k]) for k in stages):
        sys.exit("the events do not replay in their order (a dependency never met)")
    span = max(clock.values())
    return sum(1.0 - busy[k] / span for k in stages) / len(stages)


def reorder_bubble(trace_path, means, seed=None):
    stages, order = stage_orders(read_events(trace_path))
    mean = {}
    for k in stages:
        for name in BUSY:
            durs = [e["dur"] for e in order[k] if e["name"] == name]
            if durs:
                mean[(k, name)] = sum(durs) / len(durs)
    dealt = {}
    if seed is not None:
        rnd = random.Random(seed)
        for k in stages:
            # Sorted: a set's order changes from one run of Python to the next.
            for name in sorted(BUSY):
                durs = [e["dur"] for e in order[k] if e["name"] == name]
                rnd.shuffle(durs)
                dealt[(k, name)] = durs
    if means:
        dur_of = lambda k, p, e: mean[(k, e["name"])]
    elif seed is not None:
        dur_of = lambda k, p, e: dealt[(k, e["name"])].pop()
    else:
        dur_of = lambda k, p, e: e["dur"]
    return replay_in_order(order, stages, dur_of)


def table(path):
    runs = [json.loads(l) for l in open(path) if l.strip()]
    labels = list(dict.fromkeys(r["label"] for r in runs))
    nst = max(len(r["stages"]) for r in runs)
    med = lambda xs: statistics.median(xs)
    hdr = ["run", "rounds", "samples/s"]
    hdr += [f"bubble w{k} (steady / whole run)" for k in range(nst)]
    hdr += [f"ms/microbatch w{k}" for k in range(nst)]
    hdr += ["ideal samples/s", "efficiency", "against 2BW (median; lowest to highest round)"]
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for lab in labels:
        rs = [r for r in runs if r["label"] == lab]
        row = [lab, str(len(rs)), f"{med([r['samples_per_s'] for r in rs]):.2f}"]
        for k in range(nst):
            row.append(f"{med([r['stages'][k]['bubble_steady'] for r in rs]):.3f} / {med([r['stages'][k]['bubble_whole_run'] for r in rs]):.3f}")
        for k in range(nst):
            row.append(f"{med([r['stages'][k]['ms_per_microbatch'] for r in rs]):.1f}")
        row.append(f"{med([r['ideal_samples_per_s'] for r in rs]):.2f}")
        row.append(f"{med([r['efficiency'] for r in rs]):.3f}")
        ratios = ratios_to_2bw(lab, runs)
        row.append(f"{med(ratios):.3f}x ({min(ratios):.2f} to {max(ratios):.2f})" if ratios else "-")
        print("| " + " | ".join(row) + " |")


def twobw_label(label):
    """The label of the 2BW run beside `label`'s ("MODEL, SCHEDULE (...)...": the same model,
    microbatches and binary), or None where `label` is a 2BW run."""
    model, _, rest = label.partition(", ")
    schedule, _, tail = rest.partition(" ")
    return None if schedule == "2bw" else f"{model}, 2bw {tail}"


def ratios_to_2bw(label, runs):
    """Per round, `label`'s samples/s over its 2BW run's in the same round (the k-th run of
    a label is round k's: each round runs every label once), so that both saw the same
    machine; empty where there is no 2BW run to pair with."""
    base = twobw_label(label)
    mine = [r["samples_per_s"] for r in runs if r["label"] == label]
    theirs = [r["samples_per_s"] for r in runs if r["label"] == base]
    return [a / b for a, b in zip(mine, theirs)] if base and len(theirs) == len(mine) else []


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--metrics", required=True)
    r.add_argument("--trace", required=True)
    r.add_argument("--warmup", type=int, required=True)
    r.add_argument("--label", default="")
    r.add_argument("--workers", type=int, default=None)
    r.add_argument("--v-shape", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("file")
    b = sub.add_parser("bubble")
    b.add_argument("--trace", required=True)
    b.add_argument("--warmup", type=int, required=True)
    o = sub.add_parser("reorder")
    o.add_argument("--trace", required=True)
    how = o.add_mutually_exclusive_group()
    how.add_argument("--means", action="store_true")
    how.add_argument("--shuffle", type=int, metavar="N")
    a = ap.parse_args()
    if a.cmd == "run":
        print(json.dumps(run_stats(a.metrics, a.trace, a.warmup, a.label, a.workers, a.v_shape)))
    elif a.cmd == "reorder":
        if a.shuffle is not None and a.shuffle < 1:
            sys.exit("pipeline_stats.py reorder: --shuffle takes a number of replays, at least 1")
        if a.shuffle:
            print(f"{statistics.mean(reorder_bubble(a.trace, False, seed) for seed in range(a.shuffle)):.6f}")
        else:
            print(f"{reorder_bubble(a.trace, a.means):.6f}")
    elif a.cmd == "bubble":
        print(f"{mean_steady_bubble(a.trace, a.warmup):.6f}")
    else:
        table(a.file)


if __name__ == "__main__":
    main()
