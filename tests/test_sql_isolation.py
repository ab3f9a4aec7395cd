"""20 concurrent copies of one key through ``atomic()`` at every isolation level, on real
PostgreSQL and MariaDB, with no row yet or an expired one: one effect. Redis is down and the
client runs ``fail_open``, so every copy really reaches the database at once (with Redis up, the
claim would let one copy in at a time).

A copy either waits for the winner and is answered DUPLICATE from its row, or (PostgreSQL's
REPEATABLE READ and SERIALIZABLE) fails with a serialization error, its transaction rolled back,
HANDLER_ERROR: retried, and then answered DUPLICATE."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from dedupe_worker import Deduplicator, Reason, decide

from .services import free_port
from .sql_fixtures import database, my, pg

__all__ = ["my", "pg"]  # fixtures used by name

LEVELS = {  # PostgreSQL runs READ UNCOMMITTED as READ COMMITTED
    "postgresql": ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"],
    "mariadb": ["READ UNCOMMITTED", "READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"],
}
COPIES = 20


@pytest.mark.parametrize("earlier", ["no-row", "expired-row"])
@pytest.mark.parametrize(("name", "level"), [(name, level) for name, levels in LEVELS.items() for level in levels])
def test_twenty_concurrent_copies_apply_once(request: pytest.FixtureRequest, namespace: str, name: str,
                                             level: str, earlier: str) -> None:
    db = database(request, name)
    down = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))  # fails at once
    if earlier == "expired-row":  # the copies race to replace it
        seed = Deduplicator(down, namespace=namespace, fail_open=True, result_ttl=0.2, outcomes=db.outcomes)
        assert decide(seed, "order", lambda: db.credit(1)).reason is Reason.APPLIED
        time.sleep(0.3)
    dedupe = Deduplicator(down, namespace=namespace, fail_open=True, outcomes=db.outcomes)
    barrier = threading.Barrier(COPIES)

    def handler() -> Any:
        barrier.wait(30)  # every copy past the (failed) claim: they enter atomic() together
        return db.credit(1, isolation=level, pause=0.2)

    answers = concurrently(COPIES, lambda: decide(dedupe, "order", handler))
    reasons = [a.reason for a in answers]
    assert reasons.count(Reason.APPLIED) == 1
    assert set(reasons) <= {Reason.APPLIED, Reason.DUPLICATE, Reason.HANDLER_ERROR}
    assert all(a.value == {"credited": 1} for a in answers if a.reason is Reason.DUPLICATE)
    retried = concurrently(reasons.count(Reason.HANDLER_ERROR),  # the failed copies' redeliveries
                           lambda: decide(dedupe, "order", lambda: db.credit(1, isolation=level)))
    assert all(r.reason is Reason.DUPLICATE and r.value == {"credited": 1} for r in retried)
    assert db.balance() == (2 if earlier == "expired-row" else 1)
    dedupe.close()


def concurrently(count: int, call: Callable[[], Any]) -> list[Any]:
    """``call()`` in ``count`` threads at once; their answers."""
    answers: list[Any] = []
    threads = [threading.Thread(target=lambda: answers.append(call())) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == count
    return answers
