"""The crash window ``atomic()`` closes, on real processes: a RabbitMQ consumer whose handler
committed its ``atomic()`` block and was SIGKILLed before ``complete()``. After the restart the
effect is applied once and the redelivery is answered with the committed result, without the
handler running again (the engine finds the row when the key is claimed again)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import psycopg
import pytest
import redis
from kombu import Connection

from dedupe_worker._transport.record import read_result

from .kafka_fixtures import wait_until
from .rabbitmq_fixtures import amqp, consumers_of, dead_letters, drained, publish, queue_name
from .services import ProcessGroup
from .sql_fixtures import Tables, pg, pg_balance

__all__ = ["amqp", "pg", "queue_name"]  # fixtures used by name

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def processes() -> Iterator[list[ProcessGroup]]:
    made: list[ProcessGroup] = []
    yield made
    for p in made:
        p.cleanup()


@pytest.mark.parametrize("driver", ["psycopg", "sqlalchemy", "django"])
def test_a_consumer_killed_after_its_block_committed_applies_once_and_answers_the_committed_result(
        driver: str, amqp: Connection, queue_name: str, processes: list[ProcessGroup], redis_url: str,
        redis_client: redis.Redis, namespace: str, pg: Tables, postgres_dsn: str) -> None:
    effects = f"{namespace}:effects"
    args = [sys.executable, "-m", "dedupe_worker", "rabbitmq", "--url", amqp.as_uri(include_password=True),
            "--queue", queue_name, "--redis-url", redis_url, "--namespace", namespace, "--lease", "1",
            "tests.sql_handlers:rabbit_credit"]
    env = {**os.environ, "TEST_REDIS_URL": redis_url, "TEST_EFFECTS": effects, "PYTHONPATH": str(ROOT),
           "DEDUPE_SQL_DSN": postgres_dsn, "DEDUPE_SQL_TABLE": pg.outcomes.table, "TEST_ACCOUNTS": pg.accounts,
           "TEST_SQL_DRIVER": driver}
    workers = ProcessGroup(args, env, ROOT)
    processes.append(workers)
    publish(amqp, queue_name, orjson.dumps({"id": "o1", "amount": 5}), headers={"idempotency-key": "o1"})
    victim = workers.start()
    assert victim.wait(60) == -9, workers.output()  # it killed itself right after the commit
    assert pg_balance(postgres_dsn, pg.accounts) == 5
    workers.start()
    try:
        wait_until(lambda: read_result(redis_client, f"{namespace}:{{o1}}") is not None, 60,
                   "the redelivery answered")
        wait_until(lambda: drained(amqp, queue_name) and consumers_of(amqp, queue_name) == 1, 30, "queue drained")
    except AssertionError:
        print(workers.output())
        raise
    outcome = read_result(redis_client, f"{namespace}:{{o1}}")  # in either record format
    stored = orjson.loads(outcome.value if outcome is not None else b"null")
    assert stored == {"id": "o1", "credited": 5, "pid": victim.pid}  # the committed run's result
    assert pg_balance(postgres_dsn, pg.accounts) == 5
    started = [e for e in redis_client.lrange(effects, 0, -1) if e.startswith(b"started:")]
    assert len(started) == 1, f"the handler ran again: {started}"
    assert dead_letters(amqp, queue_name) == []
    with psycopg.connect(postgres_dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {pg.outcomes.table}").fetchone() == (1,)
