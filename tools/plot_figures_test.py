"""tools/plot_figures.py reads the tables the benchmarks print: CSV always, and the figures when
Debian's python3-matplotlib is installed (`make deps-plot`; skipped otherwise)."""
import csv
import importlib.util
import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import plot_figures  # noqa: E402

# As collective_bench --work prints it: a line of text after each configuration's rows.
FIGURE6 = """Figure 6: a step is a work x work matrix product.

| hosts x devices | work | step ms (MC) | OpByOp | Chained | Fused | MC step | MC fused | OpByOp/MC | Chained/MC | Fused/MC fused |
|---|---|---|---|---|---|---|---|---|---|---|
| 2x1 | 0 | 0.050 | 9000 | 12000 | 30000 | 20000 | 40000 | 0.45 | 0.60 | 0.75 |
| 2x1 | 128 | 0.300 | 3000 | 3200 | 3300 | 3333 | 3400 | 0.90 | 0.96 | 0.97 |

2x1: 95% of the multi-controller from a step of OpByOp not within the sweep, Chained 0.300 ms, Fused 0.300 ms

| 4x4 | 0 | 0.200 | 1500 | 1800 | 3400 | 5000 | 5100 | 0.30 | 0.36 | 0.67 |
| 4x4 | 128 | failed: the multi-controller peer |
"""

# As dispatch_bench prints its pipelines.
FIGURE7 = """### Pipeline of K stages, one host each, ~0.1 ms per stage, embedded: ms per run (median of 3)

| stages | parallel dispatch | sequential dispatch | sequential / parallel |
|---|---|---|---|
| 1 | 0.49 | 0.50 | 1.02x |
| 2 | 0.62 | 0.79 | 1.27x |
"""

# As train_bench --tables multi-controller prints it, twice (data parallel, then --mc-tensor 2).
TABLE1 = """### SPMD training on real processes: one controller against multi-controller (the paper's Table 1)

| processes x devices | data x tensor | one controller tokens/s | multi-controller tokens/s | ratio | loss, one controller | loss, multi-controller |
|---|---|---|---|---|---|---|
| 2 x 4 | 8 x 1 | 17685 | 24257 | 0.73 | 5.002552 | 5.002552 |
| 8 x 1 | 8 x 1 | 15000 | 16000 | 0.94 | 5.002552 | 5.002552 |

| processes x devices | data x tensor | one controller tokens/s | multi-controller tokens/s | ratio | loss, one controller | loss, multi-controller |
|---|---|---|---|---|---|---|
| 2 x 4 | 4 x 2 | 12000 | 12500 | 0.96 | 5.002552 | 5.002552 |
"""

# As train_bench prints its pipeline and island tables.
TABLE2 = """### SPMD against pipelines (8 devices, one island)

| layout | calls per step | tokens/s | of SPMD | model FLOP/s utilisation | peak MiB per device | loss after |
|---|---|---|---|---|---|---|
| SPMD: data 8 | 3 | 20000 | 1.00 | 1.0% | 10.0 | 5.0026 |
| S=2 x data 4, M=4, residuals kept | 9 | 15000 | 0.75 | 0.8% | 9.0 | 5.0026 |
| S=2 x data 4, M=4, recomputing | 9 | 13000 | 0.65 | 0.7% | 8.0 | 5.0026 |

### Data parallelism over two islands (the paper's Figure 12): an emulated link (50 us one way, 10 Gbit/s) against one island

| cluster | tokens/s | of one island | loss after |
|---|---|---|---|
| 1 island x 8 devices | 20000 | 1.000 | 5.0026 |
| 2 islands x 4 devices | 19400 | 0.970 | 5.0026 |
"""


def test_rows_after_a_line_of_text_join_their_table_and_failed_rows_are_left_out():
    rows = plot_figures.figure6_rows(plot_figures.tables(FIGURE6.splitlines()))
    assert [(r["config"], r["work"]) for r in rows] == [("2x1", 0), ("2x1", 128), ("4x4", 0)]
    assert rows[2]["devices"] == 16 and rows[2]["Fused/MC fused"] == 0.67


