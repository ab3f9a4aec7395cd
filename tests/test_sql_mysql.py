"""``atomic()`` on MariaDB (MySQL) through SQLAlchemy: the same promises as on PostgreSQL."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from dedupe_worker import Deduplicator, LeaseLost, Reason, decide
from dedupe_worker.sql import atomic

from .services import RedisServer, free_port
from .sql_fixtures import Tables, my

__all__ = ["my"]  # fixtures used by name


def credit(engine: Any, accounts: str, amount: int, runs: list[int] | None = None) -> Any:
    from sqlalchemy import text

    if runs is not None:
        runs.append(amount)
    with engine.connect() as conn, atomic(conn) as outcome:
        conn.execute(text(f"UPDATE {accounts} SET balance = balance + :n WHERE id = 1"), {"n": amount})
        outcome.result = {"credited": amount}
    return outcome.result


def balance(engine: Any, accounts: str) -> int:
    from sqlalchemy import text

    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT balance FROM {accounts} WHERE id = 1")).scalar_one())


@pytest.fixture
def dedupe(redis_client: redis.Redis, namespace: str, my: tuple[Any, Tables]) -> Iterator[Deduplicator]:
    d = Deduplicator(redis_client, namespace=namespace, lease=0.4, renew_interval=60, outcomes=my[1].outcomes)
    yield d
    d.close()


def test_mysql_redis_losing_every_record_applies_nothing_again(private_redis: RedisServer, namespace: str,
                                                               my: tuple[Any, Tables]) -> None:
    engine, tables = my
    client = redis.Redis.from_url(private_redis.url)
    dedupe = Deduplicator(client, namespace=namespace, outcomes=tables.outcomes)
    runs: list[int] = []
    assert dedupe.run("m1", credit, engine, tables.accounts, 3, runs) == {"credited": 3}
    client.flushall()
    decision = decide(dedupe, "m1", lambda: credit(engine, tables.accounts, 3, runs))
    assert decision.reason is Reason.DUPLICATE and decision.value == {"credited": 3}
    assert runs == [3, 3] and balance(engine, tables.accounts) == 3
    assert dedupe.status("m1").state == "done"
    dedupe.close()


def test_mysql_a_reclaim_after_a_crash_does_not_run_the_handler(dedupe: Deduplicator,
                                                                my: tuple[Any, Tables]) -> None:
    engine, tables = my
    runs: list[int] = []
    claim = dedupe.begin("m2")
    with dedupe.hold(claim):
        credit(engine, tables.accounts, 2, runs)  # committed; the worker dies before complete()
    time.sleep(0.5)
    decision = decide(dedupe, "m2", lambda: credit(engine, tables.accounts, 2, runs))
    assert decision.reason is Reason.DUPLICATE and decision.value == {"credited": 2}
    assert runs == [2] and balance(engine, tables.accounts) == 2


def test_mysql_a_zombie_holding_its_row_wins_and_its_successor_commits_nothing(
        dedupe: Deduplicator, my: tuple[Any, Tables]) -> None:
    from sqlalchemy import text

    engine, tables = my
    inside, go = threading.Event(), threading.Event()
    answers: dict[str, Any] = {}

    def zombie() -> Any:
        with engine.connect() as conn, atomic(conn) as outcome:
            conn.execute(text(f"UPDATE {tables.accounts} SET balance = balance + 1 WHERE id = 1"))
            outcome.result = "zombie"
            inside.set()
            go.wait(10)
        return outcome.result

    def run_zombie() -> None:
        try:
            answers["zombie"] = dedupe.run("m3", zombie)
        except LeaseLost as exc:
            answers["zombie"] = exc

    a = threading.Thread(target=run_zombie)
    a.start()
    assert inside.wait(10)
    time.sleep(0.5)
    b = threading.Thread(target=lambda: answers.setdefault(
        "successor", decide(dedupe, "m3", lambda: credit(engine, tables.accounts, 1))))
    b.start()
    time.sleep(0.4)  # the successor's INSERT IGNORE waits on the zombie's row
    go.set()
    a.join(10)
    b.join(20)
    assert isinstance(answers["zombie"], LeaseLost)
    assert answers["successor"].reason is Reason.DUPLICATE and answers["successor"].value == "zombie"
    assert balance(engine, tables.accounts) == 1


def test_mysql_fail_open_twenty_concurrent_copies_apply_once(namespace: str, my: tuple[Any, Tables]) -> None:
    engine, tables = my
    down = redis.Redis(port=free_port(), socket_connect_timeout=0.2, socket_timeout=0.2)
    dedupe = Deduplicator(down, namespace=namespace, fail_open=True, outcomes=tables.outcomes)
    barrier = threading.Barrier(20)
    answers: list[Any] = []

    def copy() -> None:
        barrier.wait(10)
        answers.append(dedupe.run("m4", credit, engine, tables.accounts, 1))

    threads = [threading.Thread(target=copy) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert answers == [{"credited": 1}] * 20
    assert balance(engine, tables.accounts) == 1
    dedupe.close()


def test_mysql_purge(dedupe: Deduplicator, my: tuple[Any, Tables]) -> None:
    engine, tables = my
    for i in range(3):
        dedupe.run(f"m-p{i}", credit, engine, tables.accounts, 1)
    assert tables.outcomes.purge(batch=2) == 0
    assert tables.outcomes.purge(batch=2, now=time.time() + 2 * 86400) == 3


def test_mysql_the_commit_confirmation_never_waits_on_the_open_transaction(
        redis_client: redis.Redis, namespace: str, mysql_url: str, my: tuple[Any, Tables]) -> None:
    from sqlalchemy import create_engine, text

    from dedupe_worker.sql import NotCommitted, SqlOutcomes

    engine, tables = my
    serializable = create_engine(mysql_url, isolation_level="SERIALIZABLE")  # reads lock there
    outcomes = SqlOutcomes(serializable, table=tables.outcomes.table)
    dedupe = Deduplicator(redis_client, namespace=namespace, outcomes=outcomes)
    with engine.connect() as conn:
        def handler() -> Any:
            with atomic(conn) as outcome:  # a savepoint in the transaction open around run()
                conn.execute(text(f"UPDATE {tables.accounts} SET balance = balance + 6 WHERE id = 1"))
                outcome.result = {"credited": 6}
            return outcome.result

        with conn.begin():
            began = time.monotonic()
            with pytest.raises(NotCommitted):
                dedupe.run("m-open", handler)
            assert time.monotonic() - began < 2  # not a lock wait
    assert decide(dedupe, "m-open", lambda: credit(engine, tables.accounts, 6)).reason is Reason.DUPLICATE
    assert balance(engine, tables.accounts) == 6
    dedupe.close()
    serializable.dispose()
