"""``dedupe-worker``: the command line.

Each subcommand lives in its own module here with ``register(subparsers)``, which adds its parser
and sets ``func``; modules import their broker client only when run, so a missing extra gives a
clear message instead of breaking the whole CLI.

As ``celery -A`` does, the current directory is importable, so ``dedupe-worker rabbitmq ...
myhandlers:apply`` finds ``myhandlers.py`` where it is run. ``-v`` counts before or after the
subcommand. A Redis that cannot be reached, or one that may evict our records, is one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

import redis

from .._errors import EvictionPolicyError, StoreUnavailable

__all__ = ["main"]

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS = ("demo", "kafka", "rabbitmq", "replay", "inspect", "forget", "stats", "doctor", "sql")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedupe-worker",
        description="Make at-least-once message delivery apply exactly once.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}._{name}").register(sub)
    for command in sub.choices.values():  # -v after the subcommand too; counted with the ones before
        command.add_argument("-v", "--verbose", dest="more_verbose", action="count", default=argparse.SUPPRESS,
                             help="more logging (-vv: debug)")
    return parser


def importable_here() -> None:
    """Put the current directory first on ``sys.path`` (as ``celery -A`` does), so handler modules
    next to the caller import; the console script's own path holds only its bin directory."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * (args.verbose + getattr(args, "more_verbose", 0))
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    importable_here()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ImportError as exc:
        print(f"dedupe-worker {args.command}: {exc}", file=sys.stderr)
        return 2
    except (StoreUnavailable, redis.ConnectionError, redis.TimeoutError) as exc:
        print(f"dedupe-worker {args.command}: cannot reach Redis: {exc}", file=sys.stderr)
        return 2
    except EvictionPolicyError as exc:
        print(f"dedupe-worker {args.command}: refusing to start: {exc} (--allow-eviction)", file=sys.stderr)
        return 2
