#!/usr/bin/env python3
"""Draws Figure 8 (throughput and device utilisation against concurrent clients) from the
markdown that build/bin/multitenancy_bench prints.

    build/bin/multitenancy_bench > mt.md && /usr/bin/python3 tools/plot_multitenancy.py mt.md fig8.png

Needs Debian's python3-matplotlib.
"""
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def figure8_rows(lines):
    rows, in_table = [], False
    for line in lines:
        if line.startswith("| clients |"):
            in_table = True
            continue
        if in_table:
            if not line.startswith("|"):
                break
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0].startswith("---"):
                continue
            rows.append((int(cells[0]), float(cells[1]), float(cells[2].rstrip("%"))))
    return rows


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        rows = figure8_rows(f.read().splitlines())
    if not rows:
        print("no Figure 8 table in " + argv[1], file=sys.stderr)
        return 1
    clients = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(clients, [r[1] for r in rows], "o-", color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_xticks(clients)
    ax.set_xticklabels([str(c) for c in clients])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("runs per second (all clients)", color="tab:blue")
    ax.set_ylim(bottom=0)
    util = ax.twinx()
    util.plot(clients, [r[2] for r in rows], "s--", color="tab:red")
    util.set_ylabel("device utilisation (%)", color="tab:red")
    util.set_ylim(0, 105)
    ax.set_title("Aggregate throughput of ~0.3 ms gang programs")
    fig.tight_layout()
    fig.savefig(argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
