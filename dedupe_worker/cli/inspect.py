"""``dedupe-worker inspect KEY...``: state, token, lease, stored result and TTLs of keys (read-only)."""

from __future__ import annotations

import argparse
import json

from ..operate.describe import describe
from .options import add_dedupe_options, deduplicator_from

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inspect", help="show the state of idempotency keys (changes nothing)")
    p.add_argument("keys", nargs="+", metavar="KEY")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    add_dedupe_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    dedupe = deduplicator_from(args)
    try:
        for key in args.keys:
            report = describe(dedupe, key)
            if args.json:
                print(json.dumps(report.as_dict()))
                continue
            print(f"{key}: {report.state}, token {report.token}")
            if report.state == "in_progress":
                print(f"  lease runs {report.remaining_lease_ms} ms more")
            if report.result_preview:
                print(f"  stored: {report.result_preview}")
            print(f"  records: {report.redis_key}:started ttl {report.started_ttl_ms} ms, "
                  f":result ttl {report.result_ttl_ms} ms (-2 = none)")
            if report.original_key:
                print(f"  original key: {report.original_key}")
    finally:
        dedupe.close()
    return 0
