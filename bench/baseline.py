"""``make bench BASELINE=<ref>``: the benches against the current code and a git ref's, in one run.

    python -m bench --baseline [REF] [--rounds N] [--only MODULE ...]

The ref is checked out into a temporary git worktree (nothing of it is committed here), installed
with the extras ``make install`` uses into its own venv, cached under ``.bench-baseline/<sha>/``
(ignored by git), and the worktree removed. The bench code always comes from the current tree:
both sides run the same ``bench.*`` module, from a folder holding only ``bench`` and ``tests`` (so
each side imports its own ``dedupe_worker``), with the same pinning, taking turns (current, baseline, current,
baseline, ...) so a noisy neighbour hits both alike. Each figure the benches print is then shown
for both sides, median and spread of the rounds, with the ratio and whether the current code is
within 10% of the baseline: the rule docs/contributing.md sets for a fast path.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import tomllib

from .charts import parse

ROOT = Path(__file__).resolve().parent.parent
#: ``--baseline`` without a ref: this release's main before issue 37's changes were merged.
RELEASE_BEFORE = "b977d1e"
CACHE = ROOT / ".bench-baseline"
#: Lower is better for these units; higher for msg/s.
LOWER_IS_BETTER = ("µs", "ms", "s", "bytes", "x ref")
#: How much worse than the baseline a figure may be and still pass.
TOLERANCE = 0.10
#: Figures in a line: a label, two or more spaces, a number and a unit (as
#: :data:`bench.charts.FIGURE`), and after it those whose label starts with ``+``.
FIGURES = re.compile(r"(?:^|(?<=\s))(?P<label>[^\s(].*?\S)\s{2,}(?P<value>-?[\d,]+(?:\.\d+)?)\s*"
                     r"(?P<unit>µs|ms|msg/s|tasks/s|bytes)\b")
#: A figure of the same run each figure of its unit is also shown against, per bench: a shared
#: machine moves whole runs up and down, and a ratio within one run cancels that.
REFERENCES = {"bench.core": "raw EVALSHA round trip (trivial)", "bench.http_middleware": "2 PINGs"}


def extras() -> str:
    """The extras ``make install`` installs (the Makefile's ``EXTRAS``), and ``bench``."""
    match = re.search(r"^EXTRAS\s*=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    return f"{match[1]},bench" if match else "bench"


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def baseline_python(ref: str) -> Path:
    """The Python of a venv holding ``ref``'s ``dedupe_worker`` (installed once, then cached) and
    the current tree's bench dependencies."""
    sha = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    venv = CACHE / sha[:12]
    python = venv / "bin" / "python"
    if (venv / ".installed").exists():
        return python
    bench_deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    with tempfile.TemporaryDirectory(prefix="dedupe-bench-baseline-") as tmp:
        src = Path(tmp) / "src"
        git("worktree", "add", "--detach", str(src), sha)
        try:
            print(f"installing {ref} ({sha[:12]}) into {venv}", flush=True)
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"{src}[{extras()}]", *bench_deps],
                           check=True)
        finally:
            git("worktree", "remove", "--force", str(src))
    (venv / ".installed").write_text(f"{ref} {sha}\n")
    return python


def link_bench(folder: Path) -> Path:
    """``folder``, given links to the current ``bench`` and ``tests`` (whose services start a
    private cluster) and nothing else: run from there, a side imports the ``dedupe_worker`` its
    venv holds, never the current tree's by the working folder."""
    for package in ("bench", "tests"):
        (folder / package).symlink_to(ROOT / package)
    return folder


