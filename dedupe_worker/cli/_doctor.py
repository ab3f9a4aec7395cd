"""``dedupe-worker doctor``: check the Redis settings the guarantees depend on.

Exit status 1 when a check fails (something that breaks a guarantee), else 0; warnings (what
weakens one) are printed with what to change.
"""

from __future__ import annotations

import argparse

from .._operate.doctor import DEFAULT_RATE, diagnose
from ._options import add_dedupe_options, deduplicator_from

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("doctor", help="check that Redis is set up so the guarantees hold")
    p.add_argument("--rate", type=float, default=DEFAULT_RATE,
                   help=f"messages/s for the memory projection (default {DEFAULT_RATE:g})")
    add_dedupe_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    dedupe = deduplicator_from(args)
    try:
        checks = diagnose(dedupe.store.client, rate=args.rate, result_ttl=dedupe.result_ttl,
                          namespace=dedupe.layout.namespace)
    finally:
        dedupe.close()
    for check in checks:
        print(f"[{check.mark:>4}] {check.name:<12} {check.detail}")
        if check.advice and (not check.ok or check.warn):
            print(f"{'':>20}-> {check.advice}")
    failed = [c.name for c in checks if not c.ok]
    print(f"\n{len(failed)} check(s) failed: {', '.join(failed)}" if failed else "\nno check failed")
    return 1 if failed else 0
