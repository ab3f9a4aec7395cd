"""``dedupe-worker``: the command line.

Each subcommand lives in its own module here with ``register(subparsers)``, which adds its parser
and sets ``func``; modules import their broker client only when run, so a missing extra gives a
clear message instead of breaking the whole CLI.

As ``celery -A`` does, the current directory is importable, so ``dedupe-worker rabbitmq ...
myhandlers:apply`` finds ``myhandlers.py`` where it is run. ``-v`` counts before or after the
subcommand. The long-running commands (``rabbitmq``, ``kafka``, ``replay``) log at INFO by
default, as ``celery worker`` does, so their summary lines show; the others at WARNING.

What the user can fix (a service that cannot be reached, a bad URL or DSN, a missing table, a
handler that does not import, a bad option) is one line on stderr naming the thing, and exit
status 2: :func:`main` says it, here and nowhere else (:mod:`._fail` words it); ``-v`` prints
the traceback before it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from ._fail import explain

__all__ = ["main"]

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS = ("demo", "kafka", "rabbitmq", "replay", "inspect", "forget", "stats", "doctor", "sql")

#: Commands that run until stopped: they log at INFO unless told otherwise.
LONG_RUNNING = frozenset({"kafka", "rabbitmq", "replay"})


class Parser(argparse.ArgumentParser):
    """argparse, with a bad option said in one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dedupe-worker",
        description="Make at-least-once message delivery apply exactly once.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-v: INFO, -vv: DEBUG; rabbitmq, kafka, replay: INFO by default, "
                             "-v: DEBUG) and the traceback behind an error")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}._{name}").register(sub)
    for command in sub.choices.values():  # -v after the subcommand too; counted with the ones before
        command.add_argument("-v", "--verbose", dest="more_verbose", action="count", default=argparse.SUPPRESS,
                             help="more logging (see dedupe-worker --help)")
    return parser


def importable_here() -> None:
    """Put the current directory first on ``sys.path`` (as ``celery -A`` does), so handler modules
    next to the caller import; the console script's own path holds only its bin directory."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def prog(args: argparse.Namespace) -> str:
    """The command as typed: ``dedupe-worker stats``, ``dedupe-worker replay kafka``."""
    return " ".join(filter(None, ("dedupe-worker", args.command, getattr(args, "broker", None))))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand it was given to, not by the top-level parser
        parser.exit(2, f"{prog(args)}: unrecognized arguments: {' '.join(unknown)} (see {prog(args)} --help)\n")
    verbose = args.verbose + getattr(args, "more_verbose", 0)
    base = logging.INFO if args.command in LONG_RUNNING else logging.WARNING
    logging.basicConfig(level=base - 10 * verbose, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    importable_here()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        line = explain(exc)
        if line is None:
            raise  # not the user's to fix: a bug, with its traceback
        if verbose:
            traceback.print_exc()
        print(f"{prog(args)}: {line}", file=sys.stderr)
        return 2
