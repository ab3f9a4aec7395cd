"""Bar charts of the benches' and the soak's figures, as SVG, with no dependency.

``make bench`` (``python -m bench``) hands every bench's printed output to :func:`bench_charts`,
which reads the figures back from it (the same lines a reader sees) and writes one chart per
group of figures sharing a unit under ``docs/img/``; the soak writes its own with
:func:`bar_chart` (see ``tests/soak/__main__.py``). Each chart carries the date and the machine it
was made on, so a picture is never mistaken for a newer run.

Two shapes of output are read:

* a figure line: a label, two or more spaces, a number and a unit (``run(), first seen   <n> µs``);
* a table: a header row, then rows of a label and numbers, cells separated by two or more spaces;
  columns that share a unit become one grouped chart, others one chart per column.
"""

from __future__ import annotations

import datetime
import html
import os
import platform
import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Chart", "bar_chart", "bench_charts", "machine", "parse", "stamp"]

UNITS = ("µs", "ms", "msg/s", "bytes", "s")
FIGURE = re.compile(r"^\s*(?P<label>\S.*?\S)\s{2,}(?P<value>-?[\d,]+(?:\.\d+)?)\s*(?P<unit>µs|ms|msg/s|bytes)\b")
NUMBER = re.compile(r"^-?[\d,]+(?:\.\d+)?(?:\s*(?P<unit>µs|ms|msg/s|bytes|%|x))?$")
LEGEND_W = 150
COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f")


class Chart:
    """Bars of one unit: ``rows`` of ``(label, values)``, one value per series."""

    def __init__(self, title: str, unit: str, series: Sequence[str], rows: Sequence[tuple[str, Sequence[float]]]):
        self.title = title
        self.unit = unit
        self.series = list(series)
        self.rows = [(label, list(values)) for label, values in rows]


def _number(cell: str) -> tuple[float, str] | None:
    match = NUMBER.match(cell.strip())
    if match is None:
        return None
    return float(cell.strip().split()[0].rstrip("µsmbytex%/").replace(",", "") or "nan"), match["unit"] or ""


def parse(text: str, title: str) -> list[Chart]:
    """The charts in one bench's output: its figure lines grouped by unit, and each table."""
    figures: dict[str, list[tuple[str, Sequence[float]]]] = {}
    charts: list[Chart] = []
    lines = text.splitlines()
    header: list[str] | None = None
    table: list[tuple[str, list[tuple[float, str]]]] = []

    def close_table() -> None:
        if header is not None and len(table) >= 2:
            charts.extend(_table_charts(title, header, table))
        table.clear()

    for line in lines:
        cells = [c for c in re.split(r"\s{2,}", line.strip()) if c]
        numbers = [_number(c) for c in cells[1:]]
        if len(cells) >= 3 and all(n is not None for n in numbers) and _number(cells[0]) is None:
            if header is not None and len(header) in (len(cells), len(cells) - 1):
                table.append((cells[0], [n for n in numbers if n is not None]))
                continue
        close_table()
        header = cells if len(cells) >= 3 else None
        match = FIGURE.match(line)
        if match:
            value = float(match["value"].replace(",", ""))
            figures.setdefault(match["unit"], []).append((match["label"].strip(), [value]))
    close_table()
    for unit, rows in figures.items():
        if len(rows) >= 2:
            charts.insert(0, Chart(title, unit, [], rows))
    return charts


def _table_charts(title: str, header: list[str], table: list[tuple[str, list[tuple[float, str]]]]) -> list[Chart]:
    """One grouped chart when every column has the same unit, else one chart per column."""
    columns = header[-len(table[0][1]):]
    units = [unit or _unit_in(name) for name, (_, unit) in zip(columns, table[0][1], strict=True)]
    if len(set(units)) == 1:
        return [Chart(title, units[0], columns, [(label, [v for v, _ in row]) for label, row in table])]
    return [Chart(f"{title}: {name}", units[i], [], [(label, [row[i][0]]) for label, row in table])
            for i, name in enumerate(columns)]


