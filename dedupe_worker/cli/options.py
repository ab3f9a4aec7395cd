"""Options shared by the consumer and replay commands, so they derive keys identically."""

from __future__ import annotations

import argparse

from ..deduplicator import Deduplicator
from ..messages.keys import KeyStrategy, field_key, first_of, header_key
from ..settings import DedupeSettings

__all__ = ["add_dedupe_options", "add_key_options", "deduplicator_from", "key_strategy_from"]


def add_dedupe_options(parser: argparse.ArgumentParser) -> None:
    """``--redis-url``, ``--namespace``, ``--lease``, ``--result-ttl`` (defaults: ``DEDUPE_*``)."""
    group = parser.add_argument_group("deduplication (defaults from DEDUPE_* environment variables)")
    group.add_argument("--redis-url", help="Redis URL (DEDUPE_REDIS_URL; default redis://127.0.0.1:6379/0)")
    group.add_argument("--namespace", help="key prefix (DEDUPE_NAMESPACE; default 'dedupe')")
    group.add_argument("--lease", type=float, help="lease in seconds (DEDUPE_LEASE; default 30)")
    group.add_argument("--result-ttl", type=float, help="seconds outcomes are kept (DEDUPE_RESULT_TTL)")


def deduplicator_from(args: argparse.Namespace) -> Deduplicator:
    overrides = {
        name: value
        for name in ("redis_url", "namespace", "lease", "result_ttl")
        if (value := getattr(args, name, None)) is not None
    }
    return Deduplicator.from_settings(DedupeSettings(**overrides))


def add_key_options(parser: argparse.ArgumentParser) -> None:
    """``--key-header`` and ``--key-field``: how the idempotency key is found in a message."""
    group = parser.add_argument_group("idempotency key (default: the consumer's default strategy)")
    group.add_argument("--key-header", metavar="NAME", help="take the key from this header only")
    group.add_argument("--key-field", metavar="PATH", help="take the key from this field of the JSON body")


def key_strategy_from(args: argparse.Namespace, default: KeyStrategy) -> KeyStrategy:
    strategies = []
    if getattr(args, "key_header", None):
        strategies.append(header_key(args.key_header))
    if getattr(args, "key_field", None):
        strategies.append(field_key(args.key_field))
    return first_of(*strategies) if strategies else default
