#!/usr/bin/env python3
"""Draws the paper's Figures 5, 6 and 7 and Tables 1 and 2 from the markdown tables the benchmarks
print, and turns any benchmark's tables into CSV.

    build/bin/collective_bench --configs 1x4,2x4,4x4,8x4,16x4 --sizes 4 --work 0 > fig5.md
    /usr/bin/python3 tools/plot_figures.py fig5 fig5.md fig5.png

    build/bin/collective_bench --configs 4x1,8x1,16x1 --sizes 4 --work 0,64,128,256,512 > fig6.md
    /usr/bin/python3 tools/plot_figures.py fig6 fig6.md fig6.png

    build/bin/dispatch_bench > dispatch.md
    /usr/bin/python3 tools/plot_figures.py fig7 dispatch.md fig7.png

    build/bin/multitenancy_bench --trace-prefix /tmp/mt_ > mt.md
    /usr/bin/python3 tools/plot_figures.py fig11 /tmp/mt_ fig11.png

    build/bin/train_bench --repeats 3 --tables multi-controller --multi-controller 2x4,4x2,8x1 > table1.md
    build/bin/train_bench --repeats 3 --tables multi-controller --multi-controller 2x4,4x2,8x1 --mc-tensor 2 >> table1.md
    /usr/bin/python3 tools/plot_figures.py table1 table1.md table1.png

    build/bin/train_bench --repeats 3 > table2.md
    /usr/bin/python3 tools/plot_figures.py table2 table2.md table2.png

    /usr/bin/python3 tools/plot_figures.py csv ANY_BENCHMARK_OUTPUT.md > tables.csv

Figures 5 and 6 read collective_bench's Figure 6 table (`--work`; work 0 is Figure 5's step, a
scalar all_reduce and an add), Figure 7 the pipeline tables of dispatch_bench, and Figure 11 the
traces multitenancy_bench writes per client count (PREFIXclients_N.json), Tables 1 and 2
train_bench's tables (one controller against multi-controller; pipelines against SPMD, and islands
against one). Drawing needs
Debian's python3-matplotlib (`make deps-plot`); `csv` needs nothing.
"""
import csv
import glob
import json
import re
import sys
import textwrap


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(lines):
    """Every markdown table in `lines`: (the heading line above it, header cells, rows of cells).
    Rows printed later without a header of their own (collective_bench's Figure 6 table puts a
    line of text after each configuration) join the table before them."""
    found, heading, i = [], "", 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("|") and i + 1 < len(lines) and lines[i + 1].strip().startswith("|---"):
            header = cells(line)
            rows, i = [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            found.append((heading, header, rows))
            continue
        if line.startswith("|") and found and len(cells(line)) == len(found[-1][1]):
            found[-1][2].append(cells(line))
        elif line:
            heading = line
        i += 1
    return found


def number(cell):
    try:
        return float(cell.rstrip("x%"))
    except ValueError:
        return None


def figure6_rows(found):
    """Rows of collective_bench's Figure 6 table as dicts of numbers, with 'config' kept as text."""
    rows = []
    for _, header, body in found:
        if header[:3] != ["hosts x devices", "work", "step ms (MC)"]:
            continue
        for cells in body:
            if len(cells) != len(header):
                continue  # a failed measurement
            row = {h: number(c) for h, c in zip(header, cells)}
            row["config"] = cells[0]
            hosts, devices = (int(v) for v in cells[0].split("x"))
            row["devices"] = hosts * devices
            rows.append(row)
    return rows


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


FORMS = [("OpByOp", "tab:red"), ("Chained", "tab:blue"), ("Fused", "tab:green")]


def figure5(found, out):
    rows = [r for r in figure6_rows(found) if r["work"] == 0]
    if not rows:
        return "no Figure 6 table with work 0 (run collective_bench with --work 0)"
    rows.sort(key=lambda r: r["devices"])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    devices = [r["devices"] for r in rows]
    for form, color in FORMS:
        ax.plot(devices, [r[form] for r in rows], "o-", color=color, label=f"{form} (single controller)")
    ax.plot(devices, [r["MC step"] for r in rows], "s--", color="0.35", label="multi-controller, a call per step")
    ax.plot(devices, [r["MC fused"] for r in rows], "^--", color="0.6", label="multi-controller, fused loop")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(devices)
    ax.set_xticklabels([r["config"] for r in rows])
    ax.set_xlabel("hosts x devices")
    ax.set_ylabel("computations per second")
    ax.set_title("Figure 5: scalar all_reduce + add, each feeding the next")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return None


def figure6(found, out):
    rows = figure6_rows(found)
    if not rows:
        return "no Figure 6 table (run collective_bench with --work)"
    def size(config):
        hosts, devices = (int(v) for v in config.split("x"))
        return (hosts * devices, hosts)

    configs = sorted({r["config"] for r in rows}, key=size)
    plt = pyplot()
    columns = min(3, len(configs))
    lines = (len(configs) + columns - 1) // columns
    fig, axes = plt.subplots(lines, columns, figsize=(4.2 * columns, 3.4 * lines), sharey=True, squeeze=False)
    for ax in axes.flat[len(configs):]:
        ax.set_visible(False)
    ratios = [("OpByOp", "OpByOp/MC"), ("Chained", "Chained/MC"), ("Fused", "Fused/MC fused")]
    for ax, config in zip(axes.flat, configs):
        mine = sorted((r for r in rows if r["config"] == config), key=lambda r: r["step ms (MC)"])
        steps = [r["step ms (MC)"] for r in mine]
        for (form, color), (_, column) in zip(FORMS, ratios):
            ax.plot(steps, [r[column] for r in mine], "o-", color=color, label=form)
        ax.axhline(0.95, color="0.5", linestyle=":", label="95%")
        ax.set_xscale("log")
        ax.set_xlabel("step of the multi-controller (ms)")
        ax.set_title(config)
        ax.grid(True, which="both", alpha=0.3)
    for line in axes:
        line[0].set_ylabel("throughput / multi-controller's")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Figure 6: computation size at which a single controller catches up")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return None


def figure7(found, out):
    pipelines = [(h, rows) for h, header, rows in found if header[:2] == ["stages", "parallel dispatch"]]
    if not pipelines:
        return "no pipeline table (dispatch_bench prints them)"
    plt = pyplot()
    fig, axes = plt.subplots(1, len(pipelines), figsize=(4.2 * len(pipelines), 3.8), sharey=False, squeeze=False)
    for ax, (heading, rows) in zip(axes[0], pipelines):
        stages = [int(r[0]) for r in rows]
        ax.plot(stages, [float(r[1]) for r in rows], "o-", color="tab:blue", label="parallel dispatch")
        ax.plot(stages, [float(r[2]) for r in rows], "s--", color="tab:red", label="sequential dispatch")
        ax.set_xscale("log", base=2)
        ax.set_xticks(stages)
        ax.set_xticklabels([str(s) for s in stages])
        ax.set_xlabel("pipeline stages")
        ax.set_ylim(bottom=0)
        where = heading.split("per stage,", 1)[-1].split(": ms per run")[0].strip() or heading
        ax.set_title("\n".join(textwrap.wrap(where, 48)), fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("ms per pipeline run")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Figure 7: parallel against sequential asynchronous dispatch")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return None


def bars(ax, labels, series, ylabel, fmt):
    """Grouped bars: `series` is [(name, colour, values)], one value per label; each bar carries its
    value."""
    width = 0.8 / len(series)
    for k, (name, colour, values) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        drawn = ax.bar(xs, values, width, color=colour, label=name)
        ax.bar_label(drawn, fmt=fmt, fontsize=7, padding=1)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)


def median(values):
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def table1(found, out):
    """Rows of the same processes x devices and data x tensor (the tables of several runs in one
    file) are drawn as their medians: tokens/s each, and the runs' own ratios."""
    runs = {}
    for _, header, body in found:
        if header[:2] != ["processes x devices", "data x tensor"]:
            continue
        for row in body:
            if len(row) == len(header):
                runs.setdefault((row[0], row[1]), []).append([number(c) for c in row[2:5]])
    if not runs:
        return "no table of one controller against multi-controller (train_bench --tables multi-controller)"
    rows = [list(key) + [median([r[k] for r in measured]) for k in range(3)] for key, measured in runs.items()]
    labels = [f"{r[0]}\n{r[1]}" for r in rows]
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    bars(left, labels, [("one controller", "tab:blue", [r[2] for r in rows]),
                        ("multi-controller", "0.55", [r[3] for r in rows])], "tokens/s", "%.0f")
    left.legend(fontsize=8)
    runs_per_row = max(len(m) for m in runs.values())
    left.set_title("SPMD training step, same kernels and collectives"
                   + (f" (medians of {runs_per_row} runs)" if runs_per_row > 1 else ""), fontsize=9)
    bars(right, labels, [("one controller / multi-controller", "tab:blue", [r[4] for r in rows])],
         "ratio", "%.2f")
    for ax in (left, right):
        ax.set_xlabel("processes x devices, then data x tensor parallelism", fontsize=8)
    right.axhline(1.0, color="0.4", linestyle=":")
    right.set_title("ratio (the paper: equal to JAX's)", fontsize=9)
    fig.suptitle("Table 1: a single controller against multi-controller training")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return None


def table2(found, out):
    pipelines = [row for _, header, body in found if header[:2] == ["layout", "calls per step"]
                 for row in body if len(row) == len(header)]
    islands = [(heading, body) for heading, header, body in found if header[:2] == ["cluster", "tokens/s"]]
    if not pipelines:
        return "no table of SPMD against pipelines (train_bench without --tables)"
    plt = pyplot()
    fig, axes = plt.subplots(1, 1 + len(islands), figsize=(6 + 3 * len(islands), 4.2),
                             gridspec_kw={"width_ratios": [3] + [1] * len(islands)}, squeeze=False)
    left = axes[0][0]
    colours = ["tab:green" if r[0].startswith("SPMD") else "tab:orange" if "recomputing" in r[0]
               else "tab:blue" for r in pipelines]
    def short(layout):  # "S=4 x data 2, M=8, recomputing" -> "S=4\nM=8" (the colour says the rest)
        m = re.match(r"S=(\d+) x data \d+, M=(\d+)", layout)
        return f"S={m.group(1)}\nM={m.group(2)}" if m else layout.replace(": ", "\n")

    labels = [short(r[0]) for r in pipelines]
    drawn = left.bar(range(len(pipelines)), [number(r[3]) for r in pipelines], color=colours)
    left.bar_label(drawn, fmt="%.2f", fontsize=7, padding=1)
    left.set_xticks(range(len(pipelines)))
    left.set_xticklabels(labels, fontsize=8)
    left.axhline(1.0, color="0.4", linestyle=":")
    left.set_ylabel("tokens/s, of SPMD's")
    left.set_title("pipelines of S stages and M microbatches on one island\n(blue: residuals kept; orange: recomputed)",
                   fontsize=9)
    left.grid(True, axis="y", alpha=0.3)
    for ax, (heading, body) in zip(axes[0][1:], islands):
        rows = [r for r in body if len(r) == 4]
        drawn = ax.bar(range(len(rows)), [number(r[2]) for r in rows], color=["0.55", "tab:blue"][: len(rows)])
        ax.bar_label(drawn, fmt="%.2f", fontsize=7, padding=1)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r[0].replace(" x ", "\nx ") for r in rows], fontsize=7)
        ax.axhline(1.0, color="0.4", linestyle=":")
        ax.set_title("\n".join(textwrap.wrap(heading.lstrip("# ").split(":")[0], 28)), fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][1 if islands else 0].set_ylabel("tokens/s, of one island's" if islands else "tokens/s, of SPMD's")
    fig.suptitle("Table 2: pipelines against SPMD, and islands joined by an emulated link against one island")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return None


