"""Options shared by the consumer and replay commands, so they derive keys identically, the
loading of the handler they name (``module:function``), and the start-up checks that each
service named is reachable (a :class:`~._fail.CommandError` naming it when not)."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from typing import Any

import redis

from .._deduplicator import Deduplicator
from .._settings import ClientOptions, DedupeSettings
from ..keys import KeyStrategy, field_key, first_of, header_key
from ._fail import CommandError, redacted

__all__ = [
    "add_broker_options",
    "add_dedupe_options",
    "add_key_options",
    "add_metrics_option",
    "config_pair",
    "deduplicator_from",
    "kafka_config",
    "kafka_reachable",
    "key_strategy_from",
    "load_callable",
    "rabbitmq_connection",
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


def rabbitmq_connection(args: argparse.Namespace) -> Any:
    """A kombu ``Connection`` to :func:`rabbitmq_url`, connected once to prove the broker is there
    (later losses are the consumer's to ride out: it reconnects)."""
    from .._extras import require

    kombu = require("kombu", "rabbitmq")
    url = rabbitmq_url(args)
    try:
        connection = kombu.Connection(url, connect_timeout=5)
        connection.ensure_connection(max_retries=1)
    except KeyError as exc:  # kombu's word for an unknown scheme: "No such transport: foo"
        raise CommandError(f"--url {redacted(url)}: {exc.args[0] if exc.args else exc}") from exc
    except (OSError, kombu.exceptions.OperationalError) as exc:
        raise CommandError(f"cannot reach RabbitMQ at {redacted(url)} (--url, DEDUPE_RABBITMQ_URL): {exc}") from exc
    return connection


def kafka_config(args: argparse.Namespace) -> dict[str, str]:
    """``bootstrap.servers`` (``--bootstrap``, else ``DEDUPE_KAFKA_BOOTSTRAP``) and the ``-X`` settings."""
    bootstrap = getattr(args, "bootstrap", None) or DedupeSettings().kafka_bootstrap
    if not bootstrap:
        raise CommandError("give --bootstrap or set DEDUPE_KAFKA_BOOTSTRAP")
    return {"bootstrap.servers": bootstrap, **dict(args.config)}


#: Seconds the start-up check waits for the Kafka cluster's metadata.
KAFKA_PROBE_TIMEOUT = 10.0


def kafka_reachable(config: dict[str, str]) -> None:
    """Ask the cluster for its metadata once, quietly: librdkafka itself retries an unreachable
    bootstrap server for ever, logging each attempt, so a typo would otherwise look like an idle
    consumer."""
    from .._extras import require

    confluent_kafka = require("confluent_kafka", "kafka")
    from confluent_kafka.admin import AdminClient

    bootstrap = config["bootstrap.servers"]
    probe = {k: v for k, v in config.items() if k not in ("group.id", "log_level")}
    try:
        client = AdminClient({**probe, "log_level": 0})
    except (confluent_kafka.KafkaException, ValueError, TypeError) as exc:  # a setting librdkafka refuses
        raise CommandError(f"Kafka settings (-X, --bootstrap): {exc.args[0] if exc.args else exc}") from exc
    try:
        client.list_topics(timeout=KAFKA_PROBE_TIMEOUT)
    except confluent_kafka.KafkaException as exc:
        raise CommandError(f"cannot reach Kafka at {bootstrap} (--bootstrap, DEDUPE_KAFKA_BOOTSTRAP): "
                           f"{exc.args[0].str() if exc.args else exc}") from exc


def add_dedupe_options(parser: argparse.ArgumentParser) -> None:
    """``--redis-url``, ``--namespace``, ``--lease``, ``--result-ttl``, ``--allow-eviction``,
    ``--sql-dsn`` (defaults: ``DEDUPE_*``)."""
    group = parser.add_argument_group("deduplication (defaults from DEDUPE_* environment variables)")
    group.add_argument("--redis-url", help="Redis URL (DEDUPE_REDIS_URL; default "
                                           f"{DedupeSettings.model_fields['redis_url'].default})")
    group.add_argument("--store-url", help="claim store URL, Redis or a database (postgresql://, mysql://); "
                                           "wins over --redis-url (DEDUPE_STORE_URL)")
    group.add_argument("--namespace", help=f"key prefix (DEDUPE_NAMESPACE; default {ClientOptions.namespace!r})")
    group.add_argument("--lease", type=float, help=f"lease in seconds (DEDUPE_LEASE; default {ClientOptions.lease:g})")
    group.add_argument("--result-ttl", type=float, help="seconds outcomes are kept (DEDUPE_RESULT_TTL)")
    group.add_argument("--allow-eviction", action="store_true", default=None,
                       help="run on a Redis whose maxmemory-policy evicts keys; evicted keys run again "
                            "(DEDUPE_ALLOW_EVICTION)")
    group.add_argument("--sql-dsn", help="database of the outcomes atomic() commits (DEDUPE_SQL_DSN; "
                                         "PostgreSQL DSN or SQLAlchemy URL)")


def deduplicator_from(args: argparse.Namespace) -> Deduplicator:
    """The deduplicator the options and ``DEDUPE_*`` describe, its Redis pinged once: a bad or
    unreachable URL is a :class:`~._fail.CommandError` naming it and where it came from."""
    overrides = {
        name: value
        for name in ("redis_url", "store_url", "namespace", "lease", "result_ttl", "allow_eviction", "sql_dsn")
        if (value := getattr(args, name, None)) is not None
    }
    settings = DedupeSettings(**overrides)
    where = ("--redis-url" if "redis_url" in overrides else "DEDUPE_REDIS_URL" if os.environ.get("DEDUPE_REDIS_URL")
             else "the default; --redis-url or DEDUPE_REDIS_URL names another")
    url = f"{redacted(settings.redis_url)} ({where})"
    try:
        dedupe = Deduplicator.from_settings(settings)
    except ValueError as exc:  # redis-py's word for a URL it cannot parse, ours for a bad option value
        if "URL" in str(exc) or settings.redis_url in str(exc):
            raise CommandError(f"bad Redis URL {url}: {exc}") from exc
        raise CommandError(f"bad setting: {exc}") from exc
    except redis.RedisError as exc:  # a cluster or Sentinel URL connects at once
        raise CommandError(f"cannot reach Redis at {url}: {exc}") from exc
    if dedupe.store.outcomes_on_row:
        return dedupe  # the SQL store: no Redis to ping; its first transition names what is wrong
    try:
        dedupe.store.client.ping()
    except redis.RedisError as exc:
        dedupe.close()
        raise CommandError(f"cannot reach Redis at {url}: {exc}") from exc
    return dedupe


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
        raise CommandError(f"handler {path!r}: expected 'module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # whatever the module raised on import: its own bug or a missing package
        raise CommandError(f"cannot import the handler's module {module_name!r} ({path}): "
                           f"{type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise CommandError(f"handler {path!r}: {module_name} has no {attr!r}") from exc
    if not callable(target):
        raise CommandError(f"handler {path!r} is not callable")
    return target  # type: ignore[no-any-return]
