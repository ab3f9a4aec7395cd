"""``dedupe-worker replay rabbitmq|kafka``: move dead-lettered messages back to work without ever
re-applying one. See ``docs/replay.md``.

Keys are derived with the same options and defaults as the consumer commands
(:func:`~dedupe_worker.cli._options.key_strategy_from`), so pass the consumer's ``--key-header`` /
``--key-field`` and ``--namespace`` here too. A message is dropped as already applied only when
the outcome stored under its key carries its own payload fingerprint (the consumers' default,
the hash of the body), or, with ``--key-only``, when the outcome was stored without any
fingerprint; ``conflict`` and ``undecodable`` dead letters stay where they are unless
``--filter`` names them. Exit status: 0; 1 when any message failed; 2 when the dead-letter queue
or topic does not exist.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from ..keys import KAFKA_DEFAULT, RABBITMQ_DEFAULT, KeyStrategy, first_of, position_key
from ..replay._plan import Planner
from ..replay._summary import Progress, ReplayOptions, Summary, format_table
from ._fail import CommandError
from ._options import (
    add_broker_options,
    add_dedupe_options,
    add_key_options,
    deduplicator_from,
    kafka_config,
    kafka_reachable,
    key_strategy_from,
    rabbitmq_connection,
)

__all__ = ["register"]


def parse_rate(text: str) -> float:
    """``50``, ``50/s`` or ``3000/min`` as messages per second."""
    number, _, unit = text.partition("/")
    per = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0}.get(unit.strip().lower())
    try:
        value = float(number)
    except ValueError:
        value = 0.0
    if per is None or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive rate like 50/s, got {text!r}")
    return value / per


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan (key, state, action); change nothing")
    parser.add_argument("--limit", type=int, metavar="N", help="examine at most N messages")
    parser.add_argument("--rate", type=parse_rate, metavar="N/s",
                        help="republish at most N messages per second")
    parser.add_argument("--filter", action="append", metavar="REASON", dest="reasons",
                        help="replay only messages dead-lettered for this reason (repeatable; "
                             "e.g. handler_error); the others are left in place. Without it, all but "
                             "conflict and undecodable dead letters, which are examined only when named")
    parser.add_argument("--key-only", action="store_true",
                        help="an outcome stored WITHOUT a fingerprint (run(), @idempotent, a consumer with "
                             "fingerprint=None) counts as applied by its key alone: the message is dropped. "
                             "Risk: a key reused for another payload drops a message that never ran. "
                             "Outcomes stored with a fingerprint are still compared")
    parser.add_argument("--json", action="store_true", help="print the summary (and the plan) as JSON")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="live progress on stderr (default: when stderr is a terminal)")
    add_key_options(parser)
    add_dedupe_options(parser)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("replay", help="move dead-lettered messages back without re-applying any",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    brokers = parser.add_subparsers(dest="broker", required=True)

    rabbit = brokers.add_parser("rabbitmq", help="replay a RabbitMQ dead-letter queue")
    add_broker_options(rabbit, "rabbitmq")
    rabbit.add_argument("--from", dest="source", required=True, metavar="QUEUE", help="the dead-letter queue")
    rabbit.add_argument("--to", metavar="EXCHANGE/ROUTING_KEY",
                        help="where to republish (default: the queue each message was dead-lettered from; "
                             "'/QUEUE' or 'QUEUE' publish straight to a queue)")
    rabbit.add_argument("--confirm-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="how long to wait for a publisher confirm (default 30)")
    _common(rabbit)
    rabbit.set_defaults(func=run_rabbitmq)

    kafka = brokers.add_parser("kafka", help="replay a Kafka dead-letter topic")
    add_broker_options(kafka, "kafka")
    kafka.add_argument("--from", dest="source", required=True, metavar="TOPIC", help="the dead-letter topic")
    kafka.add_argument("--to", metavar="TOPIC", help="where to republish (default: x-dedupe-original-topic)")
    kafka.add_argument("--group", default="dedupe-worker-replay",
                       help="consumer group whose committed offsets record the replay's progress "
                            "(default dedupe-worker-replay)")
    kafka.add_argument("--idle-timeout", type=float, default=5.0, metavar="SECONDS",
                       help="stop when nothing arrived for this long (default 5)")
    kafka.add_argument("--position-fallback", action="store_true",
                       help="as the consumer's option: when no key is found, key on the ORIGINAL "
                            "topic/partition/offset (x-dedupe-original-* headers)")
    _common(kafka)
    kafka.set_defaults(func=run_kafka)


def _run(args: argparse.Namespace, default: KeyStrategy,
         replay: Callable[[Planner, ReplayOptions], Summary]) -> int:
    """Build the planner and options from ``args``, run ``replay``, print the outcome."""
    strategy = key_strategy_from(args, default)
    if getattr(args, "position_fallback", False):
        strategy = first_of(strategy, position_key())
    planner = Planner(deduplicator_from(args), strategy, reasons=_reasons(args.reasons), key_only=args.key_only)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    progress = Progress(sys.stderr) if show else None
    options = ReplayOptions(dry_run=args.dry_run, limit=args.limit, rate=args.rate, keep_entries=args.dry_run,
                            on_start=progress.start if progress else None,
                            on_entry=progress.entry if progress else None)
    try:
        summary = replay(planner, options)
    except LookupError as exc:  # the dead-letter queue or topic does not exist
        raise CommandError(str(exc.args[0]) if exc.args else str(exc)) from exc
    finally:
        planner.dedupe.close()
    if progress is not None:
        progress.close()
    if args.json:
        print(json.dumps(summary.as_dict()))
    else:
        if args.dry_run:
            print(format_table(summary.entries))
        print(summary.line())
    return 1 if summary.failed else 0


def _reasons(values: list[str] | None) -> set[str] | None:
    if not values:
        return None
    return {part.strip() for value in values for part in value.split(",") if part.strip()}


def run_rabbitmq(args: argparse.Namespace) -> int:
    from ..replay._rabbitmq import Destination, replay_rabbitmq

    destination = Destination.parse(args.to) if args.to else None

    def replay(planner: Planner, options: ReplayOptions) -> Summary:
        with rabbitmq_connection(args) as connection:
            return replay_rabbitmq(connection, args.source, planner, destination=destination,
                                   options=options, confirm_timeout=args.confirm_timeout)

    return _run(args, RABBITMQ_DEFAULT, replay)


def run_kafka(args: argparse.Namespace) -> int:
    from ..replay._kafka import replay_kafka

    config = kafka_config(args)

    def replay(planner: Planner, options: ReplayOptions) -> Summary:
        kafka_reachable(config)
        return replay_kafka(config, args.source, args.group, planner, destination=args.to,
                            options=options, idle_timeout=args.idle_timeout)

    return _run(args, KAFKA_DEFAULT, replay)