def _unit_in(name: str) -> str:
    return next((u for u in UNITS if re.search(rf"(^|\s|/){re.escape(u)}\b", name)), "")


def machine() -> str:
    """The machine, in a few words: CPU model, vCPUs allowed, OS and Python."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{model}, {len(os.sched_getaffinity(0))} vCPU, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def stamp(now: datetime.datetime | None = None) -> str:
    """The run's date and machine, as the charts print it (two lines)."""
    when = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y-%m-%d %H:%M UTC")
    return f"measured {when}\n{machine()}"


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.2f}".rstrip("0").rstrip(".")


def bar_chart(chart: Chart, note: str) -> str:
    """The SVG of ``chart``: horizontal bars, one group per row, value at each bar's end, the
    title on top and ``note`` (where and when it was measured; one line of text per line) below."""
    esc = html.escape
    n_series = max(1, len(chart.series), max((len(v) for _, v in chart.rows), default=1))
    bar_h, gap = 14, 8
    label_w = min(360, 7 * max((len(label) for label, _ in chart.rows), default=10) + 16)
    plot_w = 440
    width = label_w + plot_w + 90
    per_row = max(1, (width - 20) // LEGEND_W)
    top = 46 + 18 * -(-len(chart.series) // per_row)
    notes = note.splitlines()
    height = top + len(chart.rows) * (n_series * bar_h + gap) + 30 + 14 * len(notes)
    peak = max((v for _, values in chart.rows for v in values), default=1.0) or 1.0
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
           f'<text x="10" y="20" font-size="15" font-weight="bold">{esc(chart.title)}</text>',
           f'<text x="10" y="38" fill="#555555">{esc(chart.unit or "value")} (longer bar = larger)</text>']
    for i, name in enumerate(chart.series):
        x, legend_y = 10 + (i % per_row) * LEGEND_W, 46 + 18 * (i // per_row) + 12
        out.append(f'<rect x="{x}" y="{legend_y - 10}" width="10" height="10" fill="{COLOURS[i % len(COLOURS)]}"/>')
        out.append(f'<text x="{x + 14}" y="{legend_y}">{esc(name)}</text>')
    y = top
    for label, values in chart.rows:
        group_h = n_series * bar_h
        out.append(f'<text x="{label_w - 6}" y="{y + group_h / 2 + 4:.0f}" text-anchor="end">{esc(label)}</text>')
        for i, value in enumerate(values):
            w = max(0.0, value) / peak * plot_w
            colour, bar_y = COLOURS[i % len(COLOURS)], y + i * bar_h
            out.append(f'<rect x="{label_w}" y="{bar_y}" width="{w:.1f}" height="{bar_h - 2}" fill="{colour}"/>')
            out.append(f'<text x="{label_w + w + 4:.1f}" y="{y + i * bar_h + bar_h - 4}">{esc(_fmt(value))}</text>')
        y += group_h + gap
    out.append(f'<line x1="{label_w}" y1="{top - 2}" x2="{label_w}" y2="{y}" stroke="#999999"/>')
    for i, line in enumerate(notes):
        out.append(f'<text x="10" y="{y + 26 + 14 * i}" fill="#555555" font-size="11">{esc(line)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _placement(label: str) -> str:
    """``same``, ``split`` or ``unpinned``: the short name of a placement label of bench.__main__."""
    if "client on vCPU" in label:
        return "split"
    return "same" if "Redis and client on" in label else "unpinned"


def bench_charts(outputs: Sequence[tuple[str, str, str]], folder: Path, note: str) -> list[Path]:
    """Write the charts of each ``(module, placement, output)`` into ``folder`` as
    ``<module>-<same|split|unpinned>-<n>.svg``; return the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for module, placement, text in outputs:
        for n, chart in enumerate(parse(text, module), 1):
            path = folder / f"{_slug(module)}-{_placement(placement)}-{n}.svg"
            path.write_text(bar_chart(chart, f"{module}: {placement}\n{note}"), encoding="utf-8")
            written.append(path)
    return written
