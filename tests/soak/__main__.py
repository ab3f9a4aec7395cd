"""``python -m tests.soak``: run the soak and print its report; exit 1 on any lost or
double-applied operation."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from bench.charts import bar_chart, stamp

from .harness import INTEGRATIONS, SoakConfig, SoakResult, run_soak
from .report import charts

#: Where the charts go unless ``--charts`` says otherwise (docs/reliability.md shows them).
CHARTS = Path(__file__).resolve().parents[2] / "docs" / "img"

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--duration", type=float, default=1200.0, help="seconds of traffic and faults (default 1200)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the traffic and the fault schedule")
    parser.add_argument("--integrations", default=",".join(INTEGRATIONS),
                        help=f"comma-separated subset of {','.join(INTEGRATIONS)}")
    parser.add_argument("--rate", type=float, default=8.0, help="operations per second (default 8)")
    parser.add_argument("--fault-gap", type=float, nargs=2, default=(4.0, 10.0), metavar=("MIN", "MAX"),
                        help="seconds between faults (default 4 10)")
    parser.add_argument("--write", "--writes", dest="write", choices=("idempotent", "fenced", "plain"),
                        default="idempotent",
                        help="the handler's ledger write: fenced and idempotent (default); the bare fenced "
                             "increment, which a re-run after a committed effect applies again; or plain, a "
                             "non-idempotent increment inside dedupe_worker.sql.atomic()")
    parser.add_argument("--keep", action="store_true", help="keep the ledger tables")
    parser.add_argument("--charts", default=str(CHARTS), metavar="DIR",
                        help="write the report's SVG charts here ('' for none; default docs/img)")
    args = parser.parse_args(argv)
    chosen = [i.strip() for i in args.integrations.split(",") if i.strip()]
    unknown = set(chosen) - set(INTEGRATIONS)
    if unknown or not chosen:
        parser.error(f"unknown integrations {sorted(unknown)}; choose from {','.join(INTEGRATIONS)}")
    logging.basicConfig(level=logging.WARNING)
    result = run_soak(SoakConfig(duration=args.duration, seed=args.seed, integrations=chosen, rate=args.rate,
                                 fault_gap=tuple(args.fault_gap), keep=args.keep, write=args.write))
    print(result.report(), flush=True)
    if args.charts:
        for path in write_charts(result, Path(args.charts)):
            print(f"chart: {path}", flush=True)
    return 0 if result.ok else 1


def write_charts(result: SoakResult, folder: Path) -> list[Path]:
    """``soak-1.svg`` (outcomes) and ``soak-2.svg`` (latency), stamped with the run's settings,
    date and machine."""
    folder.mkdir(parents=True, exist_ok=True)
    c = result.config
    faults = ", ".join(f"{k} {v}" for k, v in sorted(result.fault_counts().items())) or "none"
    note = (f"seed {c.seed}, {result.seconds:.0f}s of traffic at {c.rate:g} ops/s, lease {c.lease}s, {c.write} writes\n"
            f"faults: {faults}\n{stamp()}")
    written = []
    for n, chart in enumerate(charts(result.figures), 1):
        path = folder / f"soak-{n}.svg"
        path.write_text(bar_chart(chart, note), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    sys.exit(main())