def figure11(prefix, out, window_ms=12.0):
    """Per-device timelines of the last `window_ms` of each client count's trace, one panel per
    count, each computation coloured by its client (the tenants' functions are named tenantN)."""
    counts = []
    for path in glob.glob(glob.escape(prefix) + "clients_*.json"):
        m = re.search(r"clients_(\d+)\.json$", path)
        if m:
            counts.append((int(m.group(1)), path))
    if not counts:
        return f"no traces {prefix}clients_N.json (run multitenancy_bench with --trace-prefix)"
    counts.sort()
    plt = pyplot()
    fig, axes = plt.subplots(len(counts), 1, figsize=(10, 1.1 * len(counts) + 1.2), sharex=True, squeeze=False)
    for ax, (n, path) in zip(axes[:, 0], counts):
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        ax.set_ylabel(f"{n} client{'s' if n > 1 else ''}", rotation=0, ha="right", va="center", fontsize=9)
        ax.set_yticks([])
        if not events:
            continue
        end = max(e["ts"] + e["dur"] for e in events)
        start = end - window_ms * 1000.0
        lanes = sorted({(e["pid"], e["tid"]) for e in events})
        lane_of = {lane: i for i, lane in enumerate(lanes)}
        names = sorted({e["name"] for e in events})
        colours = {name: plt.cm.tab20(i % 20) for i, name in enumerate(names)}
        for e in events:
            if e["ts"] + e["dur"] < start:
                continue
            left = max(e["ts"], start)
            ax.broken_barh([((left - start) / 1000.0, (e["ts"] + e["dur"] - left) / 1000.0)],
                           (lane_of[(e["pid"], e["tid"])] + 0.1, 0.8), facecolors=colours[e["name"]])
        ax.set_ylim(0, len(lanes))
        ax.set_xlim(0, window_ms)
    axes[-1][0].set_xlabel("ms (the last of the measured window); one lane per device, one colour per client")
    fig.suptitle("Figure 11: device time as concurrent clients grow")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return None


def to_csv(found):
    writer = csv.writer(sys.stdout)
    for heading, header, rows in found:
        writer.writerow(["# " + heading] if heading else ["#"])
        writer.writerow(header)
        writer.writerows(rows)


def main(argv):
    figures = {"fig5": figure5, "fig6": figure6, "fig7": figure7, "table1": table1, "table2": table2}
    if len(argv) == 4 and argv[1] == "fig11":
        problem = figure11(argv[2], argv[3])
        if problem:
            print(problem, file=sys.stderr)
            return 1
        return 0
    if len(argv) == 3 and argv[1] == "csv":
        with open(argv[2]) as f:
            to_csv(tables(f.read().splitlines()))
        return 0
    if len(argv) != 4 or argv[1] not in figures:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(argv[2]) as f:
        found = tables(f.read().splitlines())
    problem = figures[argv[1]](found, argv[3])
    if problem:
        print(f"{argv[2]}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
