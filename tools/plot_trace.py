#!/usr/bin/env python3
"""Draws a per-device timeline PNG from a pathways Chrome trace (Client::WriteTrace, demo --trace).

    python3 tools/plot_trace.py trace.json trace.png [FIRST_MS]

Needs Debian's python3-matplotlib. One row per (host, device); one bar per shard of a computation,
coloured by function name. With FIRST_MS, only the first FIRST_MS milliseconds (e.g. one training step).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv):
    if len(argv) not in (3, 4):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        trace = json.load(f)
    hosts = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            hosts[e["pid"]] = e["args"]["name"]
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not slices:
        print("no computations in the trace", file=sys.stderr)
        return 1
    t0 = min(e["ts"] for e in slices)
    if len(argv) == 4:
        slices = [e for e in slices if e["ts"] - t0 < float(argv[3]) * 1000.0]
    rows = sorted({(e["pid"], e["tid"]) for e in slices})
    row_of = {r: i for i, r in enumerate(rows)}
    names = sorted({e["name"] for e in slices})
    colours = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.5))
    for e in slices:
        ax.barh(row_of[(e["pid"], e["tid"])], max(e["dur"], 1) / 1000.0, left=(e["ts"] - t0) / 1000.0,
                color=colours[e["name"]], edgecolor="none")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{hosts.get(p, p)} cpu:{t}" for p, t in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names], labels=names,
              loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
