"""``dedupe-worker kafka``: run a deduplicating Kafka consumer around ``module:function``."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ..keys import KAFKA_DEFAULT, first_of, position_key
from ._options import (
    add_broker_options,
    add_dedupe_options,
    add_key_options,
    add_metrics_option,
    deduplicator_from,
    kafka_config,
    kafka_reachable,
    key_strategy_from,
    load_callable,
    start_metrics,
)

__all__ = ["register"]

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("kafka", help="consume Kafka topics, applying each idempotency key once")
    p.add_argument("handler", help="module:function called with each confluent_kafka.Message")
    p.add_argument("--topic", action="append", required=True, help="topic to consume (repeatable)")
    p.add_argument("--group", required=True, help="consumer group id")
    p.add_argument("--batch-size", type=int, default=500, help="messages decided together (default 500)")
    p.add_argument("--max-attempts", type=int,
                   help="handler attempts before a message is dead-lettered (default 5)")
    p.add_argument("--dead-letter-topic", default="{topic}.dlq",
                   help="dead-letter topic; {topic} is the original topic (default '{topic}.dlq')")
    p.add_argument("--position-fallback", action="store_true",
                   help="when no key is found, key on topic/partition/offset (protects against "
                        "redelivery only, not against a producer sending twice)")
    add_broker_options(p, "kafka")
    add_key_options(p)
    add_dedupe_options(p)
    add_metrics_option(p)
    p.set_defaults(func=run)


def consumer_config(args: argparse.Namespace) -> dict[str, Any]:
    """The confluent-kafka settings given on the command line."""
    return {**kafka_config(args), "group.id": args.group}


def run(args: argparse.Namespace) -> int:
    from ..kafka import DedupeKafkaConsumer

    handler = load_callable(args.handler)
    config = consumer_config(args)
    strategy = key_strategy_from(args, KAFKA_DEFAULT)
    if args.position_fallback:
        strategy = first_of(strategy, position_key())
    dedupe = deduplicator_from(args)
    try:
        kafka_reachable(config)
    except BaseException:
        dedupe.close()
        raise
    start_metrics(args)
    consumer = DedupeKafkaConsumer(
        config, args.topic, handler, dedupe, key_strategy=strategy,
        batch_size=args.batch_size, max_attempts=args.max_attempts,  # None: the shared default
        dead_letter_topic=args.dead_letter_topic,
    )
    log.info("consuming %s as group %s", args.topic, args.group)
    try:
        consumer.run()
    finally:
        dedupe.close()
    return 0
