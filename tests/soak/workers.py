"""A soak consumer process: ``python -m tests.soak.workers rabbitmq|kafka ...``.

The library's own consumers (:class:`DedupeConsumer`, :class:`DedupeKafkaConsumer`) with the
soak's handlers and :class:`~tests.soak.handlers.LedgerHooks`, built from the same options the
``dedupe-worker`` commands read (``--redis-url``, ``--namespace``, ``--lease``). SIGTERM stops
them cleanly; the harness also SIGKILLs and SIGSTOPs them.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from dedupe_worker.cli._options import add_dedupe_options, deduplicator_from

from .handlers import LedgerHooks, kafka_charge, rabbit_charge

__all__ = ["main"]

#: Short backoffs: a deferred or failed message comes back within seconds, so the drain is short.
POLICY = {"retry_base": 0.2, "retry_cap": 2.0, "defer_cap": 2.0, "max_attempts": 8}


def run_rabbitmq(args: argparse.Namespace) -> None:
    from kombu import Connection

    from dedupe_worker.rabbitmq import DedupeConsumer

    class SoakConsumer(LedgerHooks, DedupeConsumer):
        pass

    consumer = SoakConsumer(Connection(args.url, heartbeat=4), args.queue, rabbit_charge,  # type: ignore[no-untyped-call]
                            deduplicator_from(args), prefetch_count=args.prefetch, **POLICY)
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    try:
        consumer.run()
    finally:
        consumer.close()


def run_kafka(args: argparse.Namespace) -> None:
    from dedupe_worker.kafka import DedupeKafkaConsumer

    class SoakKafkaConsumer(LedgerHooks, DedupeKafkaConsumer):
        pass

    config = {"bootstrap.servers": args.bootstrap, "group.id": args.group, "auto.offset.reset": "earliest",
              "session.timeout.ms": 2000, "heartbeat.interval.ms": 500}
    consumer = SoakKafkaConsumer(config, args.topic, kafka_charge, deduplicator_from(args), batch_size=20,
                                 defer_wait=0.5, **POLICY)
    consumer.run(install_signal_handlers=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak.workers")
    brokers = parser.add_subparsers(dest="broker", required=True)
    rabbit = brokers.add_parser("rabbitmq")
    rabbit.add_argument("--url", required=True)
    rabbit.add_argument("--queue", action="append", required=True)
    rabbit.add_argument("--prefetch", type=int, default=10)
    kafka = brokers.add_parser("kafka")
    kafka.add_argument("--bootstrap", required=True)
    kafka.add_argument("--topic", action="append", required=True)
    kafka.add_argument("--group", required=True)
    for sub in (rabbit, kafka):
        add_dedupe_options(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    (run_rabbitmq if args.broker == "rabbitmq" else run_kafka)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