def test_table1_draws_medians_of_the_runs_of_a_configuration(tmp_path, monkeypatch):
    drawn = {}
    monkeypatch.setattr(plot_figures, "bars", lambda ax, labels, series, *_: drawn.setdefault(len(drawn), series))
    monkeypatch.setattr(plot_figures, "pyplot", lambda: pytest.importorskip("matplotlib.pyplot"))
    second = TABLE1.replace("| 2 x 4 | 8 x 1 | 17685 | 24257 | 0.73 |", "| 2 x 4 | 8 x 1 | 20000 | 20000 | 1.00 |")
    third = TABLE1.replace("| 2 x 4 | 8 x 1 | 17685 | 24257 | 0.73 |", "| 2 x 4 | 8 x 1 | 19000 | 20000 | 0.95 |")
    assert plot_figures.table1(plot_figures.tables((TABLE1 + second + third).splitlines()), str(tmp_path / "t.png")) is None
    tokens, ratios = drawn[0], drawn[1]
    assert tokens[0][2][0] == 19000 and tokens[1][2][0] == 20000  # one controller, multi-controller
    assert ratios[0][2] == [0.95, 0.94, 0.96]


def test_csv_gives_every_table_with_its_heading(capsys):
    plot_figures.to_csv(plot_figures.tables((FIGURE6 + "\n" + FIGURE7).splitlines()))
    got = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert got[1][:3] == ["hosts x devices", "work", "step ms (MC)"]
    assert got[2][0] == "2x1" and got[4][0] == "4x4"
    pipeline = got.index(["stages", "parallel dispatch", "sequential dispatch", "sequential / parallel"])
    assert got[pipeline - 1][0].startswith("# ### Pipeline of K stages")
    assert got[pipeline + 2] == ["2", "0.62", "0.79", "1.27x"]


def test_a_missing_table_is_named(tmp_path):
    source = tmp_path / "empty.md"
    source.write_text("no tables here\n")
    assert plot_figures.main(["plot_figures.py", "fig7", str(source), str(tmp_path / "x.png")]) == 1
    assert plot_figures.main(["plot_figures.py", "fig9", str(source), str(tmp_path / "x.png")]) == 2
    assert plot_figures.main(["plot_figures.py", "table1", str(source), str(tmp_path / "x.png")]) == 1
    assert plot_figures.main(["plot_figures.py", "table2", str(source), str(tmp_path / "x.png")]) == 1


def test_figure11_names_missing_traces(tmp_path, capsys):
    assert plot_figures.main(["plot_figures.py", "fig11", str(tmp_path / "none_"), str(tmp_path / "x.png")]) == 1
    assert "clients_N.json" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="python3-matplotlib is not installed")
def test_figure11_is_drawn_from_the_traces_it_finds(tmp_path):
    for n in (1, 2):
        events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "host h"}}]
        for i in range(4):
            events.append({"ph": "X", "name": f"tenant{i % n}", "pid": 0, "tid": i % 2, "ts": 1000 * i, "dur": 900,
                           "args": {"client": f"c{i % n}"}})
        (tmp_path / f"mt_clients_{n}.json").write_text(json.dumps({"traceEvents": events}))
    out = tmp_path / "fig11.png"
    assert plot_figures.main(["plot_figures.py", "fig11", str(tmp_path / "mt_"), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="python3-matplotlib is not installed")
@pytest.mark.parametrize("figure,text", [("fig5", FIGURE6), ("fig6", FIGURE6), ("fig7", FIGURE7),
                                         ("table1", TABLE1), ("table2", TABLE2)])
def test_each_figure_is_drawn(tmp_path, figure, text):
    source = tmp_path / "bench.md"
    source.write_text(text)
    out = tmp_path / f"{figure}.png"
    assert plot_figures.main(["plot_figures.py", figure, str(source), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
