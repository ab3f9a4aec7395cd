"""``dedupe-worker stats``: a namespace at a glance (bounded SCAN) and a memory projection."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .._operate.doctor import DEFAULT_RATE
from .._operate.survey import UNREADABLE, survey
from .._sqlstore import SqlPool
from .._sqlstore.operate import survey_sql
from ._options import add_dedupe_options, deduplicator_from

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stats", help="count a namespace's keys by state and project its memory")
    p.add_argument("--sample", type=int, default=1000, help="records looked at closely (default 1000)")
    p.add_argument("--rate", type=float, default=DEFAULT_RATE,
                   help=f"messages/s for the projection (default {DEFAULT_RATE:g})")
    p.add_argument("--json", action="store_true")
    add_dedupe_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    dedupe = deduplicator_from(args)
    if isinstance(dedupe.store.client, SqlPool):
        return _sql_stats(args, dedupe.store.client, dedupe.layout.namespace)
    try:
        found = survey(dedupe.store.client, dedupe.layout.namespace, sample=args.sample,
                       progress=sys.stderr if sys.stderr.isatty() else None)
    finally:
        dedupe.close()
    report = found.as_dict(args.rate, dedupe.result_ttl)
    report["assumption"] = assumption(report)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"namespace {dedupe.layout.namespace}: {found.keys:,} Redis keys")
    for state, count in sorted(found.states.items()):
        print(f"  {state:<16} {count:,} (in the sample of {args.sample:,})")
    if found.states[UNREADABLE]:
        print("  (unreadable: records the scripts cannot read, another type or a malformed outcome; "
              "each such key's messages are dead-lettered until `dedupe-worker forget KEY --force` removes them)")
    for name, label in (("result_bytes", "stored result bytes"), ("ttl_ms", "TTL ms"),
                        ("result_ttl_ms", "outcome TTL ms")):
        if report[name]:
            low, mid, high = report[name]["min"], report[name]["p50"], report[name]["max"]
            print(f"  {label:<22} min {low:,}  p50 {mid:,}  max {high:,}")
    if not found.bytes_per_key:
        print("  projection             none: no key to measure bytes per key on (the namespace is empty)")
        return 0
    print(f"  bytes per key          {found.bytes_per_key:,} (MEMORY USAGE, sampled)")
    print(f"  projection             {report['projection_bytes']:,} bytes = {args.rate:g} msg/s x "
          f"{report['retention']:,.0f} s x {found.bytes_per_key:,} bytes per key")
    print(f"  assuming               {report['assumption']}")
    return 0


def _sql_stats(args: argparse.Namespace, pool: SqlPool, namespace: str) -> int:
    """``stats`` on a SQL store: the namespace's rows by state (one query; no memory projection:
    the database's storage is its own to watch)."""
    try:
        states = survey_sql(pool, namespace)
    finally:
        pool.close()
    if args.json:
        print(json.dumps({"namespace": namespace, "rows": sum(states.values()), "states": states}))
        return 0
    print(f"namespace {namespace}: {sum(states.values()):,} rows ({pool.dialect} store)")
    for state, count in sorted(states.items()):
        print(f"  {state:<16} {count:,}")
    if states.get("expired"):
        print("  expired rows count as gone; dedupe-worker sql purge --store <url> deletes them")
    return 0


def assumption(report: dict[str, Any]) -> str:
    """What the one projection rests on, in words."""
    rate = f"{report['rate']:g} new keys/s (--rate)"
    if report["retention_from"] == "sampled":
        return (f"{rate}, each outcome kept {report['retention']:,.0f} s: the longest remaining TTL in the "
                f"sample, above the result TTL of {report['result_ttl']:g} s (per-message ttls; high when only "
                "some outcomes are kept that long)")
    return (f"{rate}, each outcome kept the result TTL of {report['result_ttl']:g} s (--result-ttl, "
            "DEDUPE_RESULT_TTL); no sampled outcome has longer left")
