"""``dedupe-worker forget KEY...``: remove keys' records after an incident, so they run again.

Refuses to free a live lease unless ``--force``, and refuses when ``--if-token`` does not match.
A record that is not one dedupe-worker writes (another program's key of another type under the
key's names, a truncated record: its messages are dead-lettered as ``unreadable_record``) is
removed only with ``--force`` and without ``--if-token``, whatever its type or shape.
Exit status: 0 when every key was removed (or had nothing), 1 when any was refused.
"""

from __future__ import annotations

import argparse

from .._operate.describe import KeyReport, describe
from ._options import add_dedupe_options, deduplicator_from

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("forget", help="remove the records of idempotency keys (ownership-checked)")
    p.add_argument("keys", nargs="+", metavar="KEY")
    p.add_argument("--if-token", type=int, metavar="N", help="only if the key carries this fencing token")
    p.add_argument("--force", action="store_true",
                   help="free a live lease too (its worker is fenced off), and remove a record that cannot be read")
    p.add_argument("--dry-run", action="store_true", help="say what would happen; change nothing")
    add_dedupe_options(p)
    p.set_defaults(func=run)


def dry_run(report: KeyReport, if_token: int | None, force: bool) -> str:
    """What the real run would print for ``report``'s key (``forget.lua``'s rules, read-only)."""
    if report.started_ttl_ms == -2 and report.result_ttl_ms == -2:
        return "nothing to remove"
    if report.state == "unreadable":
        if force and if_token is None:
            return f"would be removed (unreadable: {report.result_preview})"
        return f"would be refused: {report.result_preview}; removed only with --force (without --if-token)"
    if if_token is not None and if_token != report.token:
        return f"would be refused: it carries token {report.token}, not {if_token}"
    if report.state == "in_progress" and not force and if_token is None:
        return f"would be refused: a live lease (token {report.token}) holds it; removed only with --force"
    return f"would be removed ({report.state}, token {report.token})"


def run(args: argparse.Namespace) -> int:
    dedupe = deduplicator_from(args)
    refused = 0
    try:
        for key in args.keys:
            report = describe(dedupe, key)
            if args.dry_run:
                print(f"{key}: {dry_run(report, args.if_token, args.force)}")
                continue
            code, token, detail = dedupe.store.forget(dedupe.request(key).stem, args.if_token, args.force)
            if code == 1 and report.state == "unreadable":
                print(f"{key}: removed (unreadable: {report.result_preview})")
            elif code == 1:
                print(f"{key}: removed ({report.state}, token {token})")
            elif code == 0:
                print(f"{key}: nothing to remove")
            elif code == -1:
                refused += 1
                print(f"{key}: refused: a live lease (token {token}) holds it; --force frees it")
            elif code == -3:
                refused += 1
                print(f"{key}: refused: {detail}; --force (without --if-token) removes it")
            else:
                refused += 1
                print(f"{key}: refused: it carries token {token}, not {args.if_token}")
    finally:
        dedupe.close()
    return 1 if refused else 0
