#!/usr/bin/env python3
"""Where a traced step's GPU time went: `moeplan run --kernel-trace N` writes OUT/kernels-rank-R.json
(PyTorch's profiler, a Chrome trace); this sums its GPU kernels and copies by name and prints the
busiest, with the time the GPU was busy against the span from its first kernel to its last.
Without GPU activity (a CPU run) it sums the operators instead.

    bench/gpu/kernels.py OUT/kernels-rank-0.json [--top 25]
"""
import argparse
import collections
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    try:
        events = json.load(open(a.trace))["traceEvents"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"kernels.py: {a.trace}: {e}")
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kind = "GPU kernels and copies" if gpu else "operators (no GPU activity in the trace)"
    chosen = gpu or [e for e in spans if e.get("cat") == "cpu_op"]
    if not chosen:
        sys.exit(f"kernels.py: {a.trace}: no kernels or operators")
    total = collections.Counter()
    calls = collections.Counter()
    for e in chosen:
        total[e["name"]] += float(e["dur"])
        calls[e["name"]] += 1
    busy = sum(total.values())
    first = min(float(e["ts"]) for e in chosen)
    last = max(float(e["ts"]) + float(e["dur"]) for e in chosen)
    print(f"{a.trace}: {kind}: {len(chosen)} spans, {busy / 1e3:.1f} ms in them, "
          f"first to last {(last - first) / 1e3:.1f} ms" + (f" (busy {100 * busy / (last - first):.0f}%)" if gpu else ""))
    for name, us in total.most_common(a.top):
        print(f"  {us / 1e3:9.2f} ms {100 * us / busy:5.1f}% {calls[name]:6d}x  {name[:110]}")


if __name__ == "__main__":
    main()
