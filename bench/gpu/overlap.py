#!/usr/bin/env python3
"""How much of a measured trace's shard all-gathers and reduce-scatters ran while the rank worked.

    bench/gpu/overlap.py TRACE [--min-hidden S]

TRACE: a run's trace.json (moeplan run writes it; docs/formats.md). Each finished all-gather and
reduce-scatter of the shard group is one span from its start to its finish, and one "_wait" span
for the part its finish waited for; the rest ran while the rank computed (a prefetched all-gather
of the next block, a reduce-scatter left in flight during backward). Prints, per rank, each
collective's count, time, time waited and the share hidden. With --min-hidden S, exits 1 unless
some rank's all-gathers were hidden by at least the share S (0..1).
"""
import argparse
import json
import sys
from collections import defaultdict

SHARD_LANE = 2


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--min-hidden", type=float, default=None)
    args = parser.parse_args()
    try:
        with open(args.trace) as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"overlap.py: {args.trace}: {e}")
    # rank -> category -> [count, microseconds]
    totals = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for e in events:
        if e.get("ph") != "X" or int(e.get("tid", 0)) != SHARD_LANE:
            continue
        t = totals[int(e["pid"])][e.get("cat", "")]
        t[0] += 1
        t[1] += float(e["dur"])
    best = 0.0
    if not totals:
        print("no shard all-gathers or reduce-scatters in the trace")
    for rank in sorted(totals):
        print(f"rank {rank}:")
        for op in ("all_gather", "reduce_scatter"):
            count, total = totals[rank][op]
            waited = totals[rank][op + "_wait"][1]
            if count == 0:
                continue
            hidden = 1.0 - waited / total if total > 0 else 0.0
            print(f"  {op}: {count}, {total / 1000:.1f} ms, waited {waited / 1000:.1f} ms, hidden {100 * hidden:.0f}%")
            if op == "all_gather":
                best = max(best, hidden)
    if args.min_hidden is not None and best < args.min_hidden:
        print(f"the all-gathers were hidden {100 * best:.0f}% at best, under {100 * args.min_hidden:.0f}%")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
