"""``dedupe-worker``: the command line.

Each subcommand lives in its own module here with ``register(subparsers)``, which adds its parser
and sets ``func``; modules import their broker client only when run, so a missing extra gives a
clear message instead of breaking the whole CLI.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

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
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * args.verbose
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ImportError as exc:
        print(f"dedupe-worker {args.command}: {exc}", file=sys.stderr)
        return 2