def figures(text: str) -> dict[str, tuple[float, str]]:
    """Every figure in one bench's output, ``(value, unit)`` by its label: the tables
    :func:`bench.charts.parse` reads (labelled by column too) and each figure of a line (one whose
    label starts with ``+`` labelled by the line's first figure too)."""
    found: dict[str, tuple[float, str]] = {}
    for chart in parse(text, ""):
        if not (chart.title or chart.series):  # figure lines: read below, with their subject
            continue
        for label, values in chart.rows:
            for series, value in zip(chart.series or [""], values, strict=False):
                name = " | ".join(part for part in (chart.title.lstrip(": "), label, series) if part)
                found[name] = (value, chart.unit)
    subject, heading, heading_indent = "", "", 0
    for line in text.splitlines():  # and the figure lines alone in their unit, which make no chart
        indent = len(line) - len(line.lstrip())
        if heading and indent <= heading_indent:
            heading = ""
        matches = list(FIGURES.finditer(line))
        if not matches and indent and line.strip():  # "  handler returns at once", then its figures indented
            heading, heading_indent = line.strip(), indent
        for n, match in enumerate(matches):
            label = match["label"].strip()
            if label.startswith("+"):  # "app  N msg/s  + dedupe  M msg/s": the app's, with dedupe
                label = f"{subject} {label}"
            elif n == 0:
                subject = label = f"{heading}: {label}" if heading else label
            else:  # after a line's figure, only a "+" one: the rest are its notes
                continue
            found[label] = (float(match["value"].replace(",", "")), match["unit"])
    return found


def relative(runs: Sequence[Mapping[str, tuple[float, str]]], reference: str) -> list[dict[str, tuple[float, str]]]:
    """Each run's figures in the unit of ``reference`` as multiples of that run's ``reference``."""
    out = []
    for run in runs:
        if reference in run:
            base, unit = run[reference]
            out.append({name: (value / base, "x ref") for name, (value, u) in run.items()
                        if u == unit and name != reference and base})
    return out


def compare(current: Sequence[Mapping[str, tuple[float, str]]],
            baseline: Sequence[Mapping[str, tuple[float, str]]]) -> list[tuple[str, str, list[float], list[float],
                                                                             float, bool]]:
    """For each figure both sides printed: ``(name, unit, current values, baseline values,
    ratio of the medians current / baseline, passes)``; passes when the current median is at most
    :data:`TOLERANCE` worse than the baseline's in the unit's direction."""
    rows = []
    names = [name for name in dict.fromkeys(n for run in current for n in run) if any(name in b for b in baseline)]
    for name in names:
        unit = next(run[name][1] for run in current if name in run)
        ours = [run[name][0] for run in current if name in run]
        theirs = [run[name][0] for run in baseline if name in run]
        a, b = statistics.median(ours), statistics.median(theirs)
        ratio = a / b if b else float("nan")
        passes = ratio <= 1 + TOLERANCE if unit in LOWER_IS_BETTER else ratio >= 1 - TOLERANCE
        rows.append((name, unit, ours, theirs, ratio, passes))
    return rows


def spread(values: Iterable[float]) -> str:
    """``median [min-max]``."""
    values = sorted(values)
    digits = 2 if values[-1] < 10 else 1 if values[-1] < 1000 else 0
    return f"{statistics.median(values):,.{digits}f} [{values[0]:,.{digits}f}-{values[-1]:,.{digits}f}]"


def report(module: str, ref: str, current: Sequence[str], baseline: Sequence[str]) -> str:
    """The comparison table of one bench's outputs, ``current`` and ``baseline`` runs in turn."""
    ours, theirs = [figures(t) for t in current], [figures(t) for t in baseline]
    rows = compare(ours, theirs)
    if reference := REFERENCES.get(module):
        rows += compare(relative(ours, reference), relative(theirs, reference))
    lines = [f"\n[{module}] current vs {ref}: median [min-max] of {len(current)} and {len(baseline)} runs, "
             f"taking turns; ratio = current / baseline; ok = within {TOLERANCE:.0%} of the baseline"
             + (f"; 'x ref': as a multiple of the same run's {reference!r}" if reference else "")]
    for name, unit, mine, base, ratio, passes in rows:
        lines.append(f"  {name:<60} {unit:<6} {spread(mine):>26}  {spread(base):>26}  "
                     f"{ratio:5.2f}  {'ok' if passes else 'WORSE'}")
    return "\n".join(lines)
