"""``dedupe-worker rabbitmq``: run a deduplicating consumer for a ``module:function`` handler.

::

    dedupe-worker rabbitmq --url amqp://guest:guest@localhost// --queue orders myapp.handlers:apply_order

The handler is called as ``handler(body, message)``. SIGTERM or SIGINT finish the message in hand,
requeue the other prefetched ones and exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

from .._extras import require
from ..keys import RABBITMQ_DEFAULT
from ._options import (
    add_broker_options,
    add_dedupe_options,
    add_key_options,
    add_metrics_option,
    deduplicator_from,
    key_strategy_from,
    load_callable,
    rabbitmq_connection,
    start_metrics,
)

__all__ = ["register", "run"]

log = logging.getLogger(__name__)

def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "rabbitmq", help="consume RabbitMQ queues, applying each message once",
        description="Consume RabbitMQ queues with a handler, applying each idempotency key once. "
                    "Failed and deferred messages go through <queue>.delay, poison messages to <queue>.dlq.",
    )
    parser.add_argument("handler", help="module:function, called as handler(body, message)")
    add_broker_options(parser, "rabbitmq")
    parser.add_argument("--queue", action="append", required=True, metavar="NAME",
                        help="queue to consume (repeat for several); declared durable if missing")
    parser.add_argument("--prefetch", type=int, default=10, help="un-acked messages per queue (default 10)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="consumer threads, each with its own connection (default 1)")
    parser.add_argument("--max-attempts", type=int,
                        help="handler attempts before a failing message is dead-lettered (default 5)")
    parser.add_argument("--no-batch", action="store_true",
                        help="claim messages one at a time instead of a prefetched batch per round trip")
    add_dedupe_options(parser)
    add_key_options(parser)
    add_metrics_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require("kombu", "rabbitmq")
    from ..rabbitmq import DedupeConsumer

    handler = load_callable(args.handler)
    dedupe = deduplicator_from(args)
    try:
        with rabbitmq_connection(args) as probe:  # the broker is there before anything starts
            connection = probe.clone()
    except BaseException:
        dedupe.close()
        raise
    start_metrics(args)
    strategy = key_strategy_from(args, RABBITMQ_DEFAULT)
    options = {} if args.max_attempts is None else {"max_attempts": args.max_attempts}
    consumers = [
        DedupeConsumer(connection if n == 0 else connection.clone(),
                       args.queue, handler, dedupe, key_strategy=strategy,
                       prefetch_count=args.prefetch, batch=not args.no_batch, **options)
        for n in range(max(1, args.concurrency))
    ]

    def stop(signum: int, frame: FrameType | None) -> None:
        log.warning("signal %d: finishing the message in hand, then stopping", signum)
        for consumer in consumers:
            consumer.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threads = [threading.Thread(target=c.run, name=f"consumer-{i}", daemon=True)
               for i, c in enumerate(consumers[1:], 1)]
    for thread in threads:
        thread.start()
    try:
        consumers[0].run()
        for thread in threads:
            thread.join()
    finally:
        for consumer in consumers:
            consumer.close()
        dedupe.close()
    return 0
