"""Shared fixtures: real Redis, RabbitMQ, Kafka (tansu), PostgreSQL and MariaDB; see ``services.py``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from dedupe_worker import Deduplicator

from . import services


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    yield from services.find_redis_url()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    try:
        client.ping()
    except redis.RedisError as exc:
        services.unavailable(f"Redis at {redis_url} ({exc})")
    yield client
    client.close()


@pytest.fixture
def namespace() -> str:
    """A namespace of its own for each test, so tests never see each other's keys."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def dedupe(redis_client: redis.Redis, namespace: str) -> Iterator[Deduplicator]:
    d = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0)
    yield d
    d.close()


@pytest.fixture
def private_redis() -> Iterator[services.RedisServer]:
    """A redis-server of the test's own, which the test may stop and start (outages)."""
    import shutil

    if shutil.which("redis-server") is None:
        services.unavailable("redis-server binary")
    server = services.RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def rabbitmq_url() -> Iterator[str]:
    yield from services.find_rabbitmq_url()


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    yield from services.find_kafka_bootstrap()


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    yield from services.find_nats_url()


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    yield from services.find_postgres_dsn()


@pytest.fixture(scope="session")
def mysql_url() -> Iterator[str]:
    yield from services.find_mysql_url()
