"""The chart writer of ``make bench`` and the soak (bench/charts.py) reads the figures back from
the benches' own report functions and draws them: the values in the SVG are the ones printed."""

from __future__ import annotations

import datetime
import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from bench import core, lua_cost
from bench.charts import Chart, bar_chart, bench_charts, parse, stamp
from tests.soak.report import Figures, charts

SVG = "{http://www.w3.org/2000/svg}"


def core_output() -> str:
    names = ["raw", "raw held", "scripts", "run", "run fp", "dup", "pipe", "batch", "powertools", "powertools dup",
             "eager plain", "eager Idempotent", "eager QueueOnce"]
    rates = {name: 1000.0 + 250 * i for i, name in enumerate(names)}  # msg/s: 1e6 / rate µs per message
    m = {**rates, "powertools records": 12.0, "memory": 184.0}
    return core.report(m, {name: 1e-5 for name in names}, "Redis on vCPU 0, client on vCPU 1 (taskset)")


def lua_cost_output() -> str:
    labels = ["this f1", "this f2"]
    usec = {(lb, case, size): 1.5 + i for i, (lb, case, size) in enumerate(
        (lb, case, size) for case in lua_cost.CASES for size in lua_cost.BATCHES for lb in labels)}
    m = {"aof": {"appendonly": "yes", "appendfsync": "everysec"}, "usec": usec, "command": "EVALSHA",
         "memory": {lb: ((168, 136), (264, 216)) for lb in labels}, "floor": {1: 152, 2: 136}}
    return lua_cost.report(m, labels, 1000, 5)


def bars(svg: str) -> list[tuple[float, str]]:
    """(bar width, the value printed beside it) of each bar."""
    root = ET.fromstring(svg)
    rects = [r for r in root.iter(f"{SVG}rect") if r.get("height") == "12"]
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    values = [t for t in texts if re.fullmatch(r"-?[\d,]+(\.\d+)?", t)]
    return [(float(r.get("width") or 0), v) for r, v in zip(rects, values, strict=True)]


def test_the_figures_of_bench_core_are_read_back_and_drawn_to_scale() -> None:
    [chart] = parse(core_output(), "bench.core")
    assert chart.unit == "µs"
    drawn = dict(chart.rows)
    assert drawn["run(), first seen"] == [round(1e6 / (1000 + 250 * 3))]
    assert drawn["raw EVALSHA round trip (trivial)"] == [1000.0]
    assert len(chart.rows) == 13
    widths = bars(bar_chart(chart, "note"))
    peak = max(v for _, values in chart.rows for v in values)
    for (width, printed), (_, [value]) in zip(widths, chart.rows, strict=True):
        assert printed.replace(",", "") == f"{value:.0f}"
        assert abs(width - value / peak * 440) < 0.1


def test_a_table_becomes_one_grouped_chart_per_unit() -> None:
    [chart] = parse(lua_cost_output(), "bench.lua_cost")
    assert chart.unit == "µs" and chart.series == [f"{lb} x{size}" for size in lua_cost.BATCHES
                                                    for lb in ("this f1", "this f2")]
    assert [label for label, _ in chart.rows] == list(lua_cost.CASES)
    assert chart.rows[0][1][:2] == [1.5, 2.5]
    mixed = "stored as   stored bytes   encode µs\nplain   10766   19.2\nzlib   1123   51.2\n"
    by_column = parse(mixed, "bench.compression")
    assert [(c.title, c.unit, c.rows) for c in by_column] == [
        ("bench.compression: stored bytes", "bytes", [("plain", [10766.0]), ("zlib", [1123.0])]),
        ("bench.compression: encode µs", "µs", [("plain", [19.2]), ("zlib", [51.2])])]


def test_each_chart_carries_the_date_and_the_machine(tmp_path: Path) -> None:
    note = stamp(datetime.datetime(2026, 11, 27, 18, 0, tzinfo=datetime.timezone.utc))
    written = bench_charts([("bench.core", "Redis on vCPU 0, client on vCPU 1 (taskset)", core_output()),
                            ("bench.lua_cost", "Redis on vCPU 0, client on vCPU 1 (taskset)", lua_cost_output())],
                           tmp_path, note)
    assert [p.name for p in written] == ["bench-core-split-1.svg", "bench-lua-cost-split-1.svg"]
    for path in written:
        texts = [t.text for t in ET.parse(path).getroot().iter(f"{SVG}text")]
        assert "measured 2026-11-27 18:00 UTC" in texts and any(t and "vCPU" in t and "Python" in t for t in texts)


def test_the_soak_report_as_charts() -> None:
    ok = Figures("rabbitmq", operations=100, deliveries=130, latencies=[0.01, 0.02, 0.5])
    ok.dead_lettered = Counter({"conflict": 2})
    bad = Figures("kafka", operations=90, deliveries=95, lost=["k1"], applied_twice=["k2", "k3"])
    outcome, latency = charts({"rabbitmq": ok, "kafka": bad})
    rows = dict(outcome.rows)
    assert outcome.series == ["rabbitmq", "kafka"]
    assert rows["operations"] == [100, 90] and rows["LOST"] == [0, 1] and rows["APPLIED TWICE"] == [0, 2]
    assert rows["dead-lettered"] == [2, 0]
    assert latency.unit == "ms" and dict(latency.rows)["rabbitmq"] == [20.0, 500.0]
    ET.fromstring(bar_chart(outcome, "seed 1\nmeasured now"))  # well-formed SVG


def test_an_empty_chart_is_still_a_picture() -> None:
    ET.fromstring(bar_chart(Chart("nothing", "", [], []), ""))
