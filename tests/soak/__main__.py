"""``python -m tests.soak``: run the soak and print its report; exit 1 on any lost or
double-applied operation."""

from __future__ import annotations

import argparse
import logging
import sys

from .harness import INTEGRATIONS, SoakConfig, run_soak

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
    args = parser.parse_args(argv)
    chosen = [i.strip() for i in args.integrations.split(",") if i.strip()]
    unknown = set(chosen) - set(INTEGRATIONS)
    if unknown or not chosen:
        parser.error(f"unknown integrations {sorted(unknown)}; choose from {','.join(INTEGRATIONS)}")
    logging.basicConfig(level=logging.WARNING)
    result = run_soak(SoakConfig(duration=args.duration, seed=args.seed, integrations=chosen, rate=args.rate,
                                 fault_gap=tuple(args.fault_gap), keep=args.keep, write=args.write))
    print(result.report(), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
