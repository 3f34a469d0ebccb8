#!/usr/bin/env python3
"""How well models of the operations' spread reproduce a run's bubble (docs/simulator.md,
the operations' spread).

Each trace's compute events are replayed in the order each stage ran them, through the
stages' dependencies alone (as `pipeline_stats.py reorder`), with:
  - the measured durations;
  - each stage's mean per kind;
  - durations drawn independently from the trace's pooled factors (duration over its
    stage and kind's mean, steps from --warmup on);
  - the same drawn in spells (a Gaussian AR(1) order whose lag-one correlation is that of
    the two stages' difference, concurrent operations paired);
  - drawn independently, shrunk toward 1 by sqrt(1 - shared), `shared` the correlation
    of the two stages' concurrent operations (the trace's own, or --shared);
  - the measured durations with every later stage's sequence of a kind shifted
    circularly by a random offset (each stage's own order kept, the stages' alignment
    broken), and dealt at random.
Draws are the mean of --draws seeded replays. Prints one line per trace and, over all
of them, each model's mean error against the measured durations' bubble.

Usage: bench/spread_models.py TRACE.json ... [--draws 40] [--shared C] [--warmup 2]
"""
import argparse
import math
import os
import random
import statistics
import sys
from statistics import NormalDist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_stats as ps  # noqa: E402

TIMED = ("forward", "backward")


def lag_one(seq):
    m = statistics.mean(seq)
    sq = sum((x - m) ** 2 for x in seq)
    return sum((a - m) * (b - m) for a, b in zip(seq, seq[1:])) / sq if sq > 0 else 0.0


def correlation(a, b):
    ma, mb = statistics.mean(a), statistics.mean(b)
    den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / den if den > 0 else 0.0


def concurrent_pairs(factors, stages):
    """(first stage's factor, the factor of the second stage's operation overlapping it
    most), where that overlap covers over half of the first's."""
    pairs = []
    for a0, a1, fa in factors[stages[0]]:
        best = max(factors[stages[1]], key=lambda o: min(a1, o[1]) - max(a0, o[0]))
        if min(a1, best[1]) - max(a0, best[0]) > 0.5 * (a1 - a0):
            pairs.append((fa, best[2]))
    return pairs


def models(path, draws, shared_fixed, warmup):
    stages, order = ps.stage_orders(ps.read_events(path))
    mean = {}
    for k in stages:
        for name in ps.BUSY:
            durs = [e["dur"] for e in order[k] if e["name"] == name]
            if durs:
                mean[(k, name)] = statistics.mean(durs)
    factors = {k: [(e["ts"], e["ts"] + e["dur"], e["dur"] / mean[(k, e["name"])]) for e in order[k] if e["name"] in TIMED and (ps.step_of(e) or 0) >= warmup] for k in stages}
    pairs = concurrent_pairs(factors, stages)
    shared = correlation([a for a, _ in pairs], [b for _, b in pairs]) if shared_fixed is None else shared_fixed
    persistence = max(0.0, lag_one([a - b for a, b in pairs]))
    pooled = sorted(f for k in stages for _, _, f in factors[k])
    normal = NormalDist()

    def drawn(seed, shrink, keep):
        rnd, table = random.Random(seed), {}
        for k in stages:
            z = 0.0
            for p, e in enumerate(order[k]):
                g = rnd.gauss(0.0, 1.0)
                z = g if p == 0 else keep * z + math.sqrt(1 - keep * keep) * g
                f = pooled[min(int(normal.cdf(z) * len(pooled)), len(pooled) - 1)]
                table[(k, p)] = mean[(k, e["name"])] * (1 + shrink * (f - 1)) if e["name"] in TIMED else e["dur"]
        return ps.replay_in_order(order, stages, lambda k, p, e: table[(k, p)])

    positions = {}
    for k in stages:
        for p, e in enumerate(order[k]):
            positions.setdefault((k, e["name"]), []).append(p)

    def rearranged(seed, shift):
        rnd, table = random.Random(seed), {}
        for (k, name), ps_ in sorted(positions.items()):
            durs = [order[k][p]["dur"] for p in ps_]
            if shift and k != stages[0]:
                o = rnd.randrange(len(durs))
                durs = durs[o:] + durs[:o]
            elif not shift:
                rnd.shuffle(durs)
            table.update({(k, p): d for p, d in zip(ps_, durs)})
        return ps.replay_in_order(order, stages, lambda k, p, e: table[(k, p)])

    avg = lambda f: statistics.mean(f(s) for s in range(draws))
    shrink = math.sqrt(max(0.0, 1 - shared))
    out = {
        "measured": ps.replay_in_order(order, stages, lambda k, p, e: e["dur"]),
        "means": ps.replay_in_order(order, stages, lambda k, p, e: mean.get((k, e["name"]), 0.0)),
        "independent": avg(lambda s: drawn(s, 1.0, 0.0)),
        "spells": avg(lambda s: drawn(s, 1.0, persistence)),
        "shrunk": avg(lambda s: drawn(s, shrink, 0.0)),
        "shifted": avg(lambda s: rearranged(s, True)),
        "dealt": avg(lambda s: rearranged(s, False)),
    }
    return shared, persistence, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--draws", type=int, default=40)
    ap.add_argument("--shared", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for path in a.traces:
        shared, persistence, out = models(path, a.draws, a.shared, a.warmup)
        rows.append(out)
        print(f"{path}: shared {shared:.2f} persistence {persistence:.2f} | " + " | ".join(f"{k} {v:.3f}" for k, v in out.items()))
    for k in rows[0]:
        if k == "measured":
            continue
        rel = [(r[k] - r["measured"]) / r["measured"] for r in rows]
        print(f"{k}: mean error {statistics.mean(abs(x) for x in rel):.1%}, bias {statistics.mean(rel):+.1%}, within 15% {sum(abs(x) <= 0.15 for x in rel)} of {len(rel)}")


if __name__ == "__main__":
    main()
