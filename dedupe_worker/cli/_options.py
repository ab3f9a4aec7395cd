"""Options shared by the consumer and replay commands, so they derive keys identically, and the
loading of the handler they name (``module:function``)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from .._deduplicator import Deduplicator
from .._settings import DedupeSettings
from ..keys import KeyStrategy, field_key, first_of, header_key

__all__ = [
    "add_broker_options",
    "add_dedupe_options",
    "add_key_options",
    "add_metrics_option",
    "config_pair",
    "deduplicator_from",
    "kafka_config",
    "key_strategy_from",
    "load_callable",
    "rabbitmq_url",
    "start_metrics",
]


def config_pair(text: str) -> tuple[str, str]:
    """One ``-X NAME=VALUE`` option (the one parser of them)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value.strip()


def add_broker_options(parser: argparse.ArgumentParser, broker: str) -> None:
    """The broker's address, the same in the consumer and replay commands: ``--url``
    (``DEDUPE_RABBITMQ_URL``) for RabbitMQ; ``--bootstrap`` (``DEDUPE_KAFKA_BOOTSTRAP``) and
    repeatable ``-X NAME=VALUE`` librdkafka settings for Kafka."""
    if broker == "rabbitmq":
        parser.add_argument("--url", help="AMQP URL (DEDUPE_RABBITMQ_URL; default "
                                          f"{DedupeSettings.model_fields['rabbitmq_url'].default})")
        return
    parser.add_argument("--bootstrap", metavar="HOST:PORT",
                        help="bootstrap.servers, e.g. 127.0.0.1:9092 (DEDUPE_KAFKA_BOOTSTRAP)")
    parser.add_argument("-X", dest="config", action="append", type=config_pair, default=[], metavar="NAME=VALUE",
                        help="extra librdkafka setting (repeatable), e.g. -X session.timeout.ms=10000")


def add_metrics_option(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port``: serve Prometheus ``/metrics`` (needs the ``metrics`` extra)."""
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve Prometheus metrics on http://0.0.0.0:PORT/metrics (pip install "
                             "'dedupe-worker[metrics]')")


def start_metrics(args: argparse.Namespace) -> None:
    """Serve ``/metrics`` when ``--metrics-port`` was given."""
    if getattr(args, "metrics_port", None):
        from ..observe import enable_metrics

        enable_metrics(port=args.metrics_port)


def rabbitmq_url(args: argparse.Namespace) -> str:
    """``--url``, else ``DEDUPE_RABBITMQ_URL``, else the local broker."""
    return getattr(args, "url", None) or DedupeSettings().rabbitmq_url


def kafka_config(args: argparse.Namespace, command: str) -> dict[str, str]:
    """``bootstrap.servers`` (``--bootstrap``, else ``DEDUPE_KAFKA_BOOTSTRAP``) and the ``-X`` settings."""
    bootstrap = getattr(args, "bootstrap", None) or DedupeSettings().kafka_bootstrap
    if not bootstrap:
        raise SystemExit(f"dedupe-worker {command}: give --bootstrap or set DEDUPE_KAFKA_BOOTSTRAP")
    return {"bootstrap.servers": bootstrap, **dict(args.config)}


def add_dedupe_options(parser: argparse.ArgumentParser) -> None:
    """``--redis-url``, ``--namespace``, ``--lease``, ``--result-ttl``, ``--allow-eviction``,
    ``--sql-dsn`` (defaults: ``DEDUPE_*``)."""
    group = parser.add_argument_group("deduplication (defaults from DEDUPE_* environment variables)")
    group.add_argument("--redis-url", help="Redis URL (DEDUPE_REDIS_URL; default redis://127.0.0.1:6379/0)")
    group.add_argument("--store-url", help="claim store URL, Redis or a database (postgresql://, mysql://); "
                                           "wins over --redis-url (DEDUPE_STORE_URL)")
    group.add_argument("--namespace", help="key prefix (DEDUPE_NAMESPACE; default 'dedupe')")
    group.add_argument("--lease", type=float, help="lease in seconds (DEDUPE_LEASE; default 30)")
    group.add_argument("--result-ttl", type=float, help="seconds outcomes are kept (DEDUPE_RESULT_TTL)")
    group.add_argument("--allow-eviction", action="store_true", default=None,
                       help="run on a Redis whose maxmemory-policy evicts keys; evicted keys run again "
                            "(DEDUPE_ALLOW_EVICTION)")
    group.add_argument("--sql-dsn", help="database of the outcomes atomic() commits (DEDUPE_SQL_DSN; "
                                         "PostgreSQL DSN or SQLAlchemy URL)")


def deduplicator_from(args: argparse.Namespace) -> Deduplicator:
    overrides = {
        name: value
        for name in ("redis_url", "store_url", "namespace", "lease", "result_ttl", "allow_eviction", "sql_dsn")
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


def load_callable(path: str) -> Callable[..., Any]:
    """Import ``package.module:function`` (attribute paths like ``module:Class.method`` work)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"expected 'module:function', got {path!r}")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{path} is not callable")
    return target  # type: ignore[no-any-return]
