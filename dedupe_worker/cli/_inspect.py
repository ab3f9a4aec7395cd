"""``dedupe-worker inspect KEY...``: state, token, lease, stored result and TTLs of keys (read-only)."""

from __future__ import annotations

import argparse
import json
import sys

from .._deduplicator import Deduplicator
from .._operate.describe import describe
from .._sqlstore import SqlPool
from .._sqlstore.operate import namespace_is_empty as sql_namespace_is_empty
from ._options import add_dedupe_options, deduplicator_from

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inspect", help="show the state of idempotency keys (changes nothing)")
    p.add_argument("keys", nargs="+", metavar="KEY")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    add_dedupe_options(p)
    p.set_defaults(func=run)


def namespace_is_empty(dedupe: Deduplicator) -> bool:
    """Whether no Redis key at all starts with the namespace (a bounded SCAN, stops at the first)."""
    if isinstance(dedupe.store.client, SqlPool):
        return sql_namespace_is_empty(dedupe.store.client, dedupe.layout.namespace)
    pattern = f"{dedupe.layout.namespace}:*"
    return next(iter(dedupe.store.client.scan_iter(match=pattern, count=1000)), None) is None


def run(args: argparse.Namespace) -> int:
    dedupe = deduplicator_from(args)
    never_seen = 0
    try:
        for key in args.keys:
            report = describe(dedupe, key)
            never_seen += report.state == "free" and report.token == 0
            if args.json:
                print(json.dumps(report.as_dict()))
                continue
            print(f"{key}: {report.state}, token {report.token}")
            if report.state == "in_progress":
                print(f"  lease runs {report.remaining_lease_ms} ms more")
            if report.result_preview:
                print(f"  stored: {report.result_preview}")
            if report.result_ttl_ms > 0:
                print(f"  kept {report.result_ttl_ms / 1000:,.1f} s more (its remaining TTL)")
            print(f"  records: {report.redis_key}:started ttl {report.started_ttl_ms} ms, "
                  f"outcome {report.result_key or '(none)'} ttl {report.result_ttl_ms} ms (-2 = none)")
            if report.original_key:
                print(f"  original key: {report.original_key}")
        if never_seen == len(args.keys) and namespace_is_empty(dedupe):
            print(f"hint: namespace {dedupe.layout.namespace!r} holds no keys at all on this Redis: check "
                  "--namespace (DEDUPE_NAMESPACE) and --redis-url (DEDUPE_REDIS_URL, its database number)",
                  file=sys.stderr)
    finally:
        dedupe.close()
    return 0
