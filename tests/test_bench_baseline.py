"""``make bench BASELINE=<ref>`` (bench/baseline.py) reads each side's figures from the benches' own
output and compares medians in each unit's direction: a time or a size may grow 10%, a rate may
drop 10%, and no more."""

from __future__ import annotations

from bench import core
from bench.baseline import compare, extras, figures, relative, report


def core_output(scale: float, with_scripts: bool = True) -> str:
    names = ["raw", "raw held", "scripts", "run", "run fp", "dup", "pipe", "batch", "powertools", "powertools dup",
             "eager plain", "eager Idempotent", "eager QueueOnce"]
    m = {name: scale * (1000.0 + 250 * i) for i, name in enumerate(names) if with_scripts or name != "scripts"}
    m.update({"powertools records": 12.0, "memory": 136.0})
    return core.report(m, {name: 1e-5 for name in names}, "Redis on vCPU 0, client on vCPU 1 (taskset)")


def test_figures_are_the_printed_lines() -> None:
    found = figures(core_output(1.0))
    assert found["run(), first seen"] == (round(1e6 / 1750), "µs")
    assert found["Redis memory per completed key"] == (136.0, "bytes")


def test_a_second_figure_on_a_line_is_labelled_by_the_first() -> None:
    found = figures("  faststream      2062 msg/s   + dedupe     1208 msg/s      +343 µs/msg   ratio 0.59\n"
                    "              + round trips     1166 msg/s (ratio 0.57)\n"
                    "  dramatiq        3709 msg/s   + dedupe     1357 msg/s      +467 µs/msg\n")
    assert found == {"faststream": (2062.0, "msg/s"), "faststream + dedupe": (1208.0, "msg/s"),
                     "faststream + round trips": (1166.0, "msg/s"), "dramatiq": (3709.0, "msg/s"),
                     "dramatiq + dedupe": (1357.0, "msg/s")}


def test_time_may_grow_ten_percent_rate_may_drop_ten_percent() -> None:
    rows = {name: (ratio, passes) for name, _, _, _, ratio, passes in compare(
        [{"t": (109.0, "µs"), "r": (91.0, "msg/s")}, {"t": (111.0, "µs"), "r": (89.0, "msg/s")},
         {"t": (110.0, "µs"), "r": (90.5, "msg/s")}],
        [{"t": (100.0, "µs"), "r": (100.0, "msg/s")}])}
    assert rows["t"] == (1.10, True) and rows["r"] == (0.905, True)
    rows = {name: (ratio, passes) for name, _, _, _, ratio, passes in compare(
        [{"t": (112.0, "µs"), "r": (88.0, "msg/s")}], [{"t": (100.0, "µs"), "r": (100.0, "msg/s")}])}
    assert rows["t"] == (1.12, False) and rows["r"] == (0.88, False)


def test_a_figure_only_one_side_prints_is_left_out() -> None:
    text = report("bench.core", "70ba3a8", [core_output(0.5)] * 2, [core_output(1.0, with_scripts=False)])
    assert "raw claim.lua+complete.lua" not in text
    run = next(line for line in text.splitlines() if "run(), first seen" in line)
    assert run.split()[-2:] == ["2.00", "WORSE"]  # half the rate: twice the time


def test_the_baseline_gets_the_extras_make_install_does() -> None:
    assert extras().endswith(",bench") and "celery" in extras().split(",")


def test_relative_is_each_run_against_its_own_reference() -> None:
    runs = [{"raw": (100.0, "µs"), "run": (230.0, "µs"), "memory": (136.0, "bytes")},
            {"raw": (200.0, "µs"), "run": (460.0, "µs")}]
    assert relative(runs, "raw") == [{"run": (2.3, "x ref")}, {"run": (2.3, "x ref")}]


def test_figures_under_an_indented_heading_carry_it() -> None:
    found = figures("  handler returns at once\n    sync run(), sequential   2,107 msg/s  (baseline)\n"
                    "  handler waits 1 ms on I/O\n    sync run(), sequential     605 msg/s  (baseline)\n"
                    "  app                 56.7 µs/request\n")
    assert found == {"handler returns at once: sync run(), sequential": (2107.0, "msg/s"),
                     "handler waits 1 ms on I/O: sync run(), sequential": (605.0, "msg/s"),
                     "app": (56.7, "µs")}
